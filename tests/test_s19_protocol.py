"""Tests for chapter S19's protocol half (code/s19_protocol.py), without a server.

Oracles: OpenAI's documented formats and limits (4 stop strings, n, the error object, the
chunk objects), S04's SamplingParams (the server must pass its fields on unchanged and its
rules through as 400s), the tokenizer, and HF `transformers`' own `apply_chat_template` with
tokenization (for a checkpoint that has a chat template).
"""
import json
import shutil

import pytest

import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
import s19_protocol as proto
from s19_protocol import APIError, Delta

MODEL = "bundled"
CONTEXT = 256


@pytest.fixture(scope="module")
def tok():
    return proto.ServingTokenizer(
        s03_checkpoint.CheckpointTokenizer.from_pretrained(s03.BUNDLED_MODEL_DIR))


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
    assert r.prompt.token_ids == tuple(tok.encode("O")) and r.prompt_tokens == 1


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
    assert str(r.prompt) == text and r.prompt.token_ids == tuple(tok.encode(text))


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
    assert list(r.prompt.token_ids) == list(want)
    assert r.prompt.token_ids[0] == 2047          # the template's token is the special id
    assert proto.ChatTemplate(s03.BUNDLED_MODEL_DIR).name == "course"


def test_serving_tokenizer_hands_the_engine_the_counted_ids(tok):
    prompt = proto.PromptIds("anything", [3, 4, 5])
    assert tok.encode(prompt) == [3, 4, 5]
    assert tok.encode("O") == tok.inner.encode("O")
    assert tok.eos_id == tok.inner.eos_id
    assert str(proto.PromptIds("", [2047])) == " "     # Part I's non-empty prompt rule holds


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
        "prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


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
