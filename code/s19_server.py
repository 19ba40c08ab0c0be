"""S19, serving: an OpenAI-compatible streaming HTTP server over the step engine.

What is new since S13
    Part II built an engine that takes requests at any time (`add_request`), advances all of
    them one step at a time (`step() -> list[RequestOutput]`, one text delta per request per
    step) and drops any of them at once (`abort`, its KV freed). A server is that loop with a
    network on both ends: HTTP requests arrive while others stream, each becomes one or more
    engine requests, and each step's deltas go out as server-sent events.

    - The API is OpenAI's (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
      `/health`), so the official `openai` client, curl or any OpenAI-compatible tool talks
      to it. code/s19_protocol.py holds the protocol: request checks, error schema, chunks.
    - One thread owns the engine (`EngineLoop`): the engine is not thread-safe, and the
      event loop that serves HTTP must never wait on a model step. Handlers send commands
      (add, abort) through a lock-protected queue; the engine thread applies them between
      steps, steps while any request is unfinished and sleeps on a condition when none is
      (no busy loop), and hands each step's deltas to the event loop in one
      `loop.call_soon_threadsafe`, into one asyncio.Queue per HTTP request. vLLM's AsyncLLM
      splits the same way (an engine core process and an asyncio front end; here a thread).
    - n choices are n engine requests (they batch like any others); choice i uses seed + i
      (vLLM V1's `ParentRequest`, vllm/v1/engine/parallel_sampling.py).
    - A client that goes away aborts its engine requests: Starlette stops a streaming
      response when the client disconnects, and the response (`EventStream`) then aborts the
      choices that have not finished; a non-streaming handler watches for the disconnect
      itself. Either way `abort` frees the KV before the next step (vLLM #24584).
    - Errors have OpenAI's schema and a 4xx status for every bad request, FastAPI's 422 and
      Starlette's 404/405 included; an error after streaming has begun is one SSE event with
      the error object, then [DONE]. A step that raises fails only the requests in it (500, or
      the error event), and the loop goes on; when S04 says the request's own parameters
      broke its row (a repetition_penalty past float32's range), it is a 400 naming the field.
    - `record_stream`: one request run in-process, its SSE lines beside the engine steps that
      produced them (the chapter's simulator shows this trace).
    - The engine is a seam: `ENGINE_CLASS` and `make_engine`. It serves Part II's most complete
      engine, S13's `LLMEngine` (code/s13_engine.py: prefix caching over S12's paged KV, with
      S11's chunked prefill); S11's or S12's is the same one-line swap. The engine's trace
      keeps its last TRACE_LIMIT steps (128), so a server running for days holds a bounded
      trace. The bound is in records, not bytes: each S13 record holds snapshots of the pool
      (its free queue and cached blocks), so a record grows with num_blocks (a reviewer
      measured about 50-70 kB per record at 257-513 blocks, the requests' own state included).

What it does not handle yet
    One model, one engine thread, one process: the engine's steps and the server's JSON work
    share one Python interpreter (the GIL), which the benchmark measures as the overhead
    ratio. A request body over MAX_BODY_BYTES (4 MiB) is refused with a 413, and a prompt
    with more characters than the context can hold with a 400 before it is encoded (so a
    megabyte of text never stalls the event loop in the tokenizer). No authentication (the
    api_key is ignored), no rate limits, no request queue limit, no TLS. The steps it serves
    get cheaper in Part III (S14-S18); S20 load-tests the whole engine.

Run it
    python code/s19_server.py                       # the bundled model on 127.0.0.1:8000
    python code/s19_server.py --port 8001 --max-num-seqs 16 --max-num-batched-tokens 64
    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "bundled", "prompt": "ROMEO.\\n", "max_tokens": 20, "stream": true}'
    python benchmarks/bench_s19_server.py --quick   # TTFT / ITL over HTTP vs in-process

Tests
    tests/test_s19_server.py: a real uvicorn server on a free loopback port and the official
    client: completions and chat, streaming and not, greedy text equal to the engine run in
    process, n > 1, stop, seeds, usage, logprobs; a disconnect mid-stream frees every KV token;
    64 concurrent streams each equal to the request alone; every bad request's 4xx and error
    schema; a step that raises fails only its requests; record_stream's lines equal what the
    server sends; the public bugs K1, K2, K4, K6, G4 and G5. tests/test_s19_protocol.py: the
    protocol alone (fields into SamplingParams, templates, refusals, the chunk formats).

References
    OpenAI API reference (completions, chat, streaming, errors). vLLM's OpenAI server
    (`entrypoints/openai/api_server.py`, `serving_completion.py`, `serving_chat.py`) and
    `AsyncLLM` (a background loop that owns the engine; per-request output queues; abort on
    disconnect). FastAPI, Starlette, uvicorn documentation. Server-sent events: the WHATWG
    HTML standard, section 9.2.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import argparse
import asyncio
import concurrent.futures
import json
import logging
import re
import socket
import sys
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s13_engine as s13
import s19_protocol as proto
from s19_protocol import APIError, Delta

log = logging.getLogger("s19_server")

ENGINE_CLASS = s13.LLMEngine     # the engine served; S11's or S12's LLMEngine drops in here
DEFAULT_MODEL_NAME = "bundled"
DEFAULT_PORT = 8000
TRACE_LIMIT = 128                # engine.trace keeps the last 128 step records (S09's StepTrace)
MAX_BODY_BYTES = 4 * 2**20       # a larger request body is a 413, unread
OFF_LOOP_BYTES = 64 * 2**10      # a larger body is parsed and tokenized in a worker thread


class ErrorResponse(JSONResponse):
    """An error's JSON with every non-ASCII character escaped: an error message may quote
    what the client sent (a lone surrogate included), and that must never turn the error into
    a 500 while it is being encoded."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


