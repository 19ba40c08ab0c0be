"""Tests for chapter S06: the PyTorch engine on the CPU (and on CUDA when there is one).

Oracles: HF `transformers` (logits of a full forward in float32 with eager attention, greedy
`generate`), the S01 loop, the S05 NumPy engine (greedy tokens) and the S04 engine (whole
completions: ids, text, finish_reason, stop_reason, logprobs) running S03's NumPy model on the
same weights; S03's parameter count; closed-form values worked out by hand. The sampler's
processors and `draw` against S04's, row by row, are in tests/test_s06_sampler.py.

Tolerances. float32: logits allclose(rtol=1e-4, atol=2e-5) at every position, as S03 against
HF; greedy tokens identical. bfloat16 and float16 (measured on the CPU on the tiny models of
S03's tests, worst case over the five models and both attentions: |logit error| 0.046 in
bfloat16, 0.005 in float16, for logits of magnitude up to 3.8): every logit within 0.1
(bfloat16) or 0.02 (float16) of HF float32; the argmax equal to float32's at every position where
float32's top-2 gap exceeds twice that tolerance (there, no error within tolerance can flip
it); greedy generation equal to HF float32 for the first 4 tokens (bfloat16; the worst model
diverged after 7) or 16 tokens (float16; all 36 matched).

The loop is S01's; this chapter overrides the seams `runner_class`, `make_sequence`, `sample`,
`decode_input` and `model_step`. Rows the model did not compute (NaN, no finite entry) and the
prefill/decode calls are put in or counted through `runner_class` subclasses, never by patching
a method.
"""
import shutil

import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
from engine_testing import counting_engine, run_in_turns
from model_testing import (
    EOS_UNUSED, PAD, TINY, V, IdTokenizer, build_tiny, first_difference, hf_greedy, hf_logits,
)
from s06_sampler import DeviceSampler
from s06_torch import (
    CachedTransformer, Engine, KVCache, StepTimes, TorchTransformer, attention, decode_attention,
    load, main, resolve_device_dtype, rms_norm, same_device,
)

CONTEXT = 96       # max_position_embeddings of every tiny model
N_GENERATE = 36
PROMPT = [5, 17, 42, 8, 63]
IMPLS = ("manual", "sdpa")
LOW_PRECISION = {  # dtype -> (max |logit - HF float32|, greedy tokens that must match)
    torch.bfloat16: (0.1, 4),
    torch.float16: (0.02, 16),
}


