"""Graded tests for the S07 exercises (see exercises/s07_measuring.py).

Oracles, none of them the solution: FLOPs and bytes of Qwen3-0.6B's published shape worked out
by hand below, and at batch 1 the chapter's tested cost functions (S03's `flops_per_token` and
`bytes_per_token`) on several configs (exercise 1); a brute-force search over batch sizes with
exact integer arithmetic on those same S03 counts, and a boundary ridge built to be hit exactly
(exercise 2); hand-computed percentiles, NumPy's `np.percentile`, and the chapter's tested
`RequestResult.from_timed` on the same stamps (exercise 3).
"""
import math
from fractions import Fraction

import numpy as np
import pytest

from exercise_loader import load_exercise
import s03_transformer as s03
import s07_measuring as s07
from s03_checkpoint import config_from_hf_dict, load_config
from s07_workloads import Request

ex = load_exercise("s07_measuring")

# Published config.json fields of Qwen/Qwen3-0.6B.
QWEN3_0_6B = config_from_hf_dict(
    {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
     "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
     "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
     "attention_bias": False, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
     "rope_theta": 1000000})
SMALL_LLAMA = config_from_hf_dict(
    {"model_type": "llama", "hidden_size": 96, "intermediate_size": 160,
     "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
     "vocab_size": 500, "tie_word_embeddings": False, "max_position_embeddings": 128,
     "rms_norm_eps": 1e-6, "rope_theta": 10000})
BUNDLED = load_config(s03.BUNDLED_MODEL_DIR)

# Qwen3-0.6B by hand. One layer's matrices: q 1024*2048 + k, v 1024*1024 each + o 2048*1024
# = 6,291,456; MLP 3*1024*3072 = 9,437,184; together 15,728,640. Norms 2*1024 + 2*128 = 2,304.
# LM head 151,936*1024 = 155,582,464.
# FLOPs per request at S: 2*(28*15,728,640 + 155,582,464) + 4*16*128*28*S
#                       = 1,191,968,768 + 229,376 S.
# Values read once: 28*(15,728,640 + 2,304) + 1,024 + 155,582,464 = 596,049,920.
# Values per request: 1,024 + 2*28*8*128*S = 1,024 + 57,344 S.


def hand_qwen(batch: int, s: int, dtype_bytes: int) -> tuple[int, int]:
    return (batch * (1_191_968_768 + 229_376 * s),
            (596_049_920 + batch * (1_024 + 57_344 * s)) * dtype_bytes)


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(2)
def test_decode_step_cost_of_qwen3_0_6b_by_hand():
    assert ex.decode_step_cost(QWEN3_0_6B, 1, 1024, 4) == (1_426_849_792, 2_619_084_800)
    assert ex.decode_step_cost(QWEN3_0_6B, 64, 1024, 4) == (91_318_386_688, 17_416_847_360)
    for batch, s, b in ((1, 1, 2), (8, 300, 2), (256, 4096, 2), (3, 17, 4)):
        assert ex.decode_step_cost(QWEN3_0_6B, batch, s, b) == hand_qwen(batch, s, b)
    flops, moved = ex.decode_step_cost(QWEN3_0_6B, 1, 1024)       # float32 by default
    assert (flops, moved) == hand_qwen(1, 1024, 4)
    assert all(type(v) is int for v in (flops, moved))
    assert ex.arithmetic_intensity(QWEN3_0_6B, 1, 1024) == pytest.approx(
        1_426_849_792 / 2_619_084_800, rel=1e-12)
    assert ex.arithmetic_intensity(QWEN3_0_6B, 64, 1024) == pytest.approx(5.2431066, rel=1e-6)


@pytest.mark.points(1)
def test_batch_one_is_the_chapters_cost_and_batching_shares_only_the_weights():
    for cfg in (QWEN3_0_6B, SMALL_LLAMA, BUNDLED):
        kv_values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        for s in (1, 7, 100):
            for b in (2, 4):
                expected = (s03.flops_per_token(cfg, s), s03.bytes_per_token(cfg, s, b))
                assert ex.decode_step_cost(cfg, 1, s, b) == expected, (cfg.model_type, s, b)
                # B requests: B times the FLOPs; the weights once, each request's row and K/V.
                per_request = (cfg.hidden_size + kv_values * s) * b
                assert ex.decode_step_cost(cfg, 5, s, b) == (
                    5 * expected[0], expected[1] + 4 * per_request)
    # Intensity grows with the batch and stays below its limit, FLOPs / per-request bytes.
    values = [ex.arithmetic_intensity(QWEN3_0_6B, batch, 1024, 2) for batch in (1, 2, 8, 64, 4096)]
    assert values == sorted(values) and values[-1] < 1_426_849_792 / ((1_024 + 57_344 * 1024) * 2)


