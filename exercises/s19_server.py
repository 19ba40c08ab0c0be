"""S19 exercises: reading a server-sent event stream, joining its chunks into the response,
bounding how many requests the server takes at once.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s19

The chapter's code is in code/s19_protocol.py (`StreamWriter`, `collect_response`,
`parse_request`, `APIError`, `error_body`) and code/s19_server.py (the server around them:
`build_app`, `ServerThread`, `ErrorResponse`). Write your own versions here: the graded tests
compare you with the OpenAI Python client's own SSE decoder (`openai._streaming.SSEDecoder`);
with streams worked by hand and with S06's single-request engine run alone on the same prompts
(the text and finish reason a stream must join to) and the tokenizer's count of each prompt
(its usage); and, for exercise 3, with S19's real server (`build_app` on uvicorn, on a free
loopback port) behind your middleware, driven by the official client and httpx. Reference
solutions are in exercises/solutions/ -- try first, peek later.

The wire format, in short. A streamed response is a byte stream of events; an event is one or
more lines ending with a blank line; a line is ended by LF, CR or CRLF. A line "data: x" adds
"x" to the event's data (several data lines are joined with "\\n"; one space after the colon
is dropped); a line starting with ":" is a comment; other fields (event, id, retry) are not
needed here. OpenAI's streams put one JSON chunk in each event's data and end with the event
"data: [DONE]".
"""
from __future__ import annotations

from typing import Iterable, Sequence


# Exercise 1: events out of a byte stream (3 points) ------------------------------------------
# The bytes arrive in pieces of any size: a piece may end in the middle of a line, of a CRLF,
# or of a multi-byte UTF-8 character. An event is complete only at its blank line; whatever
# follows the last blank line when the stream ends is not an event.

def sse_data(chunks: Iterable[bytes]) -> list[str]:
    """The data of every complete event in the byte stream, in order.

    chunks: the bytes as they arrived (any split). Lines end with b"\\n", b"\\r" or b"\\r\\n";
    each line is decoded as UTF-8. A line "data" or "data:<value>" appends value (one leading
    space removed) to the event's data lines; a line that starts with ":" is ignored, and so
    is a line of any other field. A blank line ends the event: if it has data lines, its data,
    the lines joined with "\\n", is the next item of the result; an event without data lines
    yields nothing.
    Example: sse_data([b'data: {"a": 1}\\n', b'\\n: ping\\n\\ndata: [DO', b'NE]\\r\\n\\r\\n'])
    -> ['{"a": 1}', "[DONE]"].
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: joining a stream into its response (4 points) -----------------------------------
# A client that streams still wants the whole answer in the end. Each chunk carries, for one
# choice (its index), a piece of text: "text" in a text_completion chunk, "delta"."content" in
# a chat.completion.chunk (the first chat chunk of each choice only says "role": "assistant").
# A choice's finish_reason is null until its last chunk. With stream_options.include_usage the
# last chunk before [DONE] has "choices": [] and the usage. An error after the stream began
# arrives as an event whose data is an OpenAI error object, {"error": {...}}.

def join_stream(data: Sequence[str]) -> dict:
    """The response a stream adds up to, from the data of its events (exercise 1's result).

    Returns {"choices": [{"index": i, "text": ..., "finish_reason": ...}, ...], "usage": the
    usage object or None}: one choice per index, sorted by index, its text the pieces joined
    in order (for chat, the delta contents), its finish_reason the one its last chunk gave.
    Raises ValueError when the data does not end with "[DONE]" (the stream was cut), when an
    event is an error object (the message names the error's message), or when an event comes
    after [DONE].
    Example: join_stream(['{"object": "text_completion", "choices": [{"index": 0, "text": "Hi",
    "finish_reason": null}]}', '{"object": "text_completion", "choices": [{"index": 0,
    "text": "!", "finish_reason": "length"}]}', "[DONE]"]) -> {"choices": [{"index": 0,
    "text": "Hi!", "finish_reason": "length"}], "usage": None}.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: admission control (3 points) ----------------------------------------------------
# S19's server takes every request it is sent: a burst of a thousand clients becomes a
# thousand engine requests, each holding its prompt's KV blocks or waiting for them, and
# every client waits longer and longer with no signal that the server is full. Production
# servers bound it: TGI's router has --max-concurrent-requests, SGLang has
# --max-running-requests and --max-queued-requests (a full queue refuses the request). Here
# the bound goes in front of the app, as ASGI middleware: it needs nothing from the engine.
#
# ASGI in short: the server calls `await app(scope, receive, send)` once per request
# (scope["type"] == "http", scope["method"], scope["path"]) and the call returns when the
# response has been sent, or raises when the client went away mid-response. A Starlette
# response is itself an ASGI app: `await response(scope, receive, send)` sends it. Other
# scope types ("lifespan": the app's startup and shutdown) must reach the app unchanged.

class AdmissionLimit:
    """ASGI middleware that bounds how many generation requests the wrapped app serves.

    app: the ASGI app (S19's `build_app(...)`). max_running >= 1: at most this many
    requests to POST /v1/completions or POST /v1/chat/completions are inside `app` at once;
    a request counts from the moment it enters `app` until its call returns or raises (a
    stream holds its place until its last event is sent or its client is gone; a request
    `app` answers with an error holds it until that answer is sent). max_queued >= 0: when
    all places are taken, at most this many more wait, first come first served, and a
    waiting request enters `app` as soon as a place is freed. A request that finds every
    place and every queue slot taken is answered at once, without entering `app`, with
    status 429 and OpenAI's error object {"error": {"message": a non-empty explanation,
    "type": "rate_limit_error", "param": None, "code": "too_many_requests"}} (the official
    client raises openai.RateLimitError for it). Every other request (GET /health,
    /v1/models, any other path or method, any scope that is not "http") passes straight to
    `app`, never counted and never refused. Raises ValueError for max_running < 1 or
    max_queued < 0 (or either not an int).
    Hint: one asyncio event loop runs every call, so plain counters need no lock; an
    asyncio Future per waiting request is a place to wait on.

    ASGI primer (the ASGI spec, "HTTP & WebSocket ASGI Message Format":
    https://asgi.readthedocs.io/en/latest/specs/www.html):
      An ASGI app is an async callable, `await app(scope, receive, send)`, called once per
      request. scope is a dict: scope["type"] is "http" for an HTTP request ("lifespan" for
      the app's startup and shutdown), and an "http" scope has scope["method"] (uppercased,
      "POST") and scope["path"] ("/v1/completions", without the query string).
      `await receive()` returns the next event from the client ({"type": "http.request",
      "body": bytes, "more_body": bool}, or {"type": "http.disconnect"}); `await send(event)`
      sends one event to it. A middleware is an ASGI app that holds another: to let a request
      in, `await self.app(scope, receive, send)` with the same three arguments; that call
      returns once the app has sent its whole response.
      A response is sent as a start event then body events. A whole JSON answer, without
      calling the app (it need not read the request body; `import json`):
          body = json.dumps({"error": {...}}).encode("utf-8")
          await send({"type": "http.response.start", "status": 429,
                      "headers": [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(body)).encode("ascii"))]})
          await send({"type": "http.response.body", "body": body})   # more_body: False
      Header names are lowercase bytes. Starlette's
      `await JSONResponse(content, status_code=429)(scope, receive, send)` sends the same
      two events.
    """

    def __init__(self, app, max_running: int, max_queued: int):
        raise NotImplementedError("exercise 3")

    async def __call__(self, scope, receive, send) -> None:
        raise NotImplementedError("exercise 3")
