"""Tests for chapter S19's protocol half (code/s19_protocol.py), without a server.

Oracles: OpenAI's documented formats and limits (4 stop strings, n, the error object, the
chunk objects, the usage object), S04's SamplingParams (the server must pass its fields on
unchanged and its rules through as 400s, named by the error's parameter), the tokenizer, and
HF `transformers`' own `apply_chat_template` with tokenization (for a checkpoint that has a
chat template).
"""
import json
import shutil

import pytest

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
import s19_protocol as proto
from s19_protocol import APIError, Delta

MODEL = "bundled"
CONTEXT = 256


@pytest.fixture(scope="module")
def tok():
    return s03_checkpoint.CheckpointTokenizer.from_pretrained(s03.BUNDLED_MODEL_DIR)


def parse(tok, body, kind=proto.COMPLETION, **kwargs):
    return proto.parse_request(kind, dict({"model": MODEL}, **body), MODEL, tok, CONTEXT,
                               **kwargs)


def test_fields_reach_sampling_params_unchanged(tok):
    r = parse(tok, {"prompt": "O", "max_tokens": 7, "temperature": 0.5, "top_p": 0.8,
                    "seed": 11, "stop": "x", "presence_penalty": 0.5,
                    "frequency_penalty": -0.5, "top_k": 4, "min_p": 0.1,
                    "repetition_penalty": 1.1, "min_tokens": 2, "logprobs": 3})
    want = s04.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.8, seed=11, stop=("x",),
                              presence_penalty=0.5, frequency_penalty=-0.5, top_k=4,
                              min_p=0.1, repetition_penalty=1.1, min_tokens=2, logprobs=3)
    assert r.params == (want,)
    assert r.prompt_ids == tuple(tok.encode("O")) and r.prompt_tokens == 1


def test_defaults_follow_openai(tok):
    c = parse(tok, {"prompt": "O"})
    assert c.params[0].temperature == 1.0 and c.params[0].max_tokens == 16
    assert (c.stream, c.include_usage, c.logprobs, c.n) == (False, False, None, 1)
    chat = parse(tok, {"messages": [{"role": "user", "content": "Hi"}]}, proto.CHAT)
    assert chat.params[0].max_tokens == CONTEXT - chat.prompt_tokens   # the room that is left
    nulls = parse(tok, {"prompt": "O", "temperature": None, "n": None, "stop": None})
    assert nulls.params == c.params


def test_default_max_tokens_never_passes_the_context(tok):
    r = parse(tok, {"prompt": [5] * (CONTEXT - 3)})
    assert r.params[0].max_tokens == 3


def test_n_choices_use_seed_plus_index(tok):
    r = parse(tok, {"prompt": "O", "n": 3, "seed": 40})
    assert [p.seed for p in r.params] == [40, 41, 42]
    assert [p.seed for p in parse(tok, {"prompt": "O", "n": 2}).params] == [None, None]


def test_chat_max_completion_tokens_wins_and_logprobs(tok):
    r = parse(tok, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                    "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 4},
              proto.CHAT)
    assert r.params[0].max_tokens == 9 and r.params[0].logprobs == 4 and r.logprobs == 4
    r = parse(tok, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True},
              proto.CHAT)
    assert r.logprobs == 0
    r = parse(tok, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": False},
              proto.CHAT)
    assert r.logprobs is None and r.params[0].logprobs is None


def test_course_chat_template_is_the_corpus_speech_format(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Who "},
                                             {"type": "text", "text": "art thou?"}]}]
    r = parse(tok, {"messages": messages}, proto.CHAT)
    text = "System.\nBe brief.\n\nUser.\nWho art thou?\n\nAssistant.\n"
    assert r.prompt_ids == tuple(tok.encode(text))


