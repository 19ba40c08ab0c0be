"""S17's Triton kernels (code/s17_triton.py) against torch's scaled_dot_product_attention.

Without CUDA the kernels run in Triton's interpreter (NumPy on the host), so every shape here is
tiny (H=4, Hkv=2, D=32 or 48, contexts <= 40) and each test launches a kernel a few times.
On a machine with CUDA the same tests run the compiled kernels on the GPU, and the gpu-marked
tests at the end add real shapes (H=32, Hkv=8, D=128, contexts 1k-8k, bfloat16).

Oracles: SDPA per request with the bottom-right causal mask built here by hand; the pool's
blocks gathered here by indexing with the block table, then SDPA; torch.logsumexp of scores
computed here. Never the module's own output, except where a test states that two of its
paths (split-K and one pass) must agree. Bad inputs and the interpreter's rules: errors naming
the parameter.
"""
import importlib.util
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

# Triton reads TRITON_INTERPRET when a function is decorated: these kernels when s17_triton is
# imported (the module sets the same default itself), triton.language's own helpers when triton
# is first imported in the process. If another module imported triton earlier without it
# (import torch._dynamo does), the two disagree: check_triton says so, the kernel tests skip and
# test_kernels_can_run_in_this_process fails with the reason. tests/conftest.py is the place
# to set the variable before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import s17_triton as s17t  # noqa: E402
from s01_generation_loop import ParameterError  # noqa: E402

DEVICE = torch.device("cpu" if s17t.interpreted() or not torch.cuda.is_available() else "cuda")


def setup_error() -> str | None:
    """Why the kernels cannot run in this process, or None."""
    if not s17t.TRITON_AVAILABLE:
        return "Triton is not installed"
    try:
        s17t.check_triton(DEVICE)
    except ParameterError as error:
        return str(error)
    return None


SETUP_ERROR = setup_error()
needs_triton = pytest.mark.skipif(SETUP_ERROR is not None,
                                  reason=f"the kernels cannot run here: {SETUP_ERROR}")
# The GPU's exp2 / log2 are approximate instructions: a little slack there.
ATOL = 1e-5 if DEVICE.type == "cpu" else 3e-5
H, HKV = 4, 2


def cu(lengths: list[int], device=DEVICE) -> torch.Tensor:
    """cu_seqlens: (B + 1,) int32 offsets of requests laid end to end."""
    return torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))],
                        dtype=torch.int32, device=device)


def causal_mask(t: int, s: int) -> torch.Tensor:
    """Bottom-right: query i of a chunk of t after s - t cached keys sees key j iff
    j <= s - t + i."""
    return torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]          # (t, s)


def sdpa(q, k, v, mask=None):
    """q (H, t, D), k/v (Hkv, s, D) in float32, GQA by repeating each KV head G times."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def masked_scores(q, k, mask, scale):
    """Scaled scores (H, t, s) of q (H, t, D) against k (Hkv, s, D), -inf where mask is False."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    return (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))       # (H, t, s)


def test_kernels_can_run_in_this_process():
    """Fails, saying why, where the kernel tests below skip with Triton installed: e.g. triton
    imported (by torch._dynamo, for one) before TRITON_INTERPRET was set in this process, so
    triton.language's own helpers were built to compile while these kernels are interpreted."""
    if not s17t.TRITON_AVAILABLE:
        pytest.skip("Triton is not installed")
    assert SETUP_ERROR is None, SETUP_ERROR


# ---------------------------------------------------------------------------------------------
# flash_attn_varlen
# ---------------------------------------------------------------------------------------------

