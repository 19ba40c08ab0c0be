"""S17 exercises, reference solutions: the online softmax that folds attention one tile of keys
at a time, the log-sum-exp merge of two partial results, and the address arithmetic of a paged
decode kernel.

Try the stubs in exercises/s17_attention.py first; grade these with
`python exercises/grade.py --solutions s17`.

Sources followed: Milakov and Gimelshein, "Online normalizer calculation for softmax" (2018)
and FlashAttention-2's forward pass (Dao 2023, Algorithm 1) for the running max, sum and
rescaled output; vLLM's `merge_attn_states` for the name and the rule of the merge (Flash-
Decoding, Dao et al. 2023); S12's slot mapping (code/s12_engine.py `PagedKVCache`) and vLLM's
paged attention for the block-table walk.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


# Exercise 1: the online softmax --------------------------------------------------------------

def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
                          scores: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New max first; the old sums rescaled to it; the tile's terms added. Exponentials are
    taken against 0 where the new max is still -inf (every key so far masked): they are all
    exp(-inf) = 0 then, and no -inf - (-inf) is ever formed."""
    m_new = torch.maximum(m, scores.amax(dim=-1))                            # (..., R)
    base = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
    rescale = torch.exp(m - base)                                            # (..., R)
    p = torch.exp(scores - base.unsqueeze(-1))                               # (..., R, n)
    l_new = l * rescale + p.sum(dim=-1)
    acc_new = acc * rescale.unsqueeze(-1) + p @ v.to(p.dtype)                # (..., R, D)
    return m_new, l_new, acc_new


# Exercise 2: the log-sum-exp merge -----------------------------------------------------------

def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both weights taken against the larger lse (so the larger is exp(0) = 1, and nothing
    overflows); an empty part weighs exp(-inf) = 0. Where both parts are empty the base is 0
    instead of -inf, so no -inf - (-inf) is formed, and the total 0 is kept out of the log and
    the division."""
    top = torch.maximum(lse_a, lse_b)
    base = torch.where(top == -math.inf, torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - base), torch.exp(lse_b - base)              # (...,)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (w_a.unsqueeze(-1) * out_a.float() + w_b.unsqueeze(-1) * out_b.float()) \
        / denom.unsqueeze(-1)
    lse = torch.where(total > 0, base + torch.log(denom), -math.inf)
    return out, lse


# Exercise 3: the address arithmetic of a paged decode kernel ---------------------------------

def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The block holding the position, times the block size, plus the offset inside it."""
    index, offset = divmod(int(position), int(block_size))
    if position < 0 or index >= len(block_table):
        raise ValueError(f"position {position} needs block {index} of the table, which lists "
                         f"{len(block_table)} blocks of {block_size}")
    return int(block_table[index]) * int(block_size) + offset


def block_walk(block_table: Sequence[int], seq_len: int, block_size: int
               ) -> list[tuple[int, int]]:
    """ceil(seq_len / block_size) blocks, each full but the last."""
    num_blocks = -(-int(seq_len) // int(block_size))
    if seq_len < 0 or num_blocks > len(block_table):
        raise ValueError(f"a context of {seq_len} positions needs {num_blocks} blocks of "
                         f"{block_size}; the table lists {len(block_table)}")
    return [(int(block_table[j]), min(block_size, seq_len - j * block_size))
            for j in range(num_blocks)]
