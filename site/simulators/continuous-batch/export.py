"""Data for the S09 "Try it" simulator: the same requests, static batches against continuous.

The page replays, step by step, one workload of the bundled model twice: as S08 serves it
(static batches of `max_batch` requests in arrival order, each batch running until its longest
request is done) and as S09 serves it (`LLMEngine` with `max_num_seqs = max_batch`: after every
step finished requests leave and waiting ones take their slots). Every request is there at the
start, so the only difference is the scheduling. Both runs happen here, at build time, with the
chapter engines on the CPU in float32, greedy:

- WORKLOADS: the S08 script's default prompts (8, seed 0, max_tokens 40, EOS on) in 4 slots; ten
  requests asking for 4 to 40 tokens (EOS on) in 3 slots; twelve requests of 6 tokens with one
  straggler of 40 (EOS ignored) in 4 slots;
- per request: its prompt length, its generated ids with the text piece of each, its text and
  finish reason (from S09's `step()` outputs, the step that returned each token);
- continuous: S09's trace (code/s09_trace.py's `StepTracer`), one `StepRecord` per step: the
  running ids in schedule order (admission order: FIFO never reorders them), their slots,
  joined, left, tokens in the step and prompt tokens of them, waiting (timings left out); and
  free_slots, the KV manager's free slots after each plan (`SlotKVManager.free_slots`, read by
  a second observer, `FreeSlots`);
- static: per batch, its request ids and the steps S08's `BatchStats` counted.

The page recomputes both schedules from the output lengths alone (static: batch by batch;
continuous: S10's scheduler model in site/static/course.js with S09's settings, no token
budget and no KV limit, FIFO into the lowest free slot) and checks them against the exported
ones on load
(console error and a visible banner otherwise). tests/test_s09_simulator_browser.py compares
what it shows with these values; tests/test_s09_simulator_data.py holds this data against
independent oracles (S06's engine alone, closed forms).
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
import s08_static_batching as s08  # noqa: E402
import s09_continuous_batching as s09  # noqa: E402
import s09_trace  # noqa: E402

# (id, title, corpus prompts, workload seed, max_batch, max_tokens per request, ignore_eos)
WORKLOADS = (
    ("default", "S08's default prompts: 8 requests, max_tokens 40, 4 slots", 8, 0, 4,
     [40] * 8, False),
    ("mixed", "10 requests asking for 4 to 40 tokens, 3 slots", 10, 3, 3,
     [40, 4, 12, 30, 8, 20, 6, 16, 10, 24], False),
    ("straggler", "12 requests of 6 tokens and one straggler of 40, 4 slots", 12, 5, 4,
     [40] + [6] * 11, True),
)
TRACE_FIELDS = ("step", "running", "slots", "joined", "left", "num_tokens", "prefill_tokens",
                "waiting")


def params_of(max_tokens: list[int], ignore_eos: bool) -> list[s04.SamplingParams]:
    return [s04.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos)
            for m in max_tokens]


class FreeSlots:
    """An observer beside S09's `StepTracer`: after each plan that does something (the steps
    the tracer records), how many KV slots the engine's `SlotKVManager` has free."""

    def __init__(self):
        self.counts: list[int] = []

    def on_plan(self, engine, plan) -> None:
        if plan.planned:
            self.counts.append(len(engine.scheduler.kv.free_slots))

    def on_step(self, engine, result) -> None:
        pass


def run_continuous(model, tokenizer, prompts, params, max_batch: int, max_context: int) -> dict:
    """All requests added before the first step; step until done; every output recorded."""
    engine = s09.build_engine(model, tokenizer, max_context=max_context, max_num_seqs=max_batch)
    tracer, free = s09_trace.trace(engine), FreeSlots()
    engine.observers.append(free)
    ids = [engine.add_request(p, sp, request_id=str(i))
           for i, (p, sp) in enumerate(zip(prompts, params))]
    tokens = {rid: [] for rid in ids}               # request id: [[step, id, piece], ...]
    texts = {rid: [] for rid in ids}
    reasons = {}
    while engine.has_unfinished_requests():
        step = len(tracer.records)                  # the StepRecord this step() will append
        for out in engine.step():
            for token in out.new_token_ids:
                tokens[out.request_id].append([step, token, tokenizer.decode([token])])
            texts[out.request_id].append(out.text_delta)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if len(tracer.records) != step + 1:
            raise RuntimeError(f"step {step}: expected one StepRecord per step() call")
    if len(engine.scheduler.kv.free_slots) != max_batch:
        raise RuntimeError("a slot is still taken after every request finished")
    records = [{f: (list(v) if isinstance(v := getattr(r, f), tuple) else v)
                for f in TRACE_FIELDS} | {"free_slots": n}
               for r, n in zip(tracer.records, free.counts, strict=True)]
    return {"requests": [{"id": rid, "generated": tokens[rid], "text": "".join(texts[rid]),
                          "finish_reason": reasons[rid]} for rid in ids],
            "trace": records}


def run_static(model, tokenizer, prompts, params, max_batch: int, max_context: int) -> dict:
    """S08's engine, one static batch after another of max_batch requests in order."""
    engine = s08.Engine(model, tokenizer, max_context, max_batch_size=max_batch)
    batches, token_ids = [], []
    for lo in range(0, len(prompts), max_batch):
        done = engine.generate(prompts[lo:lo + max_batch], params[lo:lo + max_batch])
        stats = engine.last_batch
        token_ids += [c.token_ids for c in done]
        batches.append({"requests": [str(i) for i in range(lo, lo + len(done))],
                        "steps": len(stats.steps), "useful": stats.useful,
                        "idle_row_steps": stats.idle_row_steps,
                        "decode_row_steps": stats.decode_row_steps})
    return {"batches": batches, "token_ids": token_ids}


def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError without the bundled model, or if
    the two engines disagree on any request's tokens."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the continuous-batch simulator replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    max_context = min(model.config.max_position_embeddings, 4096)
    data = {"source": "code/s09_continuous_batching.py (build_engine, LLMEngine.step), "
                      "code/s09_trace.py (StepTracer) and "
                      "code/s08_static_batching.py (Engine.generate, BatchStats) on the bundled "
                      "model, greedy, float32 on the CPU",
            "workloads": []}
    for key, title, num, seed, max_batch, max_tokens, ignore_eos in WORKLOADS:
        prompts = s08_cli.corpus_prompts(tokenizer, num, seed, max_context)
        params = params_of(max_tokens, ignore_eos)
        cont = run_continuous(model, tokenizer, prompts, params, max_batch, max_context)
        static = run_static(model, tokenizer, prompts, params, max_batch, max_context)
        for req, ids in zip(cont["requests"], static.pop("token_ids")):
            if [g[1] for g in req["generated"]] != ids:
                raise RuntimeError(f"{key} request {req['id']}: S08 and S09 tokens differ")
        for req, prompt, m in zip(cont["requests"], prompts, max_tokens):
            req["prompt_len"] = len(tokenizer.encode(prompt))
            req["max_tokens"] = m
        data["workloads"].append({"id": key, "title": title, "seed": seed,
                                  "max_batch": max_batch, "ignore_eos": ignore_eos,
                                  "requests": cont["requests"], "trace": cont["trace"],
                                  "static": static})
    return data


if __name__ == "__main__":  # print the size of what the page downloads, and the step counts
    import json
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for w in d["workloads"]:
        print(w["id"], "continuous steps", len(w["trace"]), "static steps",
              sum(b["steps"] for b in w["static"]["batches"]),
              "outputs", [len(r["generated"]) for r in w["requests"]])