def test_a_checkpoint_chat_template_is_rendered_by_transformers(tmp_path, tok):
    from transformers import AutoTokenizer
    directory = tmp_path / "model"
    shutil.copytree(s03.BUNDLED_MODEL_DIR, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: "
                               "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
                               "<|endoftext|>assistant: {% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    template = proto.ChatTemplate(directory)
    assert template.name == "checkpoint"
    messages = [{"role": "user", "content": "Hail <|endoftext|>"}]
    r = parse(tok, {"messages": messages}, proto.CHAT, chat_template=template)
    hf = AutoTokenizer.from_pretrained(str(directory))
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert list(r.prompt_ids) == list(want)
    assert r.prompt_ids[0] == 2047                # the template's token is the special id
    assert proto.ChatTemplate(s03.BUNDLED_MODEL_DIR).name == "course"


def test_token_id_prompts_are_passed_on_as_they_are(tok):
    # The engine runs the ids the server counted; whether each lies in [0, V) is the
    # engine's rule (LLMEngine.make_request), checked there once.
    assert parse(tok, {"prompt": [3, 4, 5]}).prompt_ids == (3, 4, 5)
    assert parse(tok, {"prompt": [2047]}).prompt_ids == (2047,)
    assert parse(tok, {"prompt": [1, 99999]}).prompt_ids == (1, 99999)


@pytest.mark.parametrize("body, status, param, fragment", [
    ({"prompt": "O", "model": "other"}, 404, "model", "does not exist"),
    ({"prompt": "O", "stop": ["a"] * 5}, 400, "stop", "at most 4"),
    ({"prompt": "O", "n": 129}, 400, "n", "[1, 128]"),
    ({"prompt": "O", "best_of": 2}, 400, "best_of", "not supported"),
    ({"prompt": "O", "logit_bias": {"1": 5}}, 400, "logit_bias", "not supported"),
    ({"prompt": "O", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "min_tokens"),
    ({"prompt": "O", "seed": 2**63}, 400, "seed", "seed must be"),
    ({"prompt": "O", "ignore_eos": 1}, 400, "ignore_eos", "bool"),
    ({"prompt": "O", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage", "boolean"),
    ({"prompt": "\ud800"}, 400, "prompt", "Unicode"),
    ({"prompt": [5] * CONTEXT}, 400, "prompt", "no room"),
    ({"prompt": [5] * 250, "max_tokens": 7}, 400, "max_tokens", "at most 6"),
    # Issue 20: values the user sent, rules checked before the request runs.
    ({"prompt": "O", "seed": 2**63 - 1, "n": 2}, 400, "seed", "seed + n - 1 must be < 2**63"),
    # Issue 26: every number checked to a finite range at the door (S04's rules), strict
    # types for the unsupported fields, chat-only fields refused on /v1/completions.
    ({"prompt": "O", "presence_penalty": 10**20}, 400, "presence_penalty", "[-2, 2]"),
    ({"prompt": "O", "frequency_penalty": -10**20}, 400, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "O", "temperature": 10**400}, 400, "temperature", "[0, 100]"),
    ({"prompt": "O", "temperature": 1e400}, 400, "temperature", "[0, 100]"),   # JSON's inf
    ({"prompt": "O", "repetition_penalty": 10**400}, 400, "repetition_penalty", "(0, inf)"),
    ({"prompt": "O", "min_p": 10**30}, 400, "min_p", "[0, 1]"),
    ({"prompt": "O", "top_k": 2.5}, 400, "top_k", "int"),
    ({"prompt": "O", "max_tokens": 10**30}, 400, "max_tokens", "ask for at most"),
    ({"prompt": "O", "n": 10**30}, 400, "n", "[1, 128]"),
    ({"prompt": "O", "logprobs": 10**30}, 400, "logprobs", "[0, 20]"),
    ({"prompt": "O", "echo": 0}, 400, "echo", "not supported"),
    ({"prompt": "O", "echo": True}, 400, "echo", "not supported"),
    ({"prompt": "O", "best_of": True}, 400, "best_of", "must be an integer"),
    ({"prompt": "O", "best_of": 1.0}, 400, "best_of", "must be an integer"),
    ({"prompt": "O", "best_of": 1, "n": 2}, 400, "best_of", ">= n"),
    ({"prompt": "O", "suffix": 0}, 400, "suffix", "not supported"),
    ({"prompt": "O", "max_completion_tokens": 5}, 400, "max_completion_tokens",
     "/v1/completions takes max_tokens"),
    ({"prompt": "O", "top_logprobs": 2}, 400, "top_logprobs", "takes logprobs"),
])
def test_refusals_name_the_rule_and_the_field(tok, body, status, param, fragment):
    with pytest.raises(APIError) as err:
        parse(tok, body)
    assert (err.value.status, err.value.param) == (status, param)
    assert fragment in err.value.message
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_the_room_exactly_fits(tok):
    r = parse(tok, {"prompt": [5] * 250, "max_tokens": 6})
    assert r.params[0].max_tokens == 6


def test_values_meaning_not_used_are_accepted_with_their_json_type(tok):
    # false, "", {} and best_of == n ask for nothing this server lacks (OpenAI's defaults).
    r = parse(tok, {"prompt": "O", "echo": False, "suffix": "", "logit_bias": {},
                    "best_of": 2, "n": 2})
    assert r.n == 2
    assert parse(tok, {"prompt": "O", "best_of": 1}).n == 1
    chat = parse(tok, {"messages": [{"role": "user", "content": "Hi"}], "tools": [],
                       "tool_choice": "none", "max_completion_tokens": 3, "top_logprobs": 1,
                       "logprobs": True}, proto.CHAT)
    assert chat.params[0].max_tokens == 3 and chat.logprobs == 1


def test_cache_salt_is_passed_on_for_the_engine_to_check(tok):
    assert parse(tok, {"prompt": "O", "cache_salt": "tenant-a"}).cache_salt == "tenant-a"
    assert parse(tok, {"prompt": "O"}).cache_salt is None
    assert "cache_salt" in proto.KNOWN          # no "ignoring unknown fields" warning


def test_engine_errors_map_to_the_field_the_client_sent(tok):
    # The mapping reads ParameterError.parameter, never the message's text.
    chat = parse(tok, {"messages": [{"role": "user", "content": "Hi"}],
                       "max_completion_tokens": 4, "logprobs": True}, proto.CHAT)
    cases = [(chat, "prompt", "messages"), (chat, "max_tokens", "max_completion_tokens"),
             (chat, "logprobs", "top_logprobs"), (chat, "cache_salt", "cache_salt"),
             (chat, None, None), (parse(tok, {"prompt": "O"}), "prompt", "prompt"),
             (parse(tok, {"prompt": "O"}), "max_tokens", "max_tokens")]
    for request, parameter, field in cases:
        err = request.refusal(s01.ParameterError("whatever the text says", parameter))
        assert (err.status, err.param, err.type) == (400, field, "invalid_request_error")
    err = chat.refusal(s01.ParameterError("max_tokens must be an integer >= 1", "max_tokens"))
    assert err.message == "max_completion_tokens must be an integer >= 1"


def test_unknown_fields_are_listed_not_refused(tok):
    assert parse(tok, {"prompt": "O", "foo": 1, "bar": None}).ignored == ("bar", "foo")


def test_json_body_rules():
    assert proto.parse_json_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"{", b"\xff", b"[]", b'"x"', b'{"t": Infinity}'):
        with pytest.raises(APIError):
            proto.parse_json_body(raw)


def meta(tok, body, kind=proto.COMPLETION):
    return proto.ResponseMeta("id-0", 0, MODEL, parse(tok, body, kind), tok)


def events(lines):
    return [line[6:-2] if line == proto.SSE_DONE else json.loads(line[6:]) for line in lines]


def test_stream_writer_completion_chunks(tok):
    writer = proto.StreamWriter(meta(tok, {"prompt": "O", "n": 2, "stream": True,
                                           "stream_options": {"include_usage": True}}))
    assert writer.start() == []
    lines = (writer.feed(Delta(1, (7,), "ab", False, None))
             + writer.feed(Delta(0, (), "", False, None))        # nothing new: no chunk
             + writer.feed(Delta(0, (8,), "c", True, "length"))
             + writer.feed(Delta(1, (2047,), "", True, "stop")))
    assert writer.done
    lines += writer.finish()
    got = events(lines)
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    assert got[-1] == "[DONE]"
    assert [c["choices"][0] for c in got[:3]] == [
        {"index": 1, "text": "ab", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "c", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in got[:3])
    assert got[3]["choices"] == [] and got[3]["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_usage_reports_the_prompt_tokens_the_cache_held(tok):
    # OpenAI's usage.prompt_tokens_details.cached_tokens, counted once, as the prompt is.
    m = meta(tok, {"prompt": [5] * 40, "n": 2, "max_tokens": 1})
    r = proto.collect_response(m, [Delta(0, (7,), "a", True, "length", None, 32),
                                   Delta(1, (8,), "b", True, "length", None, 32)])
    assert r["usage"] == {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                          "prompt_tokens_details": {"cached_tokens": 32}}


def test_stream_writer_chat_chunks_and_error(tok):
    writer = proto.StreamWriter(meta(tok, {"messages": [{"role": "user", "content": "Hi"}],
                                           "stream": True}, proto.CHAT))
    start = events(writer.start())
    assert start[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in start[0]
    mid = events(writer.feed(Delta(0, (7,), "Hi", False, None)))[0]
    assert mid["object"] == "chat.completion.chunk"
    assert mid["choices"][0] == {"index": 0, "delta": {"content": "Hi"}, "logprobs": None,
                                 "finish_reason": None}
    end = events(writer.feed(Delta(0, (2047,), "", True, "stop")))[0]
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    err = events(writer.error(APIError(500, "boom")))
    assert err == [{"error": {"message": "boom", "type": "server_error", "param": None,
                              "code": None}}, "[DONE]"]


def test_collect_response_and_logprobs_formats(tok):
    lp = s04.TokenLogprobs(7, -0.5, ((7, -0.5), (8, -1.0)))
    m = meta(tok, {"prompt": "O", "logprobs": 2})
    r = proto.collect_response(m, [Delta(0, (7,), tok.decode([7]), False, None, (lp,)),
                                   Delta(0, (8,), tok.decode([8]), True, "length", (lp,))])
    choice = r["choices"][0]
    assert choice["text"] == tok.decode([7]) + tok.decode([8])
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.5]
    assert choice["logprobs"]["text_offset"] == [0, len(tok.decode([7]))]
    assert choice["logprobs"]["top_logprobs"][0] == {tok.decode([7]): -0.5,
                                                     tok.decode([8]): -1.0}
    assert r["usage"]["completion_tokens"] == 2
    chat = meta(tok, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                      "top_logprobs": 2}, proto.CHAT)
    r = proto.collect_response(chat, [Delta(0, (7,), "x", True, "stop", (lp,))])
    content = r["choices"][0]["logprobs"]["content"][0]
    assert content["logprob"] == -0.5 and len(content["top_logprobs"]) == 2
    assert content["bytes"] == list(content["token"].encode("utf-8"))
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "x"}


def test_a_special_token_is_named_in_logprobs(tok):
    assert proto.token_text(tok, 2047) == "<|endoftext|>"


# --- issue 20: the reviewers' findings --------------------------------------------------------

def test_deeply_nested_json_is_a_400_not_a_recursion_error():
    for raw in (b"[" * 5000 + b"]" * 5000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        with pytest.raises(APIError) as err:
            proto.parse_json_body(raw)
        assert err.value.status == 400 and "nests" in err.value.message


@pytest.mark.parametrize("content", ["ab\ud800", [{"type": "text", "text": "ok"},
                                                   {"type": "text", "text": "\udfff"}]])
def test_a_lone_surrogate_in_chat_content_is_a_400(tok, content):
    with pytest.raises(APIError) as err:
        parse(tok, {"messages": [{"role": "user", "content": "Hi"},
                                 {"role": "user", "content": content}]}, proto.CHAT)
    assert (err.value.status, err.value.param) == (400, "messages[1].content")
    assert "lone surrogate" in err.value.message


def test_messages_use_the_names_the_request_sent(tok):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(APIError) as err:
        parse(tok, dict(chat, max_completion_tokens=0), proto.CHAT)
    assert err.value.param == "max_completion_tokens"
    assert err.value.message.startswith("max_completion_tokens must be")
    assert "max_tokens" not in err.value.message
    with pytest.raises(APIError) as err:
        parse(tok, dict(chat, logprobs=True, top_logprobs=30), proto.CHAT)
    assert err.value.param == "top_logprobs" and err.value.message.startswith("top_logprobs")
    with pytest.raises(APIError) as err:
        parse(tok, dict(chat, max_completion_tokens=3, min_tokens=4), proto.CHAT)
    assert "max_completion_tokens=3" in err.value.message
    # The largest seed that still works with n = 2: each choice draws from seed + i.
    r = parse(tok, {"prompt": "O", "seed": 2**63 - 2, "n": 2})
    assert [p.seed for p in r.params] == [2**63 - 2, 2**63 - 1]


class NoEncodeTokenizer:
    """Fails the test if a huge prompt is encoded or decoded (it must be refused before)."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, *args, **kwargs):
        if len(text) > 10_000:
            raise AssertionError("the huge prompt was encoded")
        return self.inner.encode(text, *args, **kwargs)

    def decode(self, ids, *args, **kwargs):
        if len(ids) > 10_000:
            raise AssertionError("the huge id prompt was decoded")
        return self.inner.decode(ids, *args, **kwargs)


def test_a_prompt_too_long_for_the_context_is_refused_before_encoding(tok):
    guard = NoEncodeTokenizer(tok)
    per_token = proto.max_token_chars(tok)
    # Independent of the helper: the longest token text of the vocabulary, or special name.
    assert per_token == max([len(tok.decode([i])) for i in range(tok.vocab_size)]
                            + [len(n) for n in tok.special_tokens])
    limit = CONTEXT * per_token
    for body, kind, param in [({"prompt": "x" * 1_000_000}, proto.COMPLETION, "prompt"),
                              ({"prompt": [5] * 1_000_000}, proto.COMPLETION, "prompt"),
                              ({"messages": [{"role": "user", "content": "x" * (limit + 1)}]},
                               proto.CHAT, "messages")]:
        with pytest.raises(APIError) as err:
            parse(guard, body, kind, max_token_chars=per_token)
        assert (err.value.status, err.value.param, err.value.code) == (
            400, param, "context_length_exceeded")
    # At the limit the prompt is encoded and counted as before (here: too many tokens).
    with pytest.raises(APIError) as err:
        parse(tok, {"prompt": "x" * limit}, max_token_chars=per_token)
    assert "tokens but the model's context holds" in err.value.message


def test_text_offsets_count_token_texts_in_both_paths(tok):
    # A stop-string prefix held back: the stream's first delta shows "" for two tokens, the
    # next shows their text and its own. Offsets come from the token texts either way.
    ids = tok.encode("To be or not")
    lp = [s04.TokenLogprobs(i, -0.5, ()) for i in ids]
    m = meta(tok, {"prompt": "O", "logprobs": 0, "stream": True})
    w = proto.StreamWriter(m)
    deltas = [Delta(0, (ids[0],), "", False, None, (lp[0],)),
              Delta(0, (ids[1],), "", False, None, (lp[1],)),
              Delta(0, tuple(ids[2:]), "To be or not", True, "length", tuple(lp[2:]))]
    streamed = [o for d in deltas for c in events(w.feed(d))
                for o in c["choices"][0]["logprobs"]["text_offset"]]
    whole = proto.collect_response(meta(tok, {"prompt": "O", "logprobs": 0}), deltas)
    texts = [tok.decode([i]) for i in ids]
    want = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"] == want
    assert proto.text_offsets(["ab", "c", ""], 5) == [5, 7, 8]


def _checkpoint_with_template(tmp_path, template: str, *, jinja_file: bool, bos: bool):
    """A copy of the bundled checkpoint with a chat template: in tokenizer_config.json or
    in chat_template.jinja beside it (how recent `transformers` saves one); with bos, a
    tokenizer whose post-processor adds a BOS (<|endoftext|>) on every encode, as Llama's
    does, and a bos_token the template can write."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    directory = tmp_path / "model"
    shutil.copytree(s03.BUNDLED_MODEL_DIR, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if jinja_file:
        (directory / "chat_template.jinja").write_text(template)
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    if bos:
        config["bos_token"] = "<|endoftext|>"
        config["add_bos_token"] = True
        hf_tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        hf_tok.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 2047)])
        hf_tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _hf_chat_ids(directory, messages):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(directory))
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(want["input_ids"] if hasattr(want, "keys") else want)


