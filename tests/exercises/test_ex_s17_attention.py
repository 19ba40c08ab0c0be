"""Graded tests for the S17 exercises (see exercises/s17_attention.py).

Oracles, none of them the solution:
- Exercise 1 (the online softmax): random rows folded tile by tile (tiles of 1 to 16 keys, keys
  masked at random, a tile all masked, a tile of much larger scores, rows whose first tiles are
  all masked); after every tile your state must be torch's max over all the keys so far, and
  the chapter's `finish` (code/s17_flash.py: acc / l and m + log l) of it torch's softmax @ v
  and logsumexp over them (float64). Then your update drives a tiled causal pass (the diagonal
  bottom-right, a chunk after cached keys, tiles wholly masked for some rows) compared with
  torch's scaled_dot_product_attention (SDPA); and rows that see only masked keys (no NaN, the
  empty state kept), scores near +-1000 (no overflow).
- Exercise 2 (the log-sum-exp merge): the keys of random queries cut at random points (an
  empty part included); each part's output from SDPA and its lse from torch.logsumexp; your
  merge must be SDPA and logsumexp over all the keys, in several orders and groupings. An
  empty part must change nothing; lses near +-1000 are compared with the merge computed in
  float64 by torch's softmax and logaddexp.
- Exercise 3 (the address arithmetic): real S12 pools (code/s12_engine.py `PagedKVCache`, two
  layers, blocks of 1, 3 and 4 positions, random keys and values) with shuffled, non-contiguous
  block tables padded with the null block. Your slots must read, from the pool seen as one
  array of slots, exactly the keys and values `PagedKVCache.gather` copies out; the blocks of
  your walk, concatenated, must be the gathered context, and the chapter's online softmax run
  over them block by block must be SDPA over the gathered keys (GQA). And the docstrings'
  hand cases.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from exercise_loader import load_exercise

ex = load_exercise("s17_attention")

import s12_engine as s12  # noqa: E402  (code/ is on the path once the loader ran)
import s17_flash as s17f  # noqa: E402

NEG = -math.inf


def empty_state(*rows: int, head_dim: int):
    """The online softmax's state before any key: m = -inf, l = 0, acc = 0 (float32)."""
    return (torch.full(rows, NEG), torch.zeros(rows), torch.zeros(*rows, head_dim))


def fold(m, l, acc, scores, v, what: str):
    """Your update, with its results' shapes and dtypes checked and no NaN allowed."""
    got = ex.online_softmax_update(m.clone(), l.clone(), acc.clone(), scores.clone(), v.clone())
    assert isinstance(got, tuple) and len(got) == 3, f"{what}: return (m, l, acc)"
    got = tuple(torch.as_tensor(x) for x in got)
    for name, new, old in zip(("m", "l", "acc"), got, (m, l, acc)):
        assert new.shape == old.shape, f"{what}: {name} has shape {tuple(new.shape)}, " \
                                       f"want {tuple(old.shape)}"
        assert not torch.isnan(new).any(), f"{what}: NaN in {name}"
    return got


def softmax_rows(scores: torch.Tensor, v: torch.Tensor):
    """Float64 oracle over whole rows: (softmax @ v, logsumexp, max); a row with no unmasked
    key gets output 0 and lse -inf."""
    s = scores.double()
    lse = torch.logsumexp(s, dim=-1)
    seen = lse > NEG
    weights = torch.where(seen[..., None], torch.softmax(torch.where(
        seen[..., None], s, 0.0), dim=-1), 0.0)
    return weights @ v.double(), lse, s.amax(dim=-1)


