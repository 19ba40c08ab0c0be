"""S16 exercises: the bucket a decode step is padded to and its padded inputs, the placeholder
books of async scheduling, and the overhead arithmetic of a step.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s16

The chapter's code is code/s16_static.py (`bucket_sizes`, `pick_bucket`, `StaticDecodeRunner`
and its persistent buffers, `decode_step`), code/s16_async.py (`AsyncScheduler`,
`AsyncLLMEngine`: num_computed_tokens moved when a step is planned, `num_output_placeholders`)
and code/s16_profile.py (`StepProfile`, `per_op_overhead_s`, `overhead_estimate`); the slot
mapping and the null block are S12's (code/s12_paged_attention.py, code/s12_engine.py). The
graded tests hold your answers against the chapter's static runner (the buffers it wrote for
real decode steps of the bundled model), against the decode step itself run on your buffers
(padded rows must change nothing real), against the real `AsyncScheduler` around S11's
model-free scheduler driven through the async loop event by event, and against the chapter's
profiler measuring the bundled model live. Reference solutions are in exercises/solutions/ --
try first, peek later.

Vocabulary (the chapter's): a decode step computes one token per request; B is the number of
requests in it; a bucket is one of a few fixed batch sizes a step is padded up to, so that a
compiled graph or a captured CUDA graph of that size can run it; the null block is block 0 of
the KV pool, never handed to a request. The host is everything a step does outside the model's
forward; the per-op overhead is the wall time of one tiny torch op.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


# Exercise 1: the bucket and the padded inputs (3 points) -------------------------------------
# A compiled graph or a CUDA graph runs one shape; the static runner keeps a few (the buckets)
# and pads a step up to the smallest that holds it. Padding rows are computed like real ones,
# so they must be given inputs that write nothing a request owns and read nothing undefined.

def bucket_for(sizes: Sequence[int], num_rows: int) -> int | None:
    """The bucket a decode step of num_rows requests is padded to: the smallest of sizes that
    holds num_rows rows, or None when none does (the step then runs eagerly, unpadded).

    sizes: the buckets, ascending without repeats (e.g. nano-vllm's 1, 2, 4, 8, 16, 32, ...).
    num_rows: >= 1. Example: sizes [1, 2, 4, 8]: 3 rows -> 4, 8 rows -> 8, 9 rows -> None.
    The tests compare you with the chapter's rule on random lists and with the bucket the
    chapter's runner used for each step of a real run.
    """
    raise NotImplementedError("exercise 1a")


def pad_to_bucket(rows: Sequence[tuple[int, int, Sequence[int]]], sizes: Sequence[int],
                  block_size: int, blocks_per_table: int) -> dict[str, torch.Tensor] | None:
    """The static runner's inputs for one decode step, padded to its bucket (`bucket_for`), or
    None when no bucket holds the rows.

    rows: one (token_id, position, block_table) per request, in batch order: the token the
    request computes now, its position (its num_computed_tokens: the tokens before it have
    KV), and its block ids (S12's block table: block j holds positions j x block_size to
    (j + 1) x block_size - 1; it covers `position`). block_size: tokens per KV block.
    blocks_per_table: M, the width every block table is padded to.

    Returns a dict of int64 CPU tensors, `bucket` rows each:
    - "input_ids" (bucket,): the token each row computes;
    - "positions" (bucket,): its position;
    - "slot_mapping" (bucket,): the KV slot its key and value are written to (S12's slot
      mapping: a slot is block id x block_size + the offset inside the block);
    - "context_lens" (bucket,): how many keys it attends to, its own included;
    - "block_tables" (bucket, M): its block ids, then 0 (the null block) up to M.
    Padding rows (bucket - len(rows) of them, after the real ones) are computed too, so they
    get inputs that touch nothing a request owns: token 0 at position 0, written to slot 0
    (the null block's first slot), a table of null blocks, and a context of 1 key (its own,
    in the null block; why not 0?).
    Example: blocks of 4, M = 3, sizes [1, 2, 4]; rows [(11, 5, (7, 2)), (12, 0, (3,)),
    (13, 8, (4, 6, 9))]: bucket 4; input_ids [11, 12, 13, 0], positions [5, 0, 8, 0],
    slot_mapping [9, 12, 36, 0], context_lens [6, 1, 9, 1], block_tables [[7, 2, 0],
    [3, 0, 0], [4, 6, 9], [0, 0, 0]].
    Raises ValueError for no rows, or a table that does not cover its row's position or is
    longer than blocks_per_table.
    The tests compare you with what the chapter's `StaticDecodeRunner` wrote into its
    persistent buffers for each decode step of a real run (S13's engine, the bundled model),
    and run the chapter's `decode_step` on your buffers: the real rows' logits must be those
    of the same rows unpadded, and the padded rows may write nowhere but the null block.
    """
    raise NotImplementedError("exercise 1b")


# Exercise 2: the placeholder books of async scheduling (4 points) ----------------------------
# With async scheduling the engine plans step N + 1 while step N runs (the chapter's
# `AsyncLLMEngine`). A request decoding in step N is planned into step N + 1 for the token
# step N has not sampled yet: its num_computed_tokens moves when a step is planned, and the
# token its step will sample is counted as an output placeholder until it comes. Keep the
# books yourself, from the events the loop goes through.

def replay(events: Sequence[tuple]) -> list[dict[str, tuple[int, int, int]]]:
    """The books of an async engine loop after each event: for each event, in order, a dict
    {request id: (num_tokens, num_computed_tokens, num_output_placeholders)} over the requests
    that were added and have not left (finished or aborted), as the scheduler's `Request`s
    hold them right after that event. num_tokens counts the prompt, the output tokens that
    arrived and the placeholders (the chapter's `Request.num_tokens`).

    The events, as the loop meets them (`AsyncLLMEngine.step`):
    - ("add", request_id, num_prompt_tokens): a request joins (nothing computed).
    - ("plan", step, {request id: n}, preempted_ids): the scheduler planned step `step`. Each
      request in the dict (in schedule order) computes its next n tokens in that step, from
      its num_computed_tokens on; preempted_ids were preempted while planning it (they lost
      all their KV: a preempted request starts again from nothing computed). Planning a step
      moves each scheduled request's num_computed_tokens past its n tokens at once, and a
      request whose n tokens reach the end of its tokens (placeholders counted) will sample a
      token in that step: it gets a placeholder for it. (A plan that schedules nothing does
      not use up a step number: the next plan may carry the same one.)
    - ("tokens", step): step `step`'s forward is done and its tokens are sampled. Every
      request that step gave a placeholder to and that is still there gets its token (its
      placeholder becomes a real output token), unless it was preempted after that step was
      planned: its row is dropped unsampled and it loses the placeholder with no token.
    - ("update", step, finished_ids): the scheduler records step `step` (its
      `update_from_output`); finished_ids, ended by the stop rules on the tokens that step
      sampled, leave. Another step has been planned since: think about whose counts are
      already past this step's.
    - ("abort", request_id): the request leaves now.
    Example: ("add", "a", 3), ("plan", 0, {"a": 3}, ()), ("plan", 1, {"a": 1}, ()),
    ("tokens", 0), ("update", 0, ()): a's books are (3, 0, 0), (4, 3, 1), (5, 4, 2),
    (5, 4, 1), (5, 4, 1).
    The tests drive the chapter's `AsyncScheduler` around S11's model-free scheduler through
    the async loop (chunked prompts, requests that finish one step late, aborts, preemption
    while a step is in flight), record its events, and compare your books with its
    requests' after every event.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: the overhead arithmetic (3 points) ----------------------------------------------
# A small model's decode step is a few hundred tiny ops with Python between them. The
# chapter's profiler splits a step into phases (`StepProfile`: schedule_s, prepare_s (the
# batch preparation inside the model call), forward_s (the model call less the
# preparation), sample_s, postprocess_s, update_s, other_s; step_s the whole step) and counts
# the ops of the model call (model_ops, from a counting run: counting slows a step, so times
# come from another run). Do the arithmetic the chapter's worked example does, then predict
# what its techniques would leave.

def host_and_overhead(profile, model_ops: int, per_op_s: float
                      ) -> tuple[float, float, float, float]:
    """(host_s, host_fraction, overhead_s, overhead_fraction) of one step.

    profile: a `StepProfile` (any object with its fields). model_ops: the ops the model call
    of such a step dispatches. per_op_s: the wall seconds of one tiny op
    (`per_op_overhead_s`). host_s: seconds of the step the host spends outside the forward
    (the batch preparation is host work); host_fraction: its share of the step. overhead_s:
    the chapter's worked estimate of the model call, as if every op cost one tiny op's time;
    overhead_fraction: that estimate over the model call's measured seconds. Raises
    ValueError for model_ops < 1 or per_op_s <= 0.
    The tests compare you with the chapter's `StepProfile` and `overhead_estimate` on steps
    the profiler measured live.
    """
    raise NotImplementedError("exercise 3a")


def predicted_step_s(profile, model_ops: int, per_op_s: float, technique: str) -> float:
    """The step's seconds predicted from its profile once a technique of the chapter is on.

    technique:
    - "graphs": the model call is replayed from a CUDA graph: its model_ops ops cost the
      overhead of one (per_op_s) instead of model_ops x per_op_s; what else the model call
      took (the arithmetic) stays. (Never below per_op_s: a replay is at least one launch.
      The preparation's few ops are counted among model_ops, so this is the most a graph can
      save.) The host's phases are unchanged.
    - "async": the next step is planned while this one's model call runs: the host's work
      other than sampling (schedule, postprocess, update and the rest) overlaps the model
      call (preparation and forward, on the worker); sampling cannot overlap (it needs the
      logits, and the next model call needs its tokens). A step then takes sampling plus the
      longer of the two.
    - "graphs+async": both.
    Example: step 10 ms: schedule 1, prepare 1, forward 5, sample 1, postprocess 1, update
    0.5, other 0.5; model_ops 401, per_op_s 0.01 ms. The model call is 6 ms, of which
    400 x 0.01 = 4 ms would go: "graphs" 6 ms, "async" 1 + max(6, 3) = 7 ms, "graphs+async"
    1 + max(2, 3) = 4 ms. Raises ValueError for another technique, model_ops < 1 or
    per_op_s <= 0.
    The tests compare you with this arithmetic applied to steps the profiler measured live.
    """
    raise NotImplementedError("exercise 3b")


def compute_catches_up(profiles: Sequence) -> tuple[float, float, int | None]:
    """(a, b, batch): the decode forward as a line a + b x B in the batch size, and the
    smallest batch at which its per-row part reaches its fixed part.

    profiles: `StepProfile`s of any kind; only decode steps count. For each batch size B
    among them take the median forward_s of its decode steps (one point per B); fit
    forward_s = a + b x B to those points by least squares (a: seconds, the part every step
    pays whatever B, mostly the ops' overhead on a small model; b: seconds per row). batch:
    the smallest integer B >= 1 with b x B >= a (from there the forward is at least half
    arithmetic), or None when b <= 0 (the fit sees no per-row cost). Raises ValueError with
    fewer than two distinct decode batch sizes.
    Example: medians 1.06 ms at B = 1, 1.12 at B = 2, 1.24 at B = 4: a = 1 ms, b = 0.06 ms,
    batch 17 (16 x 0.06 < 1 <= 17 x 0.06).
    The tests compare you with a least-squares fit (numpy's) through the medians the
    chapter's `summarize` gives for steps the profiler measured live, and with profiles
    made by hand.
    """
    raise NotImplementedError("exercise 3c")