def test_a_chat_template_jinja_file_is_read(tmp_path, tok):
    # transformers saves a checkpoint's template as chat_template.jinja next to
    # tokenizer_config.json (CHAT_TEMPLATE_FILE in tokenization_utils_base.py, PR #33957).
    directory = _checkpoint_with_template(
        tmp_path, "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant> {% endif %}",
        jinja_file=True, bos=False)
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    template = proto.ChatTemplate(directory)
    assert template.name == "checkpoint"
    messages = [{"role": "user", "content": "Who art thou?"}]
    r = parse(tok, {"messages": messages}, proto.CHAT, chat_template=template)
    assert list(r.prompt_ids) == _hf_chat_ids(directory, messages)
    assert r.prompt_ids == tuple(tok.encode("user> Who art thou?\nassistant> "))


def test_a_template_that_writes_bos_gets_one_bos_not_two(tmp_path):
    # The double-BOS pitfall: the template writes BOS, and an encode that adds the
    # tokenizer's special tokens would put a second one in front. The rendered prompt is
    # encoded without them, as HF's apply_chat_template(tokenize=True) does and as vLLM's
    # chat requests do by default (add_special_tokens=False).
    directory = _checkpoint_with_template(
        tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
        jinja_file=True, bos=True)
    tok_bos = s03_checkpoint.CheckpointTokenizer.from_pretrained(directory)
    assert tok_bos.encode("user")[0] == 2047          # this tokenizer adds a BOS on encode
    messages = [{"role": "user", "content": "Hail"}]
    r = parse(tok_bos, {"messages": messages}, proto.CHAT,
              chat_template=proto.ChatTemplate(directory))
    want = _hf_chat_ids(directory, messages)
    assert want[0] == 2047 and want[1] != 2047
    assert list(r.prompt_ids) == want
    assert r.prompt_ids.count(2047) == 1