def check_state(state, scores, v, what: str) -> None:
    m, l, acc = state
    want_out, want_lse, want_m = softmax_rows(scores, v)
    assert torch.equal(m.double(), want_m), (
        f"{what}: m must be the largest score seen per row; you have {m.tolist()}, the scores "
        f"so far give {want_m.tolist()}")
    empty = want_lse == NEG
    assert (l[empty] == 0).all() and (acc[empty] == 0).all(), (
        f"{what}: a row that has seen only masked keys must keep l = 0 and acc = 0")
    out, lse = s17f.finish(m, l, acc)
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-5), (
        f"{what}: m + log(l) must be the logsumexp of the scores so far: you give "
        f"{lse.tolist()}, torch {want_lse.tolist()}")
    assert torch.allclose(out.double(), want_out, rtol=1e-4, atol=1e-5), (
        f"{what}: acc / l must be softmax(scores) @ v over the keys so far (largest error "
        f"{(out.double() - want_out).abs().max().item():.3g})")


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(2)
def test_online_softmax_folds_tiles_to_the_softmax_of_the_row():
    g = torch.Generator().manual_seed(1701)
    heads, rows, d = 2, 5, 8
    m, l, acc = empty_state(heads, rows, head_dim=d)
    seen_s, seen_v = [], []
    for t, n in enumerate((3, 1, 7, 4, 16, 2, 5)):
        scores = 2 * torch.randn(heads, rows, n, generator=g)
        scores = scores.masked_fill(torch.rand(heads, rows, n, generator=g) < 0.2, NEG)
        v = torch.randn(heads, n, d, generator=g)
        if t < 3:
            scores[0, 0] = NEG        # head 0's row 0: its first three tiles all masked
        if t == 2:
            scores[:] = NEG           # a tile all masked, after real keys for most rows
        if t == 4:
            scores += 6.0             # a larger max: everything summed so far is rescaled
        m, l, acc = fold(m, l, acc, scores, v, f"tile {t} ({n} keys)")
        seen_s.append(scores)
        seen_v.append(v)
        check_state((m, l, acc), torch.cat(seen_s, -1), torch.cat(seen_v, -2),
                    f"after tile {t} ({n} keys)")


def causal_scores(q, k, scale):
    """(H, T, S) scaled scores with the diagonal bottom-right (query i sees keys <= S-T+i)."""
    t_len, s_len = q.shape[-2], k.shape[-2]
    allowed = (torch.arange(s_len)[None, :]
               <= s_len - t_len + torch.arange(t_len)[:, None])                # (T, S)
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, NEG), allowed