@needs_triton
def test_flash_varlen_matches_sdpa_per_request():
    """Tail tiles (T = 20, S = 40: not multiples of 16), a chunk after cached keys, a one-token
    request, a prompt from position 0 (S = T), an empty request, GQA, D = 48 (padded to 64);
    the output poisoned with NaN so an unwritten row fails; lse against logsumexp."""
    torch.manual_seed(0)
    d, scale = 48, 48 ** -0.5
    t_lens, s_lens = [20, 1, 0, 7, 17], [40, 9, 3, 7, 17]
    q = torch.randn(sum(t_lens), H, d, device=DEVICE)
    k = torch.randn(sum(s_lens), HKV, d, device=DEVICE)
    v = torch.randn(sum(s_lens), HKV, d, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    got, lse = s17t.flash_attn_varlen(q, k, v, cu(t_lens), cu(s_lens), scale, return_lse=True,
                                      out=out)
    assert got is out and lse.shape == (sum(t_lens), H) and lse.dtype == torch.float32
    assert not out.isnan().any()
    cu_q, cu_k = cu(t_lens).tolist(), cu(s_lens).tolist()
    for b, (t, s) in enumerate(zip(t_lens, s_lens)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (x.cpu().transpose(0, 1) for x in (q[rows], k[keys], v[keys]))
        mask = causal_mask(t, s)
        want = sdpa(qb, kb, vb, mask).transpose(0, 1)                               # (t, H, D)
        torch.testing.assert_close(out[rows].cpu(), want, atol=ATOL, rtol=ATOL)
        want_lse = torch.logsumexp(masked_scores(qb, kb, mask, scale), dim=-1).T   # (t, H)
        torch.testing.assert_close(lse[rows].cpu(), want_lse, atol=ATOL, rtol=ATOL)


@needs_triton
def test_flash_varlen_float16_and_bigger_tiles():
    """float16 inputs (float32 accumulation) and a 32 x 32 tile, against SDPA in float32."""
    torch.manual_seed(1)
    t_lens, s_lens = [13, 5], [13, 38]
    q = torch.randn(sum(t_lens), H, 32, device=DEVICE, dtype=torch.float16)
    k = torch.randn(sum(s_lens), HKV, 32, device=DEVICE, dtype=torch.float16)
    v = torch.randn(sum(s_lens), HKV, 32, device=DEVICE, dtype=torch.float16)
    out = s17t.flash_attn_varlen(q, k, v, cu(t_lens), cu(s_lens), 32 ** -0.5, block_m=32,
                                 block_n=32)
    assert out.dtype == torch.float16
    cu_q, cu_k = cu(t_lens).tolist(), cu(s_lens).tolist()
    for b, (t, s) in enumerate(zip(t_lens, s_lens)):
        qb, kb, vb = (x.cpu().float().transpose(0, 1) for x in (
            q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]))
        want = sdpa(qb, kb, vb, causal_mask(t, s)).transpose(0, 1)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].cpu().float(), want, atol=5e-3,
                                   rtol=5e-3)


# ---------------------------------------------------------------------------------------------
# paged_decode_attention and its split-K partials
# ---------------------------------------------------------------------------------------------

def make_pool(block_size: int, d: int, seq_lens: list[int], layers: int = 2, layer: int = 1):
    """A (L, num_blocks, block_size, Hkv, D) pool whose D rows are padded in memory (so a layer
    is a strided view, as pool.k[layer] with foreign strides), shuffled block ids per request
    (block 0 is the null block, never handed out), tables padded with 0."""
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
    store = torch.randn(2, layers, num_blocks, block_size, HKV, d + 3, device=DEVICE)
    k_pool, v_pool = store[0, ..., :d], store[1, ..., :d]       # 5-d views, D stride 1
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    width = max(math.ceil(s / block_size) for s in seq_lens) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        n = math.ceil(s / block_size)
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return k_pool[layer], v_pool[layer], tables.to(DEVICE)


def gather(cache, table, s):
    """Request's keys 0 .. s - 1 gathered from the pool through its table: (Hkv, s, D)."""
    bs = cache.shape[1]
    blocks = cache[table[:math.ceil(s / bs)].long()]                    # (n, bs, Hkv, D)
    return blocks.reshape(-1, HKV, cache.shape[-1])[:s].transpose(0, 1).cpu()