# The chapter's rules table lists parse_request's checks in the order they run: for any two
# rules, a body that breaks both is answered by the earlier one. Each body below breaks one
# rule, with its own keys; the list is in the table's order.
COMPLETION_RULES = [
    ({"model": "other"}, "model"),
    ({"echo": True}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"n": 0}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"temperature": -1}, "temperature"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": CONTEXT}, "max_tokens"),
]
CHAT_RULES = [
    ({"model": "other"}, "model"),
    ({"echo": True}, "echo"),
    ({"messages": []}, "messages"),
    ({"n": 0}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"temperature": -1}, "temperature"),
    ({"max_completion_tokens": CONTEXT}, "max_completion_tokens"),
]


@pytest.mark.parametrize("kind,rules", [(proto.COMPLETION, COMPLETION_RULES),
                                        (proto.CHAT, CHAT_RULES)])
def test_the_first_rule_broken_answers_in_the_chapters_order(tok, kind, rules):
    base = ({"prompt": "O"} if kind == proto.COMPLETION
            else {"messages": [{"role": "user", "content": "Hi"}]})
    for body, param in rules:                  # each alone breaks its rule
        with pytest.raises(APIError) as err:
            parse(tok, dict(base, **body), kind)
        assert err.value.param == param, (body, err.value.message)
    for i, (first, param) in enumerate(rules):
        for later, _ in rules[i + 1:]:
            with pytest.raises(APIError) as err:
                parse(tok, dict(base, **first, **later), kind)
            assert err.value.param == param, (first, later, err.value.message)


