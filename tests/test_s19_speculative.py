"""Tests for S19's server with S15's flags (--speculative, --num-speculative-tokens,
--prompt-lookup-min/max, --draft-model), over real HTTP with the official `openai` client.

The server is started by `s19_server.main` itself (its flags parsed, its model loaded, its
engine built by S15's `build_engine` over the served builder), with uvicorn's `run` replaced by
a catch of the app, which a `ServerThread` then serves on a free loopback port: one server per
method, `--speculative ngram` and `--speculative draft --draft-model int4` (the target's own
int4 copy drafts: most drafts accepted, so most steps emit several tokens). Oracle: the plain
served engine (`make_engine`, no speculation) run in process through S09's `LLM` on its own
copy of the bundled model, one request at a time: speculation may change the speed only, so
greedy text, token ids (through logprobs), logprobs, finish_reason and usage must be its. The
server's per-token bookkeeping is what a step with several tokens tests: a chunk may carry
several tokens, each with its logprobs entry and text offset, usage counts the tokens emitted
(not the drafts), and a stop string inside an accepted run ends the text where the plain
engine ends it. Every bad flag combination is a usage error (exit status 2) before a model
loads.
"""
import contextlib
import io
import json

import openai
import pytest

import s04_sampling as s04
import s06_torch as s06
import s19_server as srv
from s09_llm import LLM

pytestmark = pytest.mark.slow   # two servers, a few dozen requests: about 10 s

MODEL = "bundled"
REPEATS = "To be, or not to be, to be, or not to be, to be, or not to be"
ECHO = "Enter"              # its greedy text repeats itself: n-gram drafts accepted (10 of 14)
PROMPTS = ["ROMEO.\n", ECHO, REPEATS, "KING HENRY.\nOnce more unto the breach"]
ARGV = {"ngram": ["--speculative", "ngram", "--num-speculative-tokens", "4",
                  "--prompt-lookup-min", "2"],
        "draft": ["--speculative", "draft", "--draft-model", "int4",
                  "--num-speculative-tokens", "3"]}
STARTED = {"ngram": "speculative ngram k=4 (n-grams 2..4)",
           "draft": "speculative draft k=3 (int4 g32 sym copy of the target)"}


@pytest.fixture(scope="module")
def local():
    """The plain served engine, in process, one request at a time: the oracle."""
    model, tok = s06.load()
    llm = LLM(srv.make_engine(model, tok))
    cache = {}

    def run(prompt, **kwargs):
        key = (prompt, json.dumps(kwargs, sort_keys=True))
        if key not in cache:
            cache[key] = llm.generate(prompt, s04.SamplingParams(temperature=0.0, **kwargs))
        return cache[key]
    run.tokenizer = tok
    return run


@pytest.fixture(scope="module", params=sorted(ARGV))
def served(request):
    """(method, the server, its openai client, main's startup line): `main` with the
    method's flags, the app it would serve taken from uvicorn.run and served in a thread."""
    caught, out = {}, io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(srv.uvicorn, "run", lambda app, **kw: caught.update(app=app, **kw))
        mp.setattr(srv.logging, "basicConfig", lambda **kw: None)
        with contextlib.redirect_stdout(out):
            srv.main([*ARGV[request.param], "--threads", "1"])
    with srv.ServerThread(caught["app"]) as running:
        running.loop = caught["app"].state.engine_loop
        client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0,
                               timeout=60)
        yield request.param, running, client, out.getvalue()


