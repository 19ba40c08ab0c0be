"""Tests for S19's server with S16's flags (--async-scheduling, --compile,
--cudagraph-capture-sizes, --cuda-graphs) and S17's (--attention-backend, --num-splits), over
real HTTP with the official `openai` client.

Each server is started by `s19_server.main` itself (flags parsed, model loaded, engine built by
S16's `build_engine` over the served builder, buckets compiled at start up), with uvicorn's
`run` replaced by a catch of the app, which a `ServerThread` then serves on a free loopback
port, as tests/test_s19_speculative.py does: one server with --async-scheduling, and one with
--compile --cudagraph-capture-sizes 2 --async-scheduling (the compiled step run by the async
loop's worker thread, a batch of 1 padded to 2, one of 3 eager; its one compile, of one bucket
to keep it short, is most of this module's time), and one with --attention-backend paged
--async-scheduling (S17's C kernel in the runner, S16's async loop around it). Oracle:
the plain served engine (`make_engine`, S13's, no S16 technique) run in process through S09's
`LLM` on its own copy of the bundled model, one request at a time: the techniques change the
cost only, so greedy text, token ids (through logprobs), logprobs, finish_reason and usage
must be its, streamed and not. The engine is seen through the server's engine loop
(`app.state.engine_loop.call`): its type, its runner's counters, its idle state. A client
that disconnects aborts (every KV token back; the steps run stop long before max_tokens);
stopping the server stops the async loop's worker thread. Every bad flag combination is a
usage error (exit status 2) before a model loads, naming its flags.
"""
import contextlib
import io
import json
import threading
import time

import httpx
import openai
import pytest

import s04_sampling as s04
import s06_torch as s06
import s16_async
import s16_host
import s16_static
import s17_attention
import s17_cpu
import s19_server as srv
from s09_llm import LLM

pytestmark = pytest.mark.slow   # three servers, a few dozen requests, one compile: ~15 s

MODEL = "bundled"
PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING HENRY.\nOnce more unto the breach"]
COMMON = ["--threads", "1", "--device", "cpu", "--max-num-seqs", "4"]
ARGV = {"async": ["--async-scheduling"],
        "compiled": ["--compile", "--cudagraph-capture-sizes", "2", "--async-scheduling"],
        "paged": ["--attention-backend", "paged", "--async-scheduling"]}
STARTED = {"async": "eager steps; async scheduling",
           "compiled": "decode steps static in buckets 2, compiled; async scheduling",
           "paged": "attention backend paged, eager steps; async scheduling"}
BUILT = {"async": "s16_host.build_engine over s13_prefix_caching.build_engine",
         "compiled": "s16_host.build_engine over s13_prefix_caching.build_engine",
         "paged": "s16_host.build_engine over s17_attention.build_engine over "
                  "s13_prefix_caching.build_engine"}
WAIT_S = 30.0


def start(argv):
    """main(argv) with uvicorn.run caught: (the app it would serve, what it printed)."""
    caught, out = {}, io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(srv.uvicorn, "run", lambda app, **kw: caught.update(app=app, **kw))
        mp.setattr(srv.logging, "basicConfig", lambda **kw: None)
        with contextlib.redirect_stdout(out):
            srv.main(argv)
    return caught["app"], out.getvalue()


@pytest.fixture(scope="module")
def local():
    """The plain served engine, in process, one request at a time: the oracle."""
    model, tok = s06.load(device="cpu")
    llm = LLM(srv.make_engine(model, tok, 4))
    cache = {}

    def run(prompt, **kwargs):
        key = (prompt, json.dumps(kwargs, sort_keys=True))
        if key not in cache:
            cache[key] = llm.generate(prompt, s04.SamplingParams(temperature=0.0, **kwargs))
        return cache[key]
    run.tokenizer = tok
    return run


def client_for(running):
    return openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=sorted(ARGV))
def served(request):
    """(name, the server, its client, main's output), the server started by `main`."""
    if request.param == "compiled" and s16_static.find_cxx() is None:
        pytest.skip("inductor needs a C++ compiler")
    if request.param == "paged" and s17_cpu.find_cc() is None:
        pytest.skip("the paged CPU kernel needs a C compiler")
    app, printed = start([*ARGV[request.param], *COMMON])
    with srv.ServerThread(app) as running:
        running.loop = app.state.engine_loop
        yield request.param, running, client_for(running), printed


def engine_state(server):
    return server.loop.call(lambda e: (e.has_unfinished_requests(),
                                       e.scheduler.kv.num_used_tokens)).result(WAIT_S)