@needs_triton
@pytest.mark.parametrize("block_size,num_splits", [(4, 1), (4, 3), (8, 2)])
def test_paged_decode_matches_gather_sdpa(block_size, num_splits):
    """Shuffled blocks, a context not a multiple of block_size, seq_len 1, seq_len 0 (zeros),
    GQA, D = 48, a strided view of a 5-d pool; 16-position tiles spanning several blocks;
    more splits than blocks for the short requests; output poisoned with NaN."""
    torch.manual_seed(2)
    d, scale = 48, 48 ** -0.5
    seq_lens = [37, 1, 0, 16]
    k_cache, v_cache, tables = make_pool(block_size, d, seq_lens)
    q = torch.randn(len(seq_lens), H, d, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    s17t.paged_decode_attention(q, k_cache, v_cache, tables,
                                torch.tensor(seq_lens, device=DEVICE), scale,
                                num_splits=num_splits, block_n=16, out=out)
    assert not out.isnan().any()
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert (out[b] == 0).all()
            continue
        want = sdpa(q[b].cpu()[:, None], gather(k_cache, tables[b], s),
                    gather(v_cache, tables[b], s))[:, 0]                            # (H, D)
        torch.testing.assert_close(out[b].cpu(), want, atol=ATOL, rtol=ATOL)


@needs_triton
def test_split_k_partials_and_merge():
    """Each split's partial equals SDPA over its own run of blocks (empty splits: out 0, lse
    -inf); the log-sum-exp rule over the partials gives the whole context's logsumexp and
    output; the kernel's merge equals one pass."""
    torch.manual_seed(3)
    d, scale, bs, splits = 32, 32 ** -0.5, 4, 3
    seq_lens = [29, 5, 0]
    k_cache, v_cache, tables = make_pool(bs, d, seq_lens, layers=1, layer=0)
    q = torch.randn(len(seq_lens), H, d, device=DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int64)
    part_out, part_lse = s17t.paged_decode_partials(q, k_cache, v_cache, tables, lens, scale,
                                                    num_splits=splits, block_n=16)
    assert part_out.shape == (3, H, splits, d) and part_lse.shape == (3, H, splits)
    part_out, part_lse = part_out.cpu(), part_lse.cpu()
    for b, s in enumerate(seq_lens):
        k_all, v_all = gather(k_cache, tables[b], s), gather(v_cache, tables[b], s)
        qb = q[b].cpu()[:, None]                                                     # (H, 1, D)
        per_split = math.ceil(math.ceil(s / bs) / splits) * bs       # whole blocks per split
        for i in range(splits):
            lo, hi = i * per_split, min(s, (i + 1) * per_split)
            if lo >= hi:
                assert (part_lse[b, :, i] == float("-inf")).all()
                assert (part_out[b, :, i] == 0).all()
                continue
            want = sdpa(qb, k_all[:, lo:hi], v_all[:, lo:hi])[:, 0]
            torch.testing.assert_close(part_out[b, :, i], want, atol=ATOL, rtol=ATOL)
            scores = masked_scores(qb, k_all[:, lo:hi], torch.ones(1, hi - lo, dtype=bool),
                                   scale)
            torch.testing.assert_close(part_lse[b, :, i], torch.logsumexp(scores, -1)[:, 0],
                                       atol=ATOL, rtol=ATOL)
        if s == 0:
            continue
        # The merge rule, in torch: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) o_s
        lse = torch.logsumexp(part_lse[b], dim=-1)                                  # (H,)
        scores = masked_scores(qb, k_all, torch.ones(1, s, dtype=bool), scale)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1)[:, 0], atol=ATOL, rtol=ATOL)
        merged = (torch.exp(part_lse[b] - lse[:, None])[..., None] * part_out[b]).sum(1)
        torch.testing.assert_close(merged, sdpa(qb, k_all, v_all)[:, 0], atol=ATOL, rtol=ATOL)
    one_pass = s17t.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                           block_n=16)
    split_k = s17t.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                          num_splits=splits, block_n=16)
    torch.testing.assert_close(split_k, one_pass, atol=ATOL, rtol=ATOL)


