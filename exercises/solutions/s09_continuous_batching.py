"""S09 exercises, reference solutions: admission, a ragged batch's metadata, slot reuse.

Try the stubs in exercises/s09_continuous_batching.py first; grade these with
`python exercises/grade.py --solutions s09`.

Sources followed: Orca's iteration-level scheduling (Yu et al., OSDI 2022); the flattened
batch metadata of vLLM (`query_start_loc`, `seq_lens`) and flash-attention's varlen interface
(`cu_seqlens_q`); the chapter's FIFO admission into the lowest free slot.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence


# Exercise 1: admission ------------------------------------------------------------------------

def admit(waiting: Sequence[str], free_slots: Sequence[int]) -> list[tuple[str, int]]:
    slots = list(free_slots)
    if any(s < 0 for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"free slots must be distinct and >= 0 (got {slots})")
    return list(zip(waiting, sorted(slots)))     # zip stops at the shorter of the two


# Exercise 2: flatten a ragged batch -----------------------------------------------------------

def flatten(new_tokens: Sequence[Sequence[int]], num_cached: Sequence[int]) -> dict:
    if not new_tokens or len(new_tokens) != len(num_cached):
        raise ValueError("need one num_cached per request, and at least one request")
    if any(len(t) == 0 for t in new_tokens) or any(c < 0 for c in num_cached):
        raise ValueError("every request needs a new token, and num_cached must be >= 0")
    lens = [len(t) for t in new_tokens]
    starts = [0, *accumulate(lens)]
    return {"input_ids": [int(t) for tokens in new_tokens for t in tokens],
            "positions": [c + i for c, n in zip(num_cached, lens) for i in range(n)],
            "query_start_loc": starts,
            "context_lens": [c + n for c, n in zip(num_cached, lens)],
            "sample_rows": [end - 1 for end in starts[1:]]}


# Exercise 3: slots that come back -------------------------------------------------------------

def simulate(output_lens: Sequence[int], max_num_seqs: int,
             aborts: dict[int, int] | None = None) -> list[list[tuple[int, int]]]:
    if max_num_seqs < 1 or any(n < 1 for n in output_lens):
        raise ValueError("max_num_seqs and every output length must be >= 1")
    aborts = aborts or {}
    waiting = list(range(len(output_lens)))
    free = list(range(max_num_seqs))
    running: list[int] = []
    slot_of, made, steps = {}, [0] * len(output_lens), []
    while waiting or running:
        k = len(steps)
        for i, when in aborts.items():          # aborted just before step k
            if when == k and i in waiting:
                waiting.remove(i)
            elif when == k and i in running:
                running.remove(i)
                free.append(slot_of[i])
        if not (waiting or running):
            break
        for i, slot in admit([str(i) for i in waiting], free):
            waiting.remove(int(i))
            free.remove(slot)
            slot_of[int(i)] = slot
            running.append(int(i))
        steps.append(sorted(((i, slot_of[i]) for i in running), key=lambda pair: pair[1]))
        for i in list(running):
            made[i] += 1
            if made[i] == output_lens[i]:
                running.remove(i)
                free.append(slot_of[i])
    return steps