def test_the_character_guard_runs_before_a_prompts_surrogate_and_after_a_messages(tok):
    long = "\ud800" + "a" * CONTEXT
    with pytest.raises(APIError) as err:
        parse(tok, {"prompt": long}, max_token_chars=1)
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(APIError) as err:
        parse(tok, {"messages": [{"role": "user", "content": long}]}, proto.CHAT,
              max_token_chars=1)
    assert (err.value.param, err.value.code) == ("messages[0].content", None)


# A template that refuses a conversation the way Llama's and Mistral's do: raise_exception
# (transformers' helper in the template sandbox, raising jinja2's TemplateError).
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.mark.parametrize("jinja_file", [False, True], ids=["config", "jinja_file"])
def test_a_template_that_refuses_the_messages_is_a_400_naming_messages(tmp_path, tok,
                                                                       jinja_file):
    """The template's refusal is the request's fault: 400 invalid_request_error, param
    messages, the template's own message; a conversation it accepts still renders as HF
    renders it."""
    directory = _checkpoint_with_template(tmp_path, REFUSING_TEMPLATE, jinja_file=jinja_file,
                                          bos=False)
    template = proto.ChatTemplate(directory)
    bad = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}]
    with pytest.raises(APIError) as err:
        parse(tok, {"messages": bad}, proto.CHAT, chat_template=template)
    assert (err.value.status, err.value.type, err.value.param) == (
        400, "invalid_request_error", "messages")
    assert "Conversation roles must alternate user/assistant/user/..." in err.value.message
    good = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hail"},
            {"role": "user", "content": "again"}]
    r = parse(tok, {"messages": good}, proto.CHAT, chat_template=template)
    assert list(r.prompt_ids) == _hf_chat_ids(directory, good)


