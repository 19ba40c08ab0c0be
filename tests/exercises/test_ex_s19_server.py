"""Graded tests for the S19 exercises (see exercises/s19_server.py).

Oracles, none of them the solution:
- exercise 1: the official OpenAI client's own SSE decoder (`openai._streaming.SSEDecoder`,
  what `client.completions.create(stream=True)` reads streams with), on streams the server's
  code writes (`s19_server.record_stream`, the server's parser and `StreamWriter` on the served
  engine) cut into random pieces, and on hand-made streams with comments, CR / LF / CRLF line
  ends, multi-line data and multi-byte characters cut in half;
- exercise 2: streams worked by hand, and real streams of the bundled model whose joined
  text, finish reason and usage must equal S06's single-request engine run alone on the same
  prompt (greedy) and the tokenizer's own count of the prompt;
- exercise 3: S19's `parse_request` (code/s19_protocol.py) on random request bodies that
  break no rule, one, or several (a long prompt breaks the context rule beside whatever else
  is broken; some bodies break two fields): status, param and code must match the first rule
  broken in the order the stub lists, which is parse_request's; and the official client,
  which must raise the exception class of your status and read your param and code.
"""
import json
import random

import pytest

import s03_transformer as s03
import s04_sampling as s04
from exercise_loader import load_exercise

openai = pytest.importorskip("openai", reason="the S19 exercises need the openai client")
import httpx2  # noqa: E402  (the openai client's HTTP library)
from openai._streaming import SSEDecoder  # noqa: E402

import s19_protocol as proto  # noqa: E402

ex = load_exercise("s19_server")
HAVE_MODEL = (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file()
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="data/model has no bundled model")


def reference_data(chunks) -> list[str]:
    """What the openai client reads: the data of every event its decoder dispatches."""
    return [event.data for event in SSEDecoder().iter_bytes(iter(chunks))]


def random_pieces(blob: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(blob)), min(len(blob) - 1, rng.randint(0, 40))))
    return [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)])]


@pytest.fixture(scope="module")
def bundled():
    if not HAVE_MODEL:
        pytest.skip("data/model has no bundled model")
    import s06_torch as s06
    return s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")


PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"
MESSAGES = [{"role": "system", "content": "Speak as in the plays."},
            {"role": "user", "content": "Who art thou?"}]
# (kind, body): each recorded with a second request running beside it, at 16 tokens per step
# (so the prompt is chunked, S11).
BODIES = [
    ("completion", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                    "stream_options": {"include_usage": True}}),
    ("completion", {"prompt": "JULIET.\nO Romeo, Romeo! wherefore art thou Romeo?\n",
                    "max_tokens": 40, "temperature": 0, "stop": [" man"]}),
    ("completion", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "n": 3,
                    "stream_options": {"include_usage": True}}),
    ("chat", {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "n": 2,
              "stream_options": {"include_usage": True}}),
    ("chat", {"messages": MESSAGES, "max_completion_tokens": 64, "temperature": 0,
              "stop": "\n"}),
]


@pytest.fixture(scope="module")
def streams(bundled):
    """[(kind, body, SSE bytes)] recorded by the server's own code on the served engine (S13's)."""
    import s19_server as srv
    model, tokenizer = bundled
    out = []
    for kind, body in BODIES:
        engine = srv.make_engine(model, tokenizer, 4, 16)
        body = dict(body, model=srv.DEFAULT_MODEL_NAME)
        trace = srv.record_stream(engine, tokenizer, body, kind, companions=[
            ("KING.\nWhat say you?", s04.SamplingParams(temperature=0, max_tokens=6))])
        lines = trace["start"] + [line for s in trace["steps"] for line in s["lines"]] \
            + trace["end"]
        out.append((kind, body, "".join(lines).encode("utf-8")))
    return out


# Exercise 1 ----------------------------------------------------------------------------------

HAND_STREAMS = [
    [b'data: {"a": 1}\n', b'\n: ping\n\ndata: [DO', b'NE]\r\n\r\n'],
    [b"data: one\ndata: two\n\n"],                      # two data lines: "one\ntwo"
    [b"data:no space\r\rdata:  two spaces\r\n\r\n"],    # CR alone ends a line too
    [b"event: message\ndata: x\n\n", b": comment only\n\n", b"data\n\n"],   # "data": ""
    [b"data: caf\xc3", b"\xa9 \xe2\x80", b"\x94 done\n", b"\n"],            # UTF-8 cut in half
    [b"data: kept\n\n", b"data: never ended\n"],        # no blank line: not an event
    [b"\r\n\r\n: just comments\r\n\r\n"],
    [b"data: a\r", b"\n", b"\r", b"\ndata: b\n\n"],     # a CRLF cut between its two bytes
]


@pytest.mark.points(1)
def test_sse_data_by_hand():
    assert ex.sse_data(HAND_STREAMS[0]) == ['{"a": 1}', "[DONE]"]
    assert ex.sse_data(HAND_STREAMS[1]) == ["one\ntwo"]
    assert ex.sse_data(HAND_STREAMS[2]) == ["no space", " two spaces"]
    assert ex.sse_data(HAND_STREAMS[4]) == ["caf\u00e9 \u2014 done"]
    for chunks in HAND_STREAMS:
        assert list(ex.sse_data(chunks)) == reference_data(chunks), chunks
        assert list(ex.sse_data(iter(chunks))) == reference_data(chunks), "an iterator"


