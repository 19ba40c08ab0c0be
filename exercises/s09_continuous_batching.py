"""S09 exercises: one step ahead, flattening a ragged batch, slots that come back.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s09

The chapter's code is in code/s09_continuous_batching.py (`LLMEngine`, `build_engine`,
`StepResult`), code/s09_scheduler.py (`FIFOScheduler.schedule`, `SlotKVManager`,
`SchedulerOutput`) and code/s09_ragged.py (`RaggedBatch`, `RaggedRunner`). Exercise 1 asks for
a loop the chapter does not have; exercises 2 and 3 for your own versions of its metadata and
its schedule. The graded tests compare you with S09's synchronous engine on the same requests,
with the order in which your loop plans, launches and reports steps, with values worked by
hand, with loops and closed forms written in the tests, with the tokens S06's engine makes for
each prompt alone, and with the trace of S09's tested engine on real requests. Reference
solutions are in exercises/solutions/ -- try first, peek later.

Shape legend: N tokens of a ragged batch (the sum of each request's new tokens), B requests.
"""
from __future__ import annotations

from typing import Sequence


# Exercise 1: one step ahead (3 points) --------------------------------------------------------
# `LLMEngine.step` is synchronous: plan, run, sample, update, and only then plan again, so the
# CPU work of planning waits for the model. vLLM's async scheduling (on by default since v0.14)
# plans step N + 1 while step N runs: a request's num_computed_tokens moves when it is
# scheduled, and the token step N will sample is a placeholder that step N + 1 computes.
# Write that loop over the parts of an S09 engine.

