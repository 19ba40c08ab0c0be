"""S19 exercises, reference solutions: events out of a byte stream, a stream joined into its
response, admission control in front of the server.

Try the stubs in exercises/s19_server.py first; grade these with
`python exercises/grade.py --solutions s19`.

Sources followed: the WHATWG HTML standard's "Server-sent events" (interpreting an event
stream: lines end with CR, LF or CRLF; the data field; dispatch at a blank line; an event
without data is not dispatched); OpenAI's API reference (the chunk objects, the usage chunk,
the error object); the ASGI specification (one call per request, lifespan scopes); SGLang's
--max-running-requests / --max-queued-requests and TGI's --max-concurrent-requests for the
policy (a bounded number served, a bounded queue, a refusal beyond it).
"""
from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Iterable, Sequence

from starlette.responses import JSONResponse


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


# Exercise 3: admission control ---------------------------------------------------------------

LIMITED = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}


class AdmissionLimit:
    def __init__(self, app, max_running: int, max_queued: int):
        for name, value, low in (("max_running", max_running, 1),
                                 ("max_queued", max_queued, 0)):
            if not (isinstance(value, int) and not isinstance(value, bool)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low} (got {value!r})")
        self.app, self.max_running, self.max_queued = app, max_running, max_queued
        self.running = 0                       # requests inside app
        self.waiting: deque[asyncio.Future] = deque()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope.get("method"), scope.get("path")) not in LIMITED:
            await self.app(scope, receive, send)
            return
        if self.running < self.max_running and not self.waiting:
            self.running += 1
        elif len(self.waiting) < self.max_queued:
            place = asyncio.get_running_loop().create_future()
            self.waiting.append(place)
            try:
                await place                    # _release hands its place over: running kept
            except BaseException:
                if place in self.waiting:      # gone while waiting: give its slot back
                    self.waiting.remove(place)
                elif place.done() and not place.cancelled():
                    self._release()            # handed a place it will not use
                raise
        else:
            body = {"error": {"message": f"the server is full: {self.max_running} requests "
                                         f"running and {self.max_queued} waiting; retry later",
                              "type": "rate_limit_error", "param": None,
                              "code": "too_many_requests"}}
            await JSONResponse(body, status_code=429)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._release()

    def _release(self) -> None:
        """A place is free: hand it to the first request still waiting, else count it free."""
        while self.waiting:
            place = self.waiting.popleft()
            if not place.done():
                place.set_result(None)
                return
        self.running -= 1
