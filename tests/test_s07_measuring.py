"""Tests for chapter S07: the benchmark harness, the workloads and the roofline arithmetic.

Oracles: hand-computed values (latencies of a fake engine on a fake clock, percentiles of
short lists, FLOPs and bytes of a tiny config counted weight by weight), the project tokenizer
(a prompt's token count), HF `transformers` greedy `generate()` (the tokens every engine run
through the harness must still produce). No test asserts a timing of this machine.
"""
import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s05_kv_cache as s05
import s06_torch as s06
import s07_measuring as s07
from s07_measuring import (
    BenchmarkRun, Distribution, HFGenerateEngine, HookedEngine, MachinePeaks, Request,
    RequestResult, StepCost, TimedGeneration, attach_floor, bandwidth_floor_s, decode_step_cost,
    make_workload, prefill_cost, results_json, roofline_floor_s, run_benchmark, stamp_calls,
    token_times_from_step_starts, write_results,
)

TOKENIZER_JSON = s07.ROOT / "data" / "tokenizer.json"
EOS = 2047   # <|endoftext|> in data/tokenizer.json


@pytest.fixture(scope="module")
def tokenizer():
    return s03.CheckpointTokenizer(TOKENIZER_JSON, [EOS])


# ---------------------------------------------------------------------------------------------
# A fake engine on a fake clock: every latency is known by hand
# ---------------------------------------------------------------------------------------------

class FakeClock:
    """Seconds that pass only when the fake engine says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# Costs of the fake engine, in seconds (powers of two: every sum below is exact in binary).
TOKENIZE_S = 2.0 ** -10
PREFILL_PER_TOKEN_S = 2.0 ** -8
SAMPLE_S = 2.0 ** -9
DECODE_S = 2.0 ** -6
FINISH_S = 2.0 ** -7     # work after the last token (final flush, building the result)
STEP_S = DECODE_S + SAMPLE_S


class FakeRunner:
    def __init__(self, clock: FakeClock):
        self.clock = clock

    def prefill(self, ids):
        self.clock.advance(PREFILL_PER_TOKEN_S * len(ids))
        return "logits"

    def decode(self, token):
        self.clock.advance(DECODE_S)
        return "logits"


@dataclass
class FakeStats:
    pass_times_s: list = field(default_factory=list)


@dataclass
class FakeResult:
    token_ids: list
    stats: FakeStats


class FakeEngine:
    """Tokenize, prefill, then (sample, decode) per token, then finish, like S05's engine, on a
    fake clock."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.runner = FakeRunner(clock)

    def generate(self, request: Request) -> FakeResult:
        self.clock.advance(TOKENIZE_S)
        ids = list(range(request.prompt_tokens))
        stats = FakeStats()
        self.runner.prefill(ids)
        stats.pass_times_s.append(PREFILL_PER_TOKEN_S * len(ids))
        out = []
        for k in range(request.max_tokens):
            self.clock.advance(SAMPLE_S)
            out.append(7 + k)
            if k < request.max_tokens - 1:
                self.runner.decode(out[-1])
                stats.pass_times_s.append(DECODE_S)
        self.clock.advance(FINISH_S)
        return FakeResult(out, stats)


def fake_hooked(clock: FakeClock) -> HookedEngine:
    engine = FakeEngine(clock)
    return HookedEngine("fake", engine, [(engine.runner, "prefill"), (engine.runner, "decode")],
                        engine.generate)


FAKE_WORKLOAD = s07.Workload("fake", 0, (Request(0, "a", 4, 3), Request(1, "b", 8, 1),
                                         Request(2, "c", 16, 5)))


def test_latencies_of_one_request_by_hand():
    clock = FakeClock()
    run = run_benchmark(fake_hooked(clock), s07.Workload("one", 0, (Request(0, "a", 4, 3),)),
                        clock=clock, warmup=False, progress=False)
    (r,) = run.requests
    # TTFT: tokenize, prefill of 4 tokens, sample token 0.
    assert r.ttft_s == TOKENIZE_S + 4 * PREFILL_PER_TOKEN_S + SAMPLE_S
    # Each later token: one decode step and one sample; the last token counts as available
    # when the engine returns, so the work after it (FINISH_S) lands in the last gap.
    assert r.itl_s == [STEP_S, STEP_S + FINISH_S]
    assert r.e2e_s == r.ttft_s + 2 * STEP_S + FINISH_S
    assert r.tpot_s == (r.e2e_s - r.ttft_s) / 2
    assert r.output_tokens == 3 and r.token_ids == [7, 8, 9]
    assert r.model_step_s == [DECODE_S, DECODE_S]


