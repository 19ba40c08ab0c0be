"""Data for the S12 "Try it" block allocator: the KV pool, block by block, as requests grow,
finish and are preempted.

The page replays runs of S12's engine (`code/s12_engine.py`'s `LLMEngine`, over the block pool
of `code/s12_paged_attention.py`) on the bundled model, made here at build time on the CPU in
float32, greedy, end-of-sequence ignored so that every request makes its max_tokens:

- "tight": six corpus prompts arrive together; 4 seats, 32 tokens per step, blocks of 8
  tokens and a pool of 14 blocks (13 usable after the null block, 104 positions), too few for
  the four running requests, so the scheduler preempts the last admitted when a request needs
  a block and none is free; each finish gives its blocks back;
- "roomy": six prompts arriving over five steps, blocks of 16, 15 blocks (14 usable): nobody
  is preempted, and blocks freed by a finished request are handed to the next ones.

Per run: the settings; per request its prompt length, the step before which it was added, its
max_tokens, the tokens it made, its text and finish reason; and per step, from the engine's
trace (`StepRecord`): the scheduled requests in schedule order with the tokens each had
computed and computes now, each one's block table and slot mapping, the pool's changes in
order (`block_events`: "allocated" or "freed", request id, block ids), who was preempted,
joined, resumed and finished, the free blocks after the step, and the free queue itself after
the step, front first, read from the engine's pool (`scheduler.kv.pool.free_block_queue.block_ids()`).
For each preemption, its cause, seen as the scheduler decided it (`WatchedScheduler`): the
request that needed blocks, how many it held and needed, how many were free, and the victim
chosen (under FCFS the request admitted last, which may be the one that asked: then it preempts
itself, S10's rule).

The page recomputes the pool from the events' kinds, requests and block counts alone, with
the pool's rules (blocks are taken from the front of the free queue, a request's blocks go back
to its back last block first, block 0 is the null block and never handed out), and checks on
load, step by step, the block ids of every event, every block table, the count rule (a request
that has t tokens after the step's plan holds ceil(t / block_size) blocks), the slot mapping
(block_table[p // block_size] * block_size + p % block_size), the free count and the free queue
against the export (console error and a visible banner otherwise).
tests/test_s12_simulator_browser.py compares what it shows with these values;
tests/test_s12_simulator_data.py holds this data against independent oracles.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s08_static_batching as s08  # noqa: E402
import s12_engine as s12  # noqa: E402

MAX_CONTEXT = 256              # the bundled model's window
# (id, title, prompts (corpus indices), arrival step of each, max_tokens of each,
#  seats, tokens per step, block_size, num_blocks)
WORKLOADS = (
    ("tight", "A tight pool: 14 blocks of 8 for four seats (preemptions)",
     [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0], [24] * 6, 4, 32, 8, 14),
    ("roomy", "A roomier pool: 15 blocks of 16, requests arriving over five steps",
     [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4], [8, 40, 16, 32, 24, 48], 4, 32, 16, 15),
)


class WatchedScheduler(s12.PagedScheduler):
    """S12's scheduler, recording why each preemption happens through two of S10's seams:
    `num_new_tokens` (asked for the request about to allocate its blocks) and `_victim` (asked
    whom to preempt when that allocation fails: the request admitted last, which may be the
    one that asked). Nothing else changes. Each preemption appends to `causes` {"by": the
    request that needed blocks, "victim", "tokens": what it would hold, "held": its blocks,
    "needed": the blocks those tokens need, "free": free blocks}, read from the KV manager at
    the moment `_victim` is asked (a failed allocation takes nothing, so it is the state the
    allocation saw)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.causes: list[dict] = []
        self._asking: tuple[str, int] | None = None

    def num_new_tokens(self, request, budget: int) -> int:
        n = super().num_new_tokens(request, budget)
        self._asking = (request.request_id, n)
        return n

    def _victim(self):
        chosen = super()._victim()
        rid, n = self._asking
        tokens = self.kv.num_tokens(rid) + n
        self.causes.append({"by": rid, "victim": chosen.request_id, "tokens": tokens,
                            "held": len(self.kv.block_table(rid)),
                            "needed": s12.cdiv(tokens, self.kv.block_size),
                            "free": self.kv.num_free_blocks})
        return chosen