@pytest.mark.points(1)
def test_online_softmax_in_a_tiled_causal_pass_is_sdpa():
    g = torch.Generator().manual_seed(1702)
    heads, d = 2, 16
    for t_len, s_len, block_n in ((13, 13, 4), (5, 21, 4), (6, 11, 3), (1, 9, 16)):
        q = torch.randn(heads, t_len, d, generator=g)
        k = torch.randn(heads, s_len, d, generator=g)
        v = torch.randn(heads, s_len, d, generator=g)
        scale = 1 / math.sqrt(d)
        scores, allowed = causal_scores(q, k, scale)
        m, l, acc = empty_state(heads, t_len, head_dim=d)
        for j0 in range(0, s_len, block_n):
            m, l, acc = fold(m, l, acc, scores[..., j0:j0 + block_n], v[:, j0:j0 + block_n],
                             f"T={t_len}, S={s_len}: key tile at {j0}")
        out, lse = s17f.finish(m, l, acc)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        assert torch.allclose(out, want, rtol=1e-4, atol=1e-5), (
            f"T={t_len} queries after {s_len - t_len} cached keys, tiles of {block_n}: your "
            f"tiled pass differs from SDPA by {(out - want).abs().max().item():.3g}")
        assert torch.allclose(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.points(1)
def test_online_softmax_masked_rows_and_scores_near_1000():
    d = 3
    # before any key, a tile all masked: the empty state, unchanged, no NaN
    m, l, acc = fold(*empty_state(4, head_dim=d), torch.full((4, 5), NEG),
                     torch.randn(5, d), "a first tile all masked")
    assert torch.equal(m, torch.full((4,), NEG)) and not l.any() and not acc.any(), (
        "a row that has seen only masked keys keeps m = -inf, l = 0, acc = 0")
    g = torch.Generator().manual_seed(1703)
    first = torch.tensor([[NEG, NEG, NEG],           # row 0: masked throughout
                          [NEG, NEG, NEG],           # row 1: its keys come in the second tile
                          [1000.0, 999.0, NEG],      # row 2: exp(1000) is inf in float32
                          [-1000.0, -1001.0, -999.5]])   # row 3: exp(-1000) is 0
    second = torch.tensor([[NEG, NEG],
                           [0.5, -0.25],
                           [1000.5, 998.0],
                           [-998.0, NEG]])
    v1, v2 = torch.randn(3, d, generator=g), torch.randn(2, d, generator=g)
    state = empty_state(4, head_dim=d)
    state = fold(*state, first, v1, "first tile (rows all masked, scores near +-1000)")
    check_state(state, first, v1, "first tile (rows all masked, scores near +-1000)")
    state = fold(*state, second, v2, "second tile")
    check_state(state, torch.cat([first, second], -1), torch.cat([v1, v2]),
                "second tile (a row's first real keys, scores near +-1000)")
    m, l, acc = state
    assert m[0] == NEG and l[0] == 0 and not acc[0].any()


# Exercise 2 ----------------------------------------------------------------------------------

def merge(out_a, lse_a, out_b, lse_b, what: str):
    got = ex.merge_attn_states(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
    assert isinstance(got, tuple) and len(got) == 2, f"{what}: return (out, lse)"
    out, lse = (torch.as_tensor(x) for x in got)
    assert out.shape == out_a.shape and lse.shape == lse_a.shape, (
        f"{what}: shapes {tuple(out.shape)}, {tuple(lse.shape)}, want {tuple(out_a.shape)}, "
        f"{tuple(lse_a.shape)}")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN"
    return out, lse


class Query:
    """Random queries (H, 1, D) with keys and values (H, S, D): each key range's output from
    SDPA and its lse from torch.logsumexp."""

    def __init__(self, g, heads: int, s_len: int, d: int, spread: float):
        self.q = spread * torch.randn(heads, 1, d, generator=g)
        self.k = torch.randn(heads, s_len, d, generator=g)
        self.v = torch.randn(heads, s_len, d, generator=g)
        self.scale, self.g = 1 / math.sqrt(d), g

    def part(self, a: int, b: int):
        """(out (H, D), lse (H,)) over keys a .. b - 1; an empty range: lse -inf and any
        finite out."""
        heads, _, d = self.q.shape
        if a == b:
            return 100 * torch.randn(heads, d, generator=self.g), torch.full((heads,), NEG)
        k, v = self.k[:, a:b], self.v[:, a:b]
        out = F.scaled_dot_product_attention(self.q, k, v, scale=self.scale)[:, 0]
        lse = torch.logsumexp(self.q @ k.transpose(-1, -2) * self.scale, dim=-1)[:, 0]
        return out, lse


@pytest.mark.points(1)
def test_merge_of_key_ranges_is_attention_over_all_keys():
    g = torch.Generator().manual_seed(1711)
    rng = random.Random(1711)
    for spread in (1.0, 4.0):
        s_len = 37
        query = Query(g, heads=4, s_len=s_len, d=16, spread=spread)
        want_out, want_lse = query.part(0, s_len)
        for cut in (1, 17, 36, rng.randint(2, 35)):
            out, lse = merge(*query.part(0, cut), *query.part(cut, s_len),
                             f"keys 0..{cut - 1} and {cut}..{s_len - 1}")
            assert torch.allclose(out, want_out, rtol=1e-4, atol=1e-5), (
                f"keys cut at {cut}: your merge differs from SDPA over all keys by "
                f"{(out - want_out).abs().max().item():.3g}")
            assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5), (
                f"keys cut at {cut}: your lse {lse.tolist()}, logsumexp over all keys "
                f"{want_lse.tolist()}")
        # four ranges (one empty): left to right, right to left, and in pairs
        cuts = sorted(rng.sample(range(1, s_len), 2))
        bounds = [0, cuts[0], cuts[0], cuts[1], s_len]
        parts = [query.part(a, b) for a, b in zip(bounds, bounds[1:])]
        left = parts[0]
        for i, p in enumerate(parts[1:]):
            left = merge(*left, *p, f"left to right, range {i + 1}")
        right = parts[-1]
        for i, p in enumerate(reversed(parts[:-1])):
            right = merge(*p, *right, f"right to left, range {2 - i}")
        pairs = merge(*merge(*parts[0], *parts[1], "ranges 0 and 1"),
                      *merge(*parts[2], *parts[3], "ranges 2 and 3"), "the two pairs")
        for name, (out, lse) in (("left to right", left), ("right to left", right),
                                 ("in pairs", pairs)):
            assert torch.allclose(out, want_out, rtol=1e-4, atol=1e-5), (
                f"four ranges {bounds} merged {name}: off SDPA by "
                f"{(out - want_out).abs().max().item():.3g}")
            assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5), name


