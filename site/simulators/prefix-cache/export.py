"""Data for the S13 "Try it" prefix cache: requests that share a prefix, blocks found by hash,
reference counts, the LRU free queue and evictions.

The page replays runs of S13's engine (`code/s13_prefix_caching.py`'s `build_engine`: S12's
paged engine with the `PrefixCachingKVCacheManager`, its pool's changes kept) on the bundled
model, made here at build time on the CPU in float32, greedy, blocks of BLOCK_SIZE tokens.
Three workloads:

- "system": five requests, each a shared system prompt (the first SYSTEM_TOKENS tokens of
  S07's "long" prompt) in front of a corpus line, arriving one after another while the
  earlier ones decode; a pool large enough that nothing is evicted. The first computes the
  system prompt; each later one finds its full blocks cached, holds them with the others
  (reference counts up to 5) and computes only its own tokens.
- "evict": the same system prompt in a small pool, one request at a time: a request with
  the system prompt, then two that share nothing with it, then the system prompt again. The
  unrelated requests take their blocks from the front of the free queue, where the finished
  request's tail blocks wait (given back last first), so the chain's tail is evicted and its
  head kept: the last request finds only what survived.
- "chat": a conversation of three turns, each turn's prompt the previous prompt, the
  model's answer and a new line: each turn finds the blocks of the whole conversation so
  far, answers included (an output token's KV is cached once its block is full).

Per workload: the settings; per request the prompt length, its arrival step, the names (the
first 8 hex digits of the SHA-256 hash) of every full block of its final token ids (prompt and
outputs), its generated text and finish reason; the trace, one record per step joining the
three tracers' records of the step (S09's `StepRecord`: the scheduled ids in schedule order,
their tokens and starts, each one's block table; S12's `BlockRecord`: the pool's events in
order, "hit", "evicted", "allocated", "cached", "freed"; S13's `CacheRecord`: the ref_cnt of
each scheduled block when scheduled, the hits of the requests admitted, the cached blocks and
the free queue after the step, the counters); and `summary`, worked out here from the trace
alone.

The page recomputes the cache from the schedule alone (who is scheduled, with how many
tokens, who finishes) and each request's block names: the longest run of cached names at
admission (at most (tokens - 1) // block size blocks), ref_cnt + 1 for each block hit (out of
the free queue), new blocks from the front of the free queue (a named one is evicted), the
full blocks named after the step (a twin of a cached block stays unnamed), a finished request's
blocks back to the back of the queue last first, keeping their names. It checks every step's
events, block tables, ref counts, cached blocks and free queue against the trace on load
(console error and a visible banner otherwise). tests/test_s13_simulator_browser.py compares
what it shows with these values; tests/test_s13_simulator_data.py holds this data against
independent oracles.
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
import s12_engine as s12  # noqa: E402
import s13_prefix_caching as s13  # noqa: E402

MAX_CONTEXT = 256              # the bundled model's window
BLOCK_SIZE = 8
SYSTEM_TOKENS = 40             # the shared system prompt: five blocks of 8
HASH_DIGITS = 8
# the trace's fields, by the tracer whose records hold them
STEP_FIELDS = ("step", "running", "num_scheduled_tokens", "num_computed_tokens",
               "request_num_tokens", "joined", "left", "preempted", "num_tokens", "block_tables")
BLOCK_FIELDS = ("block_events",)
CACHE_FIELDS = ("ref_cnts", "cache_hits", "cached_blocks", "free_queue", "cache_stats")


def listify(value):
    """Tuples (of tuples) as lists, for JSON."""
    if isinstance(value, (tuple, list)):
        return [listify(v) for v in value]
    return value


class Run:
    """One engine and the requests added to it, stepped to the end."""

    def __init__(self, model, tokenizer, num_blocks: int, max_num_seqs: int):
        self.tokenizer = tokenizer
        self.engine = s13.build_engine(model, tokenizer, max_context=MAX_CONTEXT,
                                       max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=MAX_CONTEXT,
                                       block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                       enable_kv_cache_events=True)
        self.tracers = (s09_trace.trace(self.engine), s12.trace_blocks(self.engine),
                        s13.trace_cache(self.engine))
        self.ids, self.arrivals, self.prompts, self.max_tokens = [], {}, {}, {}
        self.tokens, self.texts, self.reasons = {}, {}, {}

    def add(self, prompt: str, max_tokens: int) -> str:
        rid = str(len(self.ids))
        params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.engine.add_request(prompt, params, request_id=rid)
        self.ids.append(rid)
        self.arrivals[rid], self.prompts[rid], self.max_tokens[rid] = (
            self.num_steps, prompt, max_tokens)
        self.tokens[rid], self.texts[rid] = [], []
        return rid

    @property
    def num_steps(self) -> int:
        """Steps recorded so far (the number of the next)."""
        return len(self.tracers[0].records)

    def step(self) -> None:
        step = self.num_steps
        for out in self.engine.step():
            self.tokens[out.request_id] += [[step, t] for t in out.new_token_ids]
            self.texts[out.request_id].append(out.text_delta)
            if out.finished:
                self.reasons[out.request_id] = out.finish_reason
        if any(len(tracer.records) != step + 1 for tracer in self.tracers):
            raise RuntimeError(f"step {step}: expected one record of each per step() call")

    def done(self, rid: str) -> bool:
        return rid in self.reasons

    def export(self) -> dict:
        engine, tok, kv = self.engine, self.tokenizer, self.engine.scheduler.kv
        if engine.has_unfinished_requests():
            raise RuntimeError("the run must end")
        if engine.scheduler.num_preemptions:
            raise RuntimeError("the prefix-cache runs must not preempt (S12's page shows that)")
        if kv.num_free_blocks != kv.num_blocks - 1:
            raise RuntimeError("every block must be free once the run has ended")
        requests, names = [], {}
        for rid in self.ids:
            ids = tok.encode(self.prompts[rid]) + [t for _, t in self.tokens[rid]]
            hashes = [h.hex()[:HASH_DIGITS] for h in s13.hash_request_tokens(ids, BLOCK_SIZE)]
            for h, full in zip(hashes, s13.hash_request_tokens(ids, BLOCK_SIZE)):
                if names.setdefault(h, full) != full:
                    raise RuntimeError(f"two block hashes share the prefix {h}")
            requests.append({
                "id": rid, "arrival": self.arrivals[rid],
                "prompt_len": len(tok.encode(self.prompts[rid])),
                "max_tokens": self.max_tokens[rid], "hashes": hashes,
                "generated": [[s, t, tok.decode([t])] for s, t in self.tokens[rid]],
                "prompt": self.prompts[rid], "text": "".join(self.texts[rid]),
                "finish_reason": self.reasons[rid]})
        trace = [{f: listify(getattr(record, f)) for record, fields in zip(
                      records, (STEP_FIELDS, BLOCK_FIELDS, CACHE_FIELDS)) for f in fields}
                 for records in zip(*(tracer.records for tracer in self.tracers), strict=True)]
        return {"block_size": kv.block_size, "num_blocks": kv.num_blocks,
                "max_num_seqs": engine.scheduler.max_num_seqs, "requests": requests,
                "trace": trace, "summary": summarize(requests, trace)}


def summarize(requests: list[dict], trace: list[dict]) -> dict:
    """From the trace alone: each request's cached and computed prompt tokens at admission,
    the most requests holding one block at once, the blocks evicted, the cached blocks left
    after the last step (none of them held), and the counters (hit rate in tokens)."""
    hits = {rid: [n, total] for rec in trace for rid, n, total in rec["cache_hits"]}
    most = max((max(c, default=0) for rec in trace for c in rec["ref_cnts"]), default=0)
    evicted = [b for rec in trace for kind, _, ids in rec["block_events"] if kind == "evicted"
               for b in ids]
    requests_, hit_requests, queries, hit_tokens = trace[-1]["cache_stats"]
    return {"hits": hits, "max_ref_cnt": most, "evicted": evicted,
            "cached_after": len(trace[-1]["cached_blocks"]), "steps": len(trace),
            "hit_tokens": hit_tokens, "query_tokens": queries,
            "hit_requests": hit_requests, "admissions": requests_}


def system_prompt(tokenizer) -> str:
    long_prompt = s07_workloads.make_workload("long", tokenizer, 1, 0,
                                              MAX_CONTEXT).requests[0].prompt
    return tokenizer.decode(tokenizer.encode(long_prompt)[:SYSTEM_TOKENS])


def workload_system(model, tokenizer) -> dict:
    head = system_prompt(tokenizer)
    chats = s08_cli.corpus_prompts(tokenizer, 5, 0, MAX_CONTEXT)
    run = Run(model, tokenizer, num_blocks=64, max_num_seqs=8)
    arrivals = [0, 1, 2, 3, 4]
    added = 0
    while added < len(chats) or run.engine.has_unfinished_requests():
        while added < len(chats) and arrivals[added] <= run.num_steps:
            run.add(head + chats[added], 12)
            added += 1
        run.step()
    return run.export()


def workload_evict(model, tokenizer) -> dict:
    head = system_prompt(tokenizer)
    chats = s08_cli.corpus_prompts(tokenizer, 8, 3, MAX_CONTEXT)
    run = Run(model, tokenizer, num_blocks=12, max_num_seqs=1)
    for prompt in (head + chats[0], chats[1], chats[2], head + chats[3]):
        rid = run.add(prompt, 8)
        while not run.done(rid):
            run.step()
    return run.export()


def workload_chat(model, tokenizer) -> dict:
    chats = s08_cli.corpus_prompts(tokenizer, 3, 2, MAX_CONTEXT)
    run = Run(model, tokenizer, num_blocks=40, max_num_seqs=1)
    prompt = chats[0]
    for turn in range(3):
        rid = run.add(prompt, 16)
        while not run.done(rid):
            run.step()
        if turn < 2:
            prompt = prompt + "".join(run.texts[rid]) + "\n" + chats[turn + 1]
    return run.export()


WORKLOADS = (
    ("system", "Five requests share a 40-token system prompt", workload_system),
    ("evict", "A small pool: unrelated requests evict the system prompt's tail", workload_evict),
    ("chat", "A three-turn chat: each turn finds the conversation so far", workload_chat),
)


def export() -> dict:
    """The prefix cache's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the prefix cache replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    data = {"source": "code/s13_prefix_caching.py (build_engine: S12's paged engine with the "
                      "PrefixCachingKVCacheManager; CacheTracer), code/s12_engine.py "
                      "(BlockTracer) and code/s09_trace.py (StepTracer) on the bundled model, "
                      "greedy, float32 on the CPU",
            "max_context": MAX_CONTEXT, "hash_digits": HASH_DIGITS, "workloads": []}
    for key, title, make in WORKLOADS:
        run = make(model, tokenizer)
        run.update({"id": key, "title": title})
        data["workloads"].append(run)
    return data


if __name__ == "__main__":  # print the size of what the page downloads, and what happened
    import json
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for w in d["workloads"]:
        print(w["id"], "blocks", w["num_blocks"], "x", w["block_size"],
              "prompts", [q["prompt_len"] for q in w["requests"]], w["summary"])
