"""Tests for chapter S14's 8-bit KV cache (code/s14_kv_cache.py).

Oracles: the e4m3 value set enumerated from its bit layout in NumPy (1 sign, 4 exponent bits
of bias 7, 3 mantissa bits, subnormals at exponent 0, S.1111.111 the NaN) and the nearest of
them to each input; int8 scales absmax / 127 computed in NumPy; a softmax perturbation bound
worked out below for attention; hand arithmetic for bytes (the bundled model: L 6, Hkv 2,
D 32; Llama-3.1-8B: L 32, Hkv 8, D 128); S06's whole-prompt forward for the logits; the same
engine with each request run alone; S13's engine for "auto".
"""
import math

import numpy as np
import pytest
import torch

import s06_torch as s06
import s13_prefix_caching as s13
import s14_kv_cache as s14
from engine_testing import drive, greedy, tokens_of
from s01_generation_loop import ParameterError
from s12_engine import PagedKVCache
from s14_kv_cache import QuantizedPagedKVCache, dequantize_kv, quantize_kv

SPECS = s14.KV_CACHE_DTYPES
QUANTIZED = ["int8", "fp8_e4m3", "fp8_per_token_head"]
CONTEXT = 160


def e4m3_values() -> np.ndarray:
    """Every finite float8_e4m3fn value, from the bit layout (OCP FP8 spec)."""
    values = []
    for bits in range(256):
        sign, exponent, mantissa = bits >> 7, (bits >> 3) & 15, bits & 7
        if exponent == 15 and mantissa == 7:
            continue                                                    # NaN
        if exponent == 0:
            magnitude = mantissa / 8 * 2.0 ** -6                        # subnormal
        else:
            magnitude = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(-magnitude if sign else magnitude)
    return np.unique(np.array(values))


# --- quantize and dequantize ---------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp8_per_tensor_round_trip_is_the_nearest_e4m3_value(scale):
    grid = e4m3_values()
    assert grid.max() == 448 and len(grid) == 253          # +-0 once, 126 positive each side
    rng = np.random.default_rng(0)
    x = np.sign(rng.normal(size=4000)) * 2.0 ** rng.uniform(-14, 10, size=4000)
    x = x.astype(np.float32)
    codes, scales = quantize_kv(torch.from_numpy(x), SPECS["fp8_e4m3"], scale)
    assert codes.dtype == torch.float8_e4m3fn and float(scales) == scale
    back = dequantize_kv(codes, scales, torch.float32).numpy()
    y = np.clip(x.astype(np.float64) / scale, -448, 448)                 # saturating
    nearest = np.abs(grid[None, :] - y[:, None]).min(axis=1)
    np.testing.assert_allclose(np.abs(back / scale - y), nearest, rtol=0, atol=1e-12)
    normal = (np.abs(y) >= 2.0 ** -6) & (np.abs(x / scale) <= 448)
    rel = np.abs(back[normal] - x[normal]) / np.abs(x[normal])
    assert rel.max() <= 2.0 ** -4                   # 3 mantissa bits: half an ulp, relative
    assert np.abs(back[~normal & (np.abs(y) < 1)] - x[~normal & (np.abs(y) < 1)]).max() \
        <= 2.0 ** -10 * scale                        # subnormal steps of 2^-9, half of one
    assert (np.abs(back[np.abs(x / scale) > 448]) == 448 * scale).all()   # never NaN