@pytest.mark.parametrize("jinja_file", [False, True], ids=["config", "jinja_file"])
def test_a_template_with_a_syntax_error_fails_when_the_server_loads_it(tmp_path, capsys,
                                                                       jinja_file):
    """transformers compiles a template only when it first renders it; the server compiles
    it when it loads the checkpoint, so a broken template stops the server at startup with
    the template's line, not every chat request with a 500. A template that merely refuses
    the probe conversation (a lone user message) is not broken: it loads."""
    import s19_server
    broken = "{% for m in messages %}{{ m['content'] }\n{% endfor %}"   # "}" for "}}"
    directory = _checkpoint_with_template(tmp_path, broken, jinja_file=jinja_file, bos=False)
    with pytest.raises(ValueError, match=r"the chat template of .* does not compile: .*"
                                         r"\(line 1 of the template\)"):
        proto.ChatTemplate(directory)
    with pytest.raises(SystemExit) as exit_:
        s19_server.main(["--model", str(directory), "--port", "0"])
    assert exit_.value.code == 2
    assert "does not compile" in capsys.readouterr().err
    fussy = tmp_path / "fussy"
    fussy.mkdir()
    picky = _checkpoint_with_template(
        fussy, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
               "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        jinja_file=jinja_file, bos=False)
    assert proto.ChatTemplate(picky).name == "checkpoint"
