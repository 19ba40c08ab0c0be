"""S16 exercises, reference solutions: the bucket a decode step is padded to and its padded
inputs, the placeholder books of async scheduling, and the overhead arithmetic of a step.

Try the stubs in exercises/s16_host.py first; grade these with
`python exercises/grade.py --solutions s16`.

Sources followed: nano-vllm's `ModelRunner.run_model` (the smallest captured batch size that
holds the batch, eager above the largest; padded rows' slot mapping and context) and vLLM's
persistent `InputBatch` and `cudagraph_capture_sizes` (padding a decode batch up to a captured
size); vLLM V1's `AsyncScheduler` (vllm/v1/core/sched/async_scheduler.py:
`num_output_placeholders`, num_computed_tokens advanced when a step is scheduled) and
`EngineCore.step_with_batch_queue`; the chapter's profiler fields and its worked example (ops
per step x the cost of one tiny op), and the simulator's timeline (eager, graph replay, the
host overlapped with the forward).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch


# Exercise 1: the bucket and the padded inputs ------------------------------------------------

def bucket_for(sizes: Sequence[int], num_rows: int) -> int | None:
    """The first size (ascending) that holds num_rows, else None."""
    return next((size for size in sizes if size >= num_rows), None)


def pad_to_bucket(rows: Sequence[tuple[int, int, Sequence[int]]], sizes: Sequence[int],
                  block_size: int, blocks_per_table: int) -> dict[str, torch.Tensor] | None:
    """Real rows first (slot: the block holding the position, times block_size, plus the
    offset inside it; context: the position + 1), then padding rows that write and read the
    null block only."""
    if not rows:
        raise ValueError("a decode step has at least one row")
    bucket = bucket_for(sizes, len(rows))
    if bucket is None:
        return None
    table_rows = []
    for token, position, table in rows:
        block = position // block_size
        if block >= len(table) or len(table) > blocks_per_table:
            raise ValueError(f"row at position {position}: its block table {tuple(table)} must "
                             f"cover block {block} and hold at most {blocks_per_table} blocks")
        slot = table[block] * block_size + position % block_size
        table_rows.append([token, position, slot, position + 1,
                           *table, *[0] * (blocks_per_table - len(table))])
    # null block: written at slot 0, read as one key, so its softmax is defined
    table_rows += [[0, 0, 0, 1] + [0] * blocks_per_table] * (bucket - len(rows))
    host = torch.tensor(table_rows, dtype=torch.int64)           # (bucket, 4 + M)
    return {"input_ids": host[:, 0].clone(), "positions": host[:, 1].clone(),
            "slot_mapping": host[:, 2].clone(), "context_lens": host[:, 3].clone(),
            "block_tables": host[:, 4:].clone()}


# Exercise 2: the placeholder books of async scheduling ---------------------------------------

def replay(events: Sequence[tuple]) -> list[dict[str, tuple[int, int, int]]]:
    """Per request: tokens that exist (prompt + outputs arrived), num_computed_tokens,
    placeholders, times preempted. Per planned step: the requests it gave a placeholder to,
    with their preemption count then (a preemption since means the row is dropped)."""
    books: dict[str, list[int]] = {}          # id -> [tokens, computed, placeholders, preempted]
    given: dict[int, list[tuple[str, int]]] = {}
    states = []
    for event in events:
        kind = event[0]
        if kind == "add":
            _, rid, num_prompt = event
            books[rid] = [num_prompt, 0, 0, 0]
        elif kind == "plan":
            _, step, scheduled, preempted = event
            for rid in preempted:
                books[rid][1] = 0
                books[rid][3] += 1
            given[step] = []
            for rid, n in scheduled.items():
                book = books[rid]
                book[1] += n                              # moved now, not after the step
                if book[1] == book[0] + book[2]:          # reaches the end: it samples
                    book[2] += 1
                    given[step].append((rid, book[3]))
        elif kind == "tokens":
            for rid, preemptions in given.pop(event[1], []):
                book = books.get(rid)
                if book is None:                          # finished or aborted meanwhile
                    continue
                book[2] -= 1
                if book[3] == preemptions:                # else: dropped, no token
                    book[0] += 1
        elif kind == "update":
            # the next plan already moved the counts past this step: nothing to record but
            # who left
            for rid in event[2]:
                books.pop(rid, None)
        elif kind == "abort":
            books.pop(event[1], None)
        else:
            raise ValueError(f"unknown event {event!r}")
        states.append({rid: (b[0] + b[2], b[1], b[2]) for rid, b in books.items()})
    return states


# Exercise 3: the overhead arithmetic ---------------------------------------------------------

def _check(model_ops: int, per_op_s: float) -> None:
    if model_ops < 1 or not per_op_s > 0:
        raise ValueError(f"need model_ops >= 1 and per_op_s > 0 (got {model_ops}, {per_op_s})")


def host_and_overhead(profile, model_ops: int, per_op_s: float
                      ) -> tuple[float, float, float, float]:
    """Host: the step less its forward. Overhead: ops x the cost of one tiny op, against the
    model call (preparation + forward)."""
    _check(model_ops, per_op_s)
    host_s = profile.step_s - profile.forward_s
    overhead_s = model_ops * per_op_s
    return (host_s, host_s / profile.step_s, overhead_s,
            overhead_s / (profile.prepare_s + profile.forward_s))


TECHNIQUES = ("graphs", "async", "graphs+async")


def predicted_step_s(profile, model_ops: int, per_op_s: float, technique: str) -> float:
    """graphs: the model call loses (model_ops - 1) ops' overhead; async: sampling, then the
    longer of the model call and the rest of the host's work."""
    if technique not in TECHNIQUES:
        raise ValueError(f"technique must be one of {TECHNIQUES} (got {technique!r})")
    _check(model_ops, per_op_s)
    model_s = profile.prepare_s + profile.forward_s
    rest_s = profile.step_s - model_s - profile.sample_s      # what the host can overlap
    if "graphs" in technique:
        replayed_s = max(per_op_s, model_s - (model_ops - 1) * per_op_s)
    else:
        replayed_s = model_s
    if "async" in technique:
        return profile.sample_s + max(replayed_s, rest_s)
    return profile.step_s - model_s + replayed_s


def compute_catches_up(profiles: Sequence) -> tuple[float, float, int | None]:
    """Median forward per decode batch size, the least-squares line through them (closed
    form), and the first B at which b x B >= a."""
    by_batch: dict[int, list[float]] = {}
    for p in profiles:
        if p.kind == "decode":
            by_batch.setdefault(p.num_seqs, []).append(p.forward_s)
    if len(by_batch) < 2:
        raise ValueError("need decode steps at two batch sizes at least")
    xs = list(by_batch)
    ys = [statistics.median(by_batch[x]) for x in xs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
         / sum((x - mx) ** 2 for x in xs))
    a = my - b * mx
    if b <= 0:
        return a, b, None
    return a, b, max(1, math.ceil(a / b))
