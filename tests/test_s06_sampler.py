"""Tests for S06's sampler on the device (code/s06_sampler.py), on the CPU.

Oracles: S04's NumPy logits processors, `process_logits`, `draw` and `compute_logprobs` on the
same rows, with the same histories and the same uniform numbers; values worked out by hand.
Every processor's output must equal S04's exactly (the same float32 array), and the draw must
pick S04's token for the same u; logprobs: the same ids, values allclose (rtol and atol 1e-5).
Top-p where the mass reaches top_p exactly is pinned against HF in
tests/test_s04_top_p_boundary.py; the sampler inside the engine (completions, rows S04 refuses,
no hidden synchronisation on CUDA) in tests/test_s06_torch.py.
"""
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import s04_sampling as s04
from s06_sampler import (
    BAD_ROW_ERRORS, DeviceSampler, apply_min_p, apply_min_tokens, apply_presence_frequency_penalties,
    apply_repetition_penalty, apply_temperature, apply_top_k, apply_top_p, compute_logprobs,
    draw,
)


# --- the processors: torch against S04's NumPy on the same rows ------------------------------

def random_row(seed, vocab=1000, scale=3.0) -> np.ndarray:
    row = np.random.default_rng(seed).normal(0, scale, size=vocab).astype(np.float32)
    row[::97] = -np.inf   # some tokens already ruled out
    return row


@pytest.mark.parametrize("seed", range(4))
def test_each_processor_equals_s04s(seed):
    row = random_row(seed)
    t = torch.from_numpy(row.copy())
    history = np.random.default_rng(seed + 10).integers(0, 1000, size=60)
    prompt_ids, output_ids = history[:40].tolist(), history[40:].tolist()
    seen = torch.zeros(1000, dtype=torch.bool)
    seen[torch.tensor(prompt_ids + output_ids)] = True
    counts = torch.bincount(torch.tensor(output_ids), minlength=1000).float()
    stop_ids = [3, 500]
    pairs = [
        (apply_min_tokens(t, 2, 5, torch.tensor(stop_ids)), s04.apply_min_tokens(row, 2, 5, stop_ids)),
        (apply_min_tokens(t, 5, 5, torch.tensor(stop_ids)), s04.apply_min_tokens(row, 5, 5, stop_ids)),
        (apply_repetition_penalty(t, seen, 1.7),
         s04.apply_repetition_penalty(row, prompt_ids + output_ids, 1.7)),
        (apply_presence_frequency_penalties(t, counts, 0.6, -0.4),
         s04.apply_presence_frequency_penalties(row, output_ids, 0.6, -0.4)),
        (apply_temperature(t, 0.37), s04.apply_temperature(row, 0.37)),
        (apply_min_p(t, 0.05), s04.apply_min_p(row, 0.05)),
        (apply_top_k(t, 17), s04.apply_top_k(row, 17)),
        (apply_top_k(t, 0), s04.apply_top_k(row, 0)),
        (apply_top_p(t, 0.8), s04.apply_top_p(row, 0.8)),
        (apply_top_p(t, 0.0), s04.apply_top_p(row, 0.0)),
    ]
    for i, (got, expected) in enumerate(pairs):
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"pair {i}")
    assert np.array_equal(t.numpy(), row)  # the input row was not edited


@pytest.mark.parametrize("params", [
    s04.SamplingParams(temperature=0),
    s04.SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=8),
    s04.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, presence_penalty=1.0,
                       repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7]),
    # The extremes SamplingParams accepts: 1e-50 is 0 in float32 (S06 drew token 0 from NaN),
    # 100 is the cap; min_tokens puts -inf rows through the division.
    s04.SamplingParams(temperature=1e-50, min_tokens=3),
    s04.SamplingParams(temperature=5e-324),
    s04.SamplingParams(temperature=100.0, top_k=2, min_tokens=3),
    s04.SamplingParams(temperature=100.0, top_p=0.5, min_p=0.9),
])
def test_device_sampler_pipeline_equals_s04_process_logits(params):
    """Histories grown token by token on the device equal S04's list-based ones."""
    rng = np.random.default_rng(5)
    prompt_ids = rng.integers(0, 1000, size=20).tolist()
    sampler = DeviceSampler(params, prompt_ids, eos_ids=[0, 1], vocab_size=1000,
                            device=torch.device("cpu"))
    output_ids: list[int] = []
    for step in range(12):
        row = random_row(100 + step)
        got = sampler.process(torch.from_numpy(row.copy()), len(output_ids))
        expected = s04.process_logits(row, params, prompt_ids, output_ids, [0, 1])
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"step {step}")
        token = int(rng.integers(0, 1000)) if step % 3 else prompt_ids[step]  # repeats too
        sampler.update(torch.tensor([token]))
        output_ids.append(token)


@pytest.mark.parametrize("params", [
    s04.SamplingParams(temperature=1.0),
    s04.SamplingParams(temperature=0.6, top_p=0.8),
    s04.SamplingParams(temperature=1.4, top_k=5, min_p=0.1),
])
def test_draw_with_s04s_uniform_numbers_picks_s04s_token(params):
    """S04 draws with one NumPy uniform u per token; fed the same u, the torch draw picks the
    same token (the seeded *streams* differ, the rule is the same)."""
    for seed in range(100):
        processed = s04.process_logits(random_row(seed, vocab=300), params)
        u = np.random.default_rng(seed).random()
        expected = s04.draw(processed, params, np.random.default_rng(seed))
        got = draw(torch.from_numpy(processed), params, torch.tensor(u, dtype=torch.float64))
        assert got.shape == (1,) and got.dtype == torch.int64 and int(got) == expected, seed


