"""S17, attention in tiles: FlashAttention's online softmax, split-K decoding and a walk over a
block table, in plain torch.

What is new since S16
    S06 computes attention the textbook way: every score of a (T, S) matrix per head, then the
    softmax over each row, then the weighted sum of values. This module computes the same
    numbers without ever holding that matrix.

    - `online_softmax_update`: one tile of keys folded into a running state (the row's largest
      score m so far, the sum l of exp(score - m) over the keys seen, and the unnormalised
      output acc = sum exp(score - m) v). When a tile brings a larger score, the old state is
      rescaled by exp(m_old - m_new): the softmax of the whole row is recovered exactly, one
      tile at a time (Milakov and Gimelshein 2018; FlashAttention's forward pass).
    - `flash_attention_varlen`: tiled causal grouped-query attention over a ragged batch laid
      end to end (`cu_seqlens_q`, `cu_seqlens_k`), the diagonal aligned bottom-right so a chunk
      of new queries after cached keys is one call; query tiles of block_m rows against key
      tiles of block_n keys, the tiles wholly above the diagonal skipped. Memory: one
      (block_m, block_n) tile of scores per head group instead of (T, S). Also the per-row
      log-sum-exp, the number split-K needs.
    - `merge_attn_states` (vLLM's name): two partial results over disjoint key ranges, each with
      its log-sum-exp, combined exactly. `split_k_decode` (flash decoding): one query's keys cut
      into num_splits ranges, each attended alone (on a GPU: in parallel), then merged.
    - `paged_attention`: the same online softmax walking each request's block table block by
      block, reading the pool in place: the algorithm of S17's C and Triton kernels, in torch.
    - `tile_trace`: which (query tile, key tile) pairs a causal tiled pass visits, and the
      running max and sum of one row after each tile (the simulator replays it).

What it does not handle
    Speed: these are references written for clarity, Python loops over tiles. The fast versions
    are code/s17_cpu.py (a C kernel) and code/s17_triton.py (Triton). No sliding window, no
    ALiBi or softcapping, no dropout; queries see keys causally only.

Run it
    python code/s17_attention.py --attention-backend paged   # the engine on S17's C kernel
    (the functions here are what the notebook, notebooks/s17_attention.ipynb, steps through)

Tests
    tests/test_s17_flash.py: every function against torch's scaled_dot_product_attention and
    S12's gather: tail tiles, GQA, a chunk after cached keys, empty and one-token requests,
    the merge's associativity, a shuffled block table.

References
    Milakov and Gimelshein, "Online normalizer calculation for softmax" (2018); Dao et al.,
    "FlashAttention" (NeurIPS 2022) and "FlashAttention-2" (2023), Algorithm 1; Dao, Haziza,
    Massa and Sizov, "Flash-Decoding for long-context inference" (2023); vLLM's
    `merge_attn_states` (vllm/attention/ops/merge_attn_states.py) for the name and the rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import s01_generation_loop as s01

ParameterError = s01.ParameterError


# ---------------------------------------------------------------------------------------------
# The online softmax
# ---------------------------------------------------------------------------------------------

def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
                          scores: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of keys into each row's running softmax state.

    m, l: float32 (..., R): per row the largest score so far and sum(exp(score - m)) over the
    keys seen (before any key: m = -inf, l = 0); acc: float32 (..., R, D), sum(exp(score - m)
    v); scores: float32 (..., R, n), this tile's scaled scores, -inf where a key is masked;
    v: (..., n, D), the tile's values. Returns the new (m, l, acc). A row that has seen only
    masked keys keeps m = -inf, l = 0, acc = 0 (no NaN: its exponentials are taken against 0).
    """
    m_new = torch.maximum(m, scores.amax(dim=-1))                            # (..., R)
    base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # finite
    alpha = torch.exp(m - base)                       # the old state's rescale, 0 if m = -inf
    p = torch.exp(scores - base[..., None])                                  # (..., R, n)
    l = l * alpha + p.sum(dim=-1)
    acc = acc * alpha[..., None] + p @ v.to(p.dtype)                         # (..., R, D)
    return m_new, l, acc


