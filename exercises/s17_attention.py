"""S17 exercises: the online softmax that folds attention one tile of keys at a time, the
log-sum-exp merge of two partial results, and the address arithmetic of a paged decode kernel.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s17

The chapter's code is code/s17_flash.py (the algorithms in plain torch: `online_softmax_update`
and `finish`, `flash_attention_varlen`, `merge_attn_states`, `split_k_decode`,
`paged_attention`), code/s17_paged_attention.c with code/s17_cpu.py (the CPU paged kernel) and
code/s17_triton.py (the Triton kernels); the KV pool, its block tables and its slot mapping are
S12's (code/s12_engine.py `PagedKVCache`). The graded tests hold your answers against torch's
own softmax and `scaled_dot_product_attention` (SDPA) over whole rows, against log-sum-exps
computed in float64, and against S12's `PagedKVCache.gather` on a real pool with a shuffled
block table. Reference solutions are in exercises/solutions/ -- try first, peek later.

Vocabulary (the chapter's): a row is one query of one head; its scores are q . k x scale for
each key, -inf where a key is masked (causal: a key after the query); a tile is a run of
consecutive keys processed together. The log-sum-exp (lse) of a row is log(sum(exp(score)))
over its keys, -inf when it has none. The KV pool holds blocks of block_size positions; a
request's block table lists its block ids in order (position p lives in block
block_table[p // block_size]); block 0 is the null block, never handed to a request.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


# Exercise 1: the online softmax (4 points) ---------------------------------------------------
# Attention never needs a row's whole (T x S) score matrix at once: a kernel reads keys one tile
# at a time and keeps, per row, three running numbers. When a tile brings a larger score than
# any before, what was summed so far is rescaled, so the result is the softmax of the whole row.

def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
                          scores: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of keys into each row's running state; return the new (m, l, acc).

    The state of a row after the keys seen so far:
    - m float32 (..., R): the largest score seen (-inf before any key, or if every key seen
      was masked);
    - l float32 (..., R): sum of exp(score - m) over the keys seen;
    - acc float32 (..., R, D): sum of exp(score - m) x v over the keys seen (unnormalised).
    The first tile starts from m = -inf, l = 0, acc = 0. After the last tile the row's
    attention output is acc / l and its lse is m + log(l) (the chapter's `finish`).
    scores: float32 (..., R, n), this tile's scaled scores, -inf where a key is masked;
    v: (..., n, D), the tile's values. The leading dims (...) are batch dims (heads, say):
    treat them like the row dim.

    The rule: the new max is max(m, the tile's largest score); the old l and acc were summed
    against the old max, so multiply them by exp(m_old - m_new) before adding the tile's
    exp(score - m_new) terms. Subtracting the max keeps every exponential <= 1: scores of 1000
    must not overflow.
    Mind the rows that have seen only masked keys (a first tile all masked, or a causal row
    whose keys all lie in later tiles): their m stays -inf, and -inf - (-inf) is NaN. Such a
    row must keep m = -inf, l = 0, acc = 0, with no NaN anywhere, and recover exactly once a
    real key comes. Hint: take the exponentials against 0 instead of m_new where m_new is
    -inf (exp(-inf - 0) = 0, which is what a masked key weighs).
    Example, one row, D = 1: the state (m, l, acc) = (1, 1, 5) (one key of score 1, value 5);
    a tile of scores [3, -inf] with values [[2], [9]] gives m = 3, l = e^-2 + 1,
    acc = 5 e^-2 + 2: the output acc / l is about 2.36.
    The tests fold random tiles of several sizes (one of them all masked, one with much larger
    scores) and after each tile compare your state with torch's softmax, max and logsumexp over
    all the keys so far; run your update inside a tiled causal attention and compare it with
    SDPA; and feed it all-masked rows and scores near 1000.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: the log-sum-exp merge (3 points) ------------------------------------------------
# Split-K (flash decoding) cuts one query's keys into ranges, attends each range alone (on a GPU
# in parallel), and combines the partial outputs. Each part brings its output and its lse: that
# is all the merge needs, and it is exact.

def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B together, from the results over A alone and over B alone.

    out_a, out_b: float32 (..., D), each the attention output over its own keys (softmax-
    weighted values); lse_a, lse_b: float32 (...,), each the log-sum-exp of its own scores;
    -inf for a part with no key (its out then holds any finite values: it must weigh nothing).
    Returns (out float32 (..., D), lse float32 (...,)) over A and B together.

    The rule: part A's softmax sum is e^lse_a, so it weighs e^lse_a / (e^lse_a + e^lse_b):
    out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b).
    Written that way it overflows (e^1000 is inf in float32 and in float64): take the
    exponentials against the larger lse. A part with lse -inf weighs 0 (merging it changes
    nothing); when both parts are empty, return out 0 and lse -inf, with no NaN.
    Example: lse_a = lse_b = 1000, out_a = [1, 0], out_b = [0, 1]: out [0.5, 0.5],
    lse 1000 + log 2.
    The tests split the keys of random queries at random points (one part empty, sometimes),
    compute each part's output with SDPA and its lse with torch.logsumexp, and compare your
    merge with SDPA over all the keys, merged in several orders; and check lses near +-1000
    against a float64 computation.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: the address arithmetic of a paged decode kernel (3 points) ----------------------
# S12 gathered a request's blocks into a contiguous copy before attending. A paged kernel reads
# the pool in place: for each block of the request's table it loads that block's keys and
# values (the last block only partly filled) and folds them into the online softmax as one tile.

def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The pool slot that holds position `position` of the request with this block table.

    block_table: the request's block ids in order (a list of ints or a 1-D int tensor; it may
    be longer than the request needs, padded with 0, the null block); position: >= 0;
    block_size: positions per block. The pool seen as one long array of slots (num_blocks x
    block_size of them) keeps block b's positions at slots b x block_size to
    (b + 1) x block_size - 1. Returns a plain int.
    Example: block_size 4, table [7, 2, 9]: position 0 -> 28, 5 -> 9, 11 -> 39.
    Raises ValueError for a negative position, or one whose block the table does not list.
    The tests read a real S12 pool (shuffled blocks) at your slots and compare with
    `PagedKVCache.gather`.
    """
    raise NotImplementedError("exercise 3a")


def block_walk(block_table: Sequence[int], seq_len: int, block_size: int
               ) -> list[tuple[int, int]]:
    """The blocks a paged decode kernel visits for a context of seq_len positions, in order:
    a list of (block id, number of valid positions in it), every block full but the last.

    block_table as in `slot_of` (padding past the context is never visited); seq_len: >= 0,
    the context length (positions 0 .. seq_len - 1 have KV). A context of 0 visits nothing.
    Example: block_size 4, table [7, 2, 9, 0]: seq_len 10 -> [(7, 4), (2, 4), (9, 2)];
    seq_len 8 -> [(7, 4), (2, 4)] (no empty third block); seq_len 1 -> [(7, 1)].
    Hint: ceil(seq_len / block_size) blocks; only the last may be partial.
    Raises ValueError for a negative seq_len or one the table's blocks cannot hold.
    The tests concatenate, block by block, the keys your walk names in a real S12 pool and
    compare them with `PagedKVCache.gather`, and run the chapter's online softmax over your
    walk against SDPA over the gathered keys.
    """
    raise NotImplementedError("exercise 3b")