def wait_idle(server):
    deadline = time.monotonic() + WAIT_S
    while (state := engine_state(server)) != (False, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def test_main_builds_s16_over_the_served_engine_and_says_so(served):
    name, server, _, printed = served
    assert STARTED[name] in printed
    assert BUILT[name] in printed
    engine = server.loop.call(lambda e: e).result(WAIT_S)
    assert isinstance(engine, s16_async.AsyncLLMEngine)
    if name == "paged":
        runner = engine.runner
        assert isinstance(runner, s17_attention.KernelRunner)
        assert runner.backend.name == "paged"
    if name == "compiled":
        runner = engine.runner
        assert isinstance(runner, s16_static.StaticDecodeRunner) and runner.compile
        assert sorted(runner.compile_times_s) == [2]          # compiled at start up
        assert "compiling the decode step for buckets 2 ..." in printed
        assert "compiled in " in printed


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_streamed_equals_not_streamed_equals_the_plain_engine(
        served, local, prompt):
    _, _, client, _ = served
    want = local(prompt, max_tokens=24, logprobs=1)
    body = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=1)
    whole = client.completions.create(**body)
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    tok = local.tokenizer
    assert choice.logprobs.tokens == [tok.decode([t]) or "<|endoftext|>"
                                      for t in want.token_ids]
    assert choice.logprobs.token_logprobs == pytest.approx(
        [e.logprob for e in want.logprobs], abs=1e-4)
    assert whole.usage.completion_tokens == len(want.token_ids)
    assert whole.usage.prompt_tokens == len(tok.encode(prompt))

    chunks = list(client.completions.create(stream=True, stream_options={
        "include_usage": True}, **body))
    text_chunks, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks] == \
        [None] * (len(text_chunks) - 1) + [want.finish_reason]
    assert [t for c in text_chunks if c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
    assert usage.usage.completion_tokens == whole.usage.completion_tokens


def test_concurrent_streams_and_chat_each_equal_the_plain_engine(served, local):
    """Requests batched together (B up to 3; compiled: B <= 2 padded to bucket 2, B = 3
    eager), each still the request alone."""
    name, server, client, _ = served
    results, errors = {}, []

    def work(k):
        try:
            prompt = PROMPTS[k]
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                               temperature=0, stream=True)
            results[k] = "".join(c.choices[0].text for c in chunks)
        except Exception as err:          # reported below, with the thread's number
            errors.append((k, err))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors
    assert results == {k: local(p, max_tokens=16).text for k, p in enumerate(PROMPTS)}
    messages = [{"role": "user", "content": "Who art thou?"}]
    want = local("User.\nWho art thou?\n\nAssistant.\n", max_tokens=16)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                       temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
        want.text, want.finish_reason)
    assert wait_idle(server) == (False, 0)
    if name == "compiled":
        runs = server.loop.call(lambda e: dict(e.runner.steps_by_bucket)).result(WAIT_S)
        assert set(runs) == {2} and runs[2] > 0, runs


class SlowRunner:
    """The engine's runner, each step at least 4 ms: the bundled model makes 240 tokens
    faster than a client reads its first chunk (tests/test_s19_server.py's FlakyRunner)."""

    def __init__(self, runner):
        self.runner = runner

    def execute_model(self, plan, requests):
        time.sleep(0.004)
        return self.runner.execute_model(plan, requests)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_a_client_that_disconnects_mid_stream_is_aborted(served):
    _, server, _, _ = served

    def slow(engine, on):
        inner = s16_host.inner_engine(engine)
        inner.runner = SlowRunner(inner.runner) if on else inner.runner.runner

    assert wait_idle(server) == (False, 0)
    server.loop.call(lambda e: slow(e, True)).result(WAIT_S)
    try:
        before = server.loop.steps
        body = {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 240, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=WAIT_S) as http:
            with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert engine_state(server)[0]          # still running while the client reads
        assert wait_idle(server) == (False, 0)          # aborted, every KV token back
        assert server.loop.steps - before < 240
    finally:
        server.loop.call(lambda e: slow(e, False)).result(WAIT_S)


def test_stopping_the_server_stops_the_async_worker_thread(local):
    app, _ = start(["--async-scheduling", *COMMON])
    with srv.ServerThread(app) as running:
        loop = app.state.engine_loop
        r = client_for(running).completions.create(model=MODEL, prompt="O", max_tokens=4,
                                                   temperature=0)
        assert r.choices[0].text == local("O", max_tokens=4).text
        worker = loop.call(lambda e: e.worker.submit(threading.current_thread).result()
                           ).result(WAIT_S)
        assert worker.is_alive() and worker is not threading.current_thread()
    assert not loop.alive and not worker.is_alive()


@pytest.mark.parametrize("argv, message", [
    (["--async-scheduling", "--speculative", "ngram"],
     "--async-scheduling does not run with --speculative"),
    (["--cuda-graphs"], "--cuda-graphs needs a CUDA device (the model would run on cpu)"),
    (["--cudagraph-capture-sizes", "2"],
     "--cudagraph-capture-sizes needs --compile or --cuda-graphs (the sizes are"),
    (["--compile", "--cudagraph-capture-sizes", "1", "0"],
     "--cudagraph-capture-sizes must be integers in [1, 512] (got 0)"),
    (["--compile", "--cudagraph-capture-sizes", "two"],
     "argument --cudagraph-capture-sizes: invalid int value: 'two'"),
    (["--compile", "--kv-cache-dtype", "int8"],
     "--compile and --cuda-graphs write the float KV pool; --kv-cache-dtype int8"),
    (["--static-decode"], "unrecognized arguments: --static-decode"),   # the script's only
    (["--attention-backend", "paged", "--compile"],
     "--compile and --cuda-graphs run S16's static step, which has its own attention"),
    (["--attention-backend", "sdpa", "--executor-backend", "mp"],
     "--executor-backend mp runs S12's runner in the worker"),
    (["--num-splits", "2"], "--num-splits is the triton backend's split-K"),
    (["--attention-backend", "flash"], "argument --attention-backend: invalid choice: 'flash'"),
])
def test_bad_s16_flags_are_usage_errors_before_a_model_loads(argv, message, capsys,
                                                             monkeypatch):
    monkeypatch.setattr(srv, "load_served", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        srv.main([*argv, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_compile_without_a_compiler_is_a_usage_error_naming_the_flag(capsys, monkeypatch):
    monkeypatch.setattr(s16_static, "find_cxx", lambda: None)
    monkeypatch.setattr(srv, "load_served", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        srv.main(["--compile", "--device", "cpu"])
    assert stop.value.code == 2
    assert "--compile: compile on the CPU needs a C++ compiler" in " ".join(
        capsys.readouterr().err.split())