def make_engine(model, tokenizer, max_num_seqs: int = 32,
                max_num_batched_tokens: int | None = None, max_context: int | None = None,
                engine_class=None, trace_limit: int | None = TRACE_LIMIT):
    """The served engine: `engine_class` (default ENGINE_CLASS, S13's) over the model, with
    the tokenizer wrapped in `ServingTokenizer` (so the engine runs the ids the server
    counted). max_context: default the model's window, at most 4096. trace_limit: the step
    records engine.trace keeps (the latest; None keeps all). Raises ValueError naming the
    rule (the engine's)."""
    engine_class = ENGINE_CLASS if engine_class is None else engine_class
    window = model.config.max_position_embeddings
    max_context = min(window, 4096) if max_context is None else max_context
    engine = engine_class(model, proto.ServingTokenizer(tokenizer), max_context, max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    engine.trace.limit = trace_limit
    return engine


# ---------------------------------------------------------------------------------------------
# The engine loop: one thread owns the engine
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineFailure:
    """Sent to a request's sink instead of a Delta when a step that ran it raised: status 500
    (the server's fault), or 400 with the field at fault for S04's known per-request failures
    (`REQUEST_FAILURES`: the request's own sampling parameters broke its row)."""

    message: str
    status: int = 500
    param: str | None = None

    def api_error(self) -> APIError:
        return APIError(self.status, self.message, self.param)


_REQUEST_PREFIX = re.compile(r"^request '([^']+)': ")
# S04's errors a row raises because of its request's own parameters (S09 names the request):
# the message -> the field to blame. A 400, not a 500: the same request fails every time.
REQUEST_FAILURES = {s04.PENALTY_OVERFLOW: "repetition_penalty",
                    s04.PENALTY_RULED_OUT: "repetition_penalty",
                    s04.MIN_TOKENS_RULED_OUT: "min_tokens"}


class EngineLoop:
    """The thread that owns `engine` and steps it while requests are unfinished.

    Thread-safe calls (any thread): `submit(requests, sink)` queues an add of several engine
    requests (one per choice) and returns a concurrent Future of their ids (it raises the
    engine's ValueError, nothing added, if any of them is refused); `abort(ids)`; `call(fn)`
    runs fn(engine) in the engine thread between steps and returns a Future of its result
    (tests and benchmarks look at the engine this way). Each `Delta` of those requests, or
    one `EngineFailure`, goes to `sink(item)` through `deliver`: after every step the engine
    thread calls deliver([(sink, item), ...]) once with all of the step's items (default:
    call each sink there and then; it must not block). The server's deliver hands the whole
    list to the event loop in one `call_soon_threadsafe`, where each sink is an asyncio
    queue's put_nowait: one wake-up of the event loop per step, not one per token (vLLM's
    AsyncLLM also moves a step's outputs as one batch). After a request's last Delta its sink
    is dropped; an aborted request's last output is dropped too (nobody is listening).
    `start()` / `stop()` / `alive`; `steps` counts engine steps, `failed_steps` the ones that
    raised.
    """

    def __init__(self, engine, deliver: Callable[[list], None] | None = None):
        self.engine = engine
        self.deliver = deliver or _call_each
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._sinks: dict[str, tuple[Callable, int]] = {}   # id -> (sink, choice index)
        self._seqs: dict[str, s01.Sequence] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.failed_steps = 0
        self._next_id = 0

    # --- called from any thread -----------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The engine thread is running (started and not stopped)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _command(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(fn)
            self._cond.notify()

    def submit(self, requests: Sequence[tuple[str, object]], sink: Callable,
               request_ids: Sequence[str] | None = None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def add() -> None:
            added = []
            try:
                for k, (prompt, params) in enumerate(requests):
                    rid = request_ids[k] if request_ids else self._new_id()
                    self.engine.add_request(prompt, params, request_id=rid)
                    added.append(rid)
            except Exception as err:             # all or nothing: take back those added
                for rid in added:
                    self.engine.abort(rid)
                future.set_exception(err)
                return
            for k, rid in enumerate(added):
                self._sinks[rid] = (sink, k)
                self._seqs[rid] = self.engine.requests.get(rid)
            future.set_result(added)

        self._command(add)
        return future

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = list(request_ids)

        def abort() -> None:
            for rid in ids:
                if self._sinks.pop(rid, None) is not None:
                    self._seqs.pop(rid, None)
                    self.engine.abort(rid)

        self._command(abort)

    def call(self, fn: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as err:
                future.set_exception(err)

        self._command(run)
        return future

    # --- the engine thread --------------------------------------------------------------

    def _new_id(self) -> str:
        self._next_id += 1
        return f"r{self._next_id}"

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while (not self._commands and not self._stopping
                       and not engine.has_unfinished_requests()):
                    self._cond.wait()        # idle: nothing to step, nothing to do
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:        # adds and aborts happen between steps only
                command()
            if engine.has_unfinished_requests():
                self._step()

    def _step(self) -> None:
        engine = self.engine
        traced = engine.trace.num_recorded
        try:
            outputs = engine.step()
        except Exception as err:            # fail the requests of this step, keep serving
            self.failed_steps += 1
            self._fail(err)
            return
        self.steps += 1
        # The trace's number of this step; None when it ran no model (only last outputs).
        trace_step = engine.trace[-1].step if engine.trace.num_recorded > traced else None
        batch = []
        for out in outputs:
            entry = self._sinks.get(out.request_id)
            if entry is None:               # aborted: its last output has no listener
                continue
            sink, index = entry
            seq = self._seqs.get(out.request_id)
            batch.append((sink, to_delta(out, seq, index, trace_step)))
            if out.finished:
                del self._sinks[out.request_id]
                self._seqs.pop(out.request_id, None)
        if batch:
            self.deliver(batch)

    def _fail(self, err: Exception) -> None:
        """A step raised. S09's step names the request a bad row belongs to ("request 'id':
        ..."): only it fails, with a 400 naming the field when the error is one of S04's
        REQUEST_FAILURES. Otherwise every request the step scheduled fails (S10's `revert`
        gave their KV back), a 500. Each is aborted and told; the others go on."""
        match = _REQUEST_PREFIX.match(str(err))
        out = getattr(self.engine, "scheduler_output", None)
        if match:
            ids = [match.group(1)]
        elif out is not None and out.num_scheduled_tokens:
            ids = list(out.num_scheduled_tokens)
        else:
            ids = list(self._sinks)         # nothing else to blame: fail all, never spin
        log.error("engine step failed for %s: %s: %s", ids, type(err).__name__, err)
        reason = str(err)[match.end():] if match else None
        if reason in REQUEST_FAILURES:
            failure = EngineFailure(f"this request's sampling parameters failed while it ran: "
                                    f"{reason}", 400, REQUEST_FAILURES[reason])
        else:
            failure = EngineFailure(f"the engine failed while running this request "
                                    f"({type(err).__name__}: {err})")
        batch = []
        for rid in ids:
            entry = self._sinks.pop(rid, None)
            self._seqs.pop(rid, None)
            self.engine.abort(rid)
            if entry is not None:
                batch.append((entry[0], failure))
        if batch:
            self.deliver(batch)


def _call_each(batch: list) -> None:
    for sink, item in batch:
        sink(item)


def to_delta(out: s01.RequestOutput, seq: s01.Sequence | None, index: int,
             step: int | None) -> Delta:
    """One engine output as the protocol's Delta: the new tokens' logprobs are the last
    entries of the request's logprobs list (S04 appends one per sampled token)."""
    logprobs = None
    if seq is not None and seq.logprobs is not None and out.new_token_ids:
        logprobs = tuple(seq.logprobs[len(seq.logprobs) - len(out.new_token_ids):])
    return Delta(index, tuple(out.new_token_ids), out.text_delta, out.finished,
                 out.finish_reason, logprobs, step)


# ---------------------------------------------------------------------------------------------
# The HTTP app
# ---------------------------------------------------------------------------------------------

def build_app(engine, model_name: str = DEFAULT_MODEL_NAME, chat_template=None,
              engine_loop: EngineLoop | None = None):
    """The FastAPI app serving `engine` (built by `make_engine`) as `model_name`.

    chat_template: a `s19_protocol.ChatTemplate` (default: the course's template). The app
    starts its `EngineLoop` on startup and stops it on shutdown; `app.state.engine_loop` is
    it (tests look at the engine through `app.state.engine_loop.call`)."""
    if not isinstance(engine.tokenizer, proto.ServingTokenizer):
        raise ValueError("build the engine with make_engine: the server hands it token ids "
                         "through a ServingTokenizer")
    loop_ = engine_loop or EngineLoop(engine)
    template = chat_template or proto.ChatTemplate(None)
    tokenizer = engine.tokenizer
    tokenizer.max_token_chars          # computed once now, not on the first request
    created_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        aio = asyncio.get_running_loop()
        # A step's items cross to the event loop in one call; there each sink is a queue's
        # put_nowait.
        loop_.deliver = lambda batch: aio.call_soon_threadsafe(_call_each, batch)
        loop_.start()
        try:
            yield
        finally:
            loop_.stop()

    # redirect_slashes off: POST /v1/completions/ is a 404 with the error schema, not
    # Starlette's empty 307 to the path without the slash.
    app = FastAPI(title="LLM course, chapter 19", lifespan=lifespan, redirect_slashes=False)
    app.state.engine_loop = loop_

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return ErrorResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, err):       # FastAPI's 422 -> OpenAI's 400
        first = (err.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return ErrorResponse(proto.error_body(f"invalid request: {first.get('msg', err)}",
                                             param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):   # unknown path 404, wrong method 405
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            err.status_code, str(err.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return ErrorResponse(proto.error_body(message, code=code), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):
        log.exception("unexpected error")
        return ErrorResponse(proto.error_body(f"internal error: {type(err).__name__}: {err}",
                                             "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created_at, "owned_by": "llm-course",
                                            "max_model_len": engine.max_context}]}

    def parse(raw: bytes, kind: str) -> proto.ParsedRequest:
        return proto.parse_request(kind, proto.parse_json_body(raw), model_name, tokenizer,
                                   engine.max_context, template)

    async def serve(request: Request, kind: str):
        raw = await read_body(request)
        if len(raw) > OFF_LOOP_BYTES:       # the JSON parser and the tokenizer, off the loop
            parsed = await asyncio.get_running_loop().run_in_executor(None, parse, raw, kind)
        else:
            parsed = parse(raw, kind)
        if parsed.ignored:
            log.warning("ignoring unknown fields %s", list(parsed.ignored))
        queue: asyncio.Queue = asyncio.Queue()
        try:
            ids = await asyncio.wrap_future(loop_.submit(
                [(parsed.prompt, p) for p in parsed.params], queue.put_nowait))
        except ValueError as err:           # the engine refused the request (its rule named)
            field = str(err).split(" ", 1)[0]
            param = field if field in proto.SAMPLING_FIELDS else (
                "messages" if kind == proto.CHAT else "prompt")
            raise APIError(400, str(err), param) from None
        prefix = "chatcmpl-" if kind == proto.CHAT else "cmpl-"
        meta = proto.ResponseMeta(prefix + uuid.uuid4().hex, int(time.time()), model_name,
                                  parsed, tokenizer)
        if parsed.stream:
            writer = proto.StreamWriter(meta)
            return EventStream(stream(writer, queue),
                               on_close=lambda: writer.done or loop_.abort(ids))
        try:
            return await collect(request, meta, queue, ids)
        except ClientGone:                  # nobody reads this; 499 is nginx's name for it
            return Response(status_code=499)

    async def stream(writer, queue):
        for line in writer.start():
            yield line
        while not writer.done:
            item = await queue.get()
            if isinstance(item, EngineFailure):
                for line in writer.error(item.api_error()):
                    yield line
                return
            for line in writer.feed(item):
                yield line
        for line in writer.finish():
            yield line

    async def collect(request, meta, queue, ids):
        deltas, finished = [], 0
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while finished < meta.request.n:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, gone},
                                             return_when=asyncio.FIRST_COMPLETED)
                if get not in done:         # the client went away: nobody to answer
                    get.cancel()
                    raise ClientGone()
                item = get.result()
                if isinstance(item, EngineFailure):
                    raise item.api_error()
                deltas.append(item)
                finished += item.finished
        finally:
            gone.cancel()
            if finished < meta.request.n:
                loop_.abort(ids)
        return JSONResponse(proto.collect_response(meta, deltas))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, proto.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, proto.CHAT)

    return app


async def read_body(request: Request) -> bytes:
    """The request body, refused with a 413 when larger than MAX_BODY_BYTES: at once when its
    Content-Length says so, else as soon as that many bytes have come."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large(int(length))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large(size)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; this server takes at most "
                         f"{MAX_BODY_BYTES} ({MAX_BODY_BYTES // 2**20} MiB)", None,
                    "request_too_large")


class EventStream(StreamingResponse):
    """A server-sent-event response that calls on_close() however it ends: every event sent,
    the client gone (Starlette cancels the sending when it sees the disconnect), or gone
    before the first event (then the generator never ran, so a `finally` inside it would
    not either). The server's on_close aborts the choices that have not finished."""

    def __init__(self, content, on_close: Callable[[], object]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ClientGone(Exception):
    """A non-streaming request whose client disconnected before its answer."""


async def _disconnected(request) -> None:
    """Returns when the client has disconnected (the body is read, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------------------------
# Running it: a real server in a thread (tests, notebook, benchmark), and the command line
# ---------------------------------------------------------------------------------------------

class ServerThread:
    """A uvicorn server for `app` in a background thread, on a socket bound before it starts
    (port 0: the OS picks a free port, so tests never collide). `url` is the base URL
    ("http://127.0.0.1:PORT"), `base_url` the OpenAI client's ("…/v1"). `stop()` shuts it
    down (the app's engine loop with it). Use as a context manager."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout: float = 60.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_thread(engine, model_name: str = DEFAULT_MODEL_NAME, chat_template=None,
                    host: str = "127.0.0.1", port: int = 0) -> ServerThread:
    """`build_app(engine, ...)` served by uvicorn in a thread on a free port (port 0)."""
    return ServerThread(build_app(engine, model_name, chat_template), host, port)


def load_served(model: str | None, device: str | None = None):
    """(model, tokenizer, chat template, checkpoint dir) for --model: a local checkpoint
    directory, or (only when it is not a directory) a hub id, with S03's clear error
    offline. Raises ValueError (CheckpointError)."""
    directory = s03_checkpoint.resolve_checkpoint(model or s03.BUNDLED_MODEL_DIR)
    torch_model, tokenizer = s06.load(directory, device)
    return torch_model, tokenizer, proto.ChatTemplate(directory), directory


# ---------------------------------------------------------------------------------------------
# The simulator's trace: one request's SSE lines beside the engine steps
# ---------------------------------------------------------------------------------------------

def record_stream(engine, body: dict, kind: str = proto.COMPLETION,
                  model_name: str = DEFAULT_MODEL_NAME, companions: Sequence[tuple] = (),
                  chat_template=None, max_steps: int = 10_000) -> dict:
    """Run one streaming request in-process, without HTTP, and record what the server would
    send beside the engine steps that produced it.

    body: the request's JSON body (its "stream" is forced true). companions: other requests
    running beside it, (prompt, SamplingParams) pairs added to the engine first (ids "c0",
    "c1", ...), so the trace shows batching. The engine must be idle (built by `make_engine`;
    its tokenizer a `ServingTokenizer`). Uses the server's own parser and `StreamWriter`, so
    the lines are the server's (id "cmpl-0" / "chatcmpl-0" and created 0, to be
    reproducible). Returns {"kind", "request": body, "prompt_tokens", "start": lines before
    any step (chat's role chunks), "steps": [{"step", "num_tokens", "token_budget",
    "scheduled": [{"id", "tokens", "kind"}] (S11's kinds, "prefill"/"decode"), "lines"
    (this request's SSE lines from this step, maybe [])}], "end": the usage chunk and [DONE]}.
    Raises APIError for a bad body, ValueError when the engine is busy."""
    if engine.has_unfinished_requests():
        raise ValueError("record_stream needs an idle engine")
    body = dict(body, stream=True)
    parsed = proto.parse_request(kind, body, model_name, engine.tokenizer, engine.max_context,
                                 chat_template)
    for k, (prompt, params) in enumerate(companions):
        engine.add_request(prompt, params, request_id=f"c{k}")
    ids = [f"choice{i}" for i in range(parsed.n)]
    for rid, params in zip(ids, parsed.params):
        engine.add_request(parsed.prompt, params, request_id=rid)
    seqs = {rid: engine.requests[rid] for rid in ids}
    meta = proto.ResponseMeta(("chatcmpl-" if kind == proto.CHAT else "cmpl-") + "0", 0,
                              model_name, parsed, engine.tokenizer)
    writer = proto.StreamWriter(meta)
    trace = {"kind": kind, "request": body, "prompt_tokens": parsed.prompt_tokens,
             "start": writer.start(), "steps": [], "end": []}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        traced = engine.trace.num_recorded
        outputs = engine.step()
        ran = engine.trace.num_recorded > traced   # a step that only returned outputs ran none
        record = engine.trace[-1] if ran else None
        lines = []
        for out in outputs:
            if out.request_id in seqs:
                lines += writer.feed(to_delta(out, seqs[out.request_id],
                                              ids.index(out.request_id),
                                              record.step if ran else None))
        if record is None:
            if lines:
                trace["steps"].append({"step": None, "num_tokens": 0, "token_budget": None,
                                       "scheduled": [], "lines": lines})
            continue
        kinds = dict(zip(record.running, getattr(record, "kinds", ())))
        trace["steps"].append({
            "step": record.step, "num_tokens": record.num_tokens,
            "token_budget": getattr(record, "token_budget", None),
            "scheduled": [{"id": rid, "tokens": n, "kind": kinds.get(rid)}
                          for rid, n in zip(record.running, record.num_scheduled_tokens)],
            "lines": lines})
    trace["end"] = writer.finish()
    return trace


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 19: an OpenAI-compatible streaming server over the step engine "
                    f"({ENGINE_CLASS.__module__}.{ENGINE_CLASS.__name__}: S13's prefix "
                    "caching over S12's paged KV and S11's chunked prefill).")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, or a Hugging Face hub id when it is not a "
                             "directory (default: the bundled model)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as model (default: 'bundled' for the "
                             "bundled model, else the --model value)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="most requests running at once (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens per step; longer prompts are chunked (S11) "
                             "(default: max-num-seqs x the context, no chunking)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="longest context a request may reach (default: the model's "
                             "window, at most 4096)")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, as S07 (default: %(default)s)")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    if not 1 <= args.threads <= cores:
        parser.error(f"--threads must be an integer in [1, {cores}] (got {args.threads})")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535] (got {args.port})")
    if args.max_num_seqs < 1:
        parser.error(f"--max-num-seqs must be >= 1 (got {args.max_num_seqs})")
    import torch
    torch.set_num_threads(args.threads)
    try:
        model, tokenizer, template, directory = load_served(args.model, args.device)
        engine = make_engine(model, tokenizer, args.max_num_seqs, args.max_num_batched_tokens,
                             args.max_context)
    except ValueError as err:
        parser.error(str(err))
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(f"serving {name} ({model.config.model_type}, "
          f"{s03.parameter_count(model.config):,} parameters, {ENGINE_CLASS.__module__}."
          f"{ENGINE_CLASS.__name__}, context {engine.max_context}, chat template "
          f"{template.name}) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(build_app(engine, name, template), host=args.host, port=args.port,
                log_level="info")


if __name__ == "__main__":
    sys.exit(main())