# ---------------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------------

@needs_triton
def test_reshape_and_cache_writes_exactly_the_slots():
    """Written slots hold the tokens bit for bit; every other element keeps the sentinel; a
    slot of -1 (padding) writes nothing. The pool is a strided view of a 5-d tensor."""
    torch.manual_seed(4)
    bs, d, num_blocks, sentinel = 8, 32, 6, 12345.0
    store = torch.full((2, 2, num_blocks, bs, HKV, d + 3), sentinel, device=DEVICE)
    k_cache, v_cache = store[0, 1, ..., :d], store[1, 1, ..., :d]
    k = torch.randn(5, HKV, d, device=DEVICE)
    v = torch.randn(5, HKV, d, device=DEVICE)
    slots = torch.tensor([17, -1, 40, 3, 47], device=DEVICE)      # block 2 off 1, ..., off 7
    assert s17t.reshape_and_cache(k, v, k_cache, v_cache, slots) is None
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.reshape(num_blocks * bs, HKV, d)
        for n, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(flat[slot], new[n])
        untouched = torch.ones(num_blocks * bs, dtype=bool)
        untouched[[17, 40, 3, 47]] = False
        assert (flat[untouched.to(DEVICE)] == sentinel).all()
    assert (store[:, 0] == sentinel).all() and (store[..., d:] == sentinel).all()


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

@needs_triton
def test_bad_inputs_name_the_parameter():
    on = dict(device=DEVICE)
    q, k = torch.zeros(4, H, 32, **on), torch.zeros(4, HKV, 32, **on)
    cu_q = cu([4])
    pool = torch.zeros(4, 4, HKV, 32, **on)
    tables = torch.zeros(1, 2, dtype=torch.int32, **on)
    lens = torch.ones(1, dtype=torch.int32, **on)
    cases = [
        ("head_dim", lambda: s17t.flash_attn_varlen(torch.zeros(4, H, 300, **on),
                                                    torch.zeros(4, HKV, 300, **on),
                                                    torch.zeros(4, HKV, 300, **on),
                                                    cu_q, cu_q, 1.0)),
        ("head_dim", lambda: s17t.paged_decode_attention(
            torch.zeros(1, H, 300, **on), torch.zeros(4, 4, HKV, 300, **on),
            torch.zeros(4, 4, HKV, 300, **on), tables, lens, 1.0)),
        ("block_size", lambda: s17t.paged_decode_attention(
            q[:1], torch.zeros(4, 6, HKV, 32, **on), torch.zeros(4, 6, HKV, 32, **on),
            tables, lens, 1.0)),
        ("block_size", lambda: s17t.reshape_and_cache(
            k, k, torch.zeros(4, 6, HKV, 32, **on), torch.zeros(4, 6, HKV, 32, **on),
            torch.zeros(4, dtype=torch.int64, **on))),
        ("num_heads", lambda: s17t.flash_attn_varlen(torch.zeros(4, 3, 32, **on), k, k, cu_q,
                                                     cu_q, 1.0)),
        ("num_heads", lambda: s17t.paged_decode_attention(torch.zeros(1, 3, 32, **on), pool,
                                                          pool, tables, lens, 1.0)),
        ("dtype", lambda: s17t.flash_attn_varlen(q.half(), k, k, cu_q, cu_q, 1.0)),
        ("dtype", lambda: s17t.paged_decode_attention(q[:1], pool.half(), pool.half(), tables,
                                                      lens, 1.0)),
        ("dtype", lambda: s17t.flash_attn_varlen(q.double(), k.double(), k.double(), cu_q,
                                                 cu_q, 1.0)),
        ("num_splits", lambda: s17t.paged_decode_attention(q[:1], pool, pool, tables, lens,
                                                           1.0, num_splits=0)),
        ("block_m", lambda: s17t.flash_attn_varlen(q, k, k, cu_q, cu_q, 1.0, block_m=8)),
        ("cu_seqlens_k", lambda: s17t.flash_attn_varlen(q, k[:3], k[:3], cu_q, cu([3]), 1.0)),
    ]
    if DEVICE.type == "cpu":        # value checks run where they are free: on host tensors
        cases += [
            ("seq_lens", lambda: s17t.paged_decode_attention(
                q[:1], pool, pool, tables, torch.tensor([9], **on), 1.0)),
            ("block_tables", lambda: s17t.paged_decode_attention(
                q[:1], pool, pool, torch.tensor([[4, 0]], **on), lens, 1.0)),
            ("slot_mapping", lambda: s17t.reshape_and_cache(
                k, k, pool, pool, torch.tensor([0, 1, 2, 16], **on))),
        ]
    for parameter, call in cases:
        with pytest.raises(ParameterError) as info:
            call()
        assert info.value.parameter == parameter, (parameter, str(info.value))
        assert parameter in str(info.value)


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's limit")
def test_bfloat16_refused_by_the_interpreter():
    """The interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584)."""
    q = torch.zeros(2, H, 32, dtype=torch.bfloat16)
    k = torch.zeros(2, HKV, 32, dtype=torch.bfloat16)
    with pytest.raises(ParameterError, match="bfloat16") as info:
        s17t.flash_attn_varlen(q, k, k, cu([2]), cu([2]), 1.0)
    assert info.value.parameter == "dtype"