def test_run_summary_percentiles_and_throughput_by_hand():
    clock = FakeClock()
    run = run_benchmark(fake_hooked(clock), FAKE_WORKLOAD, model="m", clock=clock,
                        warmup=True, progress=False)
    assert [r.request_id for r in run.requests] == [0, 1, 2]     # the warm-up is not recorded
    # Request 1 has one token: it is also the last one, available when the engine returns.
    ttft = [TOKENIZE_S + p * PREFILL_PER_TOKEN_S + SAMPLE_S + (FINISH_S if n == 1 else 0.0)
            for p, n in ((4, 3), (8, 1), (16, 5))]
    assert [r.ttft_s for r in run.requests] == ttft
    t = run.ttft_s
    # Sorted ttft = a < b < c; linear percentiles: p at index p/100 * 2.
    a, b, c = ttft
    assert t.mean == pytest.approx((a + b + c) / 3)
    assert t.p50 == b
    assert t.p90 == pytest.approx(b + 0.8 * (c - b))
    assert t.p99 == pytest.approx(b + 0.98 * (c - b))
    # ITL: 2 gaps + 0 gaps + 4 gaps; sorted: STEP_S x 4, then STEP_S + FINISH_S x 2.
    assert run.itl_s.count == 6
    assert run.itl_s.p50 == STEP_S and run.itl_s.p99 == STEP_S + FINISH_S
    assert run.itl_s.mean == pytest.approx(STEP_S + 2 * FINISH_S / 6)
    # TPOT only for requests with >= 2 tokens.
    assert run.tpot_s.count == 2
    e2e = [TOKENIZE_S + p * PREFILL_PER_TOKEN_S + SAMPLE_S + (n - 1) * STEP_S + FINISH_S
           for p, n in ((4, 3), (8, 1), (16, 5))]
    assert [r.e2e_s for r in run.requests] == pytest.approx(e2e)
    # One request after another on a clock that only the engine moves: wall = sum of e2e.
    assert run.wall_s == pytest.approx(sum(e2e))
    assert run.output_tokens == 9
    assert run.output_tokens_per_s == pytest.approx(9 / sum(e2e))
    assert run.model_step_s.count == 6 and run.model_step_s.mean == DECODE_S


def test_stamp_calls_leaves_results_and_methods_unchanged():
    clock = FakeClock()
    runner = FakeRunner(clock)
    with stamp_calls([(runner, "prefill"), (runner, "decode")], clock) as starts:
        assert runner.prefill([1, 2]) == "logits"
        assert runner.decode(3) == "logits"
    assert starts == [100.0, 100.0 + 2 * PREFILL_PER_TOKEN_S]
    assert "prefill" not in vars(runner) and "decode" not in vars(runner)
    with pytest.raises(ZeroDivisionError):
        with stamp_calls([(runner, "decode")], clock):
            1 / 0
    assert "decode" not in vars(runner)
    with pytest.raises(ValueError, match="has no method 'forward' to time"):
        with stamp_calls([(runner, "decode"), (runner, "forward")], clock):
            pass
    assert "decode" not in vars(runner)


def test_token_times_need_one_step_per_token():
    assert token_times_from_step_starts([1.0, 2.0, 4.0], 9.0, 3) == [2.0, 4.0, 9.0]
    assert token_times_from_step_starts([1.0], 3.0, 1) == [3.0]
    with pytest.raises(RuntimeError, match="made 2 steps for 3 tokens"):
        token_times_from_step_starts([1.0, 2.0], 9.0, 3)


