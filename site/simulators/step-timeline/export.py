"""Data for the S11 "Try it" step timeline: prompt chunks and decodes sharing each step's budget.

The page replays runs of S11's engine (`code/s11_chunked_prefill.py`'s `build_engine`: S09's
`LLMEngine` with its `ChunkedScheduler`) on the bundled model, made here at build time on the
CPU in float32, greedy. Each workload is a pair of runs of the same requests, drawn one above
the other:

- "stall": four short corpus prompts arrive one per step and decode; a long prompt arrives
  in step 6. Run A has S10's budget (nothing is chunked: the long prompt runs whole in one
  step, beside the four decodes); run B has 32 tokens per step, so the long prompt is cut
  into chunks that share each step with the decodes.
- "threshold": the long prompt arrives first and four short prompts one step after it, 32
  tokens per step. Run A has no per-request limit (the long prompt takes all the budget the
  decodes leave, so the short prompts wait behind it); run B caps every request at 8 tokens
  a step (`long_prefill_token_threshold`), so the short prompts join beside it.

Per run: the settings (the budget, the per-request limit, the KV capacity in tokens), and per
request the prompt length, the step before which it was added, its generated ids with the text
piece of each and the step that returned it, its text and finish reason; the trace, one
`StepRecord` per step from S09's `StepTracer` (scheduled ids in schedule order with their
tokens, kinds, starts, lengths and slots, who sampled, joined, left, tokens in all, the budget;
timings left out); and `summary`, computed here from the trace alone: each request's
first-token step, and the worst "gap", the tokens computed in the steps between two consecutive
tokens of one request (the work a decoding request waits behind: the machine-independent face
of inter-token latency).

The page recomputes every step from the request lengths, arrivals and output counts alone with
S10's scheduler model (`CourseSim.Scheduler` in site/static/course.js) grown by the chunked
scheduler's one rule, as the Python grows it (running requests first, in admission order, while
budget is left, each min(tokens left, budget left, threshold), nothing kept back for those
after it; then waiting requests while a seat and budget are left; a request samples only when
its new tokens reach the end of its token ids) and checks it against the exported trace on load
(console error and a visible banner otherwise). tests/test_s11_simulator_browser.py compares
what it shows with these values; tests/test_s11_simulator_data.py holds this data against
independent oracles (S06's engine alone, the chunking rules checked step by step).
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
import s07_workloads  # noqa: E402
import s08_cli  # noqa: E402
import s09_trace  # noqa: E402
import s11_chunked_prefill as s11  # noqa: E402

MAX_CONTEXT = 256              # the bundled model's window
MAX_NUM_SEQS = 8
LONG_SEED = 0                  # s07_workloads "long": a 183-token prompt for the tokenizer
# (id, title, order of the requests: "L" the long prompt or the index of a corpus prompt,
#  the step each arrives before, max_tokens of each, (label, budget or None, threshold) x 2)
WORKLOADS = (
    ("stall", "A long prompt arrives while four requests decode",
     [0, 1, 2, 3, "L"], [0, 1, 2, 3, 6], [32, 32, 32, 32, 8],
     (("A: no chunking (S10's budget)", None, 0), ("B: 32 tokens per step", 32, 0))),
    ("threshold", "Four short prompts arrive behind a long one, 32 tokens per step",
     ["L", 0, 1, 2, 3], [0, 1, 1, 1, 1], [8, 16, 16, 16, 16],
     (("A: no per-request limit", 32, 0), ("B: at most 8 tokens per request", 32, 8))),
)
TRACE_FIELDS = ("step", "running", "num_scheduled_tokens", "kinds", "num_computed_tokens",
                "request_num_tokens", "sampled", "slots", "joined", "left", "num_tokens",
                "prefill_tokens", "waiting", "token_budget", "preempted", "resumed", "ended")


def run_pair_member(model, tokenizer, prompts, arrivals, max_tokens, budget, threshold
                    ) -> dict:
    """Add request i before step arrivals[i]; step until done; every output recorded."""
    engine = s11.build_engine(model, tokenizer, max_context=MAX_CONTEXT,
                              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=budget,
                              long_prefill_token_threshold=threshold)
    tracer = s09_trace.trace(engine)
    ids, prompt_lens, tokens, texts, reasons = [], {}, {}, {}, {}
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        step = len(tracer.records)                 # the StepRecord the next step() appends
        while len(ids) < len(prompts) and arrivals[len(ids)] <= step:
            i = len(ids)
            params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens[i])
            rid = engine.add_request(prompts[i], params, request_id=str(i))
            ids.append(rid)
            prompt_lens[rid] = len(engine.requests[rid].prompt_ids)
            tokens[rid], texts[rid] = [], []
        for out in engine.step():
            for token in out.new_token_ids:
                tokens[out.request_id].append([step, token, tokenizer.decode([token])])
            texts[out.request_id].append(out.text_delta)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if len(tracer.records) != step + 1:
            raise RuntimeError(f"step {step}: expected one StepRecord per step() call")
    scheduler = engine.scheduler
    if scheduler.num_preemptions or len(scheduler.kv.free_slots) != MAX_NUM_SEQS:
        raise RuntimeError("the timeline's runs must not preempt, and must free every slot")
    trace = [{f: (list(v) if isinstance(v := getattr(r, f), tuple) else v)
              for f in TRACE_FIELDS} for r in tracer.records]
    requests = [{"id": rid, "prompt_len": prompt_lens[rid], "arrival": arrivals[k],
                 "max_tokens": max_tokens[k], "generated": tokens[rid],
                 "text": "".join(texts[rid]), "finish_reason": reasons[rid]}
                for k, rid in enumerate(ids)]
    return {"requests": requests, "trace": trace,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "long_prefill_token_threshold": scheduler.config.long_prefill_token_threshold,
            "kv_capacity": scheduler.kv_capacity,
            "summary": summarize(requests, trace)}


def summarize(requests: list[dict], trace: list[dict]) -> dict:
    """From the trace alone: each request's first-token step, and the worst gap, in tokens
    computed, between two consecutive tokens of one request (with the step that ends it)."""
    work = [rec["num_tokens"] for rec in trace]
    first, worst = {}, {"tokens": 0, "step": None, "request": None}
    for req in requests:
        steps = [rec["step"] for rec in trace if req["id"] in rec["sampled"]]
        first[req["id"]] = steps[0]
        for a, b in zip(steps, steps[1:]):
            gap = sum(work[a + 1:b + 1])              # what it waited behind for token k + 1
            if gap > worst["tokens"]:
                worst = {"tokens": gap, "step": b, "request": req["id"]}
    return {"first_token_step": first, "worst_gap": worst, "steps": len(trace),
            "tokens_computed": sum(work)}


def export() -> dict:
    """The timeline's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the step timeline replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    chats = s08_cli.corpus_prompts(tokenizer, 4, 0, MAX_CONTEXT)          # 29, 14, 9, 28 tokens
    long_prompt = s07_workloads.make_workload("long", tokenizer, 1, LONG_SEED,
                                              MAX_CONTEXT).requests[0].prompt
    data = {"source": "code/s11_chunked_prefill.py (build_engine: S09's LLMEngine with the "
                      "ChunkedScheduler), traced by code/s09_trace.py's StepTracer, on the "
                      "bundled model, greedy, float32 on the CPU",
            "max_context": MAX_CONTEXT, "max_num_seqs": MAX_NUM_SEQS, "workloads": []}
    for key, title, order, arrivals, max_tokens, runs in WORKLOADS:
        prompts = [long_prompt if o == "L" else chats[o] for o in order]
        long_id = str(order.index("L"))
        pair = []
        for label, budget, threshold in runs:
            run = run_pair_member(model, tokenizer, prompts, arrivals, max_tokens, budget,
                                  threshold)
            run["label"] = label
            pair.append(run)
        data["workloads"].append({"id": key, "title": title, "long_id": long_id,
                                  "runs": pair})
    return data


if __name__ == "__main__":  # print the size of what the page downloads, and what happened
    import json
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for w in d["workloads"]:
        for r in w["runs"]:
            print(w["id"], r["label"], "budget", r["max_num_batched_tokens"], "threshold",
                  r["long_prefill_token_threshold"], "prompts",
                  [q["prompt_len"] for q in r["requests"]], r["summary"])
