"""The S19 SSE-stream simulator's recorded streams are what the server sends, held against
independent oracles.

site/simulators/sse-stream/export.py records three streaming requests with the server's own
code (`s19_server.record_stream`: its parser and StreamWriter over the served engine, S13's,
another request beside it, 16 tokens per step) and what the official client reads from them.
Here:

- every choice's text and finish reason equal S06's single-request engine run alone on the
  same prompt (the completion's prompt, or the course's chat template written out here from
  its documentation), greedy or with choice i's seed, seed + i; usage equals the tokenizer's
  count of that prompt and the number of tokens S06 made, and no cached prompt token (each
  scenario runs on a fresh engine, whose prefix cache starts empty);
- the wire format: every line is one "data: <json>" event, the last "data: [DONE]"; chunk
  objects carry id, object, created and model; every choice object has a finish_reason key,
  null in all but its choice's last chunk (vLLM PR #19662); chat sends one role chunk per
  choice before any step; the usage chunk has no choices;
- the steps: a step sends one chunk for each of the request's choices that sampled in it and
  nothing when its rows only computed prompt tokens, so the first chunk comes in the step
  whose prompt chunk reaches the end of the prompt; the prompt's pieces are contiguous and sum
  to its length, cut over more than one step; no step computes more than its budget;
- the scenarios show what they are there to show: the stop string never reaches the client,
  its last chunk carries "" and "stop"; chat's two choices start in the steps that complete
  their own prompts, share every step from the later start until the first one ends, and end
  on different steps; the companion is named "other", never a choice-like "c0".
"""
from __future__ import annotations

import json

import pytest

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
from sim_browser import load_exporter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")]
pytest.importorskip("openai", reason="the SSE stream's export reads its streams with openai")


@pytest.fixture(scope="module")
def data():
    return load_exporter("sse-stream", "s19_sim_export_data").export()


@pytest.fixture(scope="module")
def scenarios(data):
    return {s["id"]: s for s in data["scenarios"]}


def all_lines(sc: dict) -> list[str]:
    return sc["start"] + [line for s in sc["steps"] for line in s["lines"]] + sc["end"]


def chunks(sc: dict) -> list[dict]:
    out = []
    for line in all_lines(sc):
        assert line.startswith("data: ") and line.endswith("\n\n") and line.count("\n") == 2
        if line != "data: [DONE]\n\n":
            out.append(json.loads(line[len("data: "):]))
    return out


def engine_prompt(sc: dict) -> str:
    if sc["kind"] == "completion":
        return sc["request"]["prompt"]
    return "".join(f"{m['role'].capitalize()}.\n{m['content']}\n\n"
                   for m in sc["request"]["messages"]) + "Assistant.\n"


def test_every_choice_equals_the_engine_alone(scenarios):
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    single = s06.Engine(model, tokenizer, 256)
    assert set(scenarios) == {"completion", "stop", "chat"}
    for sc in scenarios.values():
        body, prompt = sc["request"], engine_prompt(sc)
        assert sc["prompt"] == prompt
        assert sc["prompt_tokens"] == len(tokenizer.encode(prompt))
        made = 0
        for i, choice in enumerate(sc["expected"]["choices"]):
            seed = body["seed"] + i if "seed" in body else None
            alone = single.generate(prompt, s04.SamplingParams(
                temperature=body["temperature"], max_tokens=body["max_tokens"], seed=seed,
                stop=body.get("stop")))
            assert choice == {"index": i, "text": alone.text,
                              "finish_reason": alone.finish_reason}, (sc["id"], i)
            made += len(alone.token_ids)
        assert len(sc["expected"]["choices"]) == body.get("n", 1)
        if body.get("stream_options", {}).get("include_usage"):
            assert sc["expected"]["usage"] == {"prompt_tokens": sc["prompt_tokens"],
                                               "completion_tokens": made,
                                               "total_tokens": sc["prompt_tokens"] + made,
                                               "prompt_tokens_details": {"cached_tokens": 0}}
        else:
            assert sc["expected"]["usage"] is None


