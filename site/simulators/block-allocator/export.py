"""Data for the S12 "Try it" block allocator: the KV pool, block by block, as requests grow,
finish and are preempted.

The page replays runs of S12's engine (`code/s12_engine.py`'s `build_engine`: S09's `LLMEngine`
with S11's scheduler over the block manager of `code/s12_paged_attention.py`, its pool's changes
kept: enable_kv_cache_events) on the bundled model, made here at build time on the CPU in
float32, greedy, end-of-sequence ignored so that every request makes its max_tokens:

- "tight": six corpus prompts arrive together; 4 seats, 32 tokens per step, blocks of 8
  tokens and a pool of 14 blocks (13 usable after the null block, 104 positions), too few for
  the four running requests, so the scheduler preempts the last admitted when a request needs
  a block and none is free; each finish gives its blocks back;
- "roomy": six prompts arriving over five steps, blocks of 16, 15 blocks (14 usable): nobody
  is preempted, and blocks freed by a finished request are handed to the next ones.

Per run: the settings; per request its prompt length, the step before which it was added, its
max_tokens, the tokens it made, its text and finish reason; and per step, from the engine's
trace (S09's `StepRecord` and S12's `BlockRecord` of the step, from `StepTracer` and
`BlockTracer`): the scheduled requests in schedule order with the tokens each had computed and
computes now, each one's block table and slot mapping, the pool's changes in order
(`block_events`: "allocated" or "freed", request id, block ids), who was preempted, joined,
resumed and finished, the free blocks after the step, and the free queue itself after the
step, front first, read from the engine's pool (`scheduler.kv.pool.free_block_queue.block_ids()`).
For each preemption, its cause (`preemption_causes`, worked out from those records alone): the
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
import s08_cli  # noqa: E402
import s09_trace  # noqa: E402
import s12_engine as s12  # noqa: E402
import s12_paged_attention as s12_pool  # noqa: E402

MAX_CONTEXT = 256              # the bundled model's window
# (id, title, prompts (corpus indices), arrival step of each, max_tokens of each,
#  seats, tokens per step, block_size, num_blocks)
WORKLOADS = (
    ("tight", "A tight pool: 13 usable blocks of 8 for four seats (preemptions)",
     [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0], [24] * 6, 4, 32, 8, 14),
    ("roomy", "A roomier pool: 14 usable blocks of 16, requests arriving over five steps",
     [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4], [8, 40, 16, 32, 24, 48], 4, 32, 16, 15),
)


def preemption_causes(rec, blocks, state: dict, block_size: int, budget: int,
                      threshold: int) -> list[dict]:
    """Why each preemption of a step happened, from the step's records (S09's `StepRecord` rec,
    S12's `BlockRecord` blocks) and `state`, what the records before it left (updated here for
    the next step): "free", the free blocks before the step; per running request, "tokens"
    (KV tokens held), "blocks" (block table) and "length" (its token ids).

    S10's running loop goes through the running requests in admission order; a request whose
    allocation fails preempts the last admitted until its blocks fit, or until it is itself
    the last admitted (then it waits, and nobody after it is left to schedule). So in the
    step's pool changes, each run of "freed" by preempted requests ends with the "allocated"
    of the request that asked, or, at the end of the plan, with the asker's own "freed". Per
    preemption: {"by": the asker, "victim", "tokens": what the asker would hold, "held": its
    blocks, "needed": the blocks those tokens need, "free": free blocks before the victim's
    went back}. The asker's new tokens are its scheduled ones, or, when it preempted itself,
    S11's rule: min(what it has not computed, the budget the step left, the threshold)."""
    scheduled = dict(zip(rec.running, rec.num_scheduled_tokens))
    left = budget - rec.num_tokens
    free, causes, pending = state["free"], [], []

    def settle(by: str) -> None:
        held, n = state["tokens"][by], scheduled.get(by)
        if n is None:                                # it preempted itself: never scheduled
            n = min(state["length"][by] - held, left, threshold or left)
        tokens = held + n
        causes.extend({"by": by, "victim": victim, "tokens": tokens,
                       "held": len(state["blocks"][by]),
                       "needed": s12_pool.cdiv(tokens, block_size), "free": f}
                      for victim, f in pending)
        pending.clear()

    for kind, rid, ids in blocks.block_events:
        if kind == "allocated" and pending:
            settle(rid)
        elif kind == "freed" and rid in rec.preempted:
            pending.append((rid, free))
        free += len(ids) if kind == "freed" else -len(ids)
    if pending:
        settle(pending[-1][0])
    # what this step leaves for the next one
    for k, rid in enumerate(rec.running):
        state["tokens"][rid] = rec.num_computed_tokens[k] + rec.num_scheduled_tokens[k]
        state["blocks"][rid] = rec.block_tables[k]
        state["length"][rid] = rec.request_num_tokens[k] + (rid in rec.sampled)
    for rid in rec.preempted + rec.left:
        for part in ("tokens", "blocks", "length"):
            state[part].pop(rid, None)
    state["free"] = blocks.free_blocks
    return causes