@pytest.mark.points(1)
def test_merge_with_an_empty_part_changes_nothing():
    g = torch.Generator().manual_seed(1712)
    out_a, lse_a = torch.randn(3, 5, 8, generator=g), 3 * torch.randn(3, 5, generator=g)
    out_b = 50 * torch.randn(3, 5, 8, generator=g)               # an empty part's leftovers
    lse_b = torch.full((3, 5), NEG)
    for what, (out, lse) in (("A then an empty B", merge(out_a, lse_a, out_b, lse_b, "A, -")),
                             ("an empty B then A", merge(out_b, lse_b, out_a, lse_a, "-, A"))):
        assert torch.allclose(out, out_a, rtol=1e-6, atol=1e-6), (
            f"{what}: an empty part (lse -inf) must weigh nothing: off by "
            f"{(out - out_a).abs().max().item():.3g}")
        assert torch.allclose(lse, lse_a, rtol=1e-6, atol=1e-6), what
    out, lse = merge(out_b, lse_b, -out_b, lse_b.clone(), "two empty parts")
    assert torch.equal(lse, lse_b) and not out.any(), (
        "two empty parts: out 0 and lse -inf (no key at all)")
    # empty on either side, row by row
    mixed_a, mixed_b = lse_a.clone(), 3 * torch.randn(3, 5, generator=g)
    mixed_a[0], mixed_b[1] = NEG, NEG
    out, lse = merge(out_a, mixed_a, out_b, mixed_b, "rows empty in A or in B")
    assert torch.allclose(out[0], out_b[0], rtol=1e-6, atol=1e-5)
    assert torch.allclose(out[1], out_a[1], rtol=1e-6, atol=1e-6)
    assert torch.allclose(lse[:2], torch.stack([mixed_b[0], mixed_a[1]]), rtol=1e-6, atol=1e-6)


@pytest.mark.points(1)
def test_merge_of_lses_near_1000_does_not_overflow():
    g = torch.Generator().manual_seed(1713)
    lse_a = torch.tensor([1000.0, 1000.0, -1000.0, 1000.0, 88.5, 0.0, NEG, 500.0])
    lse_b = torch.tensor([1000.0, 1000.5, -1000.3, -1000.0, 89.0, NEG, 20.0, 480.0])
    out_a, out_b = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    out, lse = merge(out_a, lse_a, out_b, lse_b, "lses near +-1000")
    weights = torch.softmax(torch.stack([lse_a, lse_b]).double(), dim=0)        # (2, 8)
    want = weights[0, :, None] * out_a.double() + weights[1, :, None] * out_b.double()
    want_lse = torch.logaddexp(lse_a.double(), lse_b.double())
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6), (
        f"lses {lse_a.tolist()} and {lse_b.tolist()}: your out is off a float64 merge by "
        f"{(out.double() - want).abs().max().item():.3g} (exp(1000) overflows: take the "
        f"exponentials against the larger lse)")
    assert torch.allclose(lse.double(), want_lse, rtol=1e-6, atol=1e-4), (
        f"your lse {lse.tolist()}, float64's logaddexp {want_lse.tolist()}")
    out, lse = merge(torch.tensor([1.0, 0.0]), torch.tensor(1000.0), torch.tensor([0.0, 1.0]),
                     torch.tensor(1000.0), "the docstring's example")
    assert torch.allclose(out, torch.tensor([0.5, 0.5])) and \
        abs(float(lse) - (1000 + math.log(2))) < 1e-3, (out.tolist(), float(lse))


# Exercise 3 ----------------------------------------------------------------------------------

