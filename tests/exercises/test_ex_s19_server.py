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
- exercise 3: S19's real server (`build_app` over S13's engine, uvicorn on a free loopback
  port) behind your middleware, counted by two ASGI wrappers of the test's own (what reached
  the middleware, what it let in and how many at once), with the engine thread held between
  steps so that "full" is a state, not a race; the official client (RateLimitError, its
  status, type, param and code) and httpx; greedy texts against the engine run alone.
"""
import json
import random

import pytest

import s03_transformer as s03
import s04_sampling as s04
from exercise_loader import load_exercise

openai = pytest.importorskip("openai", reason="the S19 exercises need the openai client")
from openai._streaming import SSEDecoder  # noqa: E402


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
        want = reference_data(chunks)
        got = list(ex.sse_data(chunks))
        assert got == want, f"got {got}, expected {want} (openai's decoder) from sse_data({chunks})"
        got = list(ex.sse_data(iter(chunks)))
        assert got == want, f"got {got}, expected {want} from sse_data(iter({chunks}))"


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
            assert reference_data(pieces) == whole, "oracle check: openai's decoder"
            got = list(ex.sse_data(pieces))
            bad = next((i for i, (g, w) in enumerate(zip(got, whole)) if g != w),
                       min(len(got), len(whole)))
            assert got == whole, (
                f"sse_data(pieces): event {bad}: got {got[bad:bad + 1]}, expected "
                f"{whole[bad:bad + 1]} ({len(got)} events against {len(whole)}); pieces {pieces}")
            checked += 1
        one_byte = [blob[i:i + 1] for i in range(len(blob))]
        got = list(ex.sse_data(one_byte))
        assert got == whole, f"the stream one byte at a time: got {got}, expected {whole}"
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
        where = f"{kind} stream of {body}"
        indices = [c["index"] for c in joined["choices"]]
        assert indices == list(range(n)), \
            f"got choice indices {indices}, expected {list(range(n))}; {where}"
        for choice in joined["choices"]:                # greedy: every choice is the same
            i = choice["index"]
            assert choice["text"] == alone.text, \
                f"choice {i}: got text {choice['text']!r}, expected {alone.text!r}; {where}"
            assert choice["finish_reason"] == alone.finish_reason, (
                f"choice {i}: got finish_reason {choice['finish_reason']!r}, expected "
                f"{alone.finish_reason!r}; {where}")
        if "stream_options" in body:     # a fresh engine per stream: nothing cached
            want = {"prompt_tokens": prompt_tokens,
                    "completion_tokens": n * len(alone.token_ids),
                    "total_tokens": prompt_tokens + n * len(alone.token_ids),
                    "prompt_tokens_details": {"cached_tokens": 0}}
        else:
            want = None
        assert joined["usage"] == want, f"usage: got {joined['usage']}, expected {want}; {where}"
    with pytest.raises(ValueError):
        ex.join_stream(reference_data([streams[0][2]])[:-1])       # the client was cut off


# Exercise 3 ----------------------------------------------------------------------------------
# The real server (S19's build_app over S13's engine on the bundled model, uvicorn on a free
# loopback port) behind the learner's middleware. Two wrappers of the test's own count what
# happens: `Count(limiter)` every generation request that reached the middleware, and the
# limiter wraps `Count(app)`, which sees every request let in (and the most inside at once).
# The engine thread is held between steps by a gate (`engine_loop.call(gate.wait)`: a
# request let in then waits for its engine request), so "R inside, Q waiting" is a state the
# test can reach and check without timing. Each wait is bounded (WAIT_S).

import concurrent.futures  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

MODEL = "bundled"
WAIT_S = 20.0
GENERATION = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}


class Count:
    """ASGI wrapper: how many generation requests entered it, are inside, were inside at
    most at once."""

    def __init__(self, app):
        self.app, self.entered, self.inside, self.most = app, 0, 0, 0

    async def __call__(self, scope, receive, send):
        counted = scope["type"] == "http" and (scope["method"], scope["path"]) in GENERATION
        if counted:
            self.entered += 1
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.inside -= 1


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Served:
    """The limited server: .outer counts arrivals, .inner what was let in, .loop the engine
    loop (gate it with hold()/release())."""

    def __init__(self, bundled, max_running, max_queued, max_num_seqs=8):
        import s19_server as srv
        model, tokenizer = bundled
        self.engine = srv.make_engine(model, tokenizer, max_num_seqs)
        app = srv.build_app(self.engine, tokenizer, MODEL)
        self.loop = app.state.engine_loop
        self.inner = Count(app)
        self.outer = Count(ex.AdmissionLimit(self.inner, max_running, max_queued))
        self.server = srv.ServerThread(self.outer)
        self.gate = None

    def hold(self):
        self.gate = threading.Event()
        self.loop.call(lambda engine: self.gate.wait(WAIT_S))

    def release(self):
        self.gate.set()

    def client(self):
        return openai.OpenAI(base_url=self.server.base_url, api_key="x", max_retries=0,
                             timeout=WAIT_S)

    def post(self, body, path="/v1/completions"):
        return httpx.post(self.server.url + path, json=dict({"model": MODEL}, **body),
                          timeout=WAIT_S)

    def close(self):
        if self.gate is not None:
            self.gate.set()
        self.server.stop()


def greedy_text(bundled, prompt, max_tokens):
    """The engine alone, in process: the text a greedy request must get through the server."""
    import s19_server as srv
    model, tokenizer = bundled
    engine = srv.make_engine(model, tokenizer, 4)
    rid = engine.add_request(tokenizer.encode(prompt),
                             s04.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    text = []
    while engine.has_unfinished_requests():
        text += [o.text_delta for o in engine.step() if o.request_id == rid]
    return "".join(text)


@needs_model
@pytest.mark.points(1)
def test_admission_under_the_limit_is_the_server_itself(bundled):
    with pytest.raises(ValueError):
        ex.AdmissionLimit(None, 0, 1)
    with pytest.raises(ValueError):
        ex.AdmissionLimit(None, 1, -1)
    want = greedy_text(bundled, PROMPT, 8)
    served = Served(bundled, max_running=2, max_queued=1)
    try:
        client = served.client()
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                        temperature=0)
        assert got.choices[0].text == want
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
            if c.choices)
        assert streamed == want
        chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "Hail"}])
        assert chat.choices[0].message.content is not None
        with concurrent.futures.ThreadPoolExecutor(3) as pool:    # 3 at once: 2 in, 1 waits
            texts = list(pool.map(lambda _: served.post({"prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0}).json(), range(3)))
        got = [t.get("choices", [{}])[0].get("text", t) for t in texts]
        assert got == [want] * 3, f"3 requests at once, limit 2 + 1 queued: got {got}, " \
                                  f"expected {[want] * 3}"
        assert served.inner.entered == served.outer.entered == 6, (
            f"after 6 requests: {served.outer.entered} reached the middleware and "
            f"{served.inner.entered} were let in, expected 6 and 6")
        assert served.inner.most <= 2, \
            f"got {served.inner.most} requests inside at once, expected at most max_running 2"
        assert httpx.get(served.server.url + "/health").status_code == 200
        assert served.outer.inside == served.inner.inside == 0, (
            f"after every answer: got {served.outer.inside} in the middleware and "
            f"{served.inner.inside} inside, expected 0 and 0")
    finally:
        served.close()


@needs_model
@pytest.mark.points(1)
def test_a_full_server_answers_429_at_once_and_serves_the_queue_after(bundled):
    want = greedy_text(bundled, PROMPT, 4)
    served = Served(bundled, max_running=2, max_queued=2)
    try:
        served.hold()                          # the engine stops between steps
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(served.post, {"prompt": PROMPT, "max_tokens": 4,
                                                 "temperature": 0}) for _ in range(4)]
            wait_until(lambda: served.outer.entered == 4 and served.inner.inside == 2,
                       "2 requests inside and 2 more arrived")
            time.sleep(0.2)                    # the 2 waiting must stay out
            assert served.inner.entered == 2 and not any(f.done() for f in pending), (
                f"engine held, 4 sent, limit 2 running + 2 queued: got {served.inner.entered} "
                f"let in and {sum(f.done() for f in pending)} answered, expected 2 and 0")
            start = time.monotonic()
            with pytest.raises(openai.RateLimitError) as caught:
                served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
            assert time.monotonic() - start < 5.0        # refused at once, not queued
            err = caught.value
            assert err.status_code == 429 and err.code == "too_many_requests"
            assert err.param is None and err.type == "rate_limit_error"
            body = err.response.json()
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type",
                                                                     "param", "code"}
            assert body["error"]["message"].strip()
            assert served.inner.entered == 2, \
                f"the refused 5th request got in: {served.inner.entered} let in, expected 2"
            health = httpx.get(served.server.url + "/health", timeout=WAIT_S)
            assert health.status_code == 200             # not a generation request
            served.release()
            answers = [f.result(timeout=WAIT_S) for f in pending]
        codes = [a.status_code for a in answers]
        assert codes == [200] * 4, f"the 4 held requests after release: got statuses {codes}"
        texts = [a.json()["choices"][0]["text"] for a in answers]
        assert texts == [want] * 4, f"got texts {texts}, expected {[want] * 4}"
        assert served.inner.entered == 4 and served.inner.most == 2, (
            f"got {served.inner.entered} let in, at most {served.inner.most} at once; "
            f"expected 4, and 2 at once")
        assert served.outer.inside == served.inner.inside == 0, (
            f"after every answer: got {served.outer.inside} in the middleware and "
            f"{served.inner.inside} inside, expected 0 and 0")
    finally:
        served.close()


@needs_model
@pytest.mark.points(1)
def test_every_way_a_request_ends_frees_its_place(bundled):
    served = Served(bundled, max_running=1, max_queued=0)
    try:
        client = served.client()
        # An answer the app gives as an error (400) frees the place.
        code = served.post({"prompt": PROMPT, "n": 0}).status_code
        assert code == 400, f"a request with n = 0: got status {code}, expected 400"
        code = served.post({"prompt": PROMPT, "max_tokens": 2}).status_code
        assert code == 200, f"after a 400, limit 1: got status {code}, expected 200 (place freed)"
        # A stream holds its place until it ends, and frees it when its client leaves.
        room = 256 - len(bundled[1].encode("ROMEO.\n")) - 1
        with httpx.stream("POST", served.server.url + "/v1/completions", timeout=WAIT_S,
                          json={"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": room,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert served.inner.inside == 1, \
                f"a stream mid-way: got {served.inner.inside} inside, expected 1"
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        # The client closed its stream: the server aborts it, and the place is free again.
        wait_until(lambda: served.inner.inside == 0, "the disconnected stream's place")
        code = served.post({"prompt": PROMPT, "max_tokens": 2}).status_code
        assert code == 200, f"after a client left its stream: got status {code}, expected 200"
        # A stream that runs to its end frees it too.
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                stream=True))
        code = served.post({"prompt": PROMPT, "max_tokens": 2}).status_code
        assert chunks and code == 200, \
            f"after a stream ran to its end: got {len(chunks)} chunks, then status {code}"
        assert served.inner.most == 1, \
            f"got {served.inner.most} requests inside at once, expected at most max_running 1"
        wait_until(lambda: not served.loop.call(
            lambda engine: engine.has_unfinished_requests()).result(WAIT_S),
            "the engine to have nothing left")
    finally:
        served.close()
