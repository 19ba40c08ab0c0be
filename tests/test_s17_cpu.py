"""Tests for S17's CPU paged attention kernel (code/s17_cpu.py, code/s17_paged_attention.c).

Oracles: S12's `PagedKVCache.gather` (the pool read by copying blocks) followed by torch's
scaled_dot_product_attention with a bottom-right causal mask built here (query i of T new
tokens after S - T cached keys sees key j iff j <= S - T + i), GQA by repeating each KV head
here. The kernel is float32 with a polynomial 2^x: within 1e-5 of SDPA.

Every call writes into an output filled with NaN (so an element the kernel skips fails), and
every position of the pool no request owns (spare blocks, the null block, the tail of a last
block) is NaN (so a read past a context fails). The library is built once per machine into
the course's cache (about a second with gcc); one test builds it again in a fresh directory.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import s17_cpu
from s01_generation_loop import ParameterError
from s12_engine import PagedKVCache

ATOL = 1e-5
pytestmark = pytest.mark.skipif(s17_cpu.find_cc() is None, reason="needs a C compiler")


# --- oracles and inputs -----------------------------------------------------------------------

def causal_mask(t: int, s: int) -> torch.Tensor:
    """(t, s) bool: query i (at position s - t + i) sees key j iff j <= s - t + i."""
    return torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]


def make_pool(seq_lens, block_size, n_kv, d, seed):
    """S12's pool (one layer) holding each request's keys in shuffled, non-adjacent blocks,
    block 0 the null block; every position no request owns is NaN. Returns (cache, block
    tables int64 (B, M), padded with 0)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + 3                       # 3 spare blocks, never handed out
    cache = PagedKVCache(1, num_blocks, block_size, n_kv, d, max(seq_lens))
    cache.k.fill_(math.nan)
    cache.v.fill_(math.nan)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int64)
    taken = 0
    for b, (s, n) in enumerate(zip(seq_lens, need)):
        mine = ids[taken:taken + n]
        taken += n
        tables[b, :n] = torch.tensor(mine, dtype=torch.int64)
        for j, block in enumerate(mine):
            used = min(block_size, s - j * block_size)
            for pool in (cache.k, cache.v):
                pool[0, block, :used] = torch.randn(used, n_kv, d, generator=gen)
    return cache, tables


def expected(q, cache, tables, t_lens, s_lens, scale):
    """Each request's rows by S12's gather + SDPA (bottom-right causal): float32 (N, H, D)."""
    group = q.shape[1] // cache.k.shape[3]
    out = torch.zeros(q.shape)
    start = 0
    for b, (t, s) in enumerate(zip(t_lens, s_lens)):
        if t:
            k, v = cache.gather(0, tables[b:b + 1], s)                         # (1, Hkv, S, D)
            att = F.scaled_dot_product_attention(
                q[start:start + t].transpose(0, 1), k[0].repeat_interleave(group, 0),
                v[0].repeat_interleave(group, 0), attn_mask=causal_mask(t, s), scale=scale)
            out[start:start + t] = att.transpose(0, 1)
        start += t
    return out


def loc(t_lens) -> torch.Tensor:
    return torch.tensor([0] + [sum(t_lens[:i + 1]) for i in range(len(t_lens))])


# Decodes and chunks in one call: a decode at 13 (not a multiple of the block size), a chunk of
# 5 after 10 cached, a prompt from 0 (S = T = 6), a one-token prompt, a request with no new
# token, a decode at 8 (its last block full), a decode at 1.
T_LENS, S_LENS = [1, 5, 6, 1, 0, 1, 1], [13, 15, 6, 1, 8, 8, 1]


def case(n_heads, n_kv, d, block_size=4, seed=0, t_lens=T_LENS, s_lens=S_LENS):
    """(q float32 (N, H, D) as a transposed (H, N, D) tensor, cache, tables, query_start_loc,
    seq_lens, scale)."""
    cache, tables = make_pool(s_lens, block_size, n_kv, d, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(n_heads, sum(t_lens), d, generator=gen).transpose(0, 1)
    return q, cache, tables, loc(t_lens), torch.tensor(s_lens), d ** -0.5


def poisoned(q) -> torch.Tensor:
    """An output for q's shape, (H, N, D) in memory seen as (N, H, D), filled with NaN."""
    return torch.full((q.shape[1], q.shape[0], q.shape[2]), math.nan).transpose(0, 1)


def run(q, cache, tables, starts, lens, scale, **kw):
    return s17_cpu.paged_attention(q, cache.k[0], cache.v[0], starts, lens, tables, scale, **kw)


# --- against the oracle -----------------------------------------------------------------------

@pytest.mark.parametrize("d", [32, 64, 128, 48])           # 48: the kernel's generic path
@pytest.mark.parametrize("n_heads, n_kv", [(4, 2), (8, 2), (4, 4)])
def test_kernel_equals_gather_then_sdpa(n_heads, n_kv, d):
    """Decodes, chunks after cached keys, prompts from 0, one-token and empty requests in one
    call, shuffled blocks of 4 with partial last blocks; q and out transposed (H, N, D)
    views, out poisoned with NaN: every element written, within 1e-5 of SDPA."""
    q, cache, tables, starts, lens, scale = case(n_heads, n_kv, d, seed=d + n_heads)
    assert not q.is_contiguous() and q.stride(2) == 1
    out = poisoned(q)
    got = run(q, cache, tables, starts, lens, scale, out=out)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, expected(q, cache, tables, T_LENS, S_LENS, scale),
                               atol=ATOL, rtol=ATOL)