@pytest.mark.parametrize("name", ["int8", "fp8_per_token_head"])
def test_per_token_head_round_trip_within_half_a_step_and_zero_rows_stay_zero(name):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 50, 32)) * 10.0 ** rng.uniform(-3, 1, size=(3, 50, 1))
    x[1, 7] = 0.0                                                       # a row of zeros
    x = x.astype(np.float32)
    codes, scales = quantize_kv(torch.from_numpy(x), SPECS[name])
    back = dequantize_kv(codes, scales, torch.float32).numpy()
    qmax = 127 if name == "int8" else 448
    step = np.abs(x).max(-1, keepdims=True) / qmax                     # NumPy's own scale
    np.testing.assert_allclose(scales.numpy(), step[..., 0], rtol=1e-6)
    assert np.isfinite(back).all() and (back[1, 7] == 0).all()
    if name == "int8":
        assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
        assert (np.abs(x - back) <= step / 2 * (1 + 1e-5)).all()        # <= scale / 2
    else:
        big = np.abs(x) >= step * 2.0 ** -6
        assert (np.abs(x - back)[big] <= 2.0 ** -4 * np.abs(x)[big] * (1 + 1e-6)).all()
        assert (np.abs(x - back)[~big] <= (step * 2.0 ** -10 * np.ones_like(x))[~big]).all()


# --- the pool ------------------------------------------------------------------------------------

def element_bound(x: np.ndarray, name: str, scale: float = 1.0) -> np.ndarray:
    """The largest |x - x^| each element may have under `name` (from the tests above)."""
    if name == "int8":
        return np.abs(x).max(-1, keepdims=True) / 127 / 2 * (1 + 1e-5) + 0 * x
    step = np.abs(x).max(-1, keepdims=True) / 448 if name == "fp8_per_token_head" else scale
    return np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * step) * (1 + 1e-6)


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_pool_writes_through_slots_and_gathers_through_block_tables(name):
    L, blocks, bs, hkv, d = 2, 8, 4, 2, 8
    cache = QuantizedPagedKVCache(L, blocks, bs, hkv, d, 16, kv_cache_dtype=name)
    per_row = name != "fp8_e4m3"
    # bytes by hand: codes 1 byte each; per-row float32 scales, or one per layer for K and V
    scale_bytes = 2 * L * blocks * bs * hkv * 4 if per_row else 2 * L * 4
    assert cache.nbytes == 2 * L * blocks * bs * hkv * d + scale_bytes
    tables = [[3, 5], [1, 6, 2]]                                   # 7 and 10 positions
    lengths = [7, 10]
    rng = np.random.default_rng(2)
    dense = [rng.normal(size=(L, 2, hkv, n, d)).astype(np.float32) for n in lengths]
    table_tensor = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    for r, n in enumerate(lengths):
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for p in range(n)])  # by hand
        for layer in range(L):
            cache.write(layer, slots, torch.from_numpy(dense[r][layer, 0]),
                        torch.from_numpy(dense[r][layer, 1]))
    for layer in range(L):
        k, v = cache.gather(layer, table_tensor, 10)
        assert k.shape == v.shape == (2, hkv, 10, d) and k.dtype == torch.float32
        for r, n in enumerate(lengths):
            for got, want in ((k[r, :, :n], dense[r][layer, 0]),
                              (v[r, :, :n], dense[r][layer, 1])):
                err = np.abs(got.numpy() - want)
                assert (err <= element_bound(want, name)).all() and err.max() > 0
        assert not k[0, :, 8:].any()            # request 0's third table entry: the null block
    assert not cache.k[:, 0].view(torch.uint8).any()             # block 0 is never written
    cache.zero_blocks([5, 6])
    k, _ = cache.gather(0, table_tensor, 10)
    assert not k[0, :, 4:].any() and not k[1, :, 4:8].any() and k[1, :, :4].any()