def generate_ahead(engine, prompts: Sequence, params: Sequence, launch=None) -> list[list]:
    """Serve every prompt with the next step planned while the current one runs; returns each
    prompt's outputs (Part I's `RequestOutput`s, one per token, the last one finished), in
    prompt order.

    engine: an S09 engine from `build_engine` with nothing queued. Use its parts, not its
    `step`: `engine.make_request(prompt, params, request_id=str(i))` (the checks; a `Request`),
    `engine.scheduler.kv` (the `SlotKVManager`: `allocate_slots`, `free`, `block_table`) and
    `engine.scheduler.max_num_seqs` (FIFO admission as `FIFOScheduler`'s, into the lowest free
    slot), `engine.processor` (`sample_batch(logits, seqs, active)`, `postprocess(seq, token)`:
    Part I's text and stop rules). prompts, params: one `SamplingParams` per prompt (every
    prompt leaves room for at least one token).

    launch(plan, requests) -> handle starts the model on a `SchedulerOutput` (requests: your
    requests by id, whose token_ids the runner reads when the step is launched);
    handle.result() is the step's `ModelRunnerOutput`. Default (None): the runner's
    `execute_model` on one worker thread (concurrent.futures).

    The loop:
      - plan step N + 1 right after launching step N, before step N's tokens are known: each
        running request computes one position (the one its pending token fills), a new request
        its prompt; a request's num_computed_tokens moves when it is planned (vLLM's
        `_update_after_schedule`), and the pending token stands in as a placeholder;
      - then take step N's result: sample, postprocess, and a request that finished frees its
        slot (`kv.free`) at once; then launch step N + 1, less the rows of requests that have
        finished since it was planned: a finished request takes no extra token;
      - when nothing is left to launch but requests still wait or run, plan again.
    Tell `engine.observers` as `LLMEngine.step` does: `on_plan(engine, plan)` when a plan is
    made, `on_step(engine, StepResult(plan, run, outputs, step_s))` once a step's outputs are
    made. Every plan's block tables come from `kv.block_table`.
    Greedy tokens, texts and finish reasons must equal S09's synchronous engine's
    (`LLM(build_engine(...)).generate(prompts, params)`), and every slot is free at the end.

    The public pieces you need (import s01_generation_loop as s01, s09_continuous_batching as
    s09, and `RequestStatus`, `SchedulerOutput` from s09_scheduler):
      engine.make_request(prompt, params, request_id=str(i)) -> Request   (not queued)
        Request: .request_id, .seq (Part I's Sequence), .status (RequestStatus.WAITING /
        RUNNING / FINISHED), .num_computed_tokens (you move it), .num_tokens (prompt +
        outputs), .token_ids, .finished. A prompt that fills the context is finished when made:
        its one output is s01.RequestOutput(rid, [], "", True, r.seq.finish_reason,
        r.seq.stop_reason), and it never runs.
      kv = engine.scheduler.kv:  kv.allocate_slots(request, num_new_tokens) -> bool (False
        and nothing taken when no slot is free); kv.free(request); kv.block_table(request_id)
        -> tuple of slot ids.   engine.scheduler.max_num_seqs: the most requests running.
      SchedulerOutput(step, num_scheduled_tokens, num_computed_tokens, block_tables,
        scheduled_new_ids=(...), scheduled_running_ids=(...)): the three dicts keyed by
        request id in schedule order; num_computed_tokens[rid] is where its new tokens start
        (its value before this plan moved it); step counts the plans that schedule something.
      engine.runner.execute_model(plan, requests) -> ModelRunnerOutput (.req_ids, the rows
        that sample, in batch order; .logits (B, V)); requests: {request id: Request}.
      engine.processor.sample_batch(run.logits, seqs, [True] * len(seqs)) -> (tokens, _),
        seqs the Sequences of run.req_ids in that order; engine.processor.postprocess(seq,
        token) -> RequestOutput (.finished set on the last one).
      s09.StepResult(plan, run, outputs, step_s); observers: on_plan(engine, plan),
        on_step(engine, result).
    The order of calls: make every request (queue the unfinished ones); plan step 0 (tell
    on_plan); then, while the plan schedules something: launch it -> plan the next step (tell
    on_plan) -> handle.result() -> sample_batch, postprocess each row, set FINISHED and
    kv.free the finished -> on_step(StepResult) -> drop the finished rows from the next plan
    (plan again if it is empty and requests still wait or run).
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: flatten a ragged batch (4 points) ------------------------------------------------
# A step's batch has no padding: every running request's new tokens are laid end to end. A
# request that just joined brings its whole prompt; one that is decoding brings one token.

def flatten(new_tokens: Sequence[Sequence[int]], num_cached: Sequence[int]) -> dict:
    """The metadata of one ragged batch, as plain Python lists of ints.

    new_tokens[b]: request b's token ids to compute in this step (at least one each).
    num_cached[b]: how many of its positions are already in its KV slot (0 for a new request).
    Returns a dict with:
      "input_ids"       (N,) every request's new tokens, request 0's first;
      "positions"       (N,) the position of each token in its own request (num_cached[b],
                        num_cached[b] + 1, ...);
      "query_start_loc" (B + 1,) where each request's tokens start, and N at the end
                        (cu_seqlens_q in flash-attention's name);
      "context_lens"    (B,) each request's positions after this step (cached + new);
      "sample_rows"     (B,) the row of each request's last new token, whose logits are sampled.
    Example: new_tokens [[5, 6, 7], [9], [4, 2]], num_cached [0, 10, 3] ->
      input_ids [5, 6, 7, 9, 4, 2], positions [0, 1, 2, 10, 3, 4], query_start_loc [0, 3, 4, 6],
      context_lens [3, 11, 5], sample_rows [2, 3, 5].
    Raises ValueError for no request, a request with no token, a negative num_cached, or lists
    of different lengths.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: slots that come back (3 points) --------------------------------------------------
# Simulate the engine's schedule without a model: who runs in which slot at every step.

def simulate(output_lens: Sequence[int], max_num_seqs: int,
             aborts: dict[int, int] | None = None) -> list[list[tuple[int, int]]]:
    """The running (request, slot) pairs of every step of continuous batching.

    Requests 0, 1, ... are all waiting before step 0, in that order; request i makes
    output_lens[i] >= 1 tokens, one per step it runs, starting with the step it joins. Before
    each step, while a slot is free, the oldest waiting request takes the lowest free slot
    (the chapter's FIFO admission). A request
    that makes its last token in step k leaves at the end of step k: its slot is free before
    step k + 1. aborts {i: k}: request i is aborted just before step k (after step k - 1, before
    step k's admission): it leaves, or stops waiting, and its slot is free for step k. An abort
    of a request already finished does nothing.
    Returns one list per step, in order, of (request, slot) for the requests running in it,
    sorted by slot (the runner lays a step's batch out in slot order, so that the running
    requests' KV slots are one contiguous range whenever they can be). Steps continue while anyone waits or runs.
    Example: simulate([2, 1, 1], 2) -> [[(0, 0), (1, 1)], [(0, 0), (2, 1)]].
    Raises ValueError for max_num_seqs < 1 or an output length < 1.
    """
    raise NotImplementedError("exercise 3")