def test_request_result_rejects_bad_stamps():
    request = Request(0, "a", 1, 2)
    with pytest.raises(ValueError, match="generated no token"):
        RequestResult.from_timed(request, TimedGeneration([], 0.0, [], 1.0))
    with pytest.raises(ValueError, match="2 timestamps for 1 tokens"):
        RequestResult.from_timed(request, TimedGeneration([5], 0.0, [0.5, 0.6], 1.0))
    with pytest.raises(ValueError, match="timestamps must be in order"):
        RequestResult.from_timed(request, TimedGeneration([5, 6], 0.0, [0.6, 0.5], 1.0))
    with pytest.raises(ValueError, match="timestamps must be in order"):
        RequestResult.from_timed(request, TimedGeneration([5, 6], 0.0, [0.5, 0.6], 0.55))


def test_distribution_hand_values_and_errors():
    d = Distribution.of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (d.mean, d.p50, d.count) == (3.0, 3.0, 5)
    assert d.p90 == pytest.approx(4.6)    # index 3.6: 4 + 0.6 * (5 - 4)
    assert d.p99 == pytest.approx(4.96)   # index 3.96
    single = Distribution.of([0.25])
    assert (single.mean, single.p50, single.p90, single.p99) == (0.25,) * 4
    with pytest.raises(ValueError, match="at least one value"):
        Distribution.of([])
    with pytest.raises(ValueError, match="must be finite"):
        Distribution.of([1.0, math.nan])


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(s07.WORKLOAD_KINDS))
def test_workload_is_reproducible_and_exact(kind, tokenizer):
    first = make_workload(kind, tokenizer, 5, seed=3, max_context=256)
    again = make_workload(kind, tokenizer, 5, seed=3, max_context=256)
    other = make_workload(kind, tokenizer, 5, seed=4, max_context=256)
    assert first == again
    assert first.requests != other.requests
    (p_lo, p_hi), (o_lo, o_hi) = s07.WORKLOAD_KINDS[kind]
    corpus = s07.CORPUS_PATH.read_text(encoding="utf-8")
    for r in first.requests:
        assert len(tokenizer.encode(r.prompt)) == r.prompt_tokens
        assert p_lo <= r.prompt_tokens <= p_hi and o_lo <= r.max_tokens <= o_hi
        assert r.prompt in corpus
    assert first.max_context <= 256


def test_workload_output_cap_and_word_tokenizer():
    words, _ = s01.build_default()
    w = make_workload("chat", words, 4, seed=0, max_context=64, max_output_tokens=5)
    assert all(r.max_tokens <= 5 for r in w.requests)
    assert all(len(words.encode(r.prompt)) == r.prompt_tokens for r in w.requests)


def test_workload_errors(tokenizer):
    with pytest.raises(ValueError, match="kind must be one of"):
        make_workload("poetry", tokenizer, 1, 0, 256)
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
        make_workload("chat", tokenizer, 0, 0, 256)
    with pytest.raises(ValueError, match=r"needs max_context >= 224 tokens"):
        make_workload("long", tokenizer, 1, 0, 200)
    with pytest.raises(ValueError, match="max_output_tokens must be >= 1"):
        make_workload("chat", tokenizer, 1, 0, 256, max_output_tokens=0)
    with pytest.raises(ValueError, match="no speech of the corpus gave a prompt"):
        make_workload("chat", tokenizer, 1, 0, 256, text="Ham.\nNo.\n\nHor.\nYes.\n")