class WatchedEngine(s12.LLMEngine):
    """S12's engine over a `WatchedScheduler` (its `make_scheduler` seam)."""

    def make_scheduler(self, max_num_seqs, max_num_batched_tokens, kv_capacity, max_model_len,
                       policy) -> WatchedScheduler:
        return WatchedScheduler(max_num_seqs, max_num_batched_tokens,
                                self.runner.cache.num_blocks, self._block_size, max_model_len,
                                policy, self._threshold)


def run(model, tokenizer, prompts, arrivals, max_tokens, seats, budget, block_size,
        num_blocks) -> dict:
    """Add request i before step arrivals[i]; step until done; every output recorded."""
    engine = WatchedEngine(model, tokenizer, MAX_CONTEXT, seats, max_num_batched_tokens=budget,
                           block_size=block_size, num_blocks=num_blocks)
    causes = engine.scheduler.causes
    ids, made, texts, reasons, queues, preemptions = [], {}, {}, {}, [], []
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        step = len(engine.trace)                   # the StepRecord the next step() appends
        while len(ids) < len(prompts) and arrivals[len(ids)] <= step:
            i = len(ids)
            params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                        ignore_eos=True)
            rid = engine.add_request(prompts[i], params, request_id=str(i))
            ids.append(rid)
            made[rid], texts[rid] = [], []
        for out in engine.step():
            made[out.request_id] += out.new_token_ids
            texts[out.request_id].append(out.text_delta)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if len(engine.trace) != step + 1:
            raise RuntimeError(f"step {step}: expected one StepRecord per step() call")
        queues.append(engine.scheduler.kv.pool.free_block_queue.block_ids())
        preemptions.append(causes[:])
        causes.clear()
        if [c["victim"] for c in preemptions[-1]] != list(engine.trace[-1].preempted):
            raise RuntimeError(f"step {step}: the preemptions seen differ from the trace's")
    kv = engine.scheduler.kv
    if kv.num_free_blocks != kv.num_blocks - 1 or kv.block_tables():
        raise RuntimeError("every block must be free once every request has finished")
    steps = []
    for rec, queue, why in zip(engine.trace, queues, preemptions):
        at = {rid: k for k, rid in enumerate(rec.running)}
        steps.append({
            "step": rec.step,
            "scheduled": [[rid, rec.num_computed_tokens[at[rid]], rec.num_scheduled_tokens[at[rid]]]
                          for rid in rec.schedule_order],
            "block_tables": {rid: list(rec.block_tables[k]) for rid, k in at.items()},
            "slot_mapping": {rid: list(rec.slot_mapping[k]) for rid, k in at.items()},
            "events": [[kind, rid, list(blocks)] for kind, rid, blocks in rec.block_events],
            "preempted": list(rec.preempted), "preemptions": why, "joined": list(rec.joined),
            "resumed": list(rec.resumed),
            "left": list(rec.left), "free_blocks": rec.free_blocks, "free_queue": queue})
    requests = [{"id": rid, "prompt_len": len(tokenizer.encode(prompts[k])), "arrival": arrivals[k],
                 "max_tokens": max_tokens[k], "made": made[rid], "text": "".join(texts[rid]),
                 "finish_reason": reasons[rid]} for k, rid in enumerate(ids)]
    return {"block_size": block_size, "num_blocks": engine.num_blocks, "max_num_seqs": seats,
            "max_num_batched_tokens": budget, "num_preemptions": engine.scheduler.num_preemptions,
            "requests": requests, "steps": steps}


def export() -> dict:
    """The allocator view's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the block allocator replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    chats = s08.corpus_prompts(tokenizer, 6, 0, MAX_CONTEXT)
    data = {"source": "code/s12_engine.py (LLMEngine.step, trace) over code/s12_paged_attention.py "
                      "(BlockPool, KVCacheManager, PagedScheduler) on the bundled model, greedy, "
                      "float32 on the CPU",
            "max_context": MAX_CONTEXT, "null_block": s12.NULL_BLOCK_ID, "workloads": []}
    for key, title, order, arrivals, max_tokens, seats, budget, bs, nb in WORKLOADS:
        prompts = [chats[o] for o in order]
        item = run(model, tokenizer, prompts, arrivals, max_tokens, seats, budget, bs, nb)
        item.update(id=key, title=title)
        data["workloads"].append(item)
    return data


if __name__ == "__main__":  # print the size of what the page downloads, and what happened
    import json
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for w in d["workloads"]:
        print(w["id"], len(w["steps"]), "steps,", w["num_preemptions"], "preemptions,",
              [(r["prompt_len"], len(r["made"])) for r in w["requests"]])