@needs_triton
def test_check_triton_rules(monkeypatch):
    kernels_interpreted = s17t.interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not s17t.interpreted()
    with pytest.raises(ParameterError, match="TRITON_INTERPRET=1 before Python starts") as info:
        s17t.check_triton("cpu")
    assert info.value.parameter == "attention_backend"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ParameterError, match="interpreted on the host") as info:
        s17t.check_triton(torch.device("cuda"))
    assert info.value.parameter == "attention_backend"
    # Flipping the variable after import: the kernels keep what they were decorated with.
    monkeypatch.setenv("TRITON_INTERPRET", "0" if kernels_interpreted else "1")
    with pytest.raises(ParameterError, match="changed after s17_triton was imported"):
        s17t.check_triton("cuda" if kernels_interpreted else "cpu")
    # triton imported earlier under the other setting: its own helpers disagree with the kernels
    monkeypatch.setenv("TRITON_INTERPRET", "1" if kernels_interpreted else "0")
    monkeypatch.setattr(s17t, "_LIBRARY_INTERPRETED", not kernels_interpreted)
    with pytest.raises(ParameterError, match="imported before TRITON_INTERPRET") as info:
        s17t.check_triton(DEVICE)
    assert info.value.parameter == "attention_backend"


def test_without_triton_the_module_imports_and_refuses(monkeypatch):
    """A machine without Triton (the CPU torch wheel does not bring it): the module still
    imports, and every public function raises naming attention_backend."""
    monkeypatch.setitem(sys.modules, "triton", None)              # import triton -> ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("s17_triton_without", s17t.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRITON_AVAILABLE is False and module.interpreted() is False
    x = torch.zeros(1, H, 32)
    calls = [lambda: module.flash_attn_varlen(x, x[:, :HKV], x[:, :HKV], cu([1]).cpu(),
                                              cu([1]).cpu(), 1.0),
             lambda: module.paged_decode_attention(x, torch.zeros(2, 4, HKV, 32),
                                                   torch.zeros(2, 4, HKV, 32),
                                                   torch.zeros(1, 1, dtype=torch.int32),
                                                   torch.ones(1, dtype=torch.int32), 1.0),
             lambda: module.reshape_and_cache(x[:, :HKV], x[:, :HKV], torch.zeros(2, 4, HKV, 32),
                                              torch.zeros(2, 4, HKV, 32),
                                              torch.zeros(1, dtype=torch.int64))]
    for call in calls:
        with pytest.raises(ParameterError, match="pip install triton") as info:
            call()
        assert info.value.parameter == "attention_backend"


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels at real shapes (bfloat16 against SDPA in float32)
# ---------------------------------------------------------------------------------------------