class FixedUniform:
    """Stands in for S04's np.random.Generator: `random()` returns the u it was given."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


@settings(max_examples=150, deadline=None)
@given(row=arrays(np.float32, st.integers(1, 40),
                  elements=st.one_of(st.floats(-20, 20, width=32), st.just(-np.inf))),
       u=st.floats(0.0, 1.0, exclude_max=True), temperature=st.floats(0.05, 3.0))
def test_draw_equals_s04_draw_for_any_row_and_uniform(row, u, temperature):
    """Property: whatever the row (ties, -inf entries, one token) and u in [0, 1), the torch
    draw and S04's draw pick the same id, and never an id of probability 0."""
    assume(np.isfinite(row).any())
    params = s04.SamplingParams(temperature=temperature)
    processed = s04.process_logits(row, params)
    expected = s04.draw(processed, params, FixedUniform(u))
    got = int(draw(torch.from_numpy(processed), params, torch.tensor(u, dtype=torch.float64)))
    assert got == expected and np.isfinite(processed[got])


def test_draw_edges_by_hand():
    """Greedy takes the lowest id among equal maxima; u at the top of [0, 1) cannot pick a
    token after the last one with mass."""
    assert int(draw(torch.tensor([1.0, 3.0, 3.0, -np.inf]), s04.SamplingParams(temperature=0), None)) == 1
    params = s04.SamplingParams(temperature=1.0)
    row = torch.tensor([0.0, 0.0, -np.inf, -np.inf])    # p = [0.5, 0.5, 0, 0]
    assert int(draw(row, params, torch.tensor(0.0, dtype=torch.float64))) == 0
    assert int(draw(row, params, torch.tensor(0.49, dtype=torch.float64))) == 0
    assert int(draw(row, params, torch.tensor(0.5, dtype=torch.float64))) == 1
    assert int(draw(row, params, torch.tensor(np.nextafter(1.0, 0), dtype=torch.float64))) == 1
    assert int(draw(row, params, torch.tensor(1.0, dtype=torch.float64))) == 1  # clamped


def test_logprobs_equal_s04s():
    row = random_row(3)
    for token, n in ((5, 0), (17, 3), (250, 20)):
        got = compute_logprobs(torch.from_numpy(row), token, n)
        expected = s04.compute_logprobs(row, token, n)
        assert got.token_id == expected.token_id
        assert [i for i, _ in got.top_logprobs] == [i for i, _ in expected.top_logprobs]
        np.testing.assert_allclose([got.logprob, *(lp for _, lp in got.top_logprobs)],
                                   [expected.logprob, *(lp for _, lp in expected.top_logprobs)],
                                   rtol=1e-5, atol=1e-5)


# --- found by trying it: parameters that overflow, NumPy seeds ------------------------------

@pytest.fixture(scope="module")
def bundled_engines():
    import s03_checkpoint
    import s03_transformer as s03
    import s05_kv_cache as s05
    import s06_torch as s06
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists():
        pytest.skip("bundled model missing")
    model, tokenizer = s03_checkpoint.load()
    torch_model = s06.TorchTransformer.from_pretrained(s03.BUNDLED_MODEL_DIR)
    return s05.Engine(model, tokenizer, 64), s06.Engine(torch_model, tokenizer, 64)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_repetition_penalty_that_overflows_float32_is_an_error_naming_it(bundled_engines,
                                                                            temperature):
    # A positive logit / 1e-40 is +inf in float32: S06 used to sample garbage (id 0, NaN
    # logprobs) and S05 blamed the model's logits. Both now name the parameter.
    for engine in bundled_engines:
        with pytest.raises(ValueError, match="repetition_penalty pushed a logit past float32"):
            engine.generate("ROMEO.\n", 3, temperature, 0, repetition_penalty=1e-40)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_repetition_penalty_that_rules_out_every_token_is_named_on_host_and_device(
        temperature):
    # Every id was seen and every logit is negative: * 1e300 is -inf in float32 for all.
    params = s04.SamplingParams(temperature=temperature, repetition_penalty=1e300)
    row = np.full(4, -1.0, np.float32)
    with pytest.raises(ValueError, match="repetition_penalty pushed every logit to -inf"):
        s04.process_logits(row, params, prompt_ids=[0, 1, 2, 3])
    sampler = DeviceSampler(params, [0, 1, 2, 3], [], 4, torch.device("cpu"))
    logits = torch.from_numpy(row)
    token = sampler.draw(sampler.process(logits, 0), 0, logits)
    assert BAD_ROW_ERRORS[int(token)] == s04.PENALTY_RULED_OUT


@pytest.mark.parametrize("seed", [np.int64(5), np.int32(5), np.uint64(5)])
def test_numpy_integer_seeds_work_on_the_device(bundled_engines, seed):
    _, engine = bundled_engines
    assert engine.generate("ROMEO.\n", 4, 1.0, seed).token_ids == \
        engine.generate("ROMEO.\n", 4, 1.0, 5).token_ids
