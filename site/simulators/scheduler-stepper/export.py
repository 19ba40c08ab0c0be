"""Data for the S10 "Try it" stepper: the scheduler's queues, budgets and preemptions, step by step.

The page replays runs of S10's engine (`code/s10_scheduler.py`'s `build_engine`: S09's
`LLMEngine` with S10's `Scheduler` over a `TokenKVPool`) on the bundled model, made here at
build time on the CPU in float32, greedy. The KV capacity is tiny on purpose, so that requests
run out of KV while they decode and the scheduler preempts:

- WORKLOADS: S10's script's default (8 corpus prompts, one added before each step, 4 seats, KV
  for 96 tokens, FCFS); the same requests under the priority policy, the later four more
  urgent (priority 0 against 1); and all 8 at once in a 64-token context (`max_context`, the
  positions of one KV slot) with a 64-token budget per step, where the token budget, not the
  seats, decides how many prompts join a step;
- per workload, the command line of code/s10_scheduler.py that makes the same run
  (`command`, shown on the page; tests/test_s10_simulator_data.py runs each one);
- per request: prompt length, priority, the step before which it was added, its generated ids
  with the text piece of each and the step that returned it, its text, finish reason and how
  many times it was preempted;
- the trace: one `StepRecord` per step from S09's `StepTracer` (scheduled ids in schedule
  order with their tokens and slots, joined, resumed, preempted, ended by the capacity, left,
  tokens in all, prompt tokens of them, waiting, the token budget, KV used and free, the
  capacity; timings left out).

The page recomputes every step from the request lengths, arrivals and priorities alone with
the scheduler's rules (the scheduler model in site/static/course.js, `CourseSim.Scheduler`:
running first in admission order, preempting the last admitted or the lowest priority when KV
runs out; then waiting requests in policy order while seats, tokens and KV allow, if nobody
was preempted) and checks them against the exported trace on load
(console error and a visible banner otherwise). tests/test_s10_simulator_browser.py compares
what it shows with these values; tests/test_s10_simulator_data.py holds this data against
independent oracles (S06's engine alone, the scheduler's rules checked step by step).
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
import s10_scheduler as s10  # noqa: E402

# (id, title, prompts, corpus seed, max_context, max_num_seqs, max_num_batched_tokens or None,
#  kv_capacity, policy, priorities or None, steps between arrivals, max_tokens)
WORKLOADS = (
    ("fcfs", "FCFS: 8 requests, one per step, 4 seats, KV for 96 tokens", 8, 0, 256, 4, None,
     96, "fcfs", None, 1, 40),
    ("priority", "Priority: the same requests, the last four more urgent (0 against 1)", 8, 0,
     256, 4, None, 96, "priority", [1, 1, 1, 1, 0, 0, 0, 0], 1, 40),
    ("budget", "Token budget: 8 requests at once, 64-token context, 64 tokens per step, KV for "
     "128 tokens", 8, 4,
     64, 4, 64, 128, "fcfs", None, 0, 24),
)
CLI = "python code/s10_scheduler.py"
TRACE_FIELDS = ("step", "running", "num_scheduled_tokens", "slots", "joined", "resumed",
                "preempted", "ended", "left", "num_tokens", "prefill_tokens", "waiting",
                "token_budget", "kv_used_tokens", "kv_free_tokens", "kv_capacity")


def command(num: int, seed: int, max_context: int, window: int, max_num_seqs: int,
            max_num_batched_tokens, kv_capacity: int, policy: str, priorities, every: int,
            max_tokens: int) -> str:
    """The command line that serves this workload as run_workload does (greedy, float32 on
    the CPU). Flags left at the script's defaults (8 prompts, seed 0, the model's window, one
    arrival per step, 40 tokens, FCFS) are left out, except the seats and the KV capacity."""
    flags = []
    if max_context != window:
        flags += ["--max-context", str(max_context)]
    if max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    flags += ["--max-num-seqs", str(max_num_seqs), "--kv-capacity", str(kv_capacity)]
    if policy != "fcfs":
        flags += ["--policy", policy]
    if priorities is not None:
        flags += ["--priorities", ",".join(str(x) for x in priorities)]
    for flag, value, default in (("--arrival-every", every, 1), ("--num-prompts", num, 8),
                                 ("--seed", seed, 0), ("--max-tokens", max_tokens, 40)):
        if value != default:
            flags += [flag, str(value)]
    return " ".join([CLI, *flags, "--device", "cpu"])


def run_workload(model, tokenizer, prompts, priorities, max_context: int, max_num_seqs: int,
                 max_num_batched_tokens, kv_capacity: int, policy: str, every: int,
                 max_tokens: int) -> dict:
    """Add request i before step i * every; step until done; every output recorded."""
    engine = s10.build_engine(model, tokenizer, max_context=max_context,
                              max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              kv_capacity=kv_capacity, policy=policy)
    tracer = s09_trace.trace(engine)
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids, arrivals, requests = [], {}, {}
    tokens, texts, reasons = {}, {}, {}
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        step = len(tracer.records)                 # the StepRecord the next step() appends
        while len(ids) < len(prompts) and len(ids) * every <= step:
            i = len(ids)
            rid = engine.add_request(prompts[i], params, request_id=str(i),
                                     priority=priorities[i])
            ids.append(rid)
            arrivals[rid], tokens[rid], texts[rid] = step, [], []
            requests[rid] = engine.requests[rid]
        for out in engine.step():
            for token in out.new_token_ids:
                tokens[out.request_id].append([step, token, tokenizer.decode([token])])
            texts[out.request_id].append(out.text_delta)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if len(tracer.records) != step + 1:
            raise RuntimeError(f"step {step}: expected one StepRecord per step() call")
    kv = engine.scheduler.kv
    if kv.num_free_tokens != kv_capacity or len(kv.free_slots) != max_num_seqs:
        raise RuntimeError("KV or a slot is still held after every request finished")
    trace = [{f: (list(v) if isinstance(v := getattr(r, f), tuple) else v)
              for f in TRACE_FIELDS} for r in tracer.records]
    ended = {rid for rec in trace for rid in rec["ended"]}
    return {"requests": [{"id": rid, "prompt_len": len(requests[rid].prompt_ids),
                          "priority": priorities[int(rid)], "arrival": arrivals[rid],
                          "generated": tokens[rid], "text": "".join(texts[rid]),
                          "finish_reason": reasons[rid], "ended_by_capacity": rid in ended,
                          "num_preemptions": requests[rid].num_preemptions} for rid in ids],
            "trace": trace, "num_preemptions": engine.scheduler.num_preemptions}


def export() -> dict:
    """The stepper's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the scheduler stepper replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    data = {"source": "code/s10_scheduler.py (build_engine: S09's LLMEngine with the "
                      "Scheduler over a TokenKVPool), traced by code/s09_trace.py's StepTracer, "
                      "on the bundled model, greedy, float32 on the CPU",
            "workloads": []}
    for (key, title, num, seed, max_context, seats, budget, kv, policy, priorities, every,
         max_tokens) in WORKLOADS:
        prompts = s08_cli.corpus_prompts(tokenizer, num, seed, 256)   # 8 to 32 tokens
        line = command(num, seed, max_context, model.config.max_position_embeddings, seats,
                       budget, kv, policy, priorities, every, max_tokens)
        priorities = list(priorities or [0] * num)
        run = run_workload(model, tokenizer, prompts, priorities, max_context, seats, budget,
                           kv, policy, every, max_tokens)
        data["workloads"].append({
            "id": key, "title": title, "seed": seed, "max_context": max_context,
            "max_num_seqs": seats, "max_num_batched_tokens": run["trace"][0]["token_budget"],
            "kv_capacity": kv, "policy": policy, "arrival_every": every,
            "max_tokens": max_tokens, "command": line, "num_preemptions": run["num_preemptions"],
            "requests": run["requests"], "trace": run["trace"]})
    return data


if __name__ == "__main__":  # print the size of what the page downloads, and what happened
    import json
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for w in d["workloads"]:
        print(w["id"], "steps", len(w["trace"]), "preemptions", w["num_preemptions"],
              "outputs", [len(r["generated"]) for r in w["requests"]],
              "prompts", [r["prompt_len"] for r in w["requests"]],
              "budget used max", max(t["num_tokens"] for t in w["trace"]))
