"""Tests for S17's torch references (code/s17_flash.py): the online softmax, the tiled varlen
flash attention, the log-sum-exp merge, split-K decoding, the walk over a block table and the
tile trace.

Oracles, all independent of the module: torch's scaled_dot_product_attention with a
bottom-right causal mask built here (query i of T new tokens after S - T cached keys sees key
j iff j <= S - T + i), GQA by repeating each KV head here; torch.logsumexp and torch.softmax of
scores computed here; S12's `PagedKVCache.gather` (the pool read by copying blocks) + SDPA for
the paged walk; closed forms by hand (two tiles of the online softmax, which tiles a causal
pass visits, a split per key).

Shapes are small (contexts <= 30, D = 32): the functions are Python loops over tiles. Positions
a correct reader never touches (spare blocks, the null block, the tail of a request's last
block) hold NaN, so a read past a context shows as NaN in the output.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import s17_flash as fl
from s01_generation_loop import ParameterError
from s12_engine import PagedKVCache

ATOL = 1e-5             # float32 against float32 SDPA (measured differences: ~1e-6)
GROUPS = [(4, 2), (8, 2), (4, 4)]        # (H, Hkv): GQA groups of 2 and 4, and H = Hkv
D = 32


# --- oracles --------------------------------------------------------------------------------

def causal_mask(t: int, s: int) -> torch.Tensor:
    """(t, s) bool: query i (at position s - t + i) sees key j iff j <= s - t + i."""
    return torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]


def reference(q, k, v, scale):
    """One request by SDPA: q (T, H, D), k, v (S, Hkv, D) -> (out (T, H, D), lse (T, H))."""
    t, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.float().transpose(0, 1)                                            # (H, T, D)
    kh = k.float().transpose(0, 1).repeat_interleave(group, 0)                # (H, S, D)
    vh = v.float().transpose(0, 1).repeat_interleave(group, 0)
    mask = causal_mask(t, s)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(~mask, -math.inf)  # (H, T, S)
    return out.transpose(0, 1), torch.logsumexp(scores, -1).T


def cu(lengths) -> list[int]:
    return [0] + [sum(lengths[:i + 1]) for i in range(len(lengths))]


def ragged(t_lens, s_lens, n_heads, n_kv, seed, d=D, dtype=torch.float32):
    """q (sum T, H, D) and k, v (sum S, Hkv, D), random, requests end to end."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(t_lens), n_heads, d, generator=gen).to(dtype)
    k = torch.randn(sum(s_lens), n_kv, d, generator=gen).to(dtype)
    v = torch.randn(sum(s_lens), n_kv, d, generator=gen).to(dtype)
    return q, k, v