def test_main_builds_s15_over_the_served_engine_and_says_so(served):
    method, server, _, started = served
    assert STARTED[method] in started
    assert "s15_speculative.build_engine over s13_prefix_caching.build_engine" in started
    proposer = server.loop.call(lambda e: e.proposer).result(10)
    assert proposer.num_speculative_tokens == (4 if method == "ngram" else 3)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_with_logprobs_equals_the_plain_engine_streaming_and_not(
        served, local, prompt):
    _, _, client, _ = served
    want = local(prompt, max_tokens=32, logprobs=2)
    body = dict(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=2)
    whole = client.completions.create(**body)
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    lp = choice.logprobs
    tok = local.tokenizer
    assert lp.tokens == [tok.decode([t]) or "<|endoftext|>" for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert [sorted(d.values(), reverse=True) for d in lp.top_logprobs] == [
        pytest.approx([v for _, v in e.top_logprobs], abs=1e-4) for e in want.logprobs]
    assert whole.usage.completion_tokens == len(want.token_ids)      # emitted, not drafted
    assert whole.usage.prompt_tokens == len(tok.encode(prompt))

    chunks = list(client.completions.create(stream=True, stream_options={
        "include_usage": True}, **body))
    text_chunks, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert [c.choices[0].finish_reason for c in text_chunks] == \
        [None] * (len(text_chunks) - 1) + [want.finish_reason]
    streamed = [c.choices[0].logprobs for c in text_chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [x for s in streamed for x in s.token_logprobs] == lp.token_logprobs
    assert usage.usage.completion_tokens == len(want.token_ids)
    assert len(text_chunks) <= len(want.token_ids)     # a chunk per step, not per token


def test_some_steps_emit_several_tokens_in_one_chunk(served, local):
    """What the server had to handle: a RequestOutput with several new_token_ids."""
    _, _, client, _ = served
    prompt = ECHO
    want = local(prompt, max_tokens=32, logprobs=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=32,
                                            temperature=0, logprobs=0, stream=True))
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs]
    assert sum(sizes) == len(want.token_ids) and max(sizes) > 1, sizes
    assert len(chunks) < len(want.token_ids)


def test_a_stop_string_inside_an_accepted_run_ends_where_the_plain_engine_ends(served, local):
    """ECHO's greedy text reaches "cotch of the cor" in a step that emits several tokens (for
    n-grams: tokens 24 to 28, drafted from the text before): the tokens after the stop string's
    last one are dropped, with their logprobs, and usage counts what is left."""
    _, _, client, _ = served
    stop = "cotch of the cor"
    want = local(ECHO, max_tokens=40, stop=[stop], logprobs=0)
    assert want.finish_reason == "stop" and want.text.endswith("the correl of the\n")
    body = dict(model=MODEL, prompt=ECHO, max_tokens=40, temperature=0, stop=[stop],
                logprobs=0)
    whole = client.completions.create(**body)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want.text, "stop")
    assert whole.usage.completion_tokens == len(want.token_ids)
    assert len(whole.choices[0].logprobs.tokens) == len(want.token_ids)
    chunks = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(chunks[-1].choices[0].logprobs.tokens) > 1        # it ended inside a run
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
            ] == whole.choices[0].logprobs.tokens


def test_greedy_chat_streaming_and_not_equals_the_plain_engine(served, local):
    _, server, client, _ = served
    messages = [{"role": "user", "content": "Who art thou?"}]
    want = local("User.\nWho art thou?\n\nAssistant.\n", max_tokens=24, logprobs=1)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                       temperature=0, logprobs=True, top_logprobs=1)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
        want.text, want.finish_reason)
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in want.logprobs], abs=1e-4)
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    idle = server.loop.call(lambda e: (e.has_unfinished_requests(),
                                       e.scheduler.kv.num_used_tokens)).result(10)
    assert idle == (False, 0)


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "beam"], "argument --speculative: invalid choice: 'beam'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"],
     "num_speculative_tokens must be an integer >= 1 (got 0)"),
    (["--speculative", "ngram", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
     "prompt_lookup_min (3) must be <= prompt_lookup_max (2)"),
    (["--speculative", "ngram", "--draft-model", "int4"], "--draft-model is for --speculative "
                                                          "draft"),
    (["--speculative", "draft", "--prompt-lookup-max", "3"],
     "prompt_lookup_max is for speculative='ngram'"),
    (["--draft-model", "int4"], "--draft-model needs --speculative"),
    (["--prompt-lookup-min", "2"], "--prompt-lookup-min needs --speculative"),
])
def test_bad_speculative_flags_are_usage_errors_before_a_model_loads(argv, message, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(srv, "load_served", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        srv.main(argv)
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_a_draft_that_cannot_load_is_a_usage_error_naming_the_flag(capsys, monkeypatch,
                                                                   tmp_path):
    monkeypatch.setattr(srv.uvicorn, "run", lambda *a, **k: pytest.fail("it served"))
    with pytest.raises(SystemExit) as stop:
        srv.main(["--speculative", "draft", "--draft-model", str(tmp_path / "none")])
    assert stop.value.code == 2
    assert "--draft-model: draft_model" in " ".join(capsys.readouterr().err.split())