@needs_model
@pytest.mark.points(2)
def test_sse_data_reads_the_server_streams_as_the_official_client_does(streams):
    rng = random.Random(19)
    checked = 0
    for _kind, _body, blob in streams:
        whole = reference_data([blob])
        assert whole[-1] == "[DONE]" and len(whole) > 3
        for _ in range(40):
            pieces = random_pieces(blob, rng)
            if rng.random() < 0.3:                      # the same events with CRLF line ends
                pieces = random_pieces(blob.replace(b"\n", b"\r\n"), rng)
            assert list(ex.sse_data(pieces)) == reference_data(pieces) == whole
            checked += 1
        one_byte = [blob[i:i + 1] for i in range(len(blob))]
        assert list(ex.sse_data(one_byte)) == whole
    assert checked == 40 * len(BODIES)


# Exercise 2 ----------------------------------------------------------------------------------

def chunk(obj: str, *choices, usage="absent") -> str:
    body = {"id": "x", "object": obj, "created": 0, "model": "m", "choices": list(choices)}
    if usage != "absent":
        body["usage"] = usage
    return json.dumps(body)


@pytest.mark.points(1)
def test_join_stream_by_hand():
    c = "text_completion"
    two = [chunk(c, {"index": 1, "text": "B", "finish_reason": None}),
           chunk(c, {"index": 0, "text": "a", "finish_reason": None}),
           chunk(c, {"index": 0, "text": "", "finish_reason": None}),   # a token held back
           chunk(c, {"index": 1, "text": "b", "finish_reason": "stop"}),
           chunk(c, {"index": 0, "text": "a", "finish_reason": "length"}), "[DONE]"]
    assert ex.join_stream(two) == {"choices": [
        {"index": 0, "text": "aa", "finish_reason": "length"},
        {"index": 1, "text": "Bb", "finish_reason": "stop"}], "usage": None}
    k = "chat.completion.chunk"
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    chat = [chunk(k, {"index": 0, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None}, usage=None),
            chunk(k, {"index": 0, "delta": {"content": "Ay"}, "finish_reason": None},
                  usage=None),
            chunk(k, {"index": 0, "delta": {"content": "."}, "finish_reason": None},
                  usage=None),
            chunk(k, {"index": 0, "delta": {}, "finish_reason": "stop"}, usage=None),
            chunk(k, usage=usage), "[DONE]"]
    assert ex.join_stream(chat) == {"choices": [{"index": 0, "text": "Ay.",
                                                 "finish_reason": "stop"}], "usage": usage}
    with pytest.raises(ValueError):
        ex.join_stream(chat[:-1])                                   # cut before [DONE]
    with pytest.raises(ValueError):
        ex.join_stream(chat + [chat[1]])                            # after [DONE]
    error = json.dumps({"error": {"message": "the engine failed", "type": "server_error",
                                  "param": None, "code": None}})
    with pytest.raises(ValueError, match="the engine failed"):
        ex.join_stream(chat[:2] + [error, "[DONE]"])


@needs_model
@pytest.mark.points(3)
def test_join_stream_equals_the_engine_alone(streams, bundled):
    import s06_torch as s06
    model, tokenizer = bundled
    single = s06.Engine(model, tokenizer, 256)
    for kind, body, blob in streams:
        joined = ex.join_stream(reference_data([blob]))
        # The prompt the engine ran: the text itself, or the course's chat template written
        # out here from its documentation ("<Role>.\n<content>\n\n", then "Assistant.\n").
        prompt = body["prompt"] if kind == "completion" else "".join(
            f"{m['role'].capitalize()}.\n{m['content']}\n\n" for m in body["messages"]) \
            + "Assistant.\n"
        prompt_tokens = len(tokenizer.encode(prompt))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        alone = single.generate(prompt, s04.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, stop=body.get("stop")))
        n = body.get("n", 1)
        assert [c["index"] for c in joined["choices"]] == list(range(n)), (kind, body)
        for choice in joined["choices"]:                # greedy: every choice is the same
            assert choice["text"] == alone.text, (kind, body)
            assert choice["finish_reason"] == alone.finish_reason, (kind, body)
        if "stream_options" in body:     # a fresh engine per stream: nothing cached
            assert joined["usage"] == {"prompt_tokens": prompt_tokens,
                                       "completion_tokens": n * len(alone.token_ids),
                                       "total_tokens": prompt_tokens
                                       + n * len(alone.token_ids),
                                       "prompt_tokens_details": {"cached_tokens": 0}}
        else:
            assert joined["usage"] is None
    with pytest.raises(ValueError):
        ex.join_stream(reference_data([streams[0][2]])[:-1])       # the client was cut off


# Exercise 3 ----------------------------------------------------------------------------------