GPU_H, GPU_HKV, GPU_D, BF16_TOL = 32, 8, 128, 2e-2
compiled = pytest.mark.skipif(s17t.interpreted() and torch.cuda.is_available(),
                              reason="TRITON_INTERPRET is on: the kernels are interpreted here, "
                              "not compiled")


@pytest.mark.gpu
@needs_triton
@compiled
def test_gpu_flash_varlen_bf16_real_shapes():
    torch.manual_seed(5)
    dev, scale = torch.device("cuda"), GPU_D ** -0.5
    t_lens, s_lens = [1024, 1, 300, 0, 2048], [1024, 8192, 4096, 100, 2048]
    q = torch.randn(sum(t_lens), GPU_H, GPU_D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sum(s_lens), GPU_HKV, GPU_D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(sum(s_lens), GPU_HKV, GPU_D, device=dev, dtype=torch.bfloat16)
    out, lse = s17t.flash_attn_varlen(q, k, v, cu(t_lens, dev), cu(s_lens, dev), scale,
                                      block_m=64, block_n=64, return_lse=True,
                                      max_seqlen_q=max(t_lens))
    cu_q, cu_k = cu(t_lens, "cpu").tolist(), cu(s_lens, "cpu").tolist()
    for b, (t, s) in enumerate(zip(t_lens, s_lens)):
        if t == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (x.float().transpose(0, 1) for x in (q[rows], k[keys], v[keys]))
        mask = causal_mask(t, s).to(dev)
        want = sdpa(qb, kb, vb, mask).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), want, atol=BF16_TOL, rtol=BF16_TOL)
        want_lse = torch.logsumexp(masked_scores(qb, kb, mask, scale), -1).T
        torch.testing.assert_close(lse[rows], want_lse, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.gpu
@needs_triton
@compiled
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_paged_decode_bf16_real_shapes(num_splits):
    torch.manual_seed(6)
    dev, scale, bs = torch.device("cuda"), GPU_D ** -0.5, 16
    seq_lens = [1000, 8192, 1, 4097]
    num_blocks = sum(math.ceil(s / bs) for s in seq_lens) + 8
    pool = torch.randn(2, 2, num_blocks, bs, GPU_HKV, GPU_D, device=dev, dtype=torch.bfloat16)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(seq_lens), 8192 // bs + 1, dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        n = math.ceil(s / bs)
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    tables = tables.to(dev)
    q = torch.randn(len(seq_lens), GPU_H, GPU_D, device=dev, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    s17t.paged_decode_attention(q, k_cache, v_cache, tables,
                                torch.tensor(seq_lens, device=dev), scale,
                                num_splits=num_splits, out=out)
    group = GPU_H // GPU_HKV
    for b, s in enumerate(seq_lens):
        blocks = tables[b, :math.ceil(s / bs)].long()
        kb, vb = (c[blocks].reshape(-1, GPU_HKV, GPU_D)[:s].transpose(0, 1).float()
                  .repeat_interleave(group, 0) for c in (k_cache, v_cache))
        want = F.scaled_dot_product_attention(q[b].float()[:, None], kb, vb)[:, 0]
        torch.testing.assert_close(out[b].float(), want, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.gpu
@needs_triton
@compiled
def test_gpu_reshape_and_cache_real_shapes():
    torch.manual_seed(7)
    dev, bs, num_blocks = torch.device("cuda"), 16, 64
    k_cache = torch.zeros(num_blocks, bs, GPU_HKV, GPU_D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(300, GPU_HKV, GPU_D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * bs, device=dev)[:300]
    slots[::7] = -1
    s17t.reshape_and_cache(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    want_k.view(-1, GPU_HKV, GPU_D)[slots[keep]] = k[keep]
    want_v.view(-1, GPU_HKV, GPU_D)[slots[keep]] = v[keep]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
