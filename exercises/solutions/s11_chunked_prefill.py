"""S11 exercises, reference solutions: one step's chunks under a token budget, the causal mask of
a chunk, who goes first in a step.

Try the stubs in exercises/s11_chunked_prefill.py first; grade these with
`python exercises/grade.py --solutions s11`.

Sources followed: vLLM V1's `Scheduler.schedule` (a request's new tokens capped by
`long_prefill_token_threshold` and by the budget left; running requests first, while budget
is left; nothing kept back for the requests after one, as in S11's `ChunkedScheduler`); S03's
causal attention (a query at position p reads keys 0 .. p); for the step orders, Sarathi-Serve's
stall-free batching (decodes first, OSDI 2024) and SGLang's `Scheduler.get_next_batch_to_run`
(a new prefill batch runs before the decode batch), plugged into S11's real `ChunkedScheduler`
through its public `running` list and `schedule()`.
"""
from __future__ import annotations

from typing import Collection, Mapping, Sequence

import numpy as np

from s11_chunked_prefill import ChunkedScheduler


# Exercise 1: one step's chunks -----------------------------------------------------------------

def plan_step(running: Sequence[tuple[str, int]], waiting: Sequence[tuple[str, int]],
              token_budget: int, max_num_seqs: int,
              long_prefill_token_threshold: int = 0) -> list[tuple[str, int]]:
    if max_num_seqs < 1 or len(running) > max_num_seqs:
        raise ValueError("max_num_seqs must be >= 1 and hold every running request")
    if token_budget < max_num_seqs:
        raise ValueError("token_budget must be >= max_num_seqs: every running request decodes")
    if long_prefill_token_threshold < 0:
        raise ValueError("long_prefill_token_threshold must be >= 0 (0: no limit)")
    if any(left < 1 for _, left in (*running, *waiting)):
        raise ValueError("every request has at least one token left to compute")
    cap = long_prefill_token_threshold or token_budget
    budget, plan = token_budget, []
    for rid, left in running:
        if budget == 0:
            break                                   # never reached from a real step
        n = min(left, budget, cap)
        plan.append((rid, n))
        budget -= n
    for rid, left in waiting:
        if len(plan) >= max_num_seqs:
            break                                   # no seat
        n = min(left, budget, cap)
        if n == 0:
            break                                   # the budget is spent
        plan.append((rid, n))
        budget -= n
    return plan


# Exercise 2: the causal mask of a chunk ------------------------------------------------------

def chunk_mask(start: int, num_new: int) -> np.ndarray:
    if start < 0 or num_new < 1:
        raise ValueError("start must be >= 0 and num_new >= 1")
    keys = np.arange(start + num_new)[None, :]                     # (1, S)
    queries = np.arange(start, start + num_new)[:, None]           # (T, 1)
    return keys <= queries                                         # (T, S)


def chunk_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    n_heads, t_len, head_dim = q.shape
    n_kv, s_len, _ = k.shape
    if n_heads % n_kv or s_len != start + t_len:
        raise ValueError("H must be a multiple of Hkv and S == start + T")
    group = n_heads // n_kv
    qg = q.reshape(n_kv, group, t_len, head_dim)                    # (Hkv, H/Hkv, T, D)
    scores = qg @ k[:, None].transpose(0, 1, 3, 2) / np.sqrt(head_dim)   # (Hkv, H/Hkv, T, S)
    scores = np.where(chunk_mask(start, t_len), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ v[:, None]                                        # (Hkv, H/Hkv, T, D)
    return out.reshape(n_heads, t_len, head_dim).astype(np.float32)


# Exercise 3: who goes first in a step ---------------------------------------------------------

STEP_ORDERS = ("admission", "decode-first", "prefill-first")


def is_decoding(request) -> bool:
    """Sampled at least once and one token short of its end in the cache: a decode."""
    return bool(request.output_ids) and request.num_tokens - request.num_computed_tokens == 1


class OrderedScheduler(ChunkedScheduler):
    def __init__(self, config, kv, order: str = "admission"):
        if order not in STEP_ORDERS:
            raise ValueError(f"order must be one of {STEP_ORDERS} (got {order!r})")
        super().__init__(config, kv)
        self.order = order

    def schedule(self):
        # A stable sort keeps admission order inside each group; the stock schedule() then
        # walks `running` in this order and admits waiting requests after it.
        if self.order == "decode-first":
            self.running.sort(key=lambda r: not is_decoding(r))
        elif self.order == "prefill-first":
            self.running.sort(key=is_decoding)
        return super().schedule()


def latency_in_steps(sampled: Sequence[Collection[str]], arrivals: Mapping[str, int]
                     ) -> tuple[int, dict[str, int]]:
    last: dict[str, int] = {}
    ttft: dict[str, int] = {}
    worst = 0
    for step, ids in enumerate(sampled):
        for rid in ids:
            if rid not in arrivals or step < arrivals[rid]:
                raise ValueError(f"request {rid!r} sampled in step {step} before it arrived")
            if rid in last:
                worst = max(worst, step - last[rid])
            else:
                ttft[rid] = step - arrivals[rid] + 1
            last[rid] = step
    return worst, ttft