@pytest.mark.points(1)
def test_decode_step_cost_rejects_bad_input():
    for kwargs, message in (({"batch_size": 0}, "batch_size must be an integer >= 1"),
                            ({"batch_size": True}, "batch_size must be an integer >= 1"),
                            ({"batch_size": 2.0}, "batch_size must be an integer >= 1"),
                            ({"context_len": 0}, "context_len must be an integer >= 1"),
                            ({"dtype_bytes": 0}, "dtype_bytes must be an integer >= 1")):
        args = {"config": QWEN3_0_6B, "batch_size": 1, "context_len": 8, "dtype_bytes": 4, **kwargs}
        with pytest.raises(ValueError, match=message):
            ex.decode_step_cost(**args)
    gpt2 = config_from_hf_dict(
        {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
         "n_positions": 32, "eos_token_id": 0})
    with pytest.raises(ValueError, match="only llama and qwen3 models without biases"):
        ex.decode_step_cost(gpt2, 1, 8)


# Exercise 2 ----------------------------------------------------------------------------------

def brute_force_ridge_batch(cfg, s: int, b: int, ridge: float, limit: int = 100_000):
    flops1, bytes1 = s03.flops_per_token(cfg, s), s03.bytes_per_token(cfg, s, b)
    kv_values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    per_request = (cfg.hidden_size + kv_values * s) * b
    shared = bytes1 - per_request
    r = Fraction(ridge)
    for batch in range(1, limit + 1):
        if batch * flops1 >= r * (shared + batch * per_request):
            return batch
    return None


@pytest.mark.points(1)
def test_ridge_batch_size_of_qwen3_0_6b():
    # S = 1, bfloat16, ridge 295: B * 1,192,198,144 >= 295 * (1,192,099,840 + B * 116,736)
    # <=> B >= 351,669,452,800 / 1,157,761,024 = 303.75...  ->  304.
    assert ex.ridge_batch_size(QWEN3_0_6B, 1, 2, 295) == 304
    # S = 1024: the intensity tends to 1,426,849,792 / 117,442,560 = 12.15 < 295: never.
    assert ex.ridge_batch_size(QWEN3_0_6B, 1024, 2, 295) is None
    # A ridge below batch 1's intensity is reached at once.
    assert ex.ridge_batch_size(QWEN3_0_6B, 1024, 4, 0.5) == 1


@pytest.mark.points(1)
def test_ridge_batch_size_agrees_with_a_brute_force_search():
    for cfg in (QWEN3_0_6B, SMALL_LLAMA, BUNDLED):
        for s, b, ridge in ((1, 4, 20.0), (16, 4, 3.0), (64, 2, 10.5), (200, 2, 1.25),
                            (1, 2, 100.0), (32, 4, 7.0)):
            assert ex.ridge_batch_size(cfg, s, b, ridge) == brute_force_ridge_batch(
                cfg, s, b, ridge), (cfg.model_type, cfg.hidden_size, s, b, ridge)