@pytest.mark.parametrize("name", QUANTIZED)
def test_attention_over_the_pool_is_within_the_softmax_perturbation_bound(name):
    """Scores s_j = c q.k_j move by at most eps = c sum_d |q_d| max_j |dk_jd| when each k_j
    moves by dk_j, so every softmax weight changes by a factor in [e^-2eps, e^2eps] and the
    weights by at most e^2eps - 1 in total variation; the output sum_j p_j v_j then moves by
    at most max |dv| + (e^2eps - 1) max |v| (per output element). The bound uses each element's
    worst case from the round-trip tests, computed here in NumPy."""
    hkv, groups, s_len, d = 2, 2, 37, 32
    rng = np.random.default_rng(3)
    q = rng.normal(size=(hkv * groups, 1, d)).astype(np.float32)
    k = (rng.normal(size=(hkv, s_len, d)) * 2).astype(np.float32)
    v = rng.normal(size=(hkv, s_len, d)).astype(np.float32)
    cache = QuantizedPagedKVCache(1, 4, 16, hkv, d, 48, kv_cache_dtype=name)
    cache.write(0, torch.arange(16, 16 + s_len), torch.from_numpy(k), torch.from_numpy(v))
    kq, vq = cache.gather(0, torch.tensor([[1, 2, 3]]), s_len)
    c = 1 / math.sqrt(d)
    exact = s06.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                          s_len - 1, c, "manual").numpy()
    got = s06.attention(torch.from_numpy(q), kq[0], vq[0], s_len - 1, c, "manual").numpy()
    dk = np.repeat(element_bound(k, name).max(1), groups, axis=0)          # (H, D)
    dv = np.repeat(element_bound(v, name).max(1), groups, axis=0)          # (H, D)
    eps = c * (np.abs(q[:, 0]) * dk).sum(-1)                                # (H,)
    bound = dv + (np.exp(2 * eps) - 1)[:, None] * np.abs(v).max()          # (H, D)
    err = np.abs(got[:, 0] - exact[:, 0])
    assert (err <= bound).all() and err.max() > 0


# --- bytes and capacity --------------------------------------------------------------------------