def pool_with_requests(seed: int, block_size: int):
    """A two-layer S12 pool full of random keys and values, and three requests: (block table
    as a list, padded with the null block to M = 6 entries, capacity in positions). Blocks are
    handed out shuffled, so no table is contiguous."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, width = 16, 6
    pool = s12.PagedKVCache(2, num_blocks, block_size, num_kv_heads=2, head_dim=4,
                            max_seq_len=width * block_size)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    free = list(range(1, num_blocks))                           # block 0: the null block
    random.Random(seed).shuffle(free)
    requests = []
    for used in (6, 4, 1):
        table = [free.pop() for _ in range(used)]
        requests.append((table + [0] * (width - used), used * block_size))
    return pool, requests


POOLS = [(1721, 4), (1722, 3), (1723, 1)]


@pytest.mark.points(1)
def test_slot_of_reads_what_s12_gathers():
    for bs, table, cases in ((4, [7, 2, 9], {0: 28, 3: 31, 5: 9, 8: 36, 11: 39}),
                             (1, [5, 3], {0: 5, 1: 3}), (16, [3, 0], {17: 1})):
        for p, want in cases.items():
            got = ex.slot_of(table, p, bs)
            assert got == want, f"block size {bs}, table {table}, position {p}: you say " \
                                f"{got}, want {want}"
    for seed, bs in POOLS:
        pool, requests = pool_with_requests(seed, bs)
        for layer in range(2):
            flat_k = pool.k[layer].reshape(-1, *pool.k.shape[-2:])    # (slots, Hkv, D)
            flat_v = pool.v[layer].reshape(-1, *pool.v.shape[-2:])
            for r, (table, capacity) in enumerate(requests):
                rows = torch.tensor([table])
                k, v = pool.gather(layer, rows, capacity)             # (1, Hkv, S, D)
                as_given = table if r % 2 == 0 else rows[0]           # a list, or a tensor row
                for p in range(capacity):
                    slot = ex.slot_of(as_given, p, bs)
                    assert isinstance(slot, int) or (torch.is_tensor(slot) and slot.numel() == 1)
                    slot = int(slot)
                    assert 0 <= slot < flat_k.shape[0], f"slot {slot} is outside the pool"
                    assert torch.equal(flat_k[slot], k[0, :, p]) and \
                        torch.equal(flat_v[slot], v[0, :, p]), (
                            f"block size {bs}, table {table}, position {p}: slot {slot} does "
                            f"not hold the position's key and value (S12's gather)")
            with pytest.raises(ValueError):
                ex.slot_of(requests[2][0][:1], bs, bs)       # past the table's one block
    with pytest.raises(ValueError):
        ex.slot_of([7, 2], -1, 4)
    with pytest.raises(ValueError):
        ex.slot_of([7, 2], 8, 4)


def as_pairs(walk) -> list[tuple[int, int]]:
    return [(int(b), int(n)) for b, n in walk]


@pytest.mark.points(1)
def test_block_walk_hand_cases():
    table = [7, 2, 9, 0]
    for seq_len, want in ((10, [(7, 4), (2, 4), (9, 2)]), (8, [(7, 4), (2, 4)]),
                          (1, [(7, 1)]), (4, [(7, 4)]), (5, [(7, 4), (2, 1)]), (0, []),
                          (16, [(7, 4), (2, 4), (9, 4), (0, 4)])):
        got = as_pairs(ex.block_walk(table, seq_len, 4))
        assert got == want, f"table {table}, blocks of 4, context {seq_len}: you walk {got}, " \
                            f"want {want}"
    assert as_pairs(ex.block_walk([3, 8, 1], 3, 1)) == [(3, 1), (8, 1), (1, 1)]
    assert as_pairs(ex.block_walk([5], 16, 16)) == [(5, 16)]
    with pytest.raises(ValueError):
        ex.block_walk([7, 2], 9, 4)                    # 9 positions need 3 blocks
    with pytest.raises(ValueError):
        ex.block_walk([7, 2], -1, 4)


@pytest.mark.points(1)
def test_block_walk_streams_the_gathered_context():
    g = torch.Generator().manual_seed(1724)
    for seed, bs in POOLS:
        pool, requests = pool_with_requests(seed, bs)
        n_kv, d = pool.k.shape[-2:]
        group = 2                                           # GQA: 2 query heads per KV head
        for table, capacity in requests:
            for seq_len in sorted({1, bs, bs + 1, capacity - 1, capacity} - {0}):
                if seq_len > capacity:
                    continue
                walk = as_pairs(ex.block_walk(table, seq_len, bs))
                assert sum(n for _, n in walk) == seq_len, (
                    f"context {seq_len}: your walk {walk} covers {sum(n for _, n in walk)}")
                assert all(1 <= n <= bs for _, n in walk), walk
                layer = seq_len % 2
                k, v = pool.gather(layer, torch.tensor([table]), seq_len)   # (1, Hkv, S, D)
                walked_k = torch.cat([pool.k[layer, b, :n] for b, n in walk])  # (S, Hkv, D)
                walked_v = torch.cat([pool.v[layer, b, :n] for b, n in walk])
                assert torch.equal(walked_k, k[0].transpose(0, 1)) and \
                    torch.equal(walked_v, v[0].transpose(0, 1)), (
                        f"blocks of {bs}, table {table}, context {seq_len}: the blocks of your "
                        f"walk {walk} do not hold the context S12 gathers, in order")
                # one decode query per head, the chapter's online softmax over your walk
                q = torch.randn(n_kv, group, d, generator=g)
                scale = 1 / math.sqrt(d)
                m, l, acc = empty_state(n_kv, group, head_dim=d)
                for b, n in walk:
                    keys = pool.k[layer, b, :n].transpose(0, 1)         # (Hkv, n, D)
                    values = pool.v[layer, b, :n].transpose(0, 1)
                    m, l, acc = s17f.online_softmax_update(
                        m, l, acc, q @ keys.transpose(1, 2) * scale, values)
                out, _ = s17f.finish(m, l, acc)
                want = F.scaled_dot_product_attention(
                    q.reshape(n_kv * group, 1, d), k[0].repeat_interleave(group, 0),
                    v[0].repeat_interleave(group, 0), scale=scale)[:, 0]
                assert torch.allclose(out.reshape(n_kv * group, d), want, rtol=1e-4,
                                      atol=1e-5), (bs, table, seq_len)