# ---------------------------------------------------------------------------------------------
# Real engines through the harness: the hooks change no token
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3():
    """A random tiny Qwen3 with the project tokenizer's vocabulary (HF's own init)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=EOS, pad_token_id=EOS, bos_token_id=None)
    config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(config).eval()
    cfg = s03.TransformerConfig.from_hf_dict(hf.config.to_dict())
    weights = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return hf, cfg, weights


def test_engines_through_the_harness_give_hf_greedy_tokens(tiny_qwen3, tokenizer):
    hf, cfg, weights = tiny_qwen3
    workload = make_workload("chat", tokenizer, 2, seed=1, max_context=128, max_output_tokens=6)
    expected = []
    for r in workload.requests:
        ids = torch.tensor([tokenizer.encode(r.prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=r.max_tokens, min_new_tokens=r.max_tokens,
                          pad_token_id=EOS)
        expected.append(out[0, ids.shape[1]:].tolist())
        # min_new_tokens forbids EOS where the harness's engines ignore it; the two give the
        # same tokens exactly when EOS is never the argmax, which this checks.
        assert EOS not in expected[-1]
    numpy_model = s03.Transformer(cfg, weights)
    engines = [
        HookedEngine.for_s01("S01", s01.Engine(numpy_model, tokenizer, 128)),
        HookedEngine.for_cached("S05", s05.Engine(numpy_model, tokenizer, 128)),
        HookedEngine.for_cached("S06", s06.Engine(s06.TorchTransformer(cfg, weights), tokenizer,
                                                  128)),
        HFGenerateEngine("HF", hf, tokenizer, pad_token_id=EOS),
    ]
    for engine in engines:
        run = run_benchmark(engine, workload, clock=s07.time.perf_counter, progress=False)
        for r, want in zip(run.requests, expected):
            assert r.token_ids == want, engine.name
            assert r.output_tokens == len(r.itl_s) + 1
            assert 0 <= r.ttft_s <= r.e2e_s
        if engine.name != "HF":
            assert run.model_step_s.count == sum(len(w) - 1 for w in expected)
    # The hooks are gone and S01's engine has its own tokenizer back.
    assert "forward" not in vars(numpy_model)
    assert engines[0].engine.tokenizer is tokenizer


# ---------------------------------------------------------------------------------------------
# Roofline arithmetic on a config small enough to count by hand
# ---------------------------------------------------------------------------------------------

# V=10, C=4, L=1, H=2, Hkv=1, D=2, I=6, tied head, q/k norms, no biases.
HAND = s03.TransformerConfig(model_type="qwen3", vocab_size=10, hidden_size=4,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=2, intermediate_size=6, max_position_embeddings=16,
                             norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
                             qk_norm=True)


def test_decode_step_cost_by_hand():
    # Weights per token: q 4x4, k 4x2, v 4x2, o 4x4 = 48; MLP 3 x 4x6 = 72; head 10x4 = 40.
    # FLOPs at S = 3: 2 x (48 + 72 + 40) + attention 2 x 2 x (H D = 4) x 3 = 320 + 48 = 368.
    # Bytes (float32): projections 48, MLP 72, norms (2 C + 2 D =) 12, final norm 4, head 40,
    # one embedding row 4: 180 values = 720 bytes; K/V: 2 cached positions read + 1 written,
    # 2 x Hkv D = 4 values each: 12 values = 48 bytes. Total 768.
    cost = decode_step_cost(HAND, 3)
    assert (cost.flops, cost.bytes) == (368, 768)
    assert cost.intensity == pytest.approx(368 / 768)
    assert decode_step_cost(HAND, 3, dtype_bytes=2).bytes == 384


def test_prefill_cost_by_hand():
    # 3 tokens: weights 2 x 120 each = 720; attention: token s attends s positions,
    # 16 FLOPs per position: 16 x (1 + 2 + 3) = 96; LM head on the last row only: 80. 896.
    # Bytes: 176 weight values + one embedding row (4) = 720 bytes; K/V of 3 positions
    # written: 3 x 4 values = 48 bytes. 768.
    cost = prefill_cost(HAND, 3)
    assert (cost.flops, cost.bytes) == (896, 768)
    # One prompt token is one decode step at S = 1.
    assert prefill_cost(HAND, 1) == decode_step_cost(HAND, 1)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        prefill_cost(HAND, 0)


def test_floors_and_ridge_by_hand():
    peaks = MachinePeaks(bandwidth_bytes_per_s=100.0, matmul_flops_per_s=1000.0,
                         bandwidth_method="hand", matmul_method="hand")
    assert peaks.ridge_intensity == 10.0
    decode = StepCost(flops=368, bytes=768)
    assert bandwidth_floor_s(decode, peaks) == 7.68
    assert roofline_floor_s(decode, peaks) == 7.68                     # bandwidth-bound
    assert roofline_floor_s(StepCost(flops=50_000, bytes=768), peaks) == 50.0  # compute-bound


def test_attach_floor_uses_the_median_decode_context():
    peaks = MachinePeaks(100.0, 1000.0, "hand", "hand")
    # Prompt 2, 3 tokens: decode steps read S = 3 and 4; prompt 1, 2 tokens: S = 2.
    requests = [RequestResult(0, 2, 3, 0.5, [2.0, 4.0], 6.0, [1, 2, 3]),
                RequestResult(1, 1, 2, 0.5, [3.0], 4.0, [1, 2])]
    run = BenchmarkRun("e", "m", "w", 0, requests, wall_s=10.0)
    attach_floor(run, HAND, peaks)
    assert run.decode_context_len == 3
    assert run.decode_floor_s == 7.68
    assert run.decode_vs_floor == pytest.approx(3.0 / 7.68)           # ITL p50 = 3.0
    lone = BenchmarkRun("e", "m", "w", 0, [RequestResult(0, 2, 1, 0.5, [], 1.0, [1])], 1.0)
    attach_floor(lone, HAND, peaks)
    assert lone.decode_floor_s is None and lone.decode_vs_floor is None


def test_measurements_run_and_state_their_method():
    bandwidth, method = s07.measure_bandwidth(nbytes=2**20, repeats=1)
    assert bandwidth > 0 and "bytes read + written" in method
    flops, method = s07.measure_matmul_flops(n=64, repeats=1)
    assert flops > 0 and "2 n^3 FLOPs" in method
    with pytest.raises(ValueError, match="need nbytes >= 4 and repeats >= 1"):
        s07.measure_bandwidth(nbytes=2, repeats=1)
    with pytest.raises(ValueError, match="need n >= 1 and repeats >= 1"):
        s07.measure_matmul_flops(n=8, repeats=0)


def test_plot_roofline_writes_a_png(tmp_path):
    peaks = MachinePeaks(1e10, 1e11, "hand", "hand")
    path = s07.plot_roofline(peaks, [("decode", StepCost(100, 200), 1e-8),
                                     ("prefill", StepCost(10_000, 200), 1e-7)],
                             tmp_path / "roof.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])   # the PNG's IHDR chunk: width, height
    assert (width, height) == (900, 576)                # figsize (7.5, 4.8) inches at 120 dpi


# ---------------------------------------------------------------------------------------------
# The results file
# ---------------------------------------------------------------------------------------------

def test_results_json_schema(tmp_path):
    clock = FakeClock()
    run = run_benchmark(fake_hooked(clock), FAKE_WORKLOAD, model="fake-model", clock=clock,
                        progress=False)
    attach_floor(run, HAND, MachinePeaks(100.0, 1000.0, "hand bw", "hand mm"))
    machine = s07.machine_facts()
    path = write_results(tmp_path / "out" / "r.json",
                         results_json([run], machine, MachinePeaks(100.0, 1000.0, "a", "b"),
                                      extra={"note": "test"}))
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["schema"] == s07.RESULTS_SCHEMA and data["note"] == "test"
    assert set(data) >= {"created_utc", "machine", "roofline", "runs"}
    for key in ("cpu_model", "logical_cores", "torch_threads", "torch", "numpy",
                "transformers", "device", "python"):
        assert key in data["machine"]
    assert data["machine"]["numpy"] == np.__version__
    assert data["machine"]["torch"] == torch.__version__
    assert data["roofline"]["ridge_intensity_flop_per_byte"] == 10.0
    (r,) = data["runs"]
    assert (r["engine"], r["model"], r["workload"], r["seed"]) == ("fake", "fake-model", "fake", 0)
    summary = r["summary"]
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "model_step_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99", "count"}
    assert summary["requests"] == 3 and summary["output_tokens"] == 9
    assert summary["output_tokens_per_s"] == pytest.approx(9 / summary["wall_s"])
    assert summary["decode_vs_floor"] == pytest.approx(summary["itl_s"]["p50"]
                                                       / summary["decode_floor_s"])
    assert r["peak_memory"]["max_rss_bytes"] > 0
    assert "load_average_1min" in r
    assert [q["output_tokens"] for q in r["per_request"]] == [3, 1, 5]
    assert r["per_request"][1]["tpot_s"] is None and r["per_request"][1]["itl_s"] == []
    table = s07.format_table([run])
    assert "fake-model" in table and "ITL/floor" in table