def test_bytes_per_token_and_the_tokens_a_budget_holds_by_hand():
    bundled = s06.load()[0]
    cfg = s14.model_config(bundled)
    # 2 (K, V) x 6 layers x 2 heads x 32 dims = 768 values per token
    assert s14.kv_cache_bytes_per_token(cfg, "auto") == 768 * 4 == 3072          # float32
    assert s14.kv_cache_bytes_per_token(cfg, "bfloat16") == 768 * 2
    assert s14.kv_cache_bytes_per_token(cfg, "fp8_e4m3") == 768                  # half of bf16
    assert s14.kv_cache_bytes_per_token(cfg, "int8") == 768 + 2 * 6 * 2 * 4 == 864
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128}
    assert s14.kv_cache_bytes_per_token(llama, "bfloat16") == 131072
    assert s14.kv_cache_bytes_per_token(llama, "fp8") == 65536
    assert s14.kv_cache_bytes_per_token(llama, "int8_per_token_head") == 2 * 32 * 8 * 132
    mib = 2**20                               # 1 MiB in blocks of 16 tokens, minus the null
    want = {"float32": (mib // (3072 * 16) - 1) * 16, "bfloat16": (mib // (1536 * 16) - 1) * 16,
            "fp8_e4m3": (mib // (768 * 16) - 1) * 16, "int8": (mib // (864 * 16) - 1) * 16}
    got = {name: s14.pool_tokens(cfg, name, mib) for name in want}
    assert got == want == {"float32": 320, "bfloat16": 656, "fp8_e4m3": 1344, "int8": 1184}
    assert got["fp8_e4m3"] / got["bfloat16"] > 2 and got["fp8_e4m3"] / got["float32"] > 4
    assert 1.75 < got["int8"] / got["bfloat16"] < 2 and 3.5 < got["int8"] / got["float32"] < 4
    # a real pool of that many blocks fits the budget: its tensors' bytes, scales included
    for name, dtype in (("int8", "int8"), ("fp8_e4m3", "fp8_e4m3")):
        blocks = want[name] // 16 + 1
        cache = QuantizedPagedKVCache.for_model(bundled, blocks, 16, 64, kv_cache_dtype=dtype)
        assert cache.nbytes <= mib < cache.nbytes + s14.kv_cache_bytes_per_token(cfg, name) * 16


# --- the engine on the bundled model -------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = s06.load()
    text = (s06.s03.ROOT / "data" / "shakespeare.txt").read_text()
    starts, lengths = [1000, 7000, 15000, 30000, 52000], [5, 12, 20, 33, 48]
    prompts = [tokenizer.encode(text[a:a + 400])[:n] for a, n in zip(starts, lengths)]
    held_out = tokenizer.encode(text[200000:203000])[:256]
    return model, tokenizer, prompts, held_out


def run(engine, prompts, arrivals=None, new=32):
    outs, _ = drive(engine, [(p, greedy(new, ignore_eos=True)) for p in prompts],
                    arrivals or [0] * len(prompts))
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks               # all blocks free
    return [tokens_of(outs[i]) for i in range(len(prompts))]


def build(model, tokenizer, name, **options):
    return s14.build_engine(model, tokenizer, kv_cache_dtype=name, max_context=CONTEXT,
                            max_num_seqs=4, **options)


@pytest.mark.parametrize("mode", ["batch_invariant", "fast"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_each_request_equals_itself_alone_in_the_quantized_engine(bundled, name, mode):
    """Invariant 3 inside the quantized engine: 5 requests arriving over 3 steps into 4 seats
    (queueing, chunk-free prefill beside decodes) give each one the tokens it gets alone. In
    batch-invariant mode exactly by construction; in the fast mode measured equal here (a
    code flips only when a batched product moves a value across a rounding boundary)."""
    model, tokenizer, prompts, _ = bundled
    options = dict(batch_invariant=mode == "batch_invariant", enable_prefix_caching=False)
    engine = build(model, tokenizer, name, **options)
    assert isinstance(engine.runner.cache, QuantizedPagedKVCache)
    together = run(engine, prompts, [0, 0, 1, 2, 2])
    alone = [run(build(model, tokenizer, name, **options), [p])[0] for p in prompts]
    assert together == alone


def test_greedy_tokens_mostly_agree_with_the_fp32_kv_engine(bundled):
    """Not equal by design (the KV is rounded): measured on this machine 100 % of positions
    for int8 and 80 % for fp8_e4m3 (it diverges in 3 of 8 requests, after which positions
    differ by construction); the teacher-forced same-top-1 over 256 held-out tokens is the
    steadier figure (int8 99.6 %, fp8 98.4 %)."""
    model, tokenizer, prompts, held_out = bundled
    fp32 = run(build(model, tokenizer, "auto", batch_invariant=True), prompts)
    ref = s14.prefill_logits(model, held_out)
    rates = {}
    for name, least, top1 in (("int8", 0.95, 0.98), ("fp8_e4m3", 0.6, 0.95)):
        got = run(build(model, tokenizer, name, batch_invariant=True), prompts)
        same = sum(a == b for r, g in zip(fp32, got) for a, b in zip(r, g, strict=True))
        rates[name] = same / sum(map(len, fp32))
        logits = s14.prefill_logits(model, held_out, name)
        assert float((logits.argmax(-1) == ref.argmax(-1)).float().mean()) >= top1
        assert rates[name] >= least, rates


def test_prefix_hits_give_the_tokens_of_misses_in_the_quantized_engine(bundled):
    model, tokenizer, prompts, held_out = bundled
    system = held_out[:40]                                        # 2 full blocks of 16 shared
    shared = [system + p for p in prompts[:3]]
    for name in ("int8", "fp8_e4m3"):
        on = build(model, tokenizer, name, enable_prefix_caching=True)
        off = build(model, tokenizer, name, enable_prefix_caching=False)
        assert isinstance(on.scheduler.kv, s13.PrefixCachingKVCacheManager)
        hits_first = run(on, shared, [0, 3, 6])                    # later ones hit the first
        assert on.scheduler.kv.stats.hits >= 2 * 32
        assert hits_first == run(off, shared, [0, 3, 6])


def test_auto_is_s13s_engine_and_prefill_logits_are_s06s(bundled):
    model, tokenizer, prompts, held_out = bundled
    engine = build(model, tokenizer, "auto")
    assert type(engine.runner.cache) is PagedKVCache
    assert run(engine, prompts[:2]) == run(s13.build_engine(
        model, tokenizer, max_context=CONTEXT, max_num_seqs=4), prompts[:2])
    np.testing.assert_array_equal(s14.prefill_logits(model, held_out).numpy(),
                                  model.forward(held_out))
    # the evaluator's use: perplexity of the held-out tokens through an int8 pool
    targets = torch.tensor(held_out[1:])
    ppl = {name: math.exp(float(torch.nn.functional.cross_entropy(
        s14.prefill_logits(model, held_out, name)[:-1], targets))) for name in ("auto", "int8")}
    assert abs(ppl["int8"] / ppl["auto"] - 1) < 0.01, ppl


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16),
                                        ("float16", torch.float16)])
def test_16_bit_pools_store_the_cast_and_each_request_equals_itself_alone(bundled, name, dtype):
    """A 16-bit kv_cache_dtype is a plain cast (no scale): the pool's round trip is torch's own
    cast, its bytes are 2 per value (by hand: 2 x 6 layers x 2 heads x 32 dims x 2 = 1,536 a
    token on the bundled model), and through the engine each request gets the tokens it gets
    alone (the write once failed for 2-byte codes: they were moved as twice as many bytes)."""
    model, tokenizer, prompts, _ = bundled
    L, blocks, bs, hkv, d = 2, 4, 4, 2, 8
    cache = QuantizedPagedKVCache(L, blocks, bs, hkv, d, 8, kv_cache_dtype=name)
    assert cache.k.dtype == dtype and cache.nbytes == 2 * L * blocks * bs * hkv * d * 2 + 2 * L * 4
    x = torch.randn(hkv, 6, d, generator=torch.Generator().manual_seed(4))
    cache.write(1, torch.tensor([4, 5, 6, 7, 12, 13]), x, -x)
    k, v = cache.gather(1, torch.tensor([[1, 3]]), 6)
    assert torch.equal(k[0], x.to(dtype).float()) and torch.equal(v[0], (-x).to(dtype).float())
    assert not cache.k[0].view(torch.int16).any()                 # layer 0 untouched
    assert s14.kv_cache_bytes_per_token(s14.model_config(model), name) == 1536 == 2 * 6 * 2 * 32 * 2
    options = dict(batch_invariant=True, enable_prefix_caching=False)
    engine = build(model, tokenizer, name, **options)
    assert engine.runner.cache.k.dtype == dtype
    together = run(engine, prompts, [0, 0, 1, 2, 2])
    alone = [run(build(model, tokenizer, name, **options), [p])[0] for p in prompts]
    assert together == alone


# --- bad input -----------------------------------------------------------------------------------

def test_bad_kv_cache_dtypes_and_scales_are_refused_naming_the_option(bundled):
    model, tokenizer, _, _ = bundled
    for bad in ("fp4", "FP8", None, "fp8_e5m2"):
        with pytest.raises(ParameterError, match="kv_cache_dtype must be one of") as err:
            build(model, tokenizer, bad)
        assert err.value.parameter == "kv_cache_dtype"
    with pytest.raises(ParameterError, match="compute capability 8.0, fp8 needs 8.9") as err:
        s14.check_kv_cache_dtype("fp8_e4m3", "cuda", capability=(8, 0))
    assert err.value.parameter == "kv_cache_dtype"
    assert s14.check_kv_cache_dtype("fp8", "cuda", capability=(9, 0)).is_fp8
    assert s14.check_kv_cache_dtype("int8", "cuda", capability=(7, 0)).code_dtype == torch.int8
    with pytest.raises(ParameterError, match="not supported on mps"):
        s14.check_kv_cache_dtype("fp8_per_token_head", "mps")
    with pytest.raises(ParameterError, match="kv_scale is the per-tensor scale") as err:
        build(model, tokenizer, "int8", kv_scale=0.5)
    assert err.value.parameter == "kv_scale"
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ParameterError, match="kv_scale must be a finite number > 0"):
            build(model, tokenizer, "fp8_e4m3", kv_scale=bad)
    with pytest.raises(ParameterError, match="that pool is S12's PagedKVCache"):
        QuantizedPagedKVCache(1, 2, 4, 1, 8, 8, kv_cache_dtype="auto")
    with pytest.raises(ParameterError, match="budget_bytes must be an integer >= 1"):
        s14.pool_tokens(s14.model_config(model), "int8", 0)
    with pytest.raises(ParameterError, match="kv_cache_dtype must be one of"):
        s14.kv_cache_bytes_per_token(s14.model_config(model), "int4")


def test_kv_scale_is_checked_as_the_float32_the_pool_stores(bundled):
    """The pool keeps kv_scale in float32, and a saturated code (448) times it must stay
    finite: by hand, float32's largest value 3.4028235e38 / 448 = 7.6e35, its smallest
    normal 2^-126 = 1.18e-38. 1e39 is float32 inf, 1e-46 is float32 0: both were taken in
    float64 and failed (or ran on scale 0) later."""
    import s14_quantization as s14q
    model, tokenizer, _, _ = bundled
    spec = SPECS["fp8_e4m3"]
    for bad in (1e39, 1e-46, 5e-324, 3.5e38, 1e36, 1e-39):
        with pytest.raises(ParameterError, match="once stored as float32") as err:
            s14.check_kv_scale(spec, bad)
        assert err.value.parameter == "kv_scale"
    assert s14.check_kv_scale(spec, 0.1) == float(np.float32(0.1))     # what is stored
    assert s14.check_kv_scale(spec, 7.5e35) == float(np.float32(7.5e35))
    assert s14.check_kv_scale(spec, 2.0 ** -126) == 2.0 ** -126
    with pytest.raises(ParameterError) as err:                         # refused at the door:
        s14q.build_engine(model, tokenizer, quantize="int8", kv_cache_dtype="fp8", kv_scale=1e39)
    assert err.value.parameter == "kv_scale" and not s14q.quantized_weights(model)


def test_prompts_and_block_sizes_of_the_quality_hooks_are_checked(bundled):
    model, _, _, held_out = bundled
    window = model.config.max_position_embeddings                      # 256
    for ids, words in (([1.5, 3], "integers"), ([True, 5], "integers"), ([5, 2048], "V=2048"),
                       ([-1, 5], "V=2048"), ([], "1 to max_position_embeddings=256"),
                       ((held_out * 2)[:window + 1], "1 to max_position_embeddings=256"),
                       (np.array([1.0, 2.0]), "integer"), ("abc", "sequence")):
        for hook in (s14.prefill_logits, s14.model_kv):
            with pytest.raises(ParameterError, match=words) as err:
                hook(model, ids)
            assert err.value.parameter == "token_ids", (ids, hook)
    for block_size in (0, -4, 2.0, True):
        with pytest.raises(ParameterError, match="block_size must be an integer >= 1") as err:
            s14.prefill_logits(model, held_out[:8], "int8", block_size=block_size)
        assert err.value.parameter == "block_size"
    # a NumPy array or a tensor of ids is the list itself; a full window is allowed
    full = (held_out * 2)[:window]
    assert torch.equal(s14.prefill_logits(model, torch.tensor(held_out[:9]), "int8"),
                       s14.prefill_logits(model, np.array(held_out[:9]), "int8"))
    assert s14.prefill_logits(model, full).shape == (window, model.config.vocab_size)


def test_command_line_refuses_more_tokens_than_the_window(capsys):
    with pytest.raises(SystemExit) as done:
        s14.main(["--tokens", "300"])
    assert done.value.code == 2
    assert "--tokens must be an integer in [1, 256]" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_cuda_quantized_pool_equals_alone_and_agrees_with_the_cpu(name):
    if name.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ParameterError, match="fp8 needs 8.9"):
            s14.check_kv_cache_dtype(name, "cuda")
        return
    model, tokenizer = s06.load(device="cuda")
    text = (s06.s03.ROOT / "data" / "shakespeare.txt").read_text()
    prompts = [tokenizer.encode(text[a:a + 400])[:n] for a, n in ((1000, 9), (7000, 30))]
    engine = build(model, tokenizer, name, batch_invariant=True, sync_timing=True)
    assert engine.runner.cache.k.device.type == "cuda"
    together = run(engine, prompts)
    alone = [run(build(model, tokenizer, name, batch_invariant=True), [p])[0] for p in prompts]
    assert together == alone