MODEL = "bundled"
MAX_CONTEXT = 64
PROMPTS = ["ROMEO.\n", PROMPT, "KING.\n" + "Now is the winter of our discontent. " * 6]
CHAT = [[{"role": "user", "content": "Speak."}],
        [{"role": "user", "content": "Now is the winter of our discontent. " * 6}]]
BREAKS = {   # field -> values that break its rule (None: the field is dropped)
    "model": [None, "", 7, "gpt-4"],
    "n": [0, 129, 1.5, "2", True],
    "stream": ["yes", 1],
    "stream_options": [{"include_usage": True}],
    "stop": [["a", "b", "c", "d", "e"]],
    "max_tokens": [0, -3, 2.5, "8", True],
    "max_completion_tokens": [0, 1.5],
    "temperature": [-0.5, 100.5, "hot", True],
    "top_p": [1.5, -0.1, "all"],
}
FINE = {"n": [1, 2, 128], "stream": [True, False], "stop": ["\n", ["a", "b", "c", "d"]],
        "max_tokens": [1, 8, 40, 60], "temperature": [0, 0.7, 100], "top_p": [0, 0.9, 1],
        "seed": [0, 7]}


def random_body(kind: str, rng: random.Random) -> dict:
    body = {"model": MODEL}
    if kind == "completion":
        body["prompt"] = rng.choice(PROMPTS)
    else:
        body["messages"] = rng.choice(CHAT)
    for name, values in FINE.items():
        if rng.random() < 0.4:
            body[name] = rng.choice(values)
    if body.get("stream") is True and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    # Break one rule (sometimes none, sometimes a second one, so that the order counts).
    breaks = 0 if rng.random() < 0.2 else (2 if rng.random() < 0.25 else 1)
    names = [k for k in BREAKS if kind == "chat" or k != "max_completion_tokens"]
    for name in rng.sample(names, breaks):
        value = rng.choice(BREAKS[name])
        if name == "stream_options":
            body.pop("stream", None)
        if value is None:
            body.pop(name, None)
        else:
            body[name] = value
    return body


def expected(kind: str, body: dict, tokenizer):
    """What S19's parse_request does with the body: None, or (status, param, code)."""
    try:
        proto.parse_request(kind, body, MODEL, tokenizer, MAX_CONTEXT)
    except proto.APIError as err:
        return err.status, err.param, err.code
    return None


@needs_model
@pytest.mark.points(2)
def test_check_request_answers_as_the_server_does(bundled):
    _, tokenizer = bundled
    rng = random.Random(1919)
    seen, shadowed = {}, 0
    for _ in range(600):
        kind = rng.choice(["completion", "chat"])
        body = random_body(kind, rng)
        want = expected(kind, body, tokenizer)
        text = body.get("prompt") if kind == "completion" else proto.course_chat_prompt(
            body["messages"])
        prompt_tokens = len(tokenizer.encode(text))
        got = ex.check_request(kind, json.loads(json.dumps(body)), MODEL, prompt_tokens,
                               MAX_CONTEXT)
        broken = [k for k, values in BREAKS.items() if k != "model" and k in body
                  and any(body[k] == v and type(body[k]) is type(v) for v in values)]
        if prompt_tokens >= MAX_CONTEXT:
            broken.append("context")
        shadowed += len(broken) > 1          # the order decides which rule answers
        if want is None:
            assert got is None, (kind, body)
            continue
        assert got is not None, (kind, body, want)
        status, error = got
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param",
                                                                    "code"}, error
        detail = error["error"]
        assert (status, detail["param"], detail["code"]) == want, (kind, body)
        assert detail["type"] == "invalid_request_error"
        assert isinstance(detail["message"], str) and detail["message"].strip()
        seen[want] = seen.get(want, 0) + 1
    reasons = {w[1] for w in seen}
    assert {"model", "n", "stream", "stream_options", "stop", "max_tokens", "temperature",
            "top_p", "prompt", "messages"} <= reasons, sorted(reasons)
    assert any(code == "context_length_exceeded" and param == "max_tokens"
               for _, param, code in seen)
    assert shadowed >= 50, shadowed          # bodies that break two rules or more


@needs_model
@pytest.mark.points(1)
def test_the_official_client_reads_your_error_objects(bundled):
    _, tokenizer = bundled
    classes = {400: openai.BadRequestError, 404: openai.NotFoundError}
    cases = [({"model": "gpt-4", "prompt": "ROMEO.\n"}, 404),
             ({"model": MODEL, "prompt": "ROMEO.\n", "n": 0}, 400),
             ({"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 60}, 400)]
    for body, status in cases:
        got = ex.check_request("completion", body, MODEL, len(tokenizer.encode(body["prompt"])),
                               MAX_CONTEXT)
        assert got is not None and got[0] == status, body
        reply = got[1]

        def handler(request, reply=reply, status=status):
            return httpx2.Response(status, json=reply)

        client = openai.OpenAI(base_url="http://server.invalid/v1", api_key="x", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
        with pytest.raises(classes[status]) as caught:
            client.completions.create(**body)
        want = expected("completion", body, tokenizer)
        assert (caught.value.status_code, caught.value.param, caught.value.code) == want
        assert reply["error"]["message"] in caught.value.message