def run(model, tokenizer, prompts, arrivals, max_tokens, seats, budget, block_size,
        num_blocks) -> dict:
    """Add request i before step arrivals[i]; step until done; every output recorded."""
    engine = s12.build_engine(model, tokenizer, max_context=MAX_CONTEXT, max_num_seqs=seats,
                              max_num_batched_tokens=budget, block_size=block_size,
                              num_blocks=num_blocks, enable_kv_cache_events=True)
    tracer, block_tracer = s09_trace.trace(engine), s12.trace_blocks(engine)
    kv = engine.scheduler.kv
    ids, made, texts, reasons, queues = [], {}, {}, {}, []
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        step = len(tracer.records)                 # the StepRecord the next step() appends
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
        if len(tracer.records) != step + 1 or len(block_tracer.records) != step + 1:
            raise RuntimeError(f"step {step}: expected one record of each per step() call")
        queues.append(kv.pool.free_block_queue.block_ids())
    if kv.num_free_blocks != kv.num_blocks - 1 or kv.block_tables():
        raise RuntimeError("every block must be free once every request has finished")
    state = {"free": kv.num_blocks - 1, "tokens": {}, "blocks": {}, "length": {}}
    threshold = engine.scheduler.config.long_prefill_token_threshold
    steps = []
    for rec, blocks, queue in zip(tracer.records, block_tracer.records, queues, strict=True):
        at = {rid: k for k, rid in enumerate(rec.running)}
        steps.append({
            "step": rec.step,
            "scheduled": [[rid, rec.num_computed_tokens[k], rec.num_scheduled_tokens[k]]
                          for rid, k in at.items()],
            "block_tables": {rid: list(rec.block_tables[k]) for rid, k in at.items()},
            "slot_mapping": {rid: list(blocks.slot_mapping[k]) for rid, k in at.items()},
            "events": [[kind, rid, list(b)] for kind, rid, b in blocks.block_events],
            "preempted": list(rec.preempted),
            "preemptions": preemption_causes(rec, blocks, state, kv.block_size,
                                             engine.scheduler.max_num_batched_tokens,
                                             threshold),
            "joined": list(rec.joined), "resumed": list(rec.resumed), "left": list(rec.left),
            "free_blocks": blocks.free_blocks, "free_queue": queue})
    requests = [{"id": rid, "prompt_len": len(tokenizer.encode(prompts[k])),
                 "arrival": arrivals[k], "max_tokens": max_tokens[k], "made": made[rid],
                 "text": "".join(texts[rid]), "finish_reason": reasons[rid]}
                for k, rid in enumerate(ids)]
    return {"block_size": block_size, "num_blocks": kv.num_blocks, "max_num_seqs": seats,
            "max_num_batched_tokens": budget,
            "num_preemptions": engine.scheduler.num_preemptions,
            "requests": requests, "steps": steps}


def export() -> dict:
    """The allocator view's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the block allocator replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    chats = s08_cli.corpus_prompts(tokenizer, 6, 0, MAX_CONTEXT)
    data = {"source": "code/s12_engine.py (build_engine: S09's LLMEngine, S11's scheduler over "
                      "code/s12_paged_attention.py's KVCacheManager and BlockPool; BlockTracer) "
                      "and code/s09_trace.py (StepTracer) on the bundled model, greedy, float32 "
                      "on the CPU",
            "max_context": MAX_CONTEXT, "null_block": s12_pool.NULL_BLOCK_ID, "workloads": []}
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
