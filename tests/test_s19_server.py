"""Tests for chapter S19, the OpenAI-compatible server (code/s19_server.py), over real HTTP.

A module fixture starts the real server (uvicorn in a thread, on a port the OS picks on the
loopback interface) over the bundled model and the engine it serves (srv.ENGINE_BUILDER,
S13's: prefix caching, paged KV, chunked prefill); the official `openai` client (and httpx,
for raw bytes and for disconnecting; a raw socket for a body cut off) talks to it. Oracles:
the same engine built the same way, run in process through S09's `LLM`, one request alone, on
the same prompt (greedy text, token ids, seeded samples, logprobs); the tokenizer for usage
counts; the chat prompt written out by hand (the course's template in the module docstring of
code/s19_protocol.py); OpenAI's documented formats. The engine is seen only through its public
state (has_unfinished_requests, the KV manager's counts) and, where a test needs a step's
rows, through an observer the test attaches. S14's flags (--quantize, --group-size,
--kv-cache-dtype): the server started as its own process with --quantize int8 --kv-cache-dtype
int8 against S14's `build_engine` run in process on a fresh copy of the model; every bad flag a
usage error (exit status 2) before a model loads, fp8 on a device without it after.

Public bug reports (../shared/cases/public-bugs.md, sections (k) and (g)), each a test below:
K1 ggml-org/llama.cpp #3817 (a prompt over the context crashed the server), K2
sgl-project/sglang #9599 (prompts at context - 1, context, context + 1), K4 vllm-project/vllm
PR #19662 and abetlen/llama-cpp-python #735 (finish_reason missing from stream chunks, or never
set in the last one), K6 mistralai/mistral-inference #122 (max_tokens=1 gave a 500), G4
fastapi/fastapi #1342 (a streaming response kept running after its client disconnected, until
Starlette 0.13.3; vllm-project/vllm #24584 reported the same of vLLM's simple API server, and
the PRs proposing a fix, #24586 and #32442, were closed unmerged: a maintainer answered that
AsyncLLM.generate already aborts on disconnect), G5 sgl-project/sglang PR #2238 / #6778 (KV not released after aborts and
finishes under concurrency). Section (g)'s G1 and G2 are the engine's (S10/S11 test them); the
server adds no scheduling.
"""
import asyncio
import json
import logging
import socket
import threading
import time
import uuid

import httpx
import openai
import pytest
import torch

import s04_sampling as s04
import s06_torch as s06
import s13_prefix_caching as s13
import s19_server as srv
from s09_llm import LLM

pytestmark = pytest.mark.slow   # a real server, a few hundred requests: about a minute

MODEL = "bundled"
PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING HENRY.\nOnce more unto the breach",
           "First Citizen.\nBefore we proceed any further, hear me speak.", "O", "Enter",
           "JULIET.\nGood night, good night!", "Why, then the world's mine oyster"]
MAX_NUM_SEQS = 16
WAIT_S = 20.0          # every wait below is bounded by this


@pytest.fixture(scope="module")
def loaded():
    return s06.load()


@pytest.fixture(scope="module")
def server(loaded):
    model, tok = loaded
    engine = srv.make_engine(model, tok, MAX_NUM_SEQS)
    with srv.serve_in_thread(engine, tok) as running:
        running.loop = running.server.config.app.state.engine_loop
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(loaded):
    """The same engine, built the same way, in process, one request at a time: the oracle."""
    model, tok = loaded
    llm = LLM(srv.make_engine(model, tok, MAX_NUM_SEQS))
    cache = {}

    def run(prompt, **kwargs):
        key = (prompt, tuple(sorted(kwargs.items())))
        if key not in cache:
            kwargs.setdefault("temperature", 0.0)
            cache[key] = llm.generate(prompt, s04.SamplingParams(**kwargs))
        return cache[key]
    run.tokenizer = tok
    return run


def chat_text(user: str) -> str:
    return f"User.\n{user}\n\nAssistant.\n"   # the course's template, written out


def engine_state(server):
    """(unfinished requests?, KV tokens in use, KV blocks held), read in the engine thread
    between steps from the engine's public state. Held = usable - free blocks, S13's notion: a
    cached block nobody holds is in the free queue (still hittable, taken first-in-first-out),
    so it counts as free."""
    return server.loop.call(lambda e: (
        e.has_unfinished_requests(), e.scheduler.kv.num_used_tokens,
        e.scheduler.kv.num_used_blocks)).result(WAIT_S)


IDLE = (False, 0, 0)


def wait_idle(server):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        state = engine_state(server)
        if state == IDLE:
            return state
        time.sleep(0.02)
    return engine_state(server)


