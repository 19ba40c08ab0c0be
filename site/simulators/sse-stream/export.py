"""Data for the S19 "Try it" SSE stream: one request's server-sent events beside the engine
steps that produced them.

Each scenario is one streaming request to chapter 19's server, recorded at build time with
`code/s19_server.py`'s `record_stream`: the server's own request parser and `StreamWriter`
driving its engine (`s19_server.ENGINE_BUILDER`, S13's `build_engine`, through `make_engine`;
a fresh engine per scenario, so its prefix cache starts empty) on the bundled model, on the
CPU in float32, with no HTTP in between, so the lines are byte for byte what the server sends
(id "cmpl-0" / "chatcmpl-0" and created 0, to be reproducible).
Another request runs beside it (record_stream names it "c0"; here it is renamed "other", so
that it does not read as "choice 0"), and the budget is 16 tokens per step, so its prompt is
chunked (S11) and batched with the other request's decodes:

- "completion": a completion with stream_options.include_usage: nothing is sent until the
  step whose chunk completes the prompt samples, then one chunk per token, the usage chunk
  and [DONE];
- "stop": a completion with a stop string: the text that could be the start of the stop
  string is held back, and the last chunk carries "" and finish_reason "stop";
- "chat": a chat completion with n = 2 seeded choices: one role chunk per choice before any
  step; each choice's first chunk in the step that completes its own prompt (choice 1's prompt
  is scheduled after choice 0's, so it completes a step later); from then on both choices'
  chunks in the same steps, until each ends on its own step.

Per scenario: the request body, the prompt as the engine sees it (chat: after the course's
template) and its token count, the lines sent before any step ("start", chat's role chunks),
one record per engine step (its number, tokens computed and budget, every scheduled request
with its tokens, kind, where its new tokens start and end and whether it sampled, from S09's
step tracer that record_stream attaches for its run; the lines of the request from that
step), the lines after the last step ("end"), and "expected": what the official OpenAI client
reads from all the lines (its own SSE decoder, each chunk built as its own response types):
per choice the joined text and finish reason, and the usage (its token counts and
prompt_tokens_details.cached_tokens, in the order the server sends them).

The page parses the raw lines itself (splits the events, reads the data, parses the JSON,
joins each choice's text) and checks on load that it gets "expected", and that every step
sent one chunk for each of the request's choices that sampled in it and none for a step
that only computed a prompt chunk (a console error and a visible banner otherwise).
tests/test_s19_simulator_data.py holds this data against independent oracles (S06's engine
alone, the tokenizer's counts); tests/test_s19_simulator_browser.py compares the page with it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s19_protocol as proto  # noqa: E402
import s19_server as srv  # noqa: E402

MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 16    # small, so a prompt is chunked beside the other request
MODEL_NAME = srv.DEFAULT_MODEL_NAME
OTHER = "other"                # the page's name for the companion record_stream calls "c0"
COMPANION = ("KING.\nWhat say you?",
             dict(temperature=0.0, max_tokens=6, ignore_eos=True))   # decodes beside it
SCENARIOS = (
    ("completion", "A completion, with the usage at the end", proto.COMPLETION,
     {"prompt": "ROMEO.\nBut soft, what light through yonder window breaks?\n",
      "max_tokens": 8, "temperature": 0, "stream_options": {"include_usage": True}}),
    ("stop", "A completion that ends on a stop string", proto.COMPLETION,
     {"prompt": "JULIET.\nO Romeo, Romeo! wherefore art thou Romeo?\n", "max_tokens": 40,
      "temperature": 0, "stop": [" man"]}),
    ("chat", "A chat completion with two choices (n = 2)", proto.CHAT,
     {"messages": [{"role": "user", "content": "Who art thou?"}], "max_tokens": 12,
      "temperature": 0.8, "seed": 7, "n": 2, "stream_options": {"include_usage": True}}),
)


def client_reading(lines: list[str], kind: str) -> dict:
    """What the official openai client reads from the lines: its SSE decoder splits the
    events, [DONE] ends the stream, and each chunk becomes its response type as the client
    builds it (`construct_type`, which checks nothing, as `client.completions.create(...,
    stream=True)` does)."""
    from openai._models import construct_type
    from openai._streaming import SSEDecoder
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk
    cls = ChatCompletionChunk if kind == proto.CHAT else Completion
    texts, reasons, usage, done = {}, {}, None, False
    for event in SSEDecoder().iter_bytes(iter(["".join(lines).encode("utf-8")])):
        if event.data == "[DONE]":
            done = True
            break
        chunk = construct_type(type_=cls, value=json.loads(event.data))
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if kind == proto.CHAT else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            reasons[choice.index] = choice.finish_reason
    if not done:
        raise RuntimeError("the recorded stream does not end with [DONE]")
    if usage is not None:     # the fields the server sends (the client's model adds Nones)
        usage = dict({k: usage[k] for k in ("prompt_tokens", "completion_tokens",
                                            "total_tokens")},
                     prompt_tokens_details={
                         "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
    return {"choices": [{"index": i, "text": texts[i], "finish_reason": reasons[i]}
                        for i in sorted(texts)],
            "usage": usage}


def record(model, tokenizer, kind: str, body: dict) -> dict:
    engine = srv.make_engine(model, tokenizer, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
    companion = (COMPANION[0], s04.SamplingParams(**COMPANION[1]))
    body = dict(body, model=MODEL_NAME)
    trace = srv.record_stream(engine, tokenizer, body, kind, MODEL_NAME,
                              companions=[companion])
    choice_ids = [f"choice{i}" for i in range(body.get("n", 1))]
    steps = []
    for rec in trace["steps"]:
        if rec["step"] is None:
            raise RuntimeError("the scenarios must not abort")
        for x in rec["scheduled"]:
            if x["id"] != "c0" and x["id"] not in choice_ids:
                raise RuntimeError(f"unexpected request {x['id']!r} in step {rec['step']}")
        scheduled = [{"id": OTHER if x["id"] == "c0" else x["id"], "tokens": x["tokens"],
                      "kind": x["kind"], "start": x["start"], "end": x["start"] + x["tokens"],
                      "total": x["total"], "sampled": x["sampled"]}
                     for x in rec["scheduled"]]
        steps.append({"step": rec["step"], "num_tokens": rec["num_tokens"],
                      "token_budget": rec["token_budget"], "scheduled": scheduled,
                      "lines": rec["lines"]})
    if engine.has_unfinished_requests() or engine.scheduler.kv.num_used_tokens:
        raise RuntimeError("the recorded run must finish every request and free its KV")
    lines = trace["start"] + [line for s in steps for line in s["lines"]] + trace["end"]
    prompt = (proto.course_chat_prompt(body["messages"]) if kind == proto.CHAT
              else body["prompt"])
    return {"kind": kind, "request": dict(trace["request"]), "prompt": prompt,
            "prompt_tokens": trace["prompt_tokens"],
            "choice_ids": choice_ids,
            "companion": {"id": OTHER, "prompt": COMPANION[0], **COMPANION[1]},
            "start": trace["start"], "steps": steps, "end": trace["end"],
            "expected": client_reading(lines, kind)}


def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the SSE stream replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    data = {"source": "code/s19_server.py (record_stream: parse_request, StreamWriter) over "
                      f"{srv.builder_name()} on the bundled model, float32 on the CPU",
            "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "scenarios": []}
    for key, title, kind, body in SCENARIOS:
        data["scenarios"].append(dict(id=key, title=title, **record(model, tokenizer, kind,
                                                                     body)))
    return data


if __name__ == "__main__":  # print the size of what the page downloads, and what it shows
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for s in d["scenarios"]:
        print(s["id"], s["prompt_tokens"], "prompt tokens,", len(s["steps"]), "steps,",
              sum(len(x["lines"]) for x in s["steps"]), "chunks from steps;", s["expected"])