def greedy(max_tokens=N_GENERATE, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def prompt_text(ids) -> str:
    return " ".join(map(str, ids))


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    """(name, HF model, checkpoint directory, S03 NumPy Transformer of the same weights)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(request.param, directory)
    return request.param, hf, directory, s03.Transformer.from_pretrained(directory)


# --- device and dtype -----------------------------------------------------------------------

def test_defaults_are_cuda_bf16_when_present_else_cpu_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_dtype() == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA device, and torch finds none"):
        resolve_device_dtype("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device_dtype() == (torch.device("cuda"), torch.bfloat16)
    assert resolve_device_dtype(None, "float16") == (torch.device("cuda"), torch.float16)


@pytest.mark.parametrize("device, dtype, message", [
    ("tpu", None, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ("cuda:x", None, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ("cpu", "float64", "dtype must be one of float32, bfloat16, float16"),
    ("cpu", "fp16", "dtype must be one of"),
])
def test_bad_device_or_dtype_names(device, dtype, message):
    with pytest.raises(ValueError, match=message):
        resolve_device_dtype(device, dtype)


# --- float32 on the CPU: logits --------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_logits_match_transformers_at_every_position(tiny, impl):
    name, hf, directory, _ = tiny
    model = TorchTransformer.from_pretrained(directory, attention=impl)
    ids = np.random.default_rng(0).integers(0, V, size=90).tolist()
    got = model.forward(ids)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (90, V)
    np.testing.assert_allclose(got, hf_logits(hf, ids), rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("impl, prompt_len", [("manual", 1), ("manual", 37), ("sdpa", 37)])
def test_prefill_and_decode_logits_match_transformers_at_every_step(tiny, impl, prompt_len):
    """Prefill prompt_len tokens, then decode the rest of 90 one at a time (teacher forcing):
    the row at position t equals row t of HF's full forward, and stays on the device."""
    name, hf, directory, _ = tiny
    runner = CachedTransformer(TorchTransformer.from_pretrained(directory, attention=impl))
    ids = np.random.default_rng(1).integers(0, V, size=90).tolist()
    rows = [runner.prefill(ids[:prompt_len])]
    for token in ids[prompt_len:]:
        rows.append(runner.decode(torch.tensor([token])))
    assert all(r.dtype == torch.float32 and r.shape == (V,) for r in rows)
    assert runner.cache.num_cached == 90
    np.testing.assert_allclose(torch.stack(rows).numpy(), hf_logits(hf, ids)[prompt_len - 1:],
                               rtol=1e-4, atol=2e-5, err_msg=name)


def test_manual_and_sdpa_attention_agree_with_a_cache_offset():
    """A chunk of T = 3 queries after 4 cached keys: query t sees keys 0 .. 4 + t. Checked
    against a hand-built loop over heads and positions, GQA head h reading key head h // 2."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((4, 3, 8), (2, 7, 8), (2, 7, 8)))
    expected = torch.empty(4, 3, 8)
    for h in range(4):
        for t in range(3):
            visible = 4 + t + 1
            scores = (k[h // 2, :visible] @ q[h, t]) / 8 ** 0.5
            expected[h, t] = torch.softmax(scores, dim=0) @ v[h // 2, :visible]
    for impl in IMPLS:
        torch.testing.assert_close(attention(q, k, v, 4, 8 ** -0.5, impl), expected,
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="S == q_start \\+ T"):
        attention(q, k, v, 3, 1.0)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        attention(q, k, v, 4, 1.0, "flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_bitwise_hfs_with_a_stacked_q_k_weight(dtype):
    """`rms_norm` against HF's own Qwen3RMSNorm, bit for bit: on a hidden state, and on the
    (T, H + Hkv, D) q/k heads of `Qwen3Block.qkv` with the stacked weight, which must equal HF's
    q_norm on the query heads and k_norm on the key heads."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    gen = torch.Generator().manual_seed(0)
    x, heads = torch.randn(5, 64, generator=gen), torch.randn(5, 6, 16, generator=gen) * 3
    norms = {}
    for name, size in (("hidden", 64), ("q", 16), ("k", 16)):
        norms[name] = Qwen3RMSNorm(size, eps=1e-6).to(dtype)
        norms[name].weight.data = torch.randn(size, generator=gen).to(dtype)
    x, heads = x.to(dtype), heads.to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norms["hidden"].weight, 1e-6), norms["hidden"](x))
        stacked = torch.cat([norms["q"].weight.expand(4, -1), norms["k"].weight.expand(2, -1)])
        expected = torch.cat([norms["q"](heads[:, :4]), norms["k"](heads[:, 4:])], dim=1)
        assert torch.equal(rms_norm(heads, stacked, 1e-6), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_attention_with_query_groups_as_rows_equals_each_head_alone(impl):
    """B = 2 rows, H = 6 query heads over Hkv = 2 key heads, one query each, 5 keys, row 1's
    first 2 keys hidden by the additive mask; checked against a loop over rows and heads,
    head h reading key head h // 3."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((2, 6, 1, 8), (2, 2, 5, 8),
                                                               (2, 2, 5, 8)))
    mask = torch.zeros(2, 1, 1, 5)
    mask[1, ..., :2] = float("-inf")
    expected = torch.empty(2, 6, 1, 8)
    for b in range(2):
        first = 2 * b        # row 1 sees keys 2 .. 4 only
        for h in range(6):
            scores = (k[b, h // 3, first:] @ q[b, h, 0]) * 0.4
            expected[b, h, 0] = torch.softmax(scores, dim=0) @ v[b, h // 3, first:]
    torch.testing.assert_close(decode_attention(q, k, v, 0.4, impl, mask), expected,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decode_attention(q[:1], k[:1], v[:1], 0.4, impl),
                               expected[:1], rtol=1e-5, atol=1e-6)


def test_parameters_are_s03s_count_with_the_tied_head_once(tiny):
    name, hf, directory, numpy_model = tiny
    model = TorchTransformer.from_pretrained(directory)
    assert sum(p.numel() for p in model.parameters()) == s03.parameter_count(numpy_model.config)
    assert all(not p.requires_grad for p in model.parameters())
    if numpy_model.config.tie_word_embeddings:
        assert model.lm_head is model.embed_tokens


# --- float32 on the CPU: greedy tokens -------------------------------------------------------

@pytest.mark.parametrize("impl, prompt_len", [
    ("manual", 1), ("manual", 5), ("manual", 90), ("sdpa", 5), ("sdpa", 90)])
def test_greedy_equals_hf_generate_s01_loop_and_s05_engine(tiny, impl, prompt_len):
    name, hf, directory, numpy_model = tiny
    prompt = np.random.default_rng(prompt_len).integers(2, V, size=prompt_len).tolist()
    new = min(N_GENERATE, CONTEXT - prompt_len)
    expected = hf_greedy(hf, prompt, new, eos_id=EOS_UNUSED)
    model = TorchTransformer.from_pretrained(directory, attention=impl)
    ours = Engine(model, IdTokenizer()).generate(prompt_text(prompt), greedy())
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    cached = s05.Engine(numpy_model, IdTokenizer(), CONTEXT).generate(prompt_text(prompt), greedy())
    assert ours.token_ids == cached.token_ids
    # The S01 loop runs the torch model itself through forward(): S01's contract holds.
    loop = s01.Engine(model, IdTokenizer(), CONTEXT).generate(prompt_text(prompt), N_GENERATE)
    assert ours.token_ids == loop.token_ids
    assert (ours.finish_reason, ours.stop_reason) == (loop.finish_reason, loop.stop_reason)
    assert ours.stats.context_lens == loop.stats.context_lens


def test_s01_call_style_is_greedy_and_gives_the_s01_loops_ids(tiny):
    """`generate(prompt, 12)`, S01's call, on the torch engine: greedy, S01's and HF's ids."""
    name, hf, directory, numpy_model = tiny
    model = TorchTransformer.from_pretrained(directory)
    loop = s01.Engine(numpy_model, IdTokenizer(), CONTEXT).generate(prompt_text(PROMPT), 12)
    ours = Engine(model, IdTokenizer()).generate(prompt_text(PROMPT), 12)
    assert ours.token_ids == loop.token_ids, first_difference(ours.token_ids, loop.token_ids)
    assert ours.token_ids == hf_greedy(hf, PROMPT, 12, eos_id=EOS_UNUSED)
    assert ours.stats.context_lens == loop.stats.context_lens


def test_eos_stop_equals_hf_generate(tiny):
    name, hf, directory, _ = tiny
    free_run = hf_greedy(hf, PROMPT, N_GENERATE, eos_id=EOS_UNUSED)
    eos = next(t for t in free_run[3:] if t not in (PAD, EOS_UNUSED))
    expected = hf_greedy(hf, PROMPT, N_GENERATE, eos_id=eos)
    model = TorchTransformer.from_pretrained(directory)
    ours = Engine(model, IdTokenizer(eos)).generate(prompt_text(PROMPT), greedy())
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    assert ours.finish_reason == "stop" and ours.stop_reason is None  # EOS: no stop named
    assert ours.token_ids[-1] == eos and eos not in ours.token_ids[:-1]


def test_context_boundaries(tiny):
    name, hf, directory, _ = tiny
    engine = Engine(TorchTransformer.from_pretrained(directory), IdTokenizer())
    assert engine.max_context == CONTEXT
    full = engine.generate(prompt_text([3] * CONTEXT), greedy())
    assert full.token_ids == [] and full.finish_reason == "length" and full.stats.passes == 0
    with pytest.raises(ValueError, match="prompt is 97 tokens but max_context is 96"):
        engine.generate(prompt_text([3] * (CONTEXT + 1)), greedy())
    small = Engine(engine.model, IdTokenizer(), max_context=8)
    out = small.generate(prompt_text([3, 4, 5]), greedy(ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"   # 5 of a budget of 36
    assert small.runner.cache.num_cached == 7  # the 8th token was sampled, never run
    assert small.runner.cache.max_seq_len == 8


# --- the engine against S04's on a text tokenizer -------------------------------------------

@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny random Qwen3 over the project tokenizer (V = 2048): (torch model, NumPy model,
    tokenizer factory eos_id -> CheckpointTokenizer, checkpoint directory), for runs with real
    text and stop strings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tokenizer_json = s03.ROOT / "data" / "tokenizer.json"
    vocab = s03_checkpoint.CheckpointTokenizer(tokenizer_json, [0]).vocab_size
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96,
                         vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=0)
    torch.manual_seed(7)
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    directory = tmp_path_factory.mktemp("text_qwen3")
    hf.save_pretrained(directory)
    shutil.copy(tokenizer_json, directory / "tokenizer.json")  # a complete checkpoint for main()
    return (TorchTransformer.from_pretrained(directory), s03.Transformer.from_pretrained(directory),
            lambda eos: s03_checkpoint.CheckpointTokenizer(tokenizer_json, [eos]), directory)


TEXT_PROMPT = "Romeo.\nBut soft! what light"


def completions_equal(ours: s01.Completion, ref: s01.Completion) -> None:
    assert ours.token_ids == ref.token_ids, first_difference(ours.token_ids, ref.token_ids)
    assert ours.text == ref.text
    assert (ours.finish_reason, ours.stop_reason) == (ref.finish_reason, ref.stop_reason)
    assert ours.stats.context_lens == ref.stats.context_lens
    assert (ours.logprobs is None) == (ref.logprobs is None)
    if ref.logprobs is not None:
        for a, b in zip(ours.logprobs, ref.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
            np.testing.assert_allclose([a.logprob] + [lp for _, lp in a.top_logprobs],
                                       [b.logprob] + [lp for _, lp in b.top_logprobs],
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_greedy_completions_equal_s04s_with_every_stop_rule(text_model):
    torch_model, numpy_model, make_tokenizer, _ = text_model
    free = s04.Engine(numpy_model, make_tokenizer(0), 128).generate(TEXT_PROMPT, greedy(40))
    assert free.finish_reason == "length" and len(free.token_ids) == 40
    eos, stop_id = free.token_ids[12], free.token_ids[20]
    stop_text = free.text[len(free.text) // 2:][:2]   # two characters from the middle
    cases = [
        (0, greedy(40)),
        (eos, greedy(40)),                                             # EOS stop
        (eos, greedy(40, min_tokens=30)),                              # EOS held off
        (eos, greedy(40, ignore_eos=True, stop_token_ids=[stop_id])),  # a stop token id
        (0, greedy(40, stop=[stop_text])),                             # a stop string
        (0, greedy(40, stop=[stop_text], min_tokens=35)),
        (0, greedy(40, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3,
                   logprobs=3)),
    ]
    for eos_id, params in cases:
        tokenizer = make_tokenizer(eos_id)
        ref = s04.Engine(numpy_model, tokenizer, 128).generate(TEXT_PROMPT, params)
        ours = Engine(torch_model, tokenizer).generate(TEXT_PROMPT, params)
        completions_equal(ours, ref)
    assert {c[1].max_tokens for c in cases} == {40}


def test_processed_logprobs_mode_equals_s04s(text_model):
    torch_model, numpy_model, make_tokenizer, _ = text_model
    params = greedy(12, repetition_penalty=1.3, logprobs=5)
    tokenizer = make_tokenizer(0)
    ref = s04.Engine(numpy_model, tokenizer, 128, "processed_logprobs").generate(TEXT_PROMPT, params)
    ours = Engine(torch_model, tokenizer, logprobs_mode="processed_logprobs").generate(
        TEXT_PROMPT, params)
    completions_equal(ours, ref)


@pytest.mark.parametrize("params", [
    s04.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, seed=1, stop=["\n\n", "."]),
    s04.SamplingParams(temperature=1.3, top_k=20, max_tokens=30, seed=2, min_tokens=10, stop=" "),
    s04.SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, stop_token_ids=[13]),
])
def test_stream_joined_equals_generate(text_model, params):
    torch_model, _, make_tokenizer, _ = text_model
    engine = Engine(torch_model, make_tokenizer(0))
    stream = engine.stream(TEXT_PROMPT, params)
    outputs = list(stream)
    streamed = stream.result
    whole = engine.generate(TEXT_PROMPT, params)
    assert "".join(o.text_delta for o in outputs) == streamed.text == whole.text
    assert streamed.token_ids == whole.token_ids and streamed.finish_reason == whole.finish_reason
    assert [t for o in outputs for t in o.new_token_ids] == streamed.token_ids  # one per step
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (whole.finish_reason,
                                                                    whole.stop_reason)


def test_seeded_sampling_reproduces_and_seeds_differ(text_model):
    torch_model, _, make_tokenizer, _ = text_model
    engine = Engine(torch_model, make_tokenizer(0))
    params = dict(temperature=1.0, max_tokens=30, ignore_eos=True)
    a = engine.generate(TEXT_PROMPT, s04.SamplingParams(seed=3, **params)).token_ids
    engine.generate(TEXT_PROMPT, s04.SamplingParams(seed=99, **params))  # runs in between
    b = engine.generate(TEXT_PROMPT, s04.SamplingParams(seed=3, **params)).token_ids
    c = engine.generate(TEXT_PROMPT, s04.SamplingParams(seed=4, **params)).token_ids
    assert a == b and a != c and len(a) == 30


def test_step_times_split_model_and_the_rest(text_model):
    torch_model, _, make_tokenizer, _ = text_model
    c = Engine(torch_model, make_tokenizer(0)).generate(TEXT_PROMPT, greedy(10, ignore_eos=True))
    s = c.stats
    assert len(s.step_times_s) == len(s.pass_times_s) == s.passes == 10
    assert all(0 < m <= t for m, t in zip(s.pass_times_s, s.step_times_s))
    times = StepTimes.from_stats(s)
    assert times.model_s > 0 and times.other_s >= 0
    assert times.tokens_per_s == pytest.approx(10 / sum(s.step_times_s))
    with pytest.raises(ValueError, match="at least two steps"):
        StepTimes.from_stats(Engine(torch_model, make_tokenizer(0)).generate(
            TEXT_PROMPT, greedy(1)).stats)


def fixed_row_engine(model, tokenizer, row: torch.Tensor) -> Engine:
    """An engine whose runner does its real passes but hands the sampler `row` (V,) instead of
    the logits it computed: a model that produced exactly that row. Through `runner_class`."""

    class FixedRowRunner(CachedTransformer):
        def prefill(self, prompt_ids):
            super().prefill(prompt_ids)
            return row.clone()

        def decode(self, token):
            super().decode(token)
            return row.clone()

    class FixedRowEngine(Engine):
        runner_class = FixedRowRunner

    return FixedRowEngine(model, tokenizer)


def test_min_tokens_that_rules_out_every_token_is_an_error(text_model):
    """A model whose only finite logit is EOS's, with min_tokens > 0: S04's error, raised from
    the id the device flags with -1 (no extra host round trip)."""
    torch_model, _, make_tokenizer, _ = text_model
    only_eos = torch.full((torch_model.vocab_size,), float("-inf"))
    only_eos[0] = 1.0
    engine = fixed_row_engine(torch_model, make_tokenizer(0), only_eos)
    with pytest.raises(ValueError, match="min_tokens ruled out every token"):
        engine.generate(TEXT_PROMPT, greedy(5, min_tokens=2))
    assert engine.generate(TEXT_PROMPT, greedy(5)).token_ids == [0]  # without it: EOS at once


# --- the cache and errors -------------------------------------------------------------------

def test_cache_is_preallocated_and_append_writes_in_place():
    cache = KVCache(num_layers=2, num_kv_heads=3, max_seq_len=8, head_dim=4, dtype=torch.bfloat16)
    assert cache.k.shape == cache.v.shape == (2, 3, 8, 4) and cache.k.dtype == torch.bfloat16
    assert cache.nbytes == 2 * 2 * 3 * 8 * 4 * 2        # 768 bytes, reserved up front
    storage = cache.k.data_ptr()
    k = torch.ones(3, 5, 4)
    keys, values = cache.append(0, k, 2 * k)
    assert keys.shape == (3, 5, 4) and cache.num_cached == 0  # layer 1 has not written yet
    cache.append(1, k, k)
    assert (cache.num_cached, cache.num_free) == (5, 3)
    assert keys.data_ptr() == storage and float(values[0, 0, 0]) == 2.0
    with pytest.raises(ValueError, match="KV cache is full: layer 0 holds 5 of 8 positions "
                                         "and cannot take 4 more"):
        cache.append(0, torch.ones(3, 4, 4), torch.ones(3, 4, 4))
    assert cache.layer_lens == [5, 5]                          # nothing written
    cache.reset()
    assert cache.num_cached == 0 and cache.k.data_ptr() == storage


@pytest.mark.parametrize("args, kwargs, message", [
    ((0, 1, 4, 2), {}, "num_layers must be an integer >= 1"),
    ((1, 1, 4.0, 2), {}, "max_seq_len must be an integer >= 1"),
    ((1, 1, 4, 2), {"dtype": torch.int32}, "dtype must be a floating-point torch.dtype"),
])
def test_cache_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCache(*args, **kwargs)


def test_model_and_engine_errors(tiny):
    name, hf, directory, numpy_model = tiny
    with pytest.raises(ValueError, match="attention must be one of"):
        TorchTransformer.from_pretrained(directory, attention="flash")
    with pytest.raises(ValueError, match="dtype must be one of"):
        TorchTransformer.from_pretrained(directory, dtype=torch.float64)
    model = TorchTransformer.from_pretrained(directory)
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.forward([1, V])
    with pytest.raises(ValueError, match="non-empty 1-D sequence"):
        model.forward([])
    with pytest.raises(ValueError, match="positions must lie in"):
        model.forward([1] * (CONTEXT + 1))
    runner = CachedTransformer(model, max_seq_len=6)
    with pytest.raises(ValueError, match="decode needs a prefilled cache"):
        runner.decode(torch.tensor([1]))
    with pytest.raises(ValueError, match="prompt is 7 tokens but the KV cache holds 6"):
        runner.prefill([1] * 7)
    runner.prefill([1] * 6)
    with pytest.raises(ValueError, match="KV cache is full"):
        runner.decode(torch.tensor([1]))
    with pytest.raises(ValueError, match="max_seq_len must be an integer in"):
        CachedTransformer(model, max_seq_len=CONTEXT + 1)
    with pytest.raises(ValueError, match=r"max_context \(97\) must be <= the model's"):
        Engine(model, IdTokenizer(), max_context=CONTEXT + 1)
    with pytest.raises(ValueError, match="model must be a TorchTransformer"):
        Engine(numpy_model, IdTokenizer())


# --- bfloat16 and float16 (on the CPU here; the same checks run on CUDA below) ---------------

def check_low_precision(hf, directory, device: str, dtype: torch.dtype, impl: str) -> None:
    tolerance, prefix = LOW_PRECISION[dtype]
    model = TorchTransformer.from_pretrained(directory, device=device, dtype=dtype, attention=impl)
    ids = np.random.default_rng(0).integers(0, V, size=90).tolist()
    ref = hf_logits(hf, ids)                                             # HF, float32
    got = model.forward(ids)
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() <= tolerance
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > 2 * tolerance
    assert decisive.sum() >= 30  # the check covers at least a third of the positions
    np.testing.assert_array_equal(got.argmax(-1)[decisive], ref.argmax(-1)[decisive])
    expected = hf_greedy(hf, PROMPT, N_GENERATE, eos_id=EOS_UNUSED)
    ours = Engine(model, IdTokenizer()).generate(prompt_text(PROMPT), greedy())
    assert ours.token_ids[:prefix] == expected[:prefix], first_difference(ours.token_ids, expected)


@pytest.mark.parametrize("dtype, impl", [(torch.bfloat16, "manual"), (torch.bfloat16, "sdpa"),
                                         (torch.float16, "manual")], ids=["bf16-manual", "bf16-sdpa", "fp16-manual"])
@pytest.mark.slow
def test_low_precision_on_cpu_within_stated_tolerance(tiny, dtype, impl):
    name, hf, directory, _ = tiny
    check_low_precision(hf, directory, "cpu", dtype, impl)


# --- CUDA (skipped without a GPU) ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_float32_logits_and_greedy_equal_transformers(tiny, impl):
    name, hf, directory, _ = tiny
    model = TorchTransformer.from_pretrained(directory, device="cuda", attention=impl)
    assert model.embed_tokens.device.type == "cuda"
    ids = np.random.default_rng(0).integers(0, V, size=90).tolist()
    # CUDA sums in another order than the CPU: allow a little more than on the CPU.
    np.testing.assert_allclose(model.forward(ids), hf_logits(hf, ids), rtol=1e-3, atol=1e-4)
    expected = hf_greedy(hf, PROMPT, N_GENERATE, eos_id=EOS_UNUSED)
    engine = Engine(model, IdTokenizer(), sync_timing=True)
    assert engine.runner.cache.k.device.type == "cuda"
    ours = engine.generate(prompt_text(PROMPT), greedy())
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_low_precision_within_stated_tolerance(tiny, dtype, impl):
    name, hf, directory, _ = tiny
    check_low_precision(hf, directory, "cuda", dtype, impl)


@pytest.mark.gpu
def test_cuda_decode_and_sampling_never_wait_for_the_device(tiny):
    """The claim of the chapter: between two `.item()` calls the host only queues work. With
    CUDA's sync debug mode set to "error", any operation that makes the host wait for the
    device (a device-to-host copy, a data-dependent shape) raises; decode steps with every
    processor switched on must run without one."""
    name, hf, directory, _ = tiny
    model = TorchTransformer.from_pretrained(directory, device="cuda", dtype=torch.bfloat16,
                                             attention="sdpa")
    runner = CachedTransformer(model)
    params = s04.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, min_tokens=3,
                                repetition_penalty=1.2, presence_penalty=0.3,
                                frequency_penalty=0.2, seed=5, stop_token_ids=[3])
    sampler = DeviceSampler(params, PROMPT, [EOS_UNUSED], V, torch.device("cuda"))
    logits = runner.prefill(PROMPT)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(8):
            # raw logits passed too: the NaN / +inf flag must not wait for the device either
            token = sampler.draw(sampler.process(logits, step), step, logits)
            sampler.update(token)
            logits = runner.decode(token)   # model on "cuda", token on "cuda:0": never read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.cache.num_cached == len(PROMPT) + 8
    assert 0 <= int(token) < V


@pytest.mark.gpu
def test_cuda_seeded_sampling_reproduces_and_defaults_to_bf16(tiny):
    name, hf, directory, _ = tiny
    assert resolve_device_dtype() == (torch.device("cuda"), torch.bfloat16)
    model = TorchTransformer.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    engine = Engine(model, IdTokenizer())
    params = s04.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=11,
                                repetition_penalty=1.2, logprobs=2)
    a = engine.generate(prompt_text(PROMPT), params)
    b = engine.generate(prompt_text(PROMPT), params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert all(0 <= t < V for t in a.token_ids)


# --- the bundled model ----------------------------------------------------------------------

bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet (scripts/train_bundled_model.py)")


@bundled
@pytest.mark.parametrize("impl", IMPLS)
def test_bundled_model_logits_and_greedy_equal_transformers_s01_and_s05(impl):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    model, tokenizer = load(s03.BUNDLED_MODEL_DIR, device="cpu", dtype="float32", attention=impl)
    ids = tokenizer.encode("Romeo.\nBut soft! what light through yonder window breaks?")
    np.testing.assert_allclose(model.forward(ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    prompt = "Ham.\nTo be, or not to be"
    ids = tokenizer.encode(prompt)
    eos = tokenizer.eos_id
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    expected = out[0, len(ids):].tolist()
    ours = Engine(model, tokenizer).generate(prompt, greedy(40))
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    numpy_model = s03.Transformer.from_pretrained(s03.BUNDLED_MODEL_DIR)
    limit = numpy_model.config.max_position_embeddings
    assert ours.token_ids == s05.Engine(numpy_model, tokenizer, limit).generate(prompt, greedy(40)).token_ids
    assert ours.token_ids == s01.Engine(numpy_model, tokenizer, limit).generate(prompt, 40).token_ids


@bundled
def test_main_prints_completion_and_step_split(capsys):
    main(["--device", "cpu", "--prompt", "Romeo.\n", "--max-tokens", "8", "--attention", "sdpa"])
    out = capsys.readouterr().out
    assert "--- completion ---" in out and "on cpu in float32, attention sdpa" in out
    assert "decode step:" in out and "everything else" in out and "tokens/s" in out


def test_main_on_a_checkpoint_directory(text_model, capsys):
    *_, directory = text_model
    main(["--model", str(directory), "--device", "cpu", "--dtype", "bfloat16", "--max-tokens", "6",
          "--prompt", "Romeo."])
    out = capsys.readouterr().out
    assert "qwen3" in out and "on cpu in bfloat16, attention manual" in out
    assert "--- completion ---" in out and "decode step:" in out and "everything else" in out
    assert "warm-up request" in out


def test_main_names_a_missing_bundled_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(s03, "BUNDLED_MODEL_DIR", tmp_path / "model")
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "model")])
    assert "bundled model is not in" in capsys.readouterr().err


# --- regressions: bad input is an error, never wrong tokens -----------------------------------

CountingEngine = counting_engine(Engine)


def test_a_request_prefills_once_then_decodes_from_the_device_token(text_model):
    """S05's rule from the engine's state, on the device: one prefill of the prompt, then one
    decode per token at the next position, each fed the id `draw` left on the device."""
    torch_model, numpy_model, make_tokenizer, _ = text_model
    tokenizer = make_tokenizer(0)
    engine = CountingEngine(torch_model, tokenizer)
    out = engine.generate(TEXT_PROMPT, greedy(10, ignore_eos=True))
    n = len(tokenizer.encode(TEXT_PROMPT))
    assert engine.runner.calls == [("prefill", n)] + [("decode", k) for k in range(n, n + 9)]
    assert out.token_ids == s04.Engine(numpy_model, tokenizer, 128).generate(
        TEXT_PROMPT, greedy(10, ignore_eos=True)).token_ids                  # the oracle


def test_interleaved_streams_on_one_engine_each_equal_their_solo_run(text_model):
    """Two requests streamed in turn on one engine share its one KV cache. S06 used to decode
    each on top of the other's keys (wrong tokens, silently); with S05's rule (the cache's
    owner and the request's computed tokens) every step after the other request ran prefills
    again, and both completions equal their solo runs."""
    from transformers import AutoModelForCausalLM
    torch_model, _, make_tokenizer, directory = text_model
    tokenizer = make_tokenizer(0)
    engine = CountingEngine(torch_model, tokenizer)
    a_params = greedy(12, ignore_eos=True)
    b_params = s04.SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a_prompt, b_prompt = TEXT_PROMPT, "HAMLET:\nTo be, or not"
    solo_a = engine.generate(a_prompt, a_params)
    solo_b = engine.generate(b_prompt, b_params)
    assert solo_a.token_ids != solo_b.token_ids          # else the test could not fail
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    never = next(i for i in range(2, V) if i not in solo_a.token_ids)   # HF must not stop
    assert solo_a.token_ids == hf_greedy(hf, tokenizer.encode(a_prompt), 12, eos_id=never)
    engine.runner.calls.clear()
    done_a, done_b = run_in_turns([engine.stream(a_prompt, a_params),
                                   engine.stream(b_prompt, b_params)])
    completions_equal(done_a, solo_a)
    completions_equal(done_b, solo_b)
    lengths = [len(tokenizer.encode(a_prompt)), len(tokenizer.encode(b_prompt))]
    assert engine.runner.calls == [("prefill", n + step) for step in range(12) for n in lengths]


def test_nan_logits_from_a_broken_checkpoint_are_s04s_error(text_model, tmp_path):
    """A checkpoint copy whose final norm weight is NaN: every logit is NaN. S04 raises; S06
    used to sample token 0 with logprob nan. The device folds the check into the token id."""
    import safetensors.numpy
    *_, directory = text_model
    broken = tmp_path / "nan_norm"
    shutil.copytree(directory, broken)
    weights = s03_checkpoint.read_safetensors(broken / "model.safetensors")
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    safetensors.numpy.save_file(weights, str(broken / "model.safetensors"))
    torch_model, tokenizer = load(broken, device="cpu")
    numpy_model, _ = s03_checkpoint.load(broken)
    for params in (greedy(3), s04.SamplingParams(temperature=1.0, seed=0, max_tokens=3),
                   greedy(1, logprobs=2)):
        with pytest.raises(ValueError, match=r"logits must not contain NaN or \+inf"):
            s04.Engine(numpy_model, tokenizer, CONTEXT).generate("Romeo", params)  # the oracle
        with pytest.raises(ValueError, match=r"logits must not contain NaN or \+inf"):
            Engine(torch_model, tokenizer).generate("Romeo", params)


@pytest.mark.parametrize("bad, message", [
    (float("inf"), r"logits must not contain NaN or \+inf"),
    (float("nan"), r"logits must not contain NaN or \+inf"),
    (None, "logits must have at least one finite entry"),
])
def test_logits_rows_s04_rejects_are_rejected_on_the_device_too(text_model, bad, message):
    torch_model, _, make_tokenizer, _ = text_model
    row = torch.full((torch_model.vocab_size,), float("-inf"))
    if bad is not None:
        row[:] = 0.0
        row[5] = bad
    engine = fixed_row_engine(torch_model, make_tokenizer(0), row)
    for params in (greedy(3), s04.SamplingParams(temperature=0.7, seed=1, max_tokens=3)):
        with pytest.raises(ValueError, match=message):
            s04.process_logits(row.numpy(), params)                              # the oracle
        with pytest.raises(ValueError, match=message):
            engine.generate(TEXT_PROMPT, params)


def test_a_temperature_below_float32s_range_gives_the_greedy_tokens(text_model):
    """T = 1e-50 leaves only the maximum with probability > 0 (no ties in these logits), so
    its tokens are the greedy ones; S06 used to draw token 0 from a NaN row at every step."""
    torch_model, numpy_model, make_tokenizer, _ = text_model
    engine = Engine(torch_model, make_tokenizer(0))
    expected = engine.generate(TEXT_PROMPT, greedy(8, ignore_eos=True)).token_ids
    # the greedy tokens themselves: S04's NumPy engine, not this engine's own greedy path
    assert expected == s04.Engine(numpy_model, make_tokenizer(0), 128).generate(
        TEXT_PROMPT, greedy(8, ignore_eos=True)).token_ids
    tiny_t = s04.SamplingParams(temperature=1e-50, seed=0, max_tokens=8, ignore_eos=True)
    assert engine.generate(TEXT_PROMPT, tiny_t).token_ids == expected


def test_the_largest_seed_runs_and_a_larger_one_is_refused(text_model):
    """2**70 used to pass SamplingParams and fail in torch with an OverflowError."""
    torch_model, _, make_tokenizer, _ = text_model
    engine = Engine(torch_model, make_tokenizer(0))
    params = dict(temperature=1.0, max_tokens=4, ignore_eos=True)
    top = s04.SamplingParams(seed=2**63 - 1, **params)
    first = engine.generate(TEXT_PROMPT, top).token_ids
    assert len(first) == 4 and first == engine.generate(TEXT_PROMPT, top).token_ids
    with pytest.raises(ValueError, match=r"seed must be None or an int in \[0, 2\*\*63\)"):
        s04.SamplingParams(seed=2**70, **params)


@pytest.mark.parametrize("token", [
    2048, -1, 10**20, 1.5, True, torch.tensor([2048]), torch.tensor([-1]),
    torch.tensor([1.0]), torch.tensor([[1]]), torch.tensor([1, 2]),
])
def test_decode_checks_a_host_id_before_it_reaches_the_device(text_model, token):
    """An id >= V used to end in an IndexError from inside torch (on CUDA, a device assert)."""
    torch_model, *_ = text_model
    runner = CachedTransformer(torch_model, max_seq_len=8)
    runner.prefill([1, 2])
    with pytest.raises(ValueError, match=r"token id must be an integer in \[0, V=2048\)"):
        runner.decode(token)     # an int: checked on the host; a CPU tensor: by the lookup
    assert runner.cache.num_cached == 2                       # nothing was written
    expected = torch_model.forward([1, 2, 3])[-1]             # the uncached pass (HF-pinned)
    np.testing.assert_allclose(runner.decode(3).numpy(), expected, rtol=1e-4, atol=2e-5)
    runner.prefill([1, 2])
    np.testing.assert_allclose(runner.decode(torch.tensor([3])).numpy(), expected,
                               rtol=1e-4, atol=2e-5)


def test_main_reports_bad_input_as_usage_errors(text_model, tmp_path, capsys):
    *_, directory = text_model
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / "config.json").write_text("{not json")
    bad_tokenizer = tmp_path / "bad_tokenizer"
    shutil.copytree(directory, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("{bad")
    for argv, message in [
            (["--model", str(directory), "--prompt", "ab\udcff"],
             "--prompt must be valid Unicode without lone surrogates"),
            (["--model", str(broken)], "config.json"),
            (["--model", str(bad_tokenizer)], "tokenizer.json"),
            (["--model", str(directory), "--max-context", "0"], "max_context must be")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["--device", "cpu", "--max-tokens", "2", *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_same_device_treats_cuda_without_an_index_as_any_cuda_device():
    """decode trusts a tensor on the model's device without reading it; a model on "cuda" holds
    tokens on "cuda:0", and a plain == would call them different and read every token back."""
    cuda, cuda0, cuda1, cpu = (torch.device(d) for d in ("cuda", "cuda:0", "cuda:1", "cpu"))
    assert torch.device("cuda") != torch.device("cuda:0")       # why the helper exists
    assert same_device(cuda, cuda0) and same_device(cuda1, cuda) and same_device(cpu, cpu)
    assert not same_device(cuda0, cuda1) and not same_device(cpu, cuda0)
