"""S19 exercises, reference solutions: events out of a byte stream, a stream joined into its
response, a request checked the way the server does.

Try the stubs in exercises/s19_server.py first; grade these with
`python exercises/grade.py --solutions s19`.

Sources followed: the WHATWG HTML standard's "Server-sent events" (interpreting an event
stream: lines end with CR, LF or CRLF; the data field; dispatch at a blank line; an event
without data is not dispatched); OpenAI's API reference (the chunk objects, the usage chunk,
the error object); S19's `parse_request` (code/s19_protocol.py) for which field each rule
blames.
"""
from __future__ import annotations

import json
import math
from typing import Iterable, Sequence


# Exercise 1: events out of a byte stream -----------------------------------------------------

def sse_data(chunks: Iterable[bytes]) -> list[str]:
    events, data, line, skip_lf = [], [], bytearray(), False
    for chunk in chunks:
        for byte in chunk:
            if skip_lf and byte == 0x0A:          # the LF of a CRLF whose CR ended the line
                skip_lf = False
                continue
            skip_lf = False
            if byte not in (0x0A, 0x0D):
                line.append(byte)
                continue
            skip_lf = byte == 0x0D
            # Decode whole lines only: a piece may end inside a multi-byte character.
            text = line.decode("utf-8")
            line.clear()
            if text == "":                        # a blank line ends the event
                if data:
                    events.append("\n".join(data))
                data = []
                continue
            name, _, value = text.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    return events        # what follows the last blank line is not an event


# Exercise 2: joining a stream into its response ----------------------------------------------

def join_stream(data: Sequence[str]) -> dict:
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    usage, done = None, False
    for item in data:
        if done:
            raise ValueError("an event came after [DONE]")
        if item == "[DONE]":
            done = True
            continue
        chunk = json.loads(item)
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ValueError(f"the stream ended with an error: {message}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            i = choice["index"]
            if "delta" in choice:
                piece = choice["delta"].get("content") or ""
            else:
                piece = choice.get("text") or ""
            texts.setdefault(i, []).append(piece)
            if choice.get("finish_reason") is not None:
                reasons[i] = choice["finish_reason"]
            else:
                reasons.setdefault(i, None)
    if not done:
        raise ValueError("the stream was cut: it did not end with [DONE]")
    return {"choices": [{"index": i, "text": "".join(texts[i]), "finish_reason": reasons[i]}
                        for i in sorted(texts)],
            "usage": usage}


# Exercise 3: the server's first line of defence ----------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _error(status: int, message: str, param: str | None, code: str | None = None):
    return status, {"error": {"message": message, "type": "invalid_request_error",
                              "param": param, "code": code}}


def check_request(kind: str, body: dict, model_name: str, prompt_tokens: int,
                  max_context: int) -> tuple[int, dict] | None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return _error(400, "model is required", "model")
    if model != model_name:
        return _error(404, f"the model {model!r} does not exist", "model", "model_not_found")
    n = body.get("n")
    if n is not None and not (_is_int(n) and 1 <= n <= 128):
        return _error(400, f"n must be an integer in [1, 128] (got {n!r})", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return _error(400, f"stream must be a boolean (got {stream!r})", "stream")
    if body.get("stream_options") is not None and stream is not True:
        return _error(400, "stream_options is only allowed with stream: true", "stream_options")
    if prompt_tokens >= max_context:
        return _error(400, f"the prompt is {prompt_tokens} tokens; the context holds "
                           f"{max_context}", "messages" if kind == "chat" else "prompt",
                      "context_length_exceeded")
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > 4:
        return _error(400, f"stop may hold at most 4 sequences (got {len(stop)})", "stop")
    for name, high in (("temperature", 100), ("top_p", 1)):     # S04 checks these first
        value = body.get(name)
        if value is not None and not (_is_number(value) and 0 <= value <= high):
            return _error(400, f"{name} must be a number in [0, {high}] (got {value!r})", name)
    field = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        field = "max_completion_tokens"
    max_tokens = body.get(field)
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        return _error(400, f"{field} must be an integer >= 1 (got {max_tokens!r})", field)
    if max_tokens is not None and prompt_tokens + max_tokens > max_context:
        return _error(400, f"{prompt_tokens} prompt tokens + {max_tokens} > {max_context}",
                      field, "context_length_exceeded")
    return None