def test_the_wire_format(scenarios):
    for sc in scenarios.values():
        assert all_lines(sc)[-1] == "data: [DONE]\n\n"
        chat = sc["kind"] == "chat"
        objs = chunks(sc)
        n = sc["request"].get("n", 1)
        for obj in objs:
            assert obj["id"] == ("chatcmpl-0" if chat else "cmpl-0") and obj["created"] == 0
            assert obj["object"] == ("chat.completion.chunk" if chat else "text_completion")
            assert obj["model"] == sc["request"]["model"]
            for choice in obj["choices"]:
                assert "finish_reason" in choice and "logprobs" in choice
                assert ("delta" in choice) == chat and ("text" in choice) == (not chat)
        with_choices = [o for o in objs if o["choices"]]
        assert all(len(o["choices"]) == 1 for o in with_choices)
        for i in range(n):
            mine = [o["choices"][0] for o in with_choices if o["choices"][0]["index"] == i]
            reasons = [c["finish_reason"] for c in mine]
            assert reasons[:-1] == [None] * (len(mine) - 1) and reasons[-1] in ("stop",
                                                                                "length")
        if chat:
            assert [json.loads(x[6:])["choices"][0]["delta"] for x in sc["start"]] == [
                {"role": "assistant", "content": ""}] * n
        else:
            assert sc["start"] == []
        usage_chunks = [o for o in objs if o.get("usage")]
        if sc["expected"]["usage"] is not None:
            assert usage_chunks == [objs[-1]] and objs[-1]["choices"] == []
            assert objs[-1]["usage"] == sc["expected"]["usage"]
        else:
            assert usage_chunks == [] and len(sc["end"]) == 1


def test_a_chunk_for_every_sampled_row_and_none_before(scenarios, data):
    for sc in scenarios.values():
        ids = sc["choice_ids"]
        pieces = {rid: [] for rid in ids}
        first_chunk = {}
        for s in sc["steps"]:
            assert s["num_tokens"] == sum(x["tokens"] for x in s["scheduled"]) \
                <= s["token_budget"] == data["max_num_batched_tokens"]
            sampled = sorted(ids.index(x["id"]) for x in s["scheduled"]
                             if x["id"] in ids and x["sampled"])
            sent = sorted(json.loads(line[6:])["choices"][0]["index"] for line in s["lines"])
            assert sent == sampled, (sc["id"], s["step"])
            for x in s["scheduled"]:
                assert x["end"] == x["start"] + x["tokens"] <= x["total"]
                assert x["sampled"] == (x["end"] == x["total"])
                if x["id"] in ids and x["kind"] == "prefill":
                    pieces[x["id"]].append((x["start"], x["end"]))
                if x["id"] in ids and x["sampled"] and x["id"] not in first_chunk:
                    first_chunk[x["id"]] = s["step"]
                    assert x["total"] == sc["prompt_tokens"]     # the prompt is complete
        for rid, spans in pieces.items():
            assert spans[0][0] == 0 and spans[-1][1] == sc["prompt_tokens"]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))     # contiguous
        assert set(first_chunk) == set(ids)
        if sc["id"] == "completion":
            assert len(pieces["choice0"]) > 1           # the prompt was chunked
    first = scenarios["completion"]["steps"][0]["scheduled"]
    mine = next(x for x in first if x["id"] == "choice0")
    assert not mine["sampled"] and mine["end"] < scenarios["completion"]["prompt_tokens"]


def test_the_scenarios_show_the_stop_string_and_interleaved_choices(scenarios):
    stop = scenarios["stop"]
    word = stop["request"]["stop"][0]
    assert word not in "".join(json.loads(x[6:])["choices"][0]["text"]
                                for s in stop["steps"] for x in s["lines"])
    last = json.loads(stop["steps"][-1]["lines"][-1][6:])["choices"][0]
    assert last == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    chat = scenarios["chat"]
    both = [s for s in chat["steps"] if len(s["lines"]) == 2]
    assert both, "the two choices never shared a step"
    ends = {}
    for s in chat["steps"]:
        for line in s["lines"]:
            c = json.loads(line[6:])["choices"][0]
            if c["finish_reason"] is not None:
                ends[c["index"]] = s["step"]
    assert len(ends) == 2 and ends[0] != ends[1]
    starts = {}
    for s in chat["steps"]:
        for line in s["lines"]:
            starts.setdefault(json.loads(line[6:])["choices"][0]["index"], s["step"])
    for i, rid in enumerate(chat["choice_ids"]):      # the step that completes its prompt
        assert starts[i] == next(s["step"] for s in chat["steps"] for x in s["scheduled"]
                                 if x["id"] == rid and x["sampled"])
    assert [s["step"] for s in both] == list(range(max(starts.values()),
                                                   min(ends.values()) + 1))
    for sc in scenarios.values():
        assert sc["companion"]["id"] == "other"
        assert {x["id"] for s in sc["steps"] for x in s["scheduled"]} <= {
            "other", *sc["choice_ids"]}
    texts = [c["text"] for c in chat["expected"]["choices"]]
    assert texts[0] != texts[1]                 # seed and seed + 1 drew different tokens