def finish(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after the last tile -> (output acc / l (..., R, D), log-sum-exp m + log l
    (..., R)); a row that saw no key gets output 0 and log-sum-exp -inf."""
    seen = l > 0
    out = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf)
    return out, lse


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from the results over A alone and B alone.

    out_a, out_b: (..., D), each the softmax-weighted values over its own keys; lse_a, lse_b:
    float32 (...,), each log(sum(exp(score))) over its own keys (-inf: no key). The merged
    output is (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), computed against the
    larger lse so no exponential overflows; returns (out float32 (..., D), lse (...,)). Exact
    up to rounding, and associative: the ranges may be merged in any grouping.
    """
    top = torch.maximum(lse_a, lse_b)
    base = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - base), torch.exp(lse_b - base)             # 0 for -inf
    total = w_a + w_b
    safe = torch.where(total > 0, total, 1.0)
    out = (w_a[..., None] * out_a.float() + w_b[..., None] * out_b.float()) / safe[..., None]
    lse = torch.where(total > 0, base + torch.log(safe), -math.inf)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Tiled attention over a ragged batch
# ---------------------------------------------------------------------------------------------

def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """q (N, H, D), k and v (S, Hkv, D) with H a multiple of Hkv -> (H, Hkv, D); raises
    ParameterError naming the rule."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ParameterError(f"q must be (N, H, D) and k, v (S, Hkv, D) of one shape (got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})", "shape")
    n_heads, head_dim = q.shape[1:]
    n_kv = k.shape[1]
    if k.shape[2] != head_dim:
        raise ParameterError(f"q and k need one head_dim (got {head_dim} and {k.shape[2]})",
                             "head_dim")
    if n_kv < 1 or n_heads % n_kv:
        raise ParameterError(f"the query heads must be a multiple of the KV heads (got "
                             f"{n_heads} and {n_kv})", "num_heads")
    return n_heads, n_kv, head_dim


def check_cu_seqlens(cu_q, cu_k, n_q: int, n_k: int) -> tuple[list[int], list[int]]:
    """cu_seqlens_q, cu_seqlens_k (B + 1,) -> two lists of host ints; each must start at 0,
    never decrease, end at the number of rows, and give every request at least as many keys as
    queries (its queries are its last positions)."""
    cq, ck = [int(x) for x in cu_q], [int(x) for x in cu_k]
    if len(cq) != len(ck) or len(cq) < 2:
        raise ParameterError("cu_seqlens_q and cu_seqlens_k need B + 1 >= 2 entries each",
                             "cu_seqlens_q")
    for name, cu, total in (("cu_seqlens_q", cq, n_q), ("cu_seqlens_k", ck, n_k)):
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            raise ParameterError(f"{name} must start at 0, never decrease and end at {total} "
                                 f"(got {cu})", name)
    for b in range(len(cq) - 1):
        if ck[b + 1] - ck[b] < cq[b + 1] - cq[b]:
            raise ParameterError(f"request {b} has more queries than keys: a query's keys "
                                 f"include itself (bottom-right causal)", "cu_seqlens_k")
    return cq, ck


def attend_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 block_m: int, block_n: int, visit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q (T, H, D) its new queries, k, v (S, Hkv, D) all its keys, S >= T, causal
    bottom-right (query i sees keys 0 .. S - T + i). Query tiles of block_m rows, key tiles of
    block_n; a key tile wholly past a query tile's last visible key is skipped. visit(i0, j0,
    m, l), if given, sees each visited tile's start and the state after it. Returns (out
    float32 (T, H, D), lse float32 (T, H))."""
    t_len, n_heads, head_dim = q.shape
    s_len, n_kv, _ = k.shape
    group = n_heads // n_kv
    offset = s_len - t_len                            # query i is at position offset + i
    out = torch.empty(t_len, n_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(t_len, n_heads, dtype=torch.float32, device=q.device)
    keys, values = k.transpose(0, 1).float(), v.transpose(0, 1).float()      # (Hkv, S, D)
    for i0 in range(0, t_len, block_m):
        i1 = min(i0 + block_m, t_len)
        rows = i1 - i0
        # the G query heads of a KV head stacked as rows: (Hkv, G rows, D)
        q_tile = (q[i0:i1].float().reshape(rows, n_kv, group, head_dim)
                  .permute(1, 2, 0, 3).reshape(n_kv, group * rows, head_dim))
        pos = offset + torch.arange(i0, i1, device=q.device).repeat(group)   # (G rows,)
        m = torch.full((n_kv, group * rows), -math.inf, device=q.device)
        l = torch.zeros(n_kv, group * rows, device=q.device)
        acc = torch.zeros(n_kv, group * rows, head_dim, device=q.device)
        for j0 in range(0, offset + i1, block_n):   # past offset + i1 - 1 nobody looks
            j1 = min(j0 + block_n, s_len)
            scores = (q_tile @ keys[:, j0:j1].transpose(1, 2)) * scale      # (Hkv, G rows, n)
            if j1 - 1 > offset + i0:                  # the tile crosses the diagonal
                cols = torch.arange(j0, j1, device=q.device)
                scores = scores.masked_fill(cols[None, :] > pos[:, None], -math.inf)
            m, l, acc = online_softmax_update(m, l, acc, scores, values[:, j0:j1])
            if visit is not None:
                visit(i0, j0, m, l)
        o, s = finish(m, l, acc)                      # (Hkv, G rows, D), (Hkv, G rows)
        out[i0:i1] = o.reshape(n_kv, group, rows, head_dim).permute(2, 0, 1, 3).reshape(
            rows, n_heads, head_dim)
        lse[i0:i1] = s.reshape(n_kv, group, rows).permute(2, 0, 1).reshape(rows, n_heads)
    return out, lse


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q, cu_seqlens_k, scale: float, *, block_m: int = 64,
                           block_n: int = 64, return_lse: bool = False):
    """Tiled causal attention over a ragged batch (FlashAttention's varlen interface).

    q: (N_q, H, D), the new queries of B requests end to end, request b's rows cu_seqlens_q[b]
    .. cu_seqlens_q[b + 1] - 1; k, v: (N_k, Hkv, D), each request's keys (cached ones first)
    end to end by cu_seqlens_k; query i of a request with T queries and S keys sees keys
    0 .. S - T + i (the diagonal bottom-right). GQA: query head h reads KV head h // (H / Hkv).
    block_m, block_n: the query and key tile sizes (>= 1). Computed in float32; returns out in
    q's dtype (N_q, H, D), and with return_lse also the log-sum-exp float32 (N_q, H). Raises
    ParameterError naming the rule for inconsistent shapes or offsets.
    """
    check_qkv(q, k, v)
    cq, ck = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not s01.is_int(value) or value < 1:
            raise ParameterError(f"{name} must be an integer >= 1 (got {value!r})", name)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue                                  # no new query: nothing to write
        out[cq[b]:cq[b + 1]], lse[cq[b]:cq[b + 1]] = attend_tiles(
            q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], scale, block_m, block_n)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Split-K decoding
