"""S19, the OpenAI protocol: requests in, engine requests out; engine deltas in, JSON and SSE out.

What this file is
    The half of chapter 19's server that speaks OpenAI's HTTP API and knows nothing of HTTP
    servers, threads or event loops (code/s19_server.py is the other half). Everything here is
    a plain function or a small class, so the tests and the simulator run it without a socket.

    - `parse_request(kind, body, ...)`: one JSON body of `/v1/completions` (kind "completion")
      or `/v1/chat/completions` ("chat") -> `ParsedRequest`: the prompt's token ids (the
      server hands the engine these ids, so the ids it counts for `usage` are the ids that
      run), one S04 `SamplingParams` per choice (n choices are n engine requests), stream
      flags, logprobs, cache_salt. Every rule a request can break is an `APIError` with
      OpenAI's error schema and a 4xx status. Each rule lives in one place: the API's own
      rules (types of the API fields, n, stop count, the context length) here; the ranges of
      the sampling fields in S04's `SamplingParams`; the engine's own rules (token ids in
      [0, V), stop_token_ids in the vocabulary, cache_salt) in `LLMEngine.make_request`. The
      last two raise `s01.ParameterError`, whose `.parameter` `ParsedRequest.refusal` maps
      back to the field the client sent (max_completion_tokens for S04's max_tokens, ...).
    - Chat messages become one prompt through the checkpoint's chat template
      (`transformers`' `apply_chat_template`) when it has one, else through the course's
      template for the bundled model (`course_chat_prompt`): each message a speech of the
      corpus, "User.\\n<content>\\n\\n", then "Assistant.\\n" opens the reply.
    - `Delta`: what the engine made for one choice in one step (the server builds them from
      S09's `RequestOutput`: its tokens, text, logprobs, cached prompt tokens).
      `StreamWriter` turns deltas into server-sent events in OpenAI's chunk format;
      `collect_response` into one JSON response. Usage counts the prefix cache's hits as
      OpenAI does (`usage.prompt_tokens_details.cached_tokens`). The server and
      `record_stream` (the simulator's trace) use the same writer, so what the chapter shows
      is what the server sends.

What it does not handle
    Tools and function calls, response_format (JSON mode), logit_bias, echo, best_of other
    than n, suffix, audio or image content, the Responses API: each is refused with a 400
    naming it, never silently ignored; so are max_completion_tokens and top_logprobs sent to
    /v1/completions (chat fields that OpenAI's completions API does not have). Fields nobody
    defines are ignored with a warning (vLLM's rule).

References
    OpenAI API reference (completions, chat completions, streaming chunk objects, the usage
    object with prompt_tokens_details, the error object); vLLM's
    `vllm/entrypoints/openai/completion/protocol.py` and `chat_completion/protocol.py` (field
    names, its extra sampling fields, cache_salt, seed + index for n > 1, the context-length
    check) and `completion/serving.py` / `chat_completion/serving.py` (chunk order: role
    first, finish_reason chunk, usage chunk, [DONE]). Read to learn; written anew.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import s01_generation_loop as s01
import s04_sampling as s04

COMPLETION, CHAT = "completion", "chat"
MAX_STOP_STRINGS = 4      # OpenAI's limit ("Up to 4 sequences"); S02 allows far more
MAX_N = 128               # OpenAI's limit on n
DEFAULT_COMPLETION_TOKENS = 16   # OpenAI's legacy completions default (and vLLM's)
ROLES = ("system", "user", "assistant")
SSE_DONE = "data: [DONE]\n\n"

# SamplingParams fields a request may set: API name -> SamplingParams name. The last six are
# vLLM's extras (sent by the official client through extra_body).
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "seed": "seed",
                   "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
                   "stop_token_ids": "stop_token_ids"}
# OpenAI fields this server does not implement, and the values that mean "not used", JSON
# type included (`unused`: false is "not used", 0 is not; {} is, [] is not): any other value
# is a 400 (a request that asks for them must not get an answer without them). best_of has
# its own rule (`_check_best_of`).
UNSUPPORTED = {"echo": (False,), "suffix": ("",), "logit_bias": ({},),
               "tools": ([],), "tool_choice": ("none",), "functions": ([],),
               "function_call": ("none",), "response_format": ({"type": "text"},),
               "audio": (), "modalities": (["text"],), "prediction": (),
               "parallel_tool_calls": (), "web_search_options": ()}
# Chat fields that /v1/completions does not have, and what it takes instead. OpenAI's
# completions API (API reference, "Create completion") has neither field and answers an
# argument it does not define with a 400 ("Unrecognized request argument supplied: ...");
# vLLM's `CompletionRequest` (vllm/entrypoints/openai/completion/protocol.py) has neither
# either, so vLLM ignores them with a warning. Neither honours them, and ignoring them would
# silently give 16 tokens or no top logprobs, so this server refuses them, naming the field.
CHAT_ONLY = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs (an integer)"}
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream",
         "stream_options", "stop", "logprobs", "top_logprobs", "user", "metadata", "store",
         "service_tier", "best_of", "cache_salt", *SAMPLING_FIELDS, *UNSUPPORTED}


# ---------------------------------------------------------------------------------------------
# Errors: OpenAI's schema, {"error": {"message", "type", "param", "code"}}
# ---------------------------------------------------------------------------------------------

class APIError(Exception):
    """A request the server refuses: HTTP status (4xx for anything the client got wrong) and
    OpenAI's error object. type is "invalid_request_error" for 4xx, "server_error" for 5xx;
    param names the request field at fault (None when none is); code is a short machine
    name (OpenAI's "model_not_found", "context_length_exceeded") or None."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(obj: dict) -> str:
    """One server-sent event: "data: <json>" and a blank line (the SSE framing)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object. Raises APIError 400 for bytes that are not UTF-8
    JSON (NaN and Infinity included), JSON nested deeper than Python's parser recurses, or
    JSON that is not an object."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as err:
        raise APIError(400, f"the request body is not valid JSON ({err})") from None
    except RecursionError:      # Python's parser recurses once per [ or {: "[" * 5000 stops it
        raise APIError(400, "the request body nests arrays or objects too deeply to parse") \
            from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object (got a "
                            f"{type(body).__name__})")
    return body


def _no_constant(name: str):
    # NaN and Infinity are not JSON; Python's parser accepts them unless told otherwise.
    raise ValueError(f"{name} is not valid JSON")


# ---------------------------------------------------------------------------------------------
# Prompts: text, token ids, chat messages
# ---------------------------------------------------------------------------------------------

def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for: the longest decode([id]) of the vocabulary,
    or special-token name (a chat template's "<|im_start|>" is one token). A text of more
    than max_context * max_token_chars characters cannot fit the context (`parse_request`
    refuses it without encoding it). One pass over the vocabulary: the server computes it
    once, when it starts."""
    names = getattr(tokenizer, "special_tokens", {}) or {}
    longest = max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)
    return max(1, longest, *(len(n) for n in names))