def sse_events(response: httpx.Response) -> list:
    """The data of every SSE event of a streamed response ("[DONE]" kept as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- the official client: completions and chat, streaming and not ---------------------------

@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_completion_equals_the_engine_in_process(client, local, prompt):
    want = local(prompt, max_tokens=24)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(local.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_streamed_completion_joins_to_the_engine_text(client, local, prompt):
    want = local(prompt, max_tokens=24)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert len(text_chunks) == len(want.token_ids)          # one chunk per generated token
    assert [c.choices[0].finish_reason for c in text_chunks] == \
        [None] * (len(text_chunks) - 1) + [want.finish_reason]
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in text_chunks)


def test_chat_uses_the_course_template_and_equals_the_engine(client, local):
    messages = [{"role": "user", "content": "Who art thou?"}]
    want = local(chat_text("Who art thou?"), max_tokens=20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(local.tokenizer.encode(chat_text("Who art thou?")))


def test_chat_with_a_system_message_and_history(client, local):
    messages = [{"role": "system", "content": "Speak as a king."},
                {"role": "user", "content": "Who goes there?"},
                {"role": "assistant", "content": "A friend."},
                {"role": "user", "content": "Thy name?"}]
    prompt = ("System.\nSpeak as a king.\n\nUser.\nWho goes there?\n\nAssistant.\nA friend."
              "\n\nUser.\nThy name?\n\nAssistant.\n")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content == local(prompt, max_tokens=12).text


def test_streamed_chat_sends_the_role_first_then_content(client, local):
    want = local(chat_text("Speak."), max_tokens=16)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Speak."}], max_tokens=16,
        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_an_idle_loop_takes_no_steps(server):
    # The engine thread sleeps on a condition when nothing is unfinished: no step, no spin.
    assert wait_idle(server) == IDLE
    before = server.loop.steps
    time.sleep(0.2)
    assert server.loop.steps == before and server.loop.alive


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=WAIT_S).json() == {"status": "ok"}


# --- n, stop, seeds, logprobs ---------------------------------------------------------------

def test_n_choices_are_separate_requests_with_seed_plus_index(client, local):
    prompt = PROMPTS[1]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0,
                                  seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):
        want = local(prompt, max_tokens=16, temperature=1.0, seed=7 + i)
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(local.tokenizer.encode(prompt))   # counted once
    assert r.usage.completion_tokens == sum(
        len(local(prompt, max_tokens=16, temperature=1.0, seed=7 + i).token_ids)
        for i in range(3))


def test_the_same_seed_twice_gives_the_same_text(client):
    calls = [client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20,
                                       temperature=1.2, top_p=0.9, seed=123)
             for _ in range(2)]
    assert calls[0].choices[0].text == calls[1].choices[0].text
    other = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20,
                                      temperature=1.2, top_p=0.9, seed=124)
    assert other.choices[0].text != calls[0].choices[0].text   # the seed is used at all


def test_stop_string_cuts_the_text(client, local):
    full = local(PROMPTS[0], max_tokens=40).text
    word = full.split()[2]                  # a word the greedy text reaches
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40,
                                  temperature=0, stop=[word, "zzzz"])
    assert r.choices[0].text == full.split(word)[0]
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs_match_the_engine(client, local):
    want = local(PROMPTS[0], max_tokens=8, logprobs=3)
    tok = local.tokenizer
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids) == len(lp.token_logprobs)
    for k, (entry, token_id) in enumerate(zip(want.logprobs, want.token_ids)):
        assert lp.token_logprobs[k] == pytest.approx(entry.logprob, abs=1e-5)
        tops = lp.top_logprobs[k]
        assert len(tops) == 3
        for top_id, value in entry.top_logprobs:
            name = tok.decode([top_id]) or "<|endoftext|>"
            assert tops[name] == pytest.approx(value, abs=1e-5)
    assert lp.text_offset[0] == 0


def test_chat_logprobs_match_the_engine(client, local):
    want = local(chat_text("Hail!"), max_tokens=6, logprobs=2)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "Hail!"}],
                                       max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for got, entry in zip(content, want.logprobs):
        assert got.logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [v for _, v in entry.top_logprobs], abs=1e-5)
        assert got.bytes == list(got.token.encode("utf-8"))


# --- disconnects and concurrency ------------------------------------------------------------

STEP_S = 0.004


class FlakyRunner:
    """The served engine's model runner, wrapped (composition, the engine untouched): the next
    `execute_model` raises when `fail_next` is set (an injected fault); a request whose prompt
    ids are `poison` gets NaN logits (a model gone bad for that row alone); and every model
    run takes at least STEP_S (the bundled model makes 240 tokens faster than a client reads
    its first chunk, so a disconnect test needs steps of a real model's length)."""

    def __init__(self, runner):
        self.runner, self.fail_next, self.poison = runner, False, None

    def execute_model(self, plan, requests):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected fault")
        time.sleep(STEP_S)
        out = self.runner.execute_model(plan, requests)
        for row, rid in enumerate(out.req_ids):
            if self.poison is not None and tuple(requests[rid].prompt_ids) == self.poison:
                with torch.inference_mode():        # the runner's logits are inference tensors
                    out.logits[row] = float("nan")
        return out

    def __getattr__(self, name):
        return getattr(self.runner, name)


@pytest.fixture(scope="module")
def flaky(loaded):
    model, tok = loaded
    engine = srv.make_engine(model, tok, 4)
    engine.runner = FlakyRunner(engine.runner)
    with srv.serve_in_thread(engine, tok) as running:
        running.loop = running.server.config.app.state.engine_loop
        yield running


def arm(server):
    server.loop.call(lambda e: setattr(e.runner, "fail_next", True)).result(WAIT_S)



def test_g4_disconnect_mid_stream_aborts_and_frees_every_kv_token(flaky):
    server = flaky
    # G4 (fastapi #1342): read one chunk, close; the request must stop
    # within a few steps and its KV go back (the free count returns to its idle value).
    assert wait_idle(server) == IDLE
    before = server.loop.steps
    body = {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 240, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=WAIT_S) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()     # kept open: leaving it would close the stream
            assert next(line for line in lines if line.startswith("data: "))
            busy = server.loop.call(lambda e: e.has_unfinished_requests()).result(WAIT_S)
            assert busy                           # still running while the client reads
    assert wait_idle(server) == IDLE
    ran = server.loop.steps - before   # the only request: every step was one of its own
    assert ran < 240            # it stopped long before its 240 tokens
    print(f"G4: the abandoned request ran {ran} steps of 240")


def test_a_non_streaming_client_that_leaves_is_aborted_too(flaky):
    server = flaky
    assert wait_idle(server) == IDLE
    before = server.loop.steps
    body = {"model": MODEL, "prompt": "O", "max_tokens": 255, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.1)
    assert wait_idle(server) == IDLE
    steps = server.loop.steps - before
    assert steps < 255          # only this request ran: it was cut off before its end
    print(f"non-streaming disconnect: {steps} steps of 255")


def test_64_concurrent_streams_each_equal_the_request_alone(server, local):
    # Also G5 (sgl-project/sglang PR #2238, #6778): after 64 requests, 8 of them abandoned
    # mid-stream, the engine is idle with every KV token free.
    async def one(client, k):
        prompt = PROMPTS[k % len(PROMPTS)]
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True)
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
            if k >= 64 and len(parts) == 2:       # the abandoned ones
                await stream.close()
                return None
        return prompt, "".join(parts), reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, k) for k in range(72))), 150)

    results = asyncio.run(main())
    for prompt, text, reason in filter(None, results):
        want = local(prompt, max_tokens=16)
        assert (text, reason) == (want.text, want.finish_reason)
    assert wait_idle(server) == IDLE