# ---------------------------------------------------------------------------------------------

def split_k_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   num_splits: int, return_partials: bool = False):
    """One decode query against all its keys, the keys cut into num_splits ranges (flash
    decoding). q: (H, D); k, v: (S, Hkv, D). Each range is attended alone, giving a partial
    output and its log-sum-exp (on a GPU each range is its own program, so a batch of one
    still fills the machine); `merge_attn_states` folds them left to right. Returns out
    float32 (H, D), or with return_partials (out, partial outs (splits, H, D), partial lses
    (splits, H)); an empty range has lse -inf and weighs nothing."""
    if not s01.is_int(num_splits) or num_splits < 1:
        raise ParameterError(f"num_splits must be an integer >= 1 (got {num_splits!r})",
                             "num_splits")
    check_qkv(q[None], k, v)
    s_len = k.shape[0]
    bounds = [round(i * s_len / num_splits) for i in range(num_splits + 1)]
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            outs.append(torch.zeros(q.shape, dtype=torch.float32, device=q.device))
            lses.append(torch.full(q.shape[:1], -math.inf, device=q.device))
            continue
        # a range of keys all visible to the query: T = 1 query after b - a - 1 keys
        o, s = attend_tiles(q[None], k[a:b], v[a:b], scale, 1, b - a)
        outs.append(o[0])
        lses.append(s[0])
    out, lse = outs[0].float(), lses[0]
    for o, s in zip(outs[1:], lses[1:]):
        out, lse = merge_attn_states(out, lse, o, s)
    if return_partials:
        return out, torch.stack(outs), torch.stack(lses)
    return out