def context_error(prompt_tokens: int | None, max_context: int, param: str,
                  chars: int | None = None) -> APIError:
    """The 400 for a prompt that leaves no room for a completion (code
    context_length_exceeded). chars: the prompt was refused by its length in characters,
    before encoding."""
    if chars is None:
        why = (f"the prompt is {prompt_tokens} tokens but the model's context holds "
               f"{max_context}, which leaves no room for a completion")
    else:
        why = (f"the prompt is {chars} characters, more than the model's context of "
               f"{max_context} tokens can hold (refused before encoding)")
    return APIError(400, why + "; shorten the prompt (it is never truncated)", param,
                    "context_length_exceeded")


def course_chat_prompt(messages: Sequence[dict]) -> str:
    """The course's chat template, for checkpoints without one (the bundled model): each
    message as a speech of the corpus, "<Role>.\\n<content>\\n\\n" (Role = System, User,
    Assistant), then "Assistant.\\n", the speaker heading the model's reply."""
    turns = "".join(f"{m['role'].capitalize()}.\n{m['content']}\n\n" for m in messages)
    return turns + "Assistant.\n"


class ChatTemplate:
    """How chat messages become one prompt for a checkpoint: its own template (the
    `chat_template` of tokenizer_config.json, or the chat_template.jinja file beside it,
    which `transformers` writes and prefers, rendered by `transformers`'
    `apply_chat_template` with add_generation_prompt=True, then encoded with its special
    tokens as special ids and none added: the template writes its own BOS) when it has one,
    else `course_chat_prompt` (plain text, encoded as any prompt).

    A template is a program, and it can fail two ways. A syntax error is the checkpoint's:
    `transformers` compiles a template only when it first renders it, so it is compiled
    here, once, and the server refuses to start (ValueError naming the template and the
    line). A template may also refuse a conversation (Llama's and Mistral's call
    raise_exception("... roles must alternate ...")): that is the request's fault, a 400
    naming messages with the template's own words (vLLM's chat serving catches
    jinja2.TemplateError while it prepares the prompt and answers 400 too)."""

    def __init__(self, checkpoint_dir: str | Path | None):
        self.hf = None
        directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
        if directory is not None and _has_chat_template(directory):
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(str(directory))
            self._compile(directory)

    def _compile(self, directory: Path) -> None:
        """Render one short conversation, which compiles the template (transformers caches
        the compiled template for the requests): a syntax error is a ValueError now. Any
        other failure is left to the requests (the template may refuse this conversation)."""
        import jinja2
        try:
            self.hf.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                        add_generation_prompt=True)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template of {directory} does not compile: "
                             f"{err.message} (line {err.lineno} of the template)") from None
        except Exception:        # noqa: BLE001 - a refusal of this conversation: not ours
            pass

    @property
    def name(self) -> str:
        return "checkpoint" if self.hf is not None else "course"

    def render(self, messages: Sequence[dict], tokenizer) -> list[int]:
        """The prompt's token ids for these messages. Raises APIError 400 (param
        "messages") when the template refuses them (a jinja2.TemplateError: its
        raise_exception, an undefined value it needs, a sandbox refusal)."""
        if self.hf is None:
            return list(tokenizer.encode(course_chat_prompt(messages)))
        import jinja2
        try:
            text = self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=True)
        except jinja2.TemplateError as err:
            raise APIError(400, f"messages: the model's chat template refused them: {err}",
                           "messages") from None
        # The template writes every special token it wants, a BOS included: encode the text
        # without the tokenizer's own (a Llama tokenizer would put a second BOS in front),
        # its special-token strings as their ids, as HF's apply_chat_template(tokenize=True)
        # and vLLM's chat requests (add_special_tokens=False by default) do.
        return list(self.hf.encode(text, add_special_tokens=False))


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").exists():
        return True
    config = directory / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def check_messages(messages) -> list[dict]:
    """messages: a non-empty list of {"role": system|user|assistant, "content": str or a list
    of {"type": "text", "text": str} parts}. Returns [{"role", "content": str}]. Raises
    APIError 400 naming the first message at fault."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty array of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object with a role and a content", where)
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {list(ROLES)} (got {role!r})",
                           f"{where}.role")
        if isinstance(content, list):     # content parts: text only
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise APIError(400, f"{where}.content: only text parts "
                                        '({"type": "text", "text": ...}) are supported',
                                   f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string (got "
                                f"{type(content).__name__})", f"{where}.content")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate ("\\ud800" in the JSON)
            raise APIError(400, f"{where}.content must be valid Unicode: "
                                f"{content[err.start]!r} at index {err.start} is a lone "
                                "surrogate, which has no UTF-8 encoding",
                           f"{where}.content") from None
        out.append({"role": role, "content": content})
    return out


def completion_prompt(prompt, tokenizer, max_context: int | None = None,
                      max_token_chars: int | None = None) -> list[int]:
    """/v1/completions' prompt as token ids: a non-empty string (encoded), a list holding
    one, or a non-empty list of token ids (ints, passed on as they are: the engine checks
    that each lies in [0, V)). Several prompts in one request (OpenAI's batch form) are
    refused: send one request per prompt. With max_context and max_token_chars, a text of
    more than max_context * max_token_chars characters is refused before it is encoded, so a
    megabyte of text costs no tokenizer time (a guard against a denial of service; the
    context rule on tokens is `parse_request`'s). Raises APIError 400."""
    if isinstance(prompt, list) and prompt and all(s01.is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise APIError(400, "prompt must be a string, a list of one string or a list of token "
                            "ids; send several prompts as several requests", "prompt")
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be a non-empty string", "prompt")
    if _too_many_chars(len(prompt), max_context, max_token_chars):
        raise context_error(None, max_context, "prompt", len(prompt))
    try:
        s01.check_text(prompt, "prompt")    # a lone surrogate has no UTF-8, so no tokens
    except s01.ParameterError as err:
        raise APIError(400, str(err), "prompt") from None
    return list(tokenizer.encode(prompt))


def _too_many_chars(chars: int, max_context: int | None, max_token_chars: int | None) -> bool:
    return (max_context is not None and max_token_chars is not None
            and chars > max_context * max_token_chars)


# ---------------------------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParsedRequest:
    """One API request, checked. kind: COMPLETION or CHAT; prompt_ids: the prompt's token ids
    (chat: after the template), what the engine runs; params: one SamplingParams per choice
    (n = len(params)); stream, include_usage; logprobs: None, or how many top logprobs each
    token carries; cache_salt: None or what the client sent (the engine checks it);
    max_tokens_field: the field that set S04's max_tokens ("max_tokens", or chat's
    "max_completion_tokens"); ignored: unknown fields (warned about)."""

    kind: str
    model: str
    prompt_ids: tuple[int, ...]
    params: tuple[s04.SamplingParams, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None
    cache_salt: object = None
    max_tokens_field: str = "max_tokens"
    ignored: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def refusal(self, err: s01.ParameterError) -> APIError:
        """The 400 for a ParameterError the engine raised for this request (at add_request,
        or inside a step because of its own parameters), param the field the client sent."""
        return _refusal(err, _renames(self.kind, self.max_tokens_field))


def _renames(kind: str, max_tokens_field: str) -> dict[str, str]:
    """Engine / SamplingParams names -> the fields of this kind of request."""
    renames = {"max_tokens": max_tokens_field}
    if kind == CHAT:
        renames.update(prompt="messages", logprobs="top_logprobs")
    return renames


def _refusal(err: s01.ParameterError, renames: dict[str, str]) -> APIError:
    """The 400 for an engine's or SamplingParams' ParameterError, in the client's field names:
    chat's prompt is its messages, S04's max_tokens is max_completion_tokens when the chat
    request set that, S04's logprobs is chat's top_logprobs."""
    return APIError(400, _as_sent(str(err), renames), renames.get(err.parameter, err.parameter))


def _as_sent(message: str, renames: dict[str, str]) -> str:
    """S04's message in the names the request used (max_completion_tokens for S04's
    max_tokens, top_logprobs for its logprobs): a rule must read in the client's terms. Only
    the words are renamed; which field is at fault comes from the error's `parameter`."""
    for name in ("max_tokens", "logprobs"):
        sent = renames.get(name, name)
        if sent != name:
            message = re.sub(rf"\b{name}\b", sent, message)
    return message


def parse_request(kind: str, body: dict, model_name: str, tokenizer, max_context: int,
                  chat_template: ChatTemplate | None = None,
                  max_token_chars: int | None = None) -> ParsedRequest:
    """Check one request body (a dict from `parse_json_body`) and turn it into engine
    requests. Raises APIError: 404 model_not_found for another model; 400 for everything
    else the request gets wrong, its param naming the field. The checks, in order: model,
    unsupported fields, prompt or messages (with the character guard), n, best_of, stream
    and stream_options, chat's logprobs, the context length, the number of stop strings,
    seed + n - 1, the sampling fields (S04's rules, completions' logprobs range among them),
    whether an explicit max_tokens fits. max_token_chars (`max_token_chars`, which
    the server computes once): refuse a prompt longer than the context can hold in
    characters before encoding it; None encodes every prompt. What the engine checks
    (token ids in [0, V), stop_token_ids in the vocabulary, cache_salt) is left to it: the
    server maps its ParameterError with `ParsedRequest.refusal`."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required: the name of the served model (GET /v1/models)",
                       "model")
    if model != model_name:
        raise APIError(404, f"The model {model!r} does not exist; this server serves "
                            f"{model_name!r}", "model", "model_not_found")
    _check_unsupported(kind, body)
    if kind == COMPLETION:
        if "messages" in body:
            raise APIError(400, "messages belongs to /v1/chat/completions; /v1/completions "
                                "takes a prompt", "messages")
        prompt_ids = completion_prompt(body.get("prompt"), tokenizer, max_context,
                                       max_token_chars)
    else:
        if "prompt" in body:
            raise APIError(400, "prompt belongs to /v1/completions; /v1/chat/completions "
                                "takes messages", "prompt")
        messages = check_messages(body.get("messages"))
        # Two guards before the template runs (a denial of service costs no tokenizer time):
        # the template gives every message a token at least, and only adds characters.
        if len(messages) >= max_context:
            raise APIError(400, f"{len(messages)} messages cannot fit in the model's context of "
                                f"{max_context} tokens, which leaves no room for a completion "
                                "(refused before encoding)", "messages", "context_length_exceeded")
        chars = sum(len(m["content"]) for m in messages)
        if _too_many_chars(chars, max_context, max_token_chars):
            raise context_error(None, max_context, "messages", chars)
        prompt_ids = (chat_template or ChatTemplate(None)).render(messages, tokenizer)
    n = _get(body, "n", 1)
    if not s01.is_int(n) or not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be an integer in [1, {MAX_N}] (got {n!r})", "n")
    _check_best_of(body.get("best_of"), n)
    stream = _get(body, "stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean (got {stream!r})", "stream")
    include_usage = _stream_options(body, stream)
    logprobs = _logprobs(kind, body)
    room = max_context - len(prompt_ids)
    if room < 1:
        raise context_error(len(prompt_ids), max_context,
                            "messages" if kind == CHAT else "prompt")
    max_tokens, max_tokens_field = body.get("max_tokens"), "max_tokens"
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        max_tokens, max_tokens_field = body["max_completion_tokens"], "max_completion_tokens"
    renames = _renames(kind, max_tokens_field)
    stop = _get(body, "stop", None)
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop may hold at most {MAX_STOP_STRINGS} sequences (got "
                            f"{len(stop)})", "stop")
    options = {SAMPLING_FIELDS[k]: v for k, v in body.items()
               if k in SAMPLING_FIELDS and v is not None}
    given = max_tokens is not None
    default = DEFAULT_COMPLETION_TOKENS if kind == COMPLETION else room
    options.update(max_tokens=max_tokens if given else min(default, room),
                   stop=stop, logprobs=logprobs)
    seed = options.pop("seed", None)
    if s01.is_int(seed) and 0 <= seed < s04.MAX_SEED and seed + n - 1 >= s04.MAX_SEED:
        raise APIError(400, f"seed + n - 1 must be < 2**63: choice i draws from seed + i "
                            f"(got seed {seed} and n {n})", "seed")
    params = []
    for i in range(n):
        # Choice i draws from seed + i (vLLM's rule), so the n choices differ and each one is
        # reproducible; without a seed every choice gets fresh entropy.
        choice_seed = seed + i if s01.is_int(seed) else seed   # not an int: S04 refuses it
        try:
            params.append(s04.SamplingParams(seed=choice_seed, **options))
        except s01.ParameterError as err:   # S04's rule, named by the field the client sent
            raise _refusal(err, renames) from None
    if given and len(prompt_ids) + max_tokens > max_context:
        raise APIError(400, f"the model's context holds {max_context} tokens, but the prompt "
                            f"is {len(prompt_ids)} and {max_tokens_field} asks for "
                            f"{max_tokens} more ({len(prompt_ids) + max_tokens}); "
                            f"ask for at most {room}", max_tokens_field,
                       "context_length_exceeded")
    ignored = tuple(sorted(k for k in body if k not in KNOWN))
    return ParsedRequest(kind, model, tuple(prompt_ids), tuple(params), stream, include_usage,
                         params[0].logprobs, body.get("cache_salt"), max_tokens_field, ignored)


def _check_unsupported(kind: str, body: dict) -> None:
    """A 400 naming the first field this server does not implement that the request uses: a
    value other than the one meaning "not used", compared with its JSON type (echo: 0 is not
    false), and on /v1/completions the chat-only fields (`CHAT_ONLY`)."""
    for name, unused in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(_same_json(value, u) for u in unused):
            raise APIError(400, f"{name} is not supported by this server (got "
                                f"{_short(value)})", name)
    if kind == COMPLETION:
        for name, instead in CHAT_ONLY.items():
            if body.get(name) is not None:
                raise APIError(400, f"{name} is a chat completions field; /v1/completions "
                                    f"takes {instead}", name)


def _same_json(value, unused) -> bool:
    """value == unused with the same JSON type (bool is not int, int is not float)."""
    return type(value) is type(unused) and value == unused


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_best_of(best_of, n: int) -> None:
    """best_of: None, or an integer >= n (OpenAI: the candidates generated server-side, of
    which the n with the highest log probability per token are returned; "best_of must be
    greater than n", and vLLM's older CompletionRequest refused best_of < n). Only best_of
    == n is served, where there is nothing to choose: every candidate is returned."""
    if best_of is None:
        return
    if not s01.is_int(best_of):
        raise APIError(400, f"best_of must be an integer (got {_short(best_of)})", "best_of")
    if best_of < n:
        raise APIError(400, f"best_of must be >= n (got best_of {best_of} and n {n})",
                       "best_of")
    if best_of > n:
        raise APIError(400, f"best_of {best_of} > n {n} is not supported by this server: it "
                            "returns every choice it generates (ask for n choices instead)",
                       "best_of")


def _get(body: dict, name: str, default):
    value = body.get(name)
    return default if value is None else value


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       "stream_options")
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(400, f"stream_options.include_usage must be a boolean (got {usage!r})",
                       "stream_options.include_usage")
    return usage


def _logprobs(kind: str, body: dict):
    """The top logprobs per token to pass to S04 as its logprobs (None: none asked).
    Completions: logprobs is the count itself (S04 checks it: an integer in [0, 20]). Chat:
    logprobs is a boolean and top_logprobs the count (S04 checks it, and the server names
    top_logprobs); top_logprobs needs logprobs: true."""
    if kind == COMPLETION:
        return body.get("logprobs")
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise APIError(400, f"logprobs must be a boolean (got {on!r})", "logprobs")
    if top is not None and not on:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if not on:
        return None
    return 0 if top is None else top


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Delta:
    """What the engine made for one choice in one step: index (the choice), token_ids (new
    ids, usually one), text (the text that became safe to show; may be ""), finished,
    finish_reason ("stop", "length"; "abort" never reaches a client), logprobs (one S04
    `TokenLogprobs` per new token when asked, else None), num_cached_tokens (the choice's
    prompt tokens the prefix cache held when it was admitted; S09's
    `RequestOutput.num_cached_tokens`)."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: tuple | None = None
    num_cached_tokens: int = 0


def token_text(tokenizer, token_id: int) -> str:
    """A token as text for logprobs: its decoded text, or its name for a special token that
    decodes to nothing ("<|endoftext|>")."""
    text = tokenizer.decode([token_id])
    if not text:
        names = {i: name for name, i in getattr(tokenizer, "special_tokens", {}).items()}
        text = names.get(token_id, "")
    return text


@dataclass
class ResponseMeta:
    """What every chunk and response of one request shares: id ("cmpl-..." or
    "chatcmpl-..."), created (Unix seconds), model, the parsed request, the tokenizer; and
    what the deltas told so far: completion_tokens and cached_tokens per choice."""

    id: str
    created: int
    model: str
    request: ParsedRequest
    tokenizer: object
    completion_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.completion_tokens = [0] * self.request.n
        self.cached_tokens = [0] * self.request.n

    def count(self, delta: Delta) -> None:
        """Add one delta to the usage counts."""
        self.completion_tokens[delta.index] += len(delta.token_ids)
        self.cached_tokens[delta.index] = delta.num_cached_tokens

    @property
    def chat(self) -> bool:
        return self.request.kind == CHAT

    def usage(self) -> dict:
        """OpenAI's usage object. The prompt is counted once however many choices run it, and
        so are its tokens found in the prefix cache (`prompt_tokens_details.cached_tokens`,
        OpenAI's field; vLLM reports the same with --enable-prompt-tokens-details): those of
        choice 0, the first admitted (the n choices are admitted together, so none of them
        finds blocks another one is still computing)."""
        made = sum(self.completion_tokens)
        return {"prompt_tokens": self.request.prompt_tokens, "completion_tokens": made,
                "total_tokens": self.request.prompt_tokens + made,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens[0]}}

    def logprobs(self, lps, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for some tokens: chat {"content": [{token, logprob,
        bytes, top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs,
        text_offset} (`text_offsets` from `offset`: the token texts before these)."""
        if lps is None:
            return None
        tok = self.tokenizer
        if self.chat:
            def entry(token_id, logprob):
                text = token_text(tok, token_id)
                return {"token": text, "logprob": _finite(logprob),
                        "bytes": list(text.encode("utf-8"))}
            return {"content": [dict(entry(lp.token_id, lp.logprob), top_logprobs=[
                entry(i, p) for i, p in lp.top_logprobs]) for lp in lps]}
        texts = [token_text(tok, lp.token_id) for lp in lps]
        return {"tokens": texts, "token_logprobs": [_finite(lp.logprob) for lp in lps],
                "top_logprobs": [{token_text(tok, i): _finite(p) for i, p in lp.top_logprobs}
                                 for lp in lps],
                "text_offset": text_offsets(texts, offset)}


def text_offsets(texts: Sequence[str], start: int = 0) -> list[int]:
    """Each token's text_offset: `start` plus the lengths of the token texts before it. The
    one rule for both paths: a stream starts each chunk where the previous chunk's token
    texts ended (not where its shown text ended: a stop-string prefix held back makes the
    shown text shorter), so streamed offsets equal the response's. Tokens of the request's
    end that a stop string cut from the text keep their entries and offsets (vLLM also
    reports every generated token), so an offset may reach past the text's end."""
    offsets = []
    for text in texts:
        offsets.append(start)
        start += len(text)
    return offsets


def _finite(x: float) -> float:
    # JSON has no -inf: a token with probability 0 (a filter removed it) gets OpenAI's floor.
    return x if math.isfinite(x) else -9999.0


class StreamWriter:
    """Engine deltas of one request -> its server-sent events, in OpenAI's chunk format.

    `start()`: chat's first chunk per choice, the role ({"role": "assistant", "content":
    ""}); nothing for completions. `feed(delta)`: one chunk per delta that carries a token or
    ends a choice (completions: object "text_completion", choice {index, text, logprobs,
    finish_reason}; chat: "chat.completion.chunk", choice {index, delta: {content},
    logprobs, finish_reason}); every choice object has finish_reason, null until its last
    chunk (vLLM PR #19662). `finish()`: the usage chunk when include_usage (choices [], every
    earlier chunk has "usage": null), then "data: [DONE]". `error(api_error)`: the error
    event sent after streaming has begun, then [DONE] (vLLM's order)."""

    def __init__(self, meta: ResponseMeta):
        self.meta = meta
        self.offsets = [0] * meta.request.n
        self.finished: set[int] = set()

    def _chunk(self, choices: list[dict]) -> dict:
        m = self.meta
        obj = {"id": m.id, "object": "chat.completion.chunk" if m.chat else "text_completion",
               "created": m.created, "model": m.model, "choices": choices}
        if m.request.include_usage:
            obj["usage"] = None
        return obj

    def start(self) -> list[str]:
        if not self.meta.chat:
            return []
        return [sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]))
                for i in range(self.meta.request.n)]

    def feed(self, delta: Delta) -> list[str]:
        if not delta.token_ids and not delta.finished:
            return []
        m, i = self.meta, delta.index
        m.count(delta)
        logprobs = m.logprobs(delta.logprobs, self.offsets[i])
        if logprobs is not None and not m.chat:   # the next chunk's tokens start here
            self.offsets[i] += sum(len(text) for text in logprobs["tokens"])
        reason = delta.finish_reason if delta.finished else None
        if delta.finished:
            self.finished.add(i)
        if m.chat:
            body = {"delta": {"content": delta.text} if delta.text or not delta.finished
                    else {}}
        else:
            body = {"text": delta.text}
        return [sse(self._chunk([{"index": i, **body, "logprobs": logprobs,
                                  "finish_reason": reason}]))]

    @property
    def done(self) -> bool:
        return len(self.finished) == self.meta.request.n

    def finish(self) -> list[str]:
        lines = []
        if self.meta.request.include_usage:
            obj = self._chunk([])
            obj["usage"] = self.meta.usage()
            lines.append(sse(obj))
        return lines + [SSE_DONE]

    def error(self, err: APIError) -> list[str]:
        return [sse(err.body()), SSE_DONE]


def collect_response(meta: ResponseMeta, deltas: Sequence[Delta]) -> dict:
    """The non-streaming response from every delta of the request: one choice per index
    (text joined, finish_reason of its last delta, logprobs of every token), and usage."""
    n = meta.request.n
    texts, reasons, lps = [[] for _ in range(n)], [None] * n, [[] for _ in range(n)]
    meta.completion_tokens, meta.cached_tokens = [0] * n, [0] * n
    for d in deltas:
        texts[d.index].append(d.text)
        meta.count(d)
        if d.logprobs:
            lps[d.index].extend(d.logprobs)
        if d.finished:
            reasons[d.index] = d.finish_reason
    asked = meta.request.logprobs is not None
    choices = []
    for i in range(n):
        text = "".join(texts[i])
        logprobs = meta.logprobs(lps[i]) if asked else None
        if meta.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": reasons[i]})
        else:
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": reasons[i]})
    return {"id": meta.id, "object": "chat.completion" if meta.chat else "text_completion",
            "created": meta.created, "model": meta.model, "choices": choices,
            "usage": meta.usage()}