def test_kernel_with_contiguous_inputs_a_new_output_and_other_block_sizes():
    """q contiguous (N, H, D), no out (a new tensor), blocks of 1 and of 16 (every context
    here in one block), and scores far apart (q x 8) so the running max moves a lot."""
    for block_size in (1, 16):
        q, cache, tables, starts, lens, scale = case(4, 2, 32, block_size, seed=block_size)
        q = (q * 8).contiguous()
        out = run(q, cache, tables, starts, lens, scale)
        assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out, expected(q, cache, tables, T_LENS, S_LENS, scale),
                                   atol=ATOL, rtol=ATOL)


def test_a_long_context_and_every_request_decoding():
    """A decode step alone (every request one token), contexts to 200 in blocks of 16."""
    t_lens, s_lens = [1] * 4, [200, 17, 64, 3]
    q, cache, tables, starts, lens, scale = case(8, 2, 64, 16, seed=3, t_lens=t_lens,
                                                 s_lens=s_lens)
    out = run(q, cache, tables, starts, lens, scale, out=poisoned(q))
    torch.testing.assert_close(out, expected(q, cache, tables, t_lens, s_lens, scale),
                               atol=ATOL, rtol=ATOL)


def test_two_threads_give_the_same_bits_as_one():
    """The work units are independent (one token and KV head each), so the thread count
    changes nothing."""
    q, cache, tables, starts, lens, scale = case(8, 2, 32, seed=4)
    one = run(q, cache, tables, starts, lens, scale)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = run(q, cache, tables, starts, lens, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_check_false_skips_only_the_checks():
    q, cache, tables, starts, lens, scale = case(4, 2, 32, seed=5)
    assert torch.equal(run(q, cache, tables, starts, lens, scale, check=False),
                       run(q, cache, tables, starts, lens, scale))


# --- building ----------------------------------------------------------------------------------

def test_the_library_builds_in_a_fresh_cache_directory_and_is_reused(tmp_path, monkeypatch):
    """$COURSE_CACHE_DIR empty: load() compiles the C file there, and the kernel it loads
    gives the same bits as the one loaded before; build() again finds the library and does
    not compile (same file, same modification time). The module's library is put back after
    (monkeypatch), so later tests never use one in a deleted folder."""
    q, cache, tables, starts, lens, scale = case(4, 2, 48, seed=6)
    want = run(q, cache, tables, starts, lens, scale)       # the library loaded so far
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(s17_cpu, "_library", None)
    assert s17_cpu.cache_dir() == tmp_path
    lib = s17_cpu.load()
    built = list(tmp_path.glob("s17_paged_attention-*.so"))
    assert len(built) == 1 and s17_cpu.load() is lib
    assert not [p for p in tmp_path.iterdir() if p not in built]    # no temporary left behind
    assert torch.equal(run(q, cache, tables, starts, lens, scale), want)
    stamp = built[0].stat().st_mtime_ns
    assert s17_cpu.build(s17_cpu.find_cc(), tmp_path) == built[0]
    assert built[0].stat().st_mtime_ns == stamp


def test_no_c_compiler_is_an_error_naming_the_backend(monkeypatch):
    monkeypatch.setattr(s17_cpu, "find_cc", lambda: None)
    monkeypatch.setattr(s17_cpu, "_library", None)
    with pytest.raises(ParameterError, match="C compiler") as err:
        s17_cpu.load()
    assert err.value.parameter == "attention_backend"
    q, cache, tables, starts, lens, scale = case(4, 2, 32)
    with pytest.raises(ParameterError) as err:
        run(q, cache, tables, starts, lens, scale)
    assert err.value.parameter == "attention_backend"


def test_find_cc_takes_cc_from_the_environment(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert s17_cpu.find_cc() is None
    monkeypatch.setenv("CC", "gcc")
    assert s17_cpu.find_cc() is None or os.path.basename(s17_cpu.find_cc()) == "gcc"


def test_a_compiler_that_fails_is_an_error_with_its_message(tmp_path):
    """A 'compiler' that rejects every command: ParameterError("attention_backend") with
    what it printed, and nothing left in the folder."""
    fake = tmp_path / "bad-cc"
    fake.write_text("#!/bin/sh\necho 'no: this compiler refuses' >&2\nexit 1\n")
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    with pytest.raises(ParameterError, match="this compiler refuses") as err:
        s17_cpu.build(str(fake), out_dir)
    assert err.value.parameter == "attention_backend"
    assert list(out_dir.iterdir()) == []


# --- bad input ----------------------------------------------------------------------------------

def bad_inputs():
    """(name, change(args) -> args, the parameter the error names)."""

    def with_(i, value):
        return lambda a: a[:i] + [value] + a[i + 1:]

    def pool_as(fn):
        return lambda a: [a[0], fn(a[1]), fn(a[2])] + a[3:]

    return [
        ("float64 pool", pool_as(lambda p: p.double()), "dtype"),
        ("bfloat16 pool", pool_as(lambda p: p.bfloat16()), "dtype"),
        ("non-contiguous pool", pool_as(lambda p: p.transpose(1, 2).contiguous()
                                        .transpose(1, 2)), "k_cache"),
        ("k and v of two shapes", lambda a: [a[0], a[1], a[2][:-1]] + a[3:], "k_cache"),
        ("a pool of 3 dimensions", pool_as(lambda p: p[:, 0]), "k_cache"),
        ("block_size over the kernel's", pool_as(lambda p: torch.zeros(2, 1025, 2, 32)),
         "block_size"),
        ("head_dim over the kernel's", pool_as(lambda p: torch.zeros(p.shape[:3] + (1025,))),
         "head_dim"),
        ("head_dim mismatch", lambda a: [a[0][..., :16].contiguous()] + a[1:], "head_dim"),
        ("H % Hkv != 0", lambda a: [a[0][:, :3]] + a[1:], "num_heads"),
        ("float64 q", lambda a: [a[0].double()] + a[1:], "q"),
        ("q not unit stride along D", lambda a: [a[0].transpose(0, 2)
                                                 .contiguous().transpose(0, 2)] + a[1:], "q"),
        ("q of 2 dimensions", lambda a: [a[0][:, 0]] + a[1:], "q"),
        ("int32 query_start_loc", lambda a: a[:3] + [a[3].int()] + a[4:], "query_start_loc"),
        ("query_start_loc not ending at N", lambda a: a[:3] + [a[3] - 1] + a[4:],
         "query_start_loc"),
        ("query_start_loc decreasing", with_(3, torch.tensor([0, 4, 1, 12, 13, 13, 14, 15])),
         "query_start_loc"),
        ("query_start_loc of B + 2", with_(3, torch.tensor([0, 1, 6, 12, 13, 13, 14, 15, 15])),
         "query_start_loc"),
        ("seq_len below the query count", with_(4, torch.tensor([13, 4, 6, 1, 8, 8, 1])),
         "seq_lens"),
        ("seq_len past the block table", with_(4, torch.tensor([13, 15, 6, 1, 8, 8, 25])),
         "seq_lens"),
        ("int32 seq_lens", lambda a: a[:4] + [a[4].int()] + a[5:], "seq_lens"),
        ("a block id outside the pool", lambda a: a[:5] + [a[5].clone().fill_(a[1].shape[0])]
         + a[6:], "block_tables"),
        ("a negative block id", lambda a: a[:5] + [a[5].clone().fill_(-1)] + a[6:],
         "block_tables"),
        ("block tables of another batch", lambda a: a[:5] + [a[5][:-1]] + a[6:], "seq_lens"),
        ("int32 block tables", lambda a: a[:5] + [a[5].int()] + a[6:], "block_tables"),
    ]


@pytest.mark.parametrize("name, change, parameter", bad_inputs(), ids=lambda x: x
                         if isinstance(x, str) else None)
def test_bad_input_is_an_error_naming_the_parameter(name, change, parameter):
    q, cache, tables, starts, lens, scale = case(4, 2, 32, seed=8)
    args = change([q, cache.k[0], cache.v[0], starts, lens, tables, scale])
    with pytest.raises(ParameterError) as err:
        s17_cpu.paged_attention(*args)
    assert err.value.parameter == parameter, (name, str(err.value))


@pytest.mark.parametrize("make_out", [
    lambda q: torch.zeros(q.shape, dtype=torch.float64),     # the kernel writes float32
    lambda q: torch.zeros(q.shape[:2] + (2 * q.shape[2],))[..., ::2],   # stride 2 along D
], ids=["float64 out", "out not unit stride along D"])
def test_an_out_the_kernel_cannot_write_is_an_error(make_out):
    """The docstring's rule for out (float32 (N, H, D), unit stride along D) is checked like
    q's: otherwise the kernel writes float32 rows into memory laid out otherwise (and an out
    too small would be written past its end). Both outs chosen here are large enough that the
    unchecked write stays inside them."""
    q, cache, tables, starts, lens, scale = case(4, 2, 32, seed=9)
    with pytest.raises(ParameterError) as err:
        run(q, cache, tables, starts, lens, scale, out=make_out(q))
    assert err.value.parameter == "out"