@pytest.mark.points(1)
def test_ridge_batch_size_is_exact_at_the_boundary_and_checks_its_ridge():
    # A ridge equal to some batch's intensity exactly: that batch reaches it, one above does not.
    cfg, s, b = SMALL_LLAMA, 1, 4
    flops, moved = s03.flops_per_token(cfg, s), s03.bytes_per_token(cfg, s, b)
    per_request = (cfg.hidden_size + 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                   * cfg.head_dim * s) * b
    shared = moved - per_request
    # A batch whose intensity is exactly a float: reduced, its denominator is a power of two.
    found = None
    for batch in range(2, 5000):
        frac = Fraction(batch * flops, shared + batch * per_request)
        if frac.denominator & (frac.denominator - 1) == 0:
            found = (batch, frac)
            break
    assert found, "no exactly representable boundary in range"
    batch, frac = found
    assert float(frac) == frac
    assert ex.ridge_batch_size(cfg, s, b, float(frac)) == batch      # reached exactly here
    above = math.nextafter(float(frac), math.inf)
    assert ex.ridge_batch_size(cfg, s, b, above) == brute_force_ridge_batch(cfg, s, b, above)
    assert ex.ridge_batch_size(cfg, s, b, above) > batch
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="ridge_flop_per_byte must be a finite number > 0"):
            ex.ridge_batch_size(cfg, s, b, bad)


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_percentile_by_hand_and_against_numpy():
    assert ex.percentile([4, 1, 3, 2], 50) == 2.5
    assert ex.percentile([1, 2, 3, 4, 100], 90) == pytest.approx(61.6, abs=1e-12)
    assert ex.percentile([7.0], 99) == 7.0
    assert ex.percentile([3, 1, 2], 0) == 1 and ex.percentile([3, 1, 2], 100) == 3
    # One slow request in a hundred: p50 does not see it, p99 does, the mean is dragged.
    values = [0.010] * 99 + [1.0]
    assert ex.percentile(values, 50) == pytest.approx(0.010)
    assert ex.percentile(values, 99) == pytest.approx(0.010 + 0.01 * (1.0 - 0.010))
    rng = np.random.default_rng(7)
    for n in (2, 3, 10, 101, 1000):
        data = rng.lognormal(size=n).tolist()
        for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert ex.percentile(data, p) == pytest.approx(float(np.percentile(data, p)),
                                                           rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="values must not be empty"):
        ex.percentile([], 50)
    for p in (-1, 100.5):
        with pytest.raises(ValueError, match="p must be between 0 and 100"):
            ex.percentile([1.0], p)


@pytest.mark.points(2)
def test_request_latencies_by_hand_and_as_the_harness_computes_them():
    got = ex.request_latencies(10.0, [10.5, 10.6, 10.8], [1, 1, 1])
    assert set(got) == {"ttft_s", "itl_s", "e2e_s", "tpot_s"}
    assert got["ttft_s"] == pytest.approx(0.5) and got["e2e_s"] == pytest.approx(0.8)
    assert got["itl_s"] == pytest.approx([0.1, 0.2]) and got["tpot_s"] == pytest.approx(0.15)
    # Several tokens per output: ITL counts outputs, TPOT counts tokens.
    multi = ex.request_latencies(10.0, [10.5, 10.6, 10.8], [2, 3, 1])
    assert multi["itl_s"] == pytest.approx([0.1, 0.2]) and multi["e2e_s"] == pytest.approx(0.8)
    assert multi["tpot_s"] == pytest.approx(0.3 / 5)
    one = ex.request_latencies(0.0, [0.25], [1])
    assert one["ttft_s"] == 0.25 and one["itl_s"] == [] and one["tpot_s"] is None
    assert one["e2e_s"] == 0.25
    assert ex.request_latencies(0.0, [0.25], [4])["tpot_s"] == 0.0    # 4 tokens, one output
    rng = np.random.default_rng(3)
    for n_outputs in (1, 2, 9):
        start = float(rng.uniform(0, 100))
        times = (start + np.cumsum(rng.exponential(0.05, n_outputs))).tolist()
        sizes = rng.integers(1, 4, n_outputs).tolist()
        n = sum(sizes)
        stamps = [s07.Stamp(t, tuple(range(k))) for t, k in zip(times, sizes)]
        ref = s07.RequestResult.from_timed(Request(0, "x", 1, n),
                                           s07.TimedRequest(0, start, stamps))
        got = ex.request_latencies(start, times, sizes)
        assert got["ttft_s"] == pytest.approx(ref.ttft_s, abs=1e-12)
        assert got["itl_s"] == pytest.approx(ref.itl_s, abs=1e-12)
        assert got["e2e_s"] == pytest.approx(ref.e2e_s, abs=1e-12)
        assert (got["tpot_s"] is None) == (ref.tpot_s is None)
        if ref.tpot_s is not None:
            assert got["tpot_s"] == pytest.approx(ref.tpot_s, abs=1e-12)
    with pytest.raises(ValueError, match="a request needs at least one token"):
        ex.request_latencies(0.0, [], [])
    for times, sizes in (([0.5], [0]), ([0.5], [True]), ([0.5, 0.6], [1]), ([0.5], [1.0])):
        with pytest.raises(ValueError, match="tokens_per_output must hold one integer >= 1"):
            ex.request_latencies(0.0, times, sizes)
    for start, times in ((1.0, [0.5]), (0.0, [0.2, 0.1])):
        with pytest.raises(ValueError, match="timestamps must be in order"):
            ex.request_latencies(start, times, [1] * len(times))