# ---------------------------------------------------------------------------------------------
# The walk over a block table
# ---------------------------------------------------------------------------------------------

def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc, seq_lens, block_tables: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of a ragged batch against a paged KV pool, read in place block by block.

    q: (N, H, D), each request's new queries end to end (query_start_loc, B + 1 ints);
    k_cache, v_cache: one layer's pool (num_blocks, block_size, Hkv, D); seq_lens: B ints, each
    request's context after this step; block_tables: int (B, M). Query i of request b (T_b
    queries) sees positions 0 .. seq_lens[b] - T_b + i; position p lives in block
    block_tables[b, p // block_size] at offset p % block_size. Each block is one tile of the
    online softmax: no copy of a request's keys is ever made. Returns float32 (N, H, D).
    """
    n_heads, n_kv, head_dim = check_qkv(q, k_cache[0], v_cache[0])
    block_size = k_cache.shape[1]
    starts = [int(x) for x in query_start_loc]
    group = n_heads // n_kv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, s_len in enumerate(int(x) for x in seq_lens):
        a, e = starts[b], starts[b + 1]
        t_len = e - a
        if t_len == 0:
            continue
        pos = s_len - t_len + torch.arange(t_len, device=q.device).repeat(group)   # (G T,)
        q_rows = (q[a:e].float().reshape(t_len, n_kv, group, head_dim).permute(1, 2, 0, 3)
                  .reshape(n_kv, group * t_len, head_dim))                    # (Hkv, G T, D)
        m = torch.full((n_kv, group * t_len), -math.inf, device=q.device)
        l = torch.zeros(n_kv, group * t_len, device=q.device)
        acc = torch.zeros(n_kv, group * t_len, head_dim, device=q.device)
        for j in range(-(-s_len // block_size)):
            block = int(block_tables[b, j])
            n = min(block_size, s_len - j * block_size)
            keys = k_cache[block, :n].float().transpose(0, 1)                # (Hkv, n, D)
            scores = (q_rows @ keys.transpose(1, 2)) * scale                 # (Hkv, G T, n)
            cols = j * block_size + torch.arange(n, device=q.device)
            scores = scores.masked_fill(cols[None, :] > pos[:, None], -math.inf)
            m, l, acc = online_softmax_update(m, l, acc, scores,
                                              v_cache[block, :n].transpose(0, 1))
        o, _ = finish(m, l, acc)
        out[a:e] = o.reshape(n_kv, group, t_len, head_dim).permute(2, 0, 1, 3).reshape(
            t_len, n_heads, head_dim)
    return out


# ---------------------------------------------------------------------------------------------
# What a tiled pass visits (the simulator's data)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileVisit:
    """One key tile folded into one query tile: the tiles' first rows (i0: query, j0: key), and
    the running max and sum of row `row` of the query tile, head 0, after it."""
    i0: int
    j0: int
    m: float
    l: float


def tile_trace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int,
               block_n: int, row: int = 0) -> list[TileVisit]:
    """The tiles `attend_tiles` visits for one request (q (T, H, D), k, v (S, Hkv, D)), in
    order, with the running max and sum of query row i0 + row (head 0) after each."""
    trace: list[TileVisit] = []
    group = q.shape[1] // k.shape[1]

    def visit(i0, j0, m, l):
        rows = min(block_m, q.shape[0] - i0)
        r = min(row, rows - 1)                        # head 0 is the first of KV head 0's rows
        trace.append(TileVisit(i0, j0, float(m[0, r]), float(l[0, r])))
    assert group >= 1
    attend_tiles(q, k, v, scale, block_m, block_n, visit)
    return trace