def make_pool(seq_lens, block_size, n_kv, d, seed):
    """S12's pool (one layer) holding each request's keys in shuffled, non-adjacent blocks,
    block 0 the null block; every position no request owns (spare blocks, the null block, the
    tail of a last block) is NaN. Returns (cache, block tables int64 (B, M) padded with 0)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + 3                       # 3 spare blocks, never handed out
    cache = PagedKVCache(1, num_blocks, block_size, n_kv, d, max(max(seq_lens), 1))
    cache.k.fill_(math.nan)
    cache.v.fill_(math.nan)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int64)   # a 0 past each end
    taken = 0
    for b, (s, n) in enumerate(zip(seq_lens, need)):
        tables[b, :n] = torch.tensor(ids[taken:taken + n])
        taken += n
        for j in range(n):
            used = min(block_size, s - j * block_size)
            for pool in (cache.k, cache.v):
                pool[0, ids[taken - n + j], :used] = torch.randn(used, n_kv, d, generator=gen)
    return cache, tables


def gathered(cache, tables, b, s_len):
    """Request b's keys and values by S12's gather: two (S, Hkv, D) copies."""
    k, v = cache.gather(0, tables[b:b + 1], s_len)                          # (1, Hkv, S, D)
    return k[0].transpose(0, 1), v[0].transpose(0, 1)


# --- flash_attention_varlen -------------------------------------------------------------------

# A prompt from 0 (S = T = 7), a decode (T = 1 after 19), an empty request (T = 0), a chunk
# after 17 cached keys (T = 13, S = 30), another prompt (9), a one-token prompt (S = T = 1).
T_LENS, S_LENS = [7, 1, 0, 13, 9, 1], [7, 20, 5, 30, 9, 1]


@pytest.mark.parametrize("n_heads, n_kv", GROUPS)
@pytest.mark.parametrize("block_m, block_n", [(4, 5), (3, 16), (64, 64)])
def test_flash_attention_varlen_equals_sdpa_per_request(n_heads, n_kv, block_m, block_n):
    """Tail tiles (7, 13, 9, 30 are not multiples of 4, 5, 3 or 16; 64 covers each request
    in one tile), GQA, empty and one-token requests; the lse against torch.logsumexp."""
    q, k, v = ragged(T_LENS, S_LENS, n_heads, n_kv, seed=n_heads * 10 + n_kv)
    scale = D ** -0.5
    out, lse = fl.flash_attention_varlen(q, k, v, torch.tensor(cu(T_LENS)), cu(S_LENS), scale,
                                         block_m=block_m, block_n=block_n, return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert lse.shape == (sum(T_LENS), n_heads) and lse.dtype == torch.float32
    cq, ck = cu(T_LENS), cu(S_LENS)
    for b in range(len(T_LENS)):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        want, want_lse = reference(q[rows], k[keys], v[keys], scale)
        torch.testing.assert_close(out[rows], want, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(lse[rows], want_lse, atol=ATOL, rtol=ATOL)
    # without return_lse: the output alone, the same numbers
    assert torch.equal(fl.flash_attention_varlen(q, k, v, cq, ck, scale, block_m=block_m,
                                                 block_n=block_n), out)


def test_flash_attention_varlen_returns_the_inputs_dtype():
    """bfloat16 in, bfloat16 out (float32 inside): close to SDPA over the same bf16 values."""
    q, k, v = ragged([5, 1], [12, 6], 4, 2, seed=3, dtype=torch.bfloat16)
    out = fl.flash_attention_varlen(q, k, v, cu([5, 1]), cu([12, 6]), 0.2, block_m=2,
                                    block_n=4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:5].float(), reference(q[:5], k[:12], v[:12], 0.2)[0],
                               atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[5:].float(), reference(q[5:], k[12:], v[12:], 0.2)[0],
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("call, parameter", [
    (lambda q, k, v: fl.flash_attention_varlen(q, k[:, :, :16], v[:, :, :16], [0, 3], [0, 5],
                                               1.0), "head_dim"),
    (lambda q, k, v: fl.flash_attention_varlen(q.repeat(1, 2, 1)[:, :3], k[:, :2], v[:, :2],
                                               [0, 3], [0, 5], 1.0), "num_heads"),
    (lambda q, k, v: fl.flash_attention_varlen(q[0], k, v, [0, 3], [0, 5], 1.0), "shape"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v[:4], [0, 3], [0, 5], 1.0), "shape"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [1, 3], [0, 5], 1.0), "cu_seqlens_q"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 2], [0, 5], 1.0), "cu_seqlens_q"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 3], [0, 4], 1.0), "cu_seqlens_k"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 2, 1, 3], [0, 2, 4, 5], 1.0),
     "cu_seqlens_q"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 3], [0, 5, 5], 1.0),
     "cu_seqlens_q"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0], [0], 1.0), "cu_seqlens_q"),
    # request 0: 3 queries but 2 keys (a query's keys include itself)
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 3, 3], [0, 2, 5], 1.0),
     "cu_seqlens_k"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 3], [0, 5], 1.0, block_m=0),
     "block_m"),
    (lambda q, k, v: fl.flash_attention_varlen(q, k, v, [0, 3], [0, 5], 1.0, block_n=True),
     "block_n"),
])
def test_flash_attention_varlen_bad_input_names_the_parameter(call, parameter):
    q, k, v = ragged([3], [5], 4, 2, seed=0)
    with pytest.raises(ParameterError) as err:
        call(q, k, v)
    assert err.value.parameter == parameter, str(err.value)


# --- the online softmax -----------------------------------------------------------------------

def fold(scores, v, tile):
    """scores (R, n), v (n, D) folded tile columns at a time from the empty state -> the
    (out, lse) of `finish`."""
    rows = scores.shape[0]
    m = torch.full((rows,), -math.inf)
    l = torch.zeros(rows)
    acc = torch.zeros(rows, v.shape[1])
    for j0 in range(0, scores.shape[1], tile):
        m, l, acc = fl.online_softmax_update(m, l, acc, scores[:, j0:j0 + tile],
                                             v[j0:j0 + tile])
    return fl.finish(m, l, acc)


def test_online_softmax_two_tiles_by_hand():
    """The chapter's worked example: scores [1, 2] then [3, 0] of one row. After tile 1:
    m = 2, l = e^-1 + 1. Tile 2 brings 3: the old sum is rescaled by e^(2 - 3), so
    l = (e^-1 + 1) e^-1 + e^0 + e^-3 and m = 3; lse = 3 + log l = log(e + e^2 + e^3 + 1)."""
    m, l, acc = torch.tensor([-math.inf]), torch.zeros(1), torch.zeros(1, 1)
    v = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    m, l, acc = fl.online_softmax_update(m, l, acc, torch.tensor([[1.0, 2.0]]), v[:2])
    assert m.item() == 2.0 and l.item() == pytest.approx(math.exp(-1) + 1, rel=1e-6)
    assert acc.item() == pytest.approx(math.exp(-1) * 1 + 2, rel=1e-6)
    m, l, acc = fl.online_softmax_update(m, l, acc, torch.tensor([[3.0, 0.0]]), v[2:])
    assert m.item() == 3.0
    assert l.item() == pytest.approx((math.exp(-1) + 1) * math.exp(-1) + 1 + math.exp(-3),
                                     rel=1e-6)
    out, lse = fl.finish(m, l, acc)
    weights = [math.exp(s) for s in (1, 2, 3, 0)]
    assert lse.item() == pytest.approx(math.log(sum(weights)), rel=1e-6)
    assert out.item() == pytest.approx(sum(w * x for w, x in zip(weights, (1, 2, 3, 4)))
                                       / sum(weights), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(1, 12), d=st.integers(1, 4),
       tile=st.integers(1, 13), spread=st.sampled_from([1.0, 30.0]),
       seed=st.integers(0, 2 ** 16), masked=st.floats(0.0, 0.9))
def test_online_softmax_in_any_tile_size_is_the_softmax(rows, n, d, tile, spread, seed,
                                                        masked):
    """Folding tiles of any size (1 .. n + 1) gives softmax(scores) @ v and logsumexp; keys
    masked with -inf weigh nothing; a row with every key masked ends with output 0 and lse
    -inf, never NaN. spread 30: scores far apart, so a late larger score must rescale the
    state (a missed rescale is off by e^30)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=gen) * spread
    scores[torch.rand(rows, n, generator=gen) < masked] = -math.inf
    v = torch.randn(n, d, generator=gen)
    out, lse = fold(scores, v, tile)
    assert not out.isnan().any() and not lse.isnan().any()
    for r in range(rows):
        if torch.isinf(scores[r]).all():
            assert lse[r] == -math.inf and (out[r] == 0).all()
            continue
        torch.testing.assert_close(lse[r], torch.logsumexp(scores[r], 0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[r], torch.softmax(scores[r], 0) @ v, atol=1e-5,
                                   rtol=1e-5)


# --- the log-sum-exp merge --------------------------------------------------------------------

def part(q, k, v, scale):
    """A decode query q (H, D) over keys k, v (n, Hkv, D), all visible: (out, lse) by SDPA
    and logsumexp (T = 1, S = n: the bottom-right mask lets everything through)."""
    out, lse = reference(q[None], k, v, scale)
    return out[0], lse[0]


def test_merge_is_associative_and_equals_attention_over_all_keys():
    """Keys cut into A (0..3), B (4..8), C (9..11): merge(merge(A, B), C) == merge(A,
    merge(B, C)) == attention over all 12 keys, outputs and lse. GQA 8:2."""
    q, k, v = ragged([1], [12], 8, 2, seed=5)
    q = q[0] * 3                                       # spread the scores a little
    scale = D ** -0.5
    a, b, c = (part(q, k[r], v[r], scale) for r in (slice(0, 4), slice(4, 9), slice(9, 12)))
    left = fl.merge_attn_states(*fl.merge_attn_states(*a, *b), *c)
    right = fl.merge_attn_states(*a, *fl.merge_attn_states(*b, *c))
    whole = part(q, k, v, scale)
    for got in (left, right):
        assert got[0].dtype == torch.float32 and got[0].shape == (8, D)
        torch.testing.assert_close(got[0], whole[0], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(got[1], whole[1], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(left[0], right[0], atol=ATOL, rtol=ATOL)


def test_merge_with_an_empty_part_is_the_identity():
    """An empty part (lse -inf; its output any finite value) weighs nothing, on either side:
    the other part comes back exactly. Two empty parts: output 0 and lse -inf, no NaN."""
    q, k, v = ragged([1], [6], 4, 2, seed=6)
    a_out, a_lse = part(q[0], k, v, 0.3)
    junk = torch.full_like(a_out, 123.0)
    empty = torch.full_like(a_lse, -math.inf)
    for got in (fl.merge_attn_states(a_out, a_lse, junk, empty),
                fl.merge_attn_states(junk, empty, a_out, a_lse)):
        assert torch.equal(got[0], a_out) and torch.equal(got[1], a_lse)
    out, lse = fl.merge_attn_states(junk, empty, junk, empty)
    assert (out == 0).all() and (lse == -math.inf).all()


# --- split-K decoding -------------------------------------------------------------------------

S_SPLIT = 7


@pytest.mark.parametrize("num_splits", range(1, S_SPLIT + 3))
def test_split_k_decode_equals_attention_over_all_keys(num_splits):
    """num_splits 1 .. S + 2 (more splits than keys: some ranges are empty) with GQA 8:2:
    the output is SDPA's over all keys; the partials' lses logsumexp to the whole lse; with
    more splits than keys exactly num_splits - S ranges are empty (lse -inf); with one split
    per key, split j is key j alone (output v_j, lse its score)."""
    q, k, v = ragged([1], [S_SPLIT], 8, 2, seed=7)
    q, scale = q[0], D ** -0.5
    want, want_lse = part(q, k, v, scale)
    out, outs, lses = fl.split_k_decode(q, k, v, scale, num_splits, return_partials=True)
    assert out.shape == (8, D) and outs.shape == (num_splits, 8, D)
    assert lses.shape == (num_splits, 8)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(torch.logsumexp(lses, 0), want_lse, atol=ATOL, rtol=ATOL)
    assert torch.equal(fl.split_k_decode(q, k, v, scale, num_splits), out)
    empty = torch.isinf(lses).sum(0)
    assert (empty == max(0, num_splits - S_SPLIT)).all()
    if num_splits == S_SPLIT:
        scores = torch.einsum("hd,shd->hs", q, k.repeat_interleave(4, 1)) * scale  # (H, S)
        torch.testing.assert_close(lses, scores.T, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(outs, v.repeat_interleave(4, 1), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_split_k_decode_refuses_a_bad_num_splits(bad):
    q, k, v = ragged([1], [4], 4, 2, seed=0)
    with pytest.raises(ParameterError) as err:
        fl.split_k_decode(q[0], k, v, 1.0, bad)
    assert err.value.parameter == "num_splits"


# --- the walk over a block table ----------------------------------------------------------------

@pytest.mark.parametrize("n_heads, n_kv", GROUPS)
def test_paged_attention_equals_s12_gather_then_sdpa(n_heads, n_kv):
    """Blocks of 4, shuffled and non-adjacent: a decode at 13 (a context not a multiple of
    4), a chunk of 5 after 10 cached, a prompt from 0 (6), a one-token prompt, a request with
    no new token, a decode at 8 (the last block full). The unused parts of the pool are NaN;
    the pool is a strided view."""
    t_lens, s_lens = [1, 5, 6, 1, 0, 1], [13, 15, 6, 1, 8, 8]
    cache, tables = make_pool(s_lens, 4, n_kv, D, seed=n_heads + n_kv)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(t_lens), n_heads, D, generator=gen)
    scale = D ** -0.5
    # the pool passed as views with rows padded in memory (NaN between them): any strides
    k_pool, v_pool = (torch.cat([p[0], torch.full(p.shape[1:-1] + (8,), math.nan)], -1)
                      [..., :D] for p in (cache.k, cache.v))
    assert not k_pool.is_contiguous()
    out = fl.paged_attention(q, k_pool, v_pool, cu(t_lens), torch.tensor(s_lens), tables,
                             scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    starts = cu(t_lens)
    for b, (t, s) in enumerate(zip(t_lens, s_lens)):
        if t:
            k, v = gathered(cache, tables, b, s)
            want, _ = reference(q[starts[b]:starts[b + 1]], k, v, scale)
            torch.testing.assert_close(out[starts[b]:starts[b + 1]], want, atol=ATOL,
                                       rtol=ATOL)


# --- the tile trace ---------------------------------------------------------------------------

@pytest.mark.parametrize("t, s, block_m, block_n, visits", [
    # a prompt of 10 in 4 x 4 tiles: query tile 0 (rows 0-3) sees keys 0-3 only, tile 4
    # (rows 4-7) keys to 7, tile 8 (rows 8, 9) keys to 9: the tiles above the diagonal skipped
    (10, 10, 4, 4, [(0, 0), (4, 0), (4, 4), (8, 0), (8, 4), (8, 8)]),
    # a chunk of 3 after 7 cached (positions 7, 8, 9), tiles of 2 x 4: every key tile visited
    (3, 10, 2, 4, [(0, 0), (0, 4), (0, 8), (2, 0), (2, 4), (2, 8)]),
    # one query tile, key tiles of 3 over 5 keys: the last tile has 2 keys
    (2, 5, 8, 3, [(0, 0), (0, 3)]),
])
def test_tile_trace_visits_the_tiles_by_hand_and_keeps_the_running_max_and_sum(
        t, s, block_m, block_n, visits):
    """The (query tile, key tile) pairs a causal pass visits, in order; after each, row
    i0 + 1's running max is the max of its visible scores so far and its running sum
    sum(exp(score - max)) over them (head 0, computed here)."""
    q, k, v = ragged([t], [s], 4, 2, seed=t + s)
    scale = D ** -0.5
    trace = fl.tile_trace(q, k, v, scale, block_m, block_n, row=1)
    assert [(x.i0, x.j0) for x in trace] == visits
    scores = (q[:, 0] @ k[:, 0].T * scale).masked_fill(~causal_mask(t, s), -math.inf)  # (T, S)
    for x in trace:
        r = min(x.i0 + 1, t - 1, x.i0 + block_m - 1)
        seen = scores[r, :x.j0 + block_n]
        top = seen.max()
        assert x.m == pytest.approx(top.item(), rel=1e-6, abs=1e-6)
        assert x.l == pytest.approx(torch.exp(seen - top).sum().item(), rel=1e-5)