def test_requests_from_many_threads_with_the_sync_client(server, local):
    results, errors = {}, []

    def work(k):
        try:
            c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": PROMPTS[k]}],
                                          max_tokens=10, temperature=0)
            results[k] = r.choices[0].message.content
        except Exception as err:           # reported below, with the thread's number
            errors.append((k, err))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert not errors
    assert results == {k: local(chat_text(p), max_tokens=10).text
                       for k, p in enumerate(PROMPTS)}


# --- bad requests: a 4xx and OpenAI's error schema, never a 5xx -----------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
GOOD_C = {"model": MODEL, "prompt": "O"}
GOOD_CH = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
BAD = [
    # (name, path, body (bytes sent as they are), status, param, code)
    ("malformed JSON", C, b'{"model": "bundled", "prompt": ', 400, None, None),
    ("not an object", C, b"[1, 2]", 400, None, None),
    ("NaN is not JSON", C, b'{"model": "bundled", "prompt": "O", "temperature": NaN}', 400,
     None, None),
    ("no model", C, {"prompt": "O"}, 400, "model", None),
    ("unknown model", C, dict(GOOD_C, model="gpt-5"), 404, "model", "model_not_found"),
    ("unknown model, chat", CH, dict(GOOD_CH, model="gpt-5"), 404, "model", "model_not_found"),
    ("no prompt", C, {"model": MODEL}, 400, "prompt", None),
    ("empty prompt", C, dict(GOOD_C, prompt=""), 400, "prompt", None),
    ("prompt a number", C, dict(GOOD_C, prompt=5), 400, "prompt", None),
    ("two prompts", C, dict(GOOD_C, prompt=["a", "b"]), 400, "prompt", None),
    ("token id out of range", C, dict(GOOD_C, prompt=[1, 99999]), 400, "prompt", None),
    ("messages to completions", C, dict(GOOD_C, messages=[]), 400, "messages", None),
    ("no messages", CH, {"model": MODEL}, 400, "messages", None),
    ("bad role", CH, dict(GOOD_CH, messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", None),
    ("content a number", CH, dict(GOOD_CH, messages=[{"role": "user", "content": 3}]), 400,
     "messages[0].content", None),
    ("max_tokens 0", C, dict(GOOD_C, max_tokens=0), 400, "max_tokens", None),
    ("max_tokens -1, chat", CH, dict(GOOD_CH, max_tokens=-1), 400, "max_tokens", None),
    ("max_tokens a string", C, dict(GOOD_C, max_tokens="ten"), 400, "max_tokens", None),
    ("max_completion_tokens 0", CH, dict(GOOD_CH, max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("temperature -0.5", C, dict(GOOD_C, temperature=-0.5), 400, "temperature", None),
    ("temperature 1000", CH, dict(GOOD_CH, temperature=1000), 400, "temperature", None),
    ("temperature a string", C, dict(GOOD_C, temperature="hot"), 400, "temperature", None),
    ("top_p 1.5", C, dict(GOOD_C, top_p=1.5), 400, "top_p", None),
    ("top_p -0.1", CH, dict(GOOD_CH, top_p=-0.1), 400, "top_p", None),
    ("five stop strings", C, dict(GOOD_C, stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("empty stop string", C, dict(GOOD_C, stop=[""]), 400, "stop", None),
    ("stop a number", CH, dict(GOOD_CH, stop=5), 400, "stop", None),
    ("seed negative", C, dict(GOOD_C, seed=-1), 400, "seed", None),
    ("n 0", C, dict(GOOD_C, n=0), 400, "n", None),
    ("n true", CH, dict(GOOD_CH, n=True), 400, "n", None),
    ("stream a string", C, dict(GOOD_C, stream="yes"), 400, "stream", None),
    ("stream_options without stream", C, dict(GOOD_C, stream_options={"include_usage": True}),
     400, "stream_options", None),
    ("logprobs 21", C, dict(GOOD_C, logprobs=21), 400, "logprobs", None),
    ("logprobs true in completions", C, dict(GOOD_C, logprobs=True), 400, "logprobs", None),
    ("top_logprobs without logprobs", CH, dict(GOOD_CH, top_logprobs=2), 400, "top_logprobs",
     None),
    ("top_logprobs 30", CH, dict(GOOD_CH, logprobs=True, top_logprobs=30), 400,
     "top_logprobs", None),
    ("presence_penalty 3", C, dict(GOOD_C, presence_penalty=3), 400, "presence_penalty", None),
    ("echo", C, dict(GOOD_C, echo=True), 400, "echo", None),
    ("tools", CH, dict(GOOD_CH, tools=[{"type": "function"}]), 400, "tools", None),
    ("prompt over the context", C, dict(GOOD_C, prompt="O " * 400), 400, "prompt",
     "context_length_exceeded"),
    ("max_tokens past the context", C, dict(GOOD_C, max_tokens=300), 400, "max_tokens",
     "context_length_exceeded"),
    # Issue 20 (reviewers' findings, each a 500 before).
    ("JSON nested 5000 deep", C, b"[" * 5000 + b"]" * 5000, 400, None, None),
    ("JSON nested 5000 deep in the prompt", C,
     b'{"model": "bundled", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, None),
    ("lone surrogate in chat content", CH,
     b'{"model": "bundled", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages[0].content", None),
    ("lone surrogate in a content part", CH,
     b'{"model": "bundled", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\udfff"}]}]}', 400, "messages[0].content", None),
    ("stop_token_ids past the vocabulary", C, dict(GOOD_C, stop_token_ids=[5000]), 400,
     "stop_token_ids", None),
    # The engine's step refuses this row (min_tokens bans every token): the request alone
    # ends, and without streaming that is the 400 naming min_tokens.
    ("min_tokens with every token banned", C, dict(GOOD_C, min_tokens=1, max_tokens=3,
                                                    stop_token_ids=list(range(2048))),
     400, "min_tokens", None),
    ("seed + n - 1 past 2**63", C, dict(GOOD_C, seed=2**63 - 1, n=2), 400, "seed", None),
    # Second review: a surrogate quoted in an error message, and messages the template pads.
    ("lone surrogate as the model", C, b'{"model": "\\ud800", "prompt": "O"}', 404, "model",
     "model_not_found"),
    ("more messages than the context has tokens", CH,
     {"model": "bundled", "messages": [{"role": "user", "content": ""}] * 300}, 400, "messages",
     "context_length_exceeded"),
    # Issue 26: numbers far out of range (an OverflowError inside the step before), strict
    # JSON types, chat fields on completions, cache_salt checked at the door.
    ("presence_penalty 10**20", C, b'{"model": "bundled", "prompt": "O", '
     b'"presence_penalty": 100000000000000000000}', 400, "presence_penalty", None),
    ("frequency_penalty -10**20, chat", CH, dict(GOOD_CH, frequency_penalty=-10**20), 400,
     "frequency_penalty", None),
    ("seed past a C long", C, dict(GOOD_C, seed=2**70), 400, "seed", None),
    ("repetition_penalty 1e999 (JSON's inf)", C,
     b'{"model": "bundled", "prompt": "O", "repetition_penalty": 1e999}', 400,
     "repetition_penalty", None),
    ("min_tokens 10**30", C, dict(GOOD_C, min_tokens=10**30), 400, "min_tokens", None),
    ("echo 0", C, dict(GOOD_C, echo=0), 400, "echo", None),
    ("best_of true", C, dict(GOOD_C, best_of=True), 400, "best_of", None),
    ("best_of 2", C, dict(GOOD_C, best_of=2), 400, "best_of", None),
    ("max_completion_tokens on completions", C, dict(GOOD_C, max_completion_tokens=4), 400,
     "max_completion_tokens", None),
    ("top_logprobs on completions", C, dict(GOOD_C, logprobs=2, top_logprobs=2), 400,
     "top_logprobs", None),
    ("cache_salt a number", C, dict(GOOD_C, cache_salt=5), 400, "cache_salt", None),
    ("cache_salt empty, chat", CH, dict(GOOD_CH, cache_salt=""), 400, "cache_salt", None),
    ("cache_salt a lone surrogate", C,
     b'{"model": "bundled", "prompt": "O", "cache_salt": "\\ud800"}', 400, "cache_salt", None),
]


@pytest.mark.parametrize("name, path, body, status, param, code", BAD,
                         ids=[b[0] for b in BAD])
def test_every_bad_request_gets_its_4xx_and_the_error_schema(server, name, path, body, status,
                                                             param, code):
    kwargs = ({"content": body, "headers": {"content-type": "application/json"}}
              if isinstance(body, bytes) else {"json": body})
    r = httpx.post(server.url + path, timeout=WAIT_S, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize("body, fragment", [
    (dict(GOOD_C, stop_token_ids=[5000]), "stop_token_ids must lie in [0, V=2048)"),
    (dict(GOOD_C, min_tokens=1, max_tokens=3, stop_token_ids=list(range(2048))),
     "min_tokens ruled out every token"),
], ids=["at the door", "in the step"])
def test_the_engines_refusals_say_their_rule(server, body, fragment):
    """The two BAD rows the engine refuses (at make_request, and inside a step) carry the
    engine's own rule in the message, not only the field."""
    r = httpx.post(server.url + C, json=body, timeout=WAIT_S)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_huge_numbers_inside_their_ranges_run(server):
    # Issue 26's other half: a number the door lets through must not overflow in the step.
    body = dict(GOOD_C, max_tokens=4, temperature=1.0, top_k=10**30, seed=2**63 - 1,
                repetition_penalty=1e30, presence_penalty=2, frequency_penalty=-2)
    r = httpx.post(server.url + C, json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("content_type, status", [
    (None, 415), ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("application/jsonx", 415), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200)])
def test_a_body_not_sent_as_json_is_a_415(server, content_type, status):
    # vLLM's validate_json_request (vllm #11171, PR #13193) and FastAPI's strict content type:
    # only application/json (parameters allowed, case-insensitive) is parsed as JSON.
    raw = json.dumps(dict(GOOD_C, max_tokens=1)).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(server.url + C, content=raw, headers=headers, timeout=WAIT_S)
    assert r.status_code == status, r.text
    if status == 415:
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", None, "unsupported_media_type")
        assert "application/json" in error["message"]


def test_wrong_paths_and_methods_use_the_schema(server):
    r = httpx.get(server.url + "/v1/completions", timeout=WAIT_S)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(server.url + "/v1/embeddings", json={}, timeout=WAIT_S)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    for path in (C + "/", CH + "/"):        # no 307 with an empty body: the schema's 404
        r = httpx.post(server.url + path, json=GOOD_C, timeout=WAIT_S)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_the_official_client_raises_its_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="O")
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
        client.completions.create(model=MODEL, prompt="O", max_tokens=0)


def test_unknown_fields_are_ignored(client, local):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"not_a_field": 1})
    assert r.choices[0].text == local(PROMPTS[0], max_tokens=8).text


# --- public bugs of section (k) -------------------------------------------------------------

def test_k1_prompt_over_the_context_is_a_400_and_the_server_keeps_answering(server, client):
    # K1, ggml-org/llama.cpp #3817: a prompt longer than the context crashed the server.
    long_prompt = "O Romeo, Romeo! wherefore art thou Romeo? " * 40
    r = httpx.post(server.url + C, json=dict(GOOD_C, prompt=long_prompt), timeout=WAIT_S)
    assert r.status_code == 400
    assert "context holds 256" in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="O", max_tokens=2).choices


@pytest.mark.parametrize("length, ok", [(255, True), (256, False), (257, False)])
def test_k2_prompts_at_the_context_boundary(server, loaded, length, ok):
    # K2, sgl-project/sglang #9599: a prompt of context - 1 tokens crashed the server.
    # Context 256: 255 tokens leave room for one (finish_reason "length"); 256 and 257 none.
    token = loaded[1].encode(" the")[0]
    body = dict(GOOD_C, prompt=[token] * length, max_tokens=1, ignore_eos=True, temperature=0)
    r = httpx.post(server.url + C, json=body, timeout=WAIT_S)
    if ok:
        assert r.status_code == 200
        usage = r.json()["usage"]
        assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens",
                                      "total_tokens")} == {"prompt_tokens": 255,
                                                           "completion_tokens": 1,
                                                           "total_tokens": 256}
        assert r.json()["choices"][0]["finish_reason"] == "length"
    else:
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("n", [1, 2])
def test_k4_finish_reason_is_in_every_chunk_and_set_once_per_choice(server, n):
    # K4, vllm-project/vllm PR #19662 (finish_reason missing from chunks) and
    # abetlen/llama-cpp-python #735 (never set in the last chunk).
    body = dict(GOOD_CH, max_tokens=12, temperature=1.0, seed=3, n=n, stream=True)
    with httpx.stream("POST", server.url + CH, json=body, timeout=WAIT_S) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for i in range(n):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert all("finish_reason" in c for c in mine)
        reasons = [c["finish_reason"] for c in mine]
        assert reasons[:-1] == [None] * (len(mine) - 1)
        assert reasons[-1] in ("stop", "length")
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("path", [C, CH])
def test_k6_max_tokens_1_is_a_200_with_one_token(server, path):
    # K6, mistralai/mistral-inference #122: max_tokens=1 returned HTTP 500.
    good = GOOD_C if path == C else GOOD_CH
    r = httpx.post(server.url + path, json=dict(good, max_tokens=1), timeout=WAIT_S)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 1
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# --- a step that fails fails only its requests ----------------------------------------------

def test_a_failed_step_is_a_500_and_the_loop_goes_on(flaky):
    arm(flaky)
    r = httpx.post(flaky.url + C, json=dict(GOOD_C, max_tokens=4), timeout=WAIT_S)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "injected fault" in r.json()["error"]["message"]
    assert wait_idle(flaky) == IDLE
    r = httpx.post(flaky.url + C, json=dict(GOOD_C, max_tokens=4), timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_bad_logits_for_one_request_are_a_500_for_it_alone(flaky, local):
    # The engine refuses a row of NaN logits (RequestOutput.error, parameter None: the
    # request's own fields are not to blame): a 500 for that request, its neighbour untouched.
    poison = [7, 8, 9, 10]
    flaky.loop.call(lambda e: setattr(e.runner, "poison", tuple(poison))).result(WAIT_S)

    async def main():
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            return await asyncio.gather(
                http.post(flaky.url + C, json=dict(GOOD_C, prompt=poison, max_tokens=4)),
                http.post(flaky.url + C, json=dict(GOOD_C, prompt=PROMPTS[2], max_tokens=12,
                                                   temperature=0)))
    try:
        bad, good = asyncio.run(main())
    finally:
        flaky.loop.call(lambda e: setattr(e.runner, "poison", None)).result(WAIT_S)
    assert bad.status_code == 500, bad.text
    assert (bad.json()["error"]["type"], bad.json()["error"]["param"]) == ("server_error", None)
    assert "NaN" in bad.json()["error"]["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == local(PROMPTS[2], max_tokens=12).text
    assert wait_idle(flaky) == IDLE


def test_a_failure_after_streaming_began_is_an_error_event_then_done(flaky):
    body = dict(GOOD_C, max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", flaky.url + C, json=body, timeout=WAIT_S) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "text_completion" in first
        arm(flaky)
        rest = [line for line in lines if line.startswith("data: ")]
    error = json.loads(rest[-2][len("data: "):])
    assert error["error"]["type"] == "server_error" and rest[-1] == "data: [DONE]"
    assert wait_idle(flaky) == IDLE
    assert flaky.loop.failed_steps >= 1


# --- one request's failure is its own (issue 26) ---------------------------------------------

class ErrorWatcher:
    """An observer the test attaches: for each request a step ended with an error, (its id,
    the error's parameter, the ids of every row that sampled in that step)."""

    def __init__(self):
        self.failed = []

    def on_plan(self, engine, plan):
        pass

    def on_step(self, engine, result):
        self.failed += [(o.request_id, o.error.parameter, tuple(result.req_ids))
                        for o in result.outputs if o.error is not None]


def test_one_bad_request_among_good_streams_fails_alone(flaky, local):
    # repetition_penalty 1e-40 passes the door (any number > 0) and divides a positive logit
    # of a prompt token past float32's range in the step: that row is refused. Two good
    # streams decode while the bad requests (one streamed, one not) join them; the good ones
    # must be what each is alone, the bad ones a 400 / an error event naming the field.
    server, watcher = flaky, ErrorWatcher()
    assert wait_idle(server) == IDLE
    server.loop.call(lambda e: e.observers.append(watcher)).result(WAIT_S)
    goods = PROMPTS[:2]
    bad = dict(GOOD_C, prompt="ROMEO.\n", max_tokens=8, repetition_penalty=1e-40)

    async def good(client, prompt, started):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                 temperature=0, stream=True)
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
            started.release()
        return prompt, "".join(parts), reason

    async def bad_requests(http, started):
        for _ in goods:                          # both good streams are decoding by now
            await started.acquire()
        plain = http.post(server.url + C, json=bad)
        streamed = http.post(server.url + C, json=dict(bad, stream=True))
        return await asyncio.gather(plain, streamed)

    async def main():
        started = asyncio.Semaphore(0)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                      timeout=60) as client, \
                httpx.AsyncClient(timeout=WAIT_S) as http:
            return await asyncio.gather(bad_requests(http, started),
                                        *(good(client, p, started) for p in goods))

    try:
        (plain, streamed), *results = asyncio.run(main())
    finally:
        server.loop.call(lambda e: e.observers.remove(watcher)).result(WAIT_S)
    assert plain.status_code == 400, plain.text
    assert (plain.json()["error"]["param"], plain.json()["error"]["type"]) == (
        "repetition_penalty", "invalid_request_error")
    assert s04.PENALTY_OVERFLOW in plain.json()["error"]["message"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["param"] == "repetition_penalty"
    assert events[-1] == "[DONE]"
    for prompt, text, reason in results:
        want = local(prompt, max_tokens=24)
        assert (text, reason) == (want.text, want.finish_reason)
    assert [parameter for _, parameter, _ in watcher.failed] == ["repetition_penalty"] * 2
    # Each bad row was refused in a step where other rows sampled: neighbours, untouched.
    assert all(len(rows) > 1 for _, _, rows in watcher.failed), watcher.failed
    assert wait_idle(server) == IDLE


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_gone_while_uploading_its_body_logs_no_error(server):
    # Issue 26: Starlette's ClientDisconnect from the body read reached the app's 500 handler
    # (logged with a traceback) and uvicorn ("Exception in ASGI application"): twice, for a
    # client that simply left. uvicorn's loggers do not propagate to the root, so the test
    # listens on them and on the server's own.
    captured = Captured()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "s19_server")]
    level = loggers[1].level
    loggers[1].setLevel(logging.INFO)            # to see that the server heard the client go
    for logger in loggers:
        logger.addHandler(captured)
    try:
        body = json.dumps(dict(GOOD_C, prompt="O Romeo " * 100)).encode()
        head = (f"POST {C} HTTP/1.1\r\nHost: {server.host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        for _ in range(3):
            with socket.create_connection((server.host, server.port), timeout=WAIT_S) as sock:
                sock.sendall(head.encode() + body[:len(body) // 2])
                time.sleep(0.05)                 # the server waits for the rest of the body
        time.sleep(0.3)                          # ... and then hears the disconnect
        assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200
    finally:
        loggers[1].setLevel(level)
        for logger in loggers:
            logger.removeHandler(captured)
    errors = [(r.name, r.getMessage()) for r in captured.records if r.levelno >= logging.ERROR]
    assert errors == []
    gone = [r for r in captured.records if "while sending its body" in r.getMessage()]
    assert len(gone) == 3 and all(r.levelno == logging.INFO for r in gone)
    assert wait_idle(server) == IDLE


def test_cache_salt_keeps_tenants_apart_and_usage_reports_the_hits(server):
    # vLLM's cache_salt: the same prompt under another salt shares no cached block; under the
    # same salt it hits. OpenAI's usage.prompt_tokens_details.cached_tokens reports the hits,
    # in the streamed usage chunk too. The prompt is new to this server (a fresh word in it).
    prompt = f"{uuid.uuid4().hex}\n" + "First Citizen.\nBefore we proceed any further. " * 5
    a, b = f"tenant-{uuid.uuid4().hex}", f"tenant-{uuid.uuid4().hex}"

    def cached(salt, stream=False):
        body = dict(GOOD_C, prompt=prompt, max_tokens=1, temperature=0)
        if salt is not None:
            body["cache_salt"] = salt
        if not stream:
            r = httpx.post(server.url + C, json=body, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", server.url + C, json=body, timeout=WAIT_S) as response:
                usage = [e for e in sse_events(response) if e != "[DONE]"][-1]["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    prompt_tokens, first = cached(a)
    assert prompt_tokens > 2 * 16 and first == 0          # more than two blocks of 16 tokens
    assert cached(b) == (prompt_tokens, 0)                 # another tenant: nothing shared
    assert cached(None) == (prompt_tokens, 0)              # no salt is another tenant too
    _, again = cached(a)
    assert 0 < again < prompt_tokens and again % 16 == 0   # its own full blocks hit
    assert cached(a, stream=True) == (prompt_tokens, again)
    assert wait_idle(server) == IDLE


# --- record_stream: the simulator's trace ---------------------------------------------------

def test_record_stream_lines_are_what_the_server_sends(loaded, server):
    model, tok = loaded
    engine = srv.make_engine(model, tok, 4, max_num_batched_tokens=8)
    body = dict(GOOD_CH, messages=[{"role": "user", "content": "Who art thou?"}],
                max_tokens=6, temperature=0, stream_options={"include_usage": True})
    trace = srv.record_stream(engine, tok, body, "chat",
                              companions=[("ROMEO.\n", s04.SamplingParams(temperature=0,
                                                                          max_tokens=4))])
    assert trace["prompt_tokens"] == 13
    lines = trace["start"] + [x for s in trace["steps"] for x in s["lines"]] + trace["end"]
    with httpx.stream("POST", server.url + CH, json=dict(body, stream=True),
                      timeout=WAIT_S) as response:
        sent = [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: {")]
    recorded = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    strip = lambda c: {k: v for k, v in c.items() if k not in ("id", "created")}  # noqa: E731
    assert [strip(c) for c in recorded] == [strip(c) for c in sent]
    assert lines[-1] == "data: [DONE]\n\n"
    # The 13-token prompt, admitted behind the companion's 5-token prompt in a budget of 8,
    # is chunked: no line until the step whose chunk reaches its end and samples.
    mine = [s for s in trace["steps"] if any(x["id"] == "choice0" for x in s["scheduled"])]
    prefill = [s for s in mine if any(x["id"] == "choice0" and x["kind"] == "prefill"
                                      for x in s["scheduled"])]
    assert sum(x["tokens"] for s in prefill for x in s["scheduled"] if x["id"] == "choice0") \
        == 13
    assert all(not s["lines"] for s in prefill[:-1]) and prefill[-1]["lines"]
    assert all(s["num_tokens"] <= 8 for s in trace["steps"])


# --- the chapter's figure ---------------------------------------------------------------------

def test_the_figure_is_the_benchmarks_json_drawn_with_its_legend_off_the_data():
    """chapters/figures/s19_server.png is scripts/s19_figure.py's drawing of the committed
    benchmark figures (chapters/figures/s19_server.json), both ways at every concurrency, each
    ratio the median of the repeats' paired ratios, and its legend covers no data."""
    import subprocess
    import sys
    from pathlib import Path

    import matplotlib.pyplot as plt

    from legend_check import covered_by_legends
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import s19_figure
    figures = json.loads(s19_figure.DATA.read_text())
    config = figures["config"]
    assert sorted((s["way"], s["concurrency"]) for s in figures["summary"]) == sorted(
        (w, c) for w in ("server", "in-process") for c in config["concurrency"])
    assert len(figures["runs"]) == 2 * len(config["concurrency"]) * config["repeats"]
    assert config["repeats"] % 2 == 1
    runs = {(r["way"], r["concurrency"], r["repeat"]): r for r in figures["runs"]}
    for r in figures["ratios"]:
        c = r["concurrency"]
        each = sorted(runs["server", c, k]["itl"]["p50_ms"] / runs["in-process", c, k]["itl"]
                      ["p50_ms"] for k in range(config["repeats"]))
        assert r["itl_p50"] == pytest.approx(each[len(each) // 2])   # odd repeats: the middle
    assert all(not s["timed_out"] for s in figures["summary"])
    fig = s19_figure.build_figure(figures)
    assert covered_by_legends(fig) == []
    plt.close(fig)
    done = subprocess.run([sys.executable, str(root / "scripts" / "s19_figure.py"), "--check"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# --- issue 20: the reviewers' findings over HTTP ----------------------------------------------

def test_the_served_engine_is_s13_and_says_so(server, capsys):
    assert srv.ENGINE_BUILDER is s13.build_engine
    kv = server.loop.call(lambda e: e.scheduler.kv).result(WAIT_S)
    assert isinstance(kv, s13.PrefixCachingKVCacheManager)
    with pytest.raises(SystemExit):
        srv.main(["--help"])
    assert "s13_prefix_caching.build_engine" in " ".join(capsys.readouterr().out.split())
    # After a request the engine is idle with every block free, though blocks of its prompt
    # stay cached (free and hittable): S13's notion of free.
    httpx.post(server.url + C, json=dict(GOOD_C, prompt=PROMPTS[3], max_tokens=2),
               timeout=WAIT_S)
    assert wait_idle(server) == IDLE
    assert server.loop.call(lambda e: e.scheduler.kv.pool.num_cached_free_blocks
                            ).result(WAIT_S) > 0


def test_a_penalty_overflow_is_a_400_naming_the_field_streaming_or_not(server):
    # repetition_penalty 1e-40 divides a positive logit of a prompt token by 1e-40: past
    # float32's range, S04's PENALTY_OVERFLOW in the step. The request's own fault: a 400.
    body = dict(GOOD_C, prompt="ROMEO.\n", max_tokens=8, repetition_penalty=1e-40)
    r = httpx.post(server.url + C, json=body, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "repetition_penalty")
    assert s04.PENALTY_OVERFLOW in error["message"]
    chat = dict(GOOD_CH, max_tokens=8, repetition_penalty=1e-40, stream=True)
    with httpx.stream("POST", server.url + CH, json=chat, timeout=WAIT_S) as response:
        assert response.status_code == 200       # streaming had begun: the error is an event
        events = sse_events(response)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["error"]["type"] == "invalid_request_error"
    assert events[-2]["error"]["param"] == "repetition_penalty" and events[-1] == "[DONE]"
    assert wait_idle(server) == IDLE
    r = httpx.post(server.url + C, json=dict(GOOD_C, max_tokens=2), timeout=WAIT_S)
    assert r.status_code == 200


def test_a_huge_prompt_gets_a_4xx_quickly_and_health_answers_meanwhile(server):
    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(timeout=WAIT_S) as http:
            while not stop.is_set():
                start = time.monotonic()
                assert http.get(server.url + "/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.2)
        megabyte = "To be, or not to be, " * 50_000                # 1.05 MB of text
        cases = [(C, dict(GOOD_C, prompt=megabyte), 400, "prompt"),
                 (CH, dict(GOOD_CH, messages=[{"role": "user", "content": megabyte}]), 400,
                  "messages"),
                 (C, dict(GOOD_C, prompt="x" * (srv.MAX_BODY_BYTES + 1)), 413, None)]
        for path, body, status, param in cases:
            start = time.monotonic()
            r = httpx.post(server.url + path, json=body, timeout=WAIT_S)
            took = time.monotonic() - start
            assert r.status_code == status, r.text[:200]
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["param"] == param
            assert took < 5.0, f"{path} took {took:.2f} s"  # 66 kB encodes in 0.07 s here
            print(f"{len(r.request.content) / 1e6:.1f} MB body: {status} in {took:.3f} s")
    finally:
        stop.set()
        poller.join(WAIT_S)
    assert latencies and max(latencies) < 2.0, max(latencies)


@pytest.mark.parametrize("prompt, stop", [("ROMEO.\n", "I w"), ("O", "an")])
def test_streamed_text_offsets_equal_the_response_when_a_stop_string_holds_text(
        client, prompt, stop):
    body = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, logprobs=0,
                stop=[stop])
    whole = client.completions.create(**body).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **body)]
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert tokens == whole.tokens
    want = [sum(len(t) for t in whole.tokens[:k]) for k in range(len(whole.tokens))]
    assert streamed == whole.text_offset == want
    # The case at hand: some chunk showed less text than its tokens (a stop prefix held).
    assert any(c.logprobs and c.text != "".join(c.logprobs.tokens) for c in chunks)


def test_the_server_runs_no_tracer_and_record_stream_takes_its_own_off(loaded, server):
    # Tracing is an observer; the server needs none (tracing off costs nothing). Its only
    # observer is its engine loop (one tuple of scheduled ids per step, to fail a step that
    # raises). record_stream attaches S09's StepTracer for its run and takes it off after.
    observers = server.loop.call(lambda e: list(e.observers)).result(WAIT_S)
    assert observers == [server.loop]
    model, tok = loaded
    engine = srv.make_engine(model, tok, 4, 16)
    assert engine.observers == []
    body = dict(GOOD_C, prompt="ROMEO.\n", max_tokens=5, temperature=0)
    first = srv.record_stream(engine, tok, body)
    assert engine.observers == [] and not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_used_tokens == 0
    again = srv.record_stream(engine, tok, body)      # the steps count on: 5, 6, ... now
    same = lambda t: [(s["scheduled"], s["lines"]) for s in t["steps"]] + [t["end"]]  # noqa
    assert same(again) == same(first) and len(first["steps"]) >= 5
    assert again["steps"][0]["step"] == first["steps"][-1]["step"] + 1


# --- S14's flags: --quantize, --group-size, --kv-cache-dtype ----------------------------------

def test_the_command_line_with_quantize_int8_and_an_int8_kv_cache_serves_s14s_greedy_text(
        tmp_path):
    """`code/s19_server.py --quantize int8 --kv-cache-dtype int8` started as a user starts it
    (its own process, loopback, a free port): each greedy completion equals S14's engine
    (`s14_quantization.build_engine`, the same flags, built as the server builds it) run in
    process on a fresh copy of the bundled model, one request at a time."""
    import subprocess
    import sys
    from pathlib import Path

    import s14_kv_cache
    import s14_quantization as s14q
    root = Path(__file__).resolve().parents[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(root / "code" / "s19_server.py"), "--port", str(port),
             "--quantize", "int8", "--kv-cache-dtype", "int8", "--threads", "1"],
            cwd=root, stdout=out, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no /health within 120 s"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        model, tok = s06.load()                       # a fresh copy: quantized in place
        engine = srv.make_engine(model, tok, builder=s14q.build_engine, quantize="int8",
                                 kv_cache_dtype="int8")
        assert isinstance(engine.runner.cache, s14_kv_cache.QuantizedPagedKVCache)
        llm = LLM(engine)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        for prompt in PROMPTS[:3]:
            want = llm.generate(prompt, s04.SamplingParams(temperature=0.0, max_tokens=24))
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0).choices[0]
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason), prompt
    finally:
        process.terminate()
        process.wait(30)
    started = log.read_text()
    assert "weights int8 per-channel, KV cache int8, s14_quantization.build_engine" in started


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "int3"], "argument --quantize: invalid choice: 'int3'"),
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["--group-size", "32"], "--group-size needs --quantize int4"),
    (["--quantize", "q4_0", "--group-size", "32"], "--group-size needs --quantize int4"),
    (["--quantize", "int4", "--group-size", "48"], "--group-size must be one of 32, 64, 128 "
                                                   "(got 48)"),
    (["--quantize", "int4", "--group-size", "x"], "argument --group-size: invalid int value"),
])
def test_bad_quantization_flags_are_usage_errors_before_a_model_loads(argv, message, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(srv, "load_served", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        srv.main(argv)
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_fp8_kv_on_a_device_without_fp8_is_a_usage_error_naming_the_flag(capsys, monkeypatch):
    """S14's door (`check_kv_cache_dtype`), reached through the flag: refused before the
    weights are quantized or a port is opened."""
    import s14_kv_cache
    monkeypatch.setattr(s14_kv_cache, "fp8_support", lambda *a, **k: "no fp8 on this device")
    monkeypatch.setattr(srv.uvicorn, "run", lambda *a, **k: pytest.fail("it served"))
    with pytest.raises(SystemExit) as stop:
        srv.main(["--quantize", "int8", "--kv-cache-dtype", "fp8", "--device", "cpu"])
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--kv-cache-dtype: kv_cache_dtype='fp8' needs fp8 on the device: no fp8" in err
