r"""S19, serving: an OpenAI-compatible streaming HTTP server over the step engine.

What is new since S13
    Part II built an engine that takes requests at any time (`add_request`), advances all of
    them one step at a time (`step() -> list[RequestOutput]`, one text delta per request per
    step) and drops any of them at once (`abort`, its KV freed). A server is that loop with a
    network on both ends: HTTP requests arrive while others stream, each becomes one or more
    engine requests, and each step's deltas go out as server-sent events.

    - The API is OpenAI's (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
      `/health`, a 503 once the engine is gone), so the official `openai` client, curl or
      any OpenAI-compatible tool talks to it. code/s19_protocol.py holds the protocol:
      request checks, error schema, chunks.
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
      itself. Either way `abort` frees the KV before the next step (as vLLM's
      `AsyncLLM.generate` aborts a request whose generator is cancelled or closed).
    - The server keeps its own tokenizer: it encodes each prompt once (chat: through the
      template), counts those ids for `usage` and hands the engine the same ids as a list. It
      reads only what the engine returns: each step's `RequestOutput`s (new tokens, text,
      logprobs, `num_cached_tokens`, `error`), never the engine's requests.
    - Errors have OpenAI's schema and a 4xx status for every bad request, FastAPI's 422 and
      Starlette's 404/405 included; the field at fault comes from the `s01.ParameterError`'s
      `.parameter`, never from its text. A body that is not `application/json` is a 415. An
      error after streaming has begun is one SSE event with the error object, then [DONE].
      A request the engine ends inside a step because its own row was refused (a
      repetition_penalty past float32's range: `RequestOutput.error`) fails alone: a 400
      naming the field, or a 500 when the model's logits were bad; its neighbours go on. A
      step that raises fails only the requests it scheduled (500), and the loop goes on.
    - `cache_salt` (vLLM's per-request field) reaches `add_request`: requests with different
      salts never share cached KV blocks. Hits are reported as OpenAI reports them,
      `usage.prompt_tokens_details.cached_tokens`.
    - `record_stream`: one request run in-process, its SSE lines beside the engine steps that
      produced them (the chapter's simulator shows this trace; it attaches S09's
      `StepTracer` for its run, and the server runs none).
    - The engine is a seam: `ENGINE_BUILDER` and `make_engine`. It serves Part II's most
      complete engine, S13's (`s13_prefix_caching.build_engine`: prefix caching over S12's
      paged KV, with S11's chunked prefill); S11's or S12's `build_engine` is the same
      one-line swap. Part III's flags pick the layers over it (code/s19_engine_flags.py
      assembles them): --quantize / --kv-cache-dtype serve S14's `build_engine` instead, and
      --speculative wraps either in S15's (`speculative_builder`): then one step may emit
      several tokens for a request (its accepted drafts and one more) in one `RequestOutput`,
      so a chunk may carry several tokens; the server already counts tokens, not steps (usage,
      logprobs and their text offsets, stop strings are the engine's), so its answers are
      the same, only sooner.
    - --compile, --cuda-graphs, --cudagraph-capture-sizes and --async-scheduling build the
      served engine through S16's `build_engine` over whichever of the above is served
      (`host_builder`): static decode steps in batch-size buckets, compiled (every bucket at
      start up, before the server listens) or captured in CUDA graphs, and the engine stepped
      one plan ahead (`s16_async.AsyncLLMEngine`: the engine thread calls its `step`, `abort`
      and `add_request` as the plain engine's; its forward runs on a worker thread, which
      `EngineLoop.stop` ends). The answers are the same; S16 refuses --async-scheduling with
      --speculative, and static steps with S14's 8-bit KV cache.
    - --attention-backend (gather, sdpa, paged, triton) and --num-splits build it through
      S17's `build_engine` (`attention_builder`), inside S16's when both are given: the same
      answers, each step's attention by S12's gather, torch's SDPA, the C kernel that reads
      the blocks in place, or Triton's kernels (S17 refuses a kernel backend with --compile,
      --cuda-graphs, --executor-backend mp and S14's 8-bit KV cache).
    - --tensor-parallel-size N > 1 (with --distributed-backend, --threads-per-rank,
      --disable-custom-all-reduce) builds it through S18's `build_engine` (`parallel_builder`):
      the model split over N ranks, N - 1 of them spawned processes that each read their own
      slices of the served checkpoint; the server's process is rank 0 and keeps the scheduler,
      the sampler and S15's n-gram drafts, so the engine thread and the server do not change.
      The same greedy answers. `EngineLoop.stop` stops the ranks (`s16_host.shutdown_engine`),
      and exit does if the server never started. S18 refuses S16's techniques, S14's
      quantization and S15's draft model with it, before any process starts.

What it does not handle yet
    One model, one engine thread, one process (with --tensor-parallel-size, rank 0's): the
    engine's steps and the server's JSON work share one Python interpreter (the GIL), which
    the benchmark measures as the overhead ratio (S20 moves the engine to a process of its
    own: code/s20_engine_core.py, serving through this app unchanged; `main`'s parts,
    `add_server_arguments`, `check_server_arguments` and `build_served`, are S20's too). A request body over MAX_BODY_BYTES (4 MiB)
    is refused with a 413, and a prompt with more characters than the context can hold with
    a 400 before it is encoded (so a megabyte of text never stalls the event loop in the
    tokenizer). No authentication (the api_key is ignored), no rate limits, no request queue
    limit, no TLS. The steps it serves get cheaper in Part III (S14-S18); S20 load-tests the
    whole engine.

Run it
    python code/s19_server.py                       # the bundled model on 127.0.0.1:8000
    python code/s19_server.py --port 8001 --max-num-seqs 16 --max-num-batched-tokens 64
    python code/s19_server.py --quantize int8 --kv-cache-dtype int8   # S14's 8-bit weights, KV
    python code/s19_server.py --speculative ngram --num-speculative-tokens 4    # S15
    python code/s19_server.py --speculative draft --draft-model int4  # S15, an int4 copy drafts
    python code/s19_server.py --async-scheduling --compile     # S16 (compiles at start up)
    python code/s19_server.py --tensor-parallel-size 2         # S18: the model on two ranks
    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "bundled", "prompt": "ROMEO.\n", "max_tokens": 20, "stream": true}'
    python benchmarks/bench_s19_server.py --quick   # TTFT / ITL over HTTP vs in-process
    python benchmarks/bench_s19_split.py --quick    # where the server's time goes

Tests
    tests/test_s19_server.py: a real uvicorn server on a free loopback port and the official
    client: completions and chat, streaming and not, greedy text equal to the engine run in
    process, n > 1, stop, seeds, usage, logprobs; a disconnect mid-stream frees every KV token;
    64 concurrent streams each equal to the request alone; every bad request's 4xx and error
    schema (content types, strict types, out-of-range numbers); one bad request among good
    streams fails alone; a client gone while uploading logs no error; cache_salt keeps
    tenants' cached blocks apart; a step that raises fails only its requests; record_stream's
    lines equal what the server sends; the public bugs K1, K2, K4, K6, G4 and G5.
    tests/test_s19_speculative.py: S15's flags: greedy completions and chat, streaming and not,
    with logprobs and a stop string, from a server started by `main` with --speculative ngram
    and with --speculative draft --draft-model int4, equal to the plain engine's; several
    tokens per chunk; every bad flag combination a usage error naming its rule.
    tests/test_s19_host_flags.py: S16's flags: a server started by `main` with
    --async-scheduling (and one with --compile --cudagraph-capture-sizes 1 2) answers greedy
    completions and chat, streaming and not, as the plain engine does; a disconnect aborts;
    its worker thread stops with the server; every bad flag combination a usage error.
    tests/test_s19_tensor_parallel.py: S18's flag: a server started by `main` with
    --tensor-parallel-size 2 answers greedy completions and chat, streaming and not, as S05
    does alone; no rank process is left once it stops; S18's refusals are usage errors.
    tests/test_s19_protocol.py: the protocol alone (fields into SamplingParams, templates,
    refusals, the chunk formats).

References
    OpenAI API reference (completions, chat, streaming, errors). vLLM's OpenAI server
    (`vllm/entrypoints/openai/api_server.py`, `vllm/entrypoints/openai/completion/serving.py`,
    `vllm/entrypoints/openai/chat_completion/serving.py`, the exception handlers in
    `vllm/entrypoints/serve/utils/server_utils.py`; its `validate_json_request`, vLLM #11171 /
    PR #13193, for the content type) and `AsyncLLM` (`vllm/v1/engine/async_llm.py`:
    a background task that moves the engine core's outputs; per-request output queues; abort
    on disconnect). FastAPI ("Strict Content-Type"), Starlette, uvicorn documentation.
    Server-sent events: the WHATWG HTML standard, section 9.2.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import argparse
import asyncio
import concurrent.futures
import json
import logging
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
from starlette.requests import ClientDisconnect

import s03_checkpoint
import s03_transformer as s03
import s06_torch as s06
import s08_cli
import s09_trace
import s13_prefix_caching as s13
import s16_host
import s16_static
import s19_engine_flags as engine_flags
import s19_protocol as proto
from s01_generation_loop import ParameterError
from s19_protocol import APIError, Delta

log = logging.getLogger("s19_server")

ENGINE_BUILDER = s13.build_engine   # the engine served; s11/s12's build_engine drop in here
DEFAULT_MODEL_NAME = "bundled"
DEFAULT_PORT = 8000
DEFAULT_MAX_CONTEXT = 4096          # the longest context served unless --max-context says
JSON_MEDIA_TYPE = "application/json"
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
                builder=None, **options):
    """The served engine: `builder` (default ENGINE_BUILDER, S13's `build_engine`) over the
    model and tokenizer. max_context: default the model's window, at most
    DEFAULT_MAX_CONTEXT (4096); max_num_batched_tokens: the token budget of a step (None:
    max_num_seqs x max_context, nothing chunked). options: the builder's other keywords.
    No observer is attached: the server runs no tracer. Raises ParameterError naming the
    option (the engine's rule)."""
    builder = ENGINE_BUILDER if builder is None else builder
    window = model.config.max_position_embeddings
    max_context = min(window, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
    return builder(model, tokenizer, max_context=max_context, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, **options)


def builder_name(builder=None) -> str:
    """"module.function" of the engine builder (default ENGINE_BUILDER), as --help says;
    Part III's layers over it spelled out ("s15_speculative.build_engine over
    s13_prefix_caching.build_engine")."""
    return engine_flags.builder_name(ENGINE_BUILDER if builder is None else builder)


# ---------------------------------------------------------------------------------------------
# The engine loop: one thread owns the engine
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineFailure:
    """Sent to a request's sink instead of a Delta when the engine failed it: message, and
    parameter, the engine's name of the request's own field to blame (the request's row was
    refused because of it: a 400 naming that field, since the same request fails every time),
    or None when the server is at fault (a 500: a step that raised, or bad logits from the
    model)."""

    message: str
    parameter: str | None = None

    @classmethod
    def from_output(cls, error: ParameterError) -> "EngineFailure":
        """The failure for a request the engine ended inside a step (`RequestOutput.error`)."""
        return cls(f"this request failed while it ran: {error}", error.parameter)

    def api_error(self, request: proto.ParsedRequest) -> APIError:
        """OpenAI's error for it, in the request's field names."""
        if self.parameter is None:
            return APIError(500, self.message)
        return request.refusal(ParameterError(self.message, self.parameter))


class EngineLoop:
    """The thread that owns `engine` and steps it while requests are unfinished.

    Thread-safe calls (any thread): `submit(requests, sink, cache_salt)` queues an add of
    several engine requests (one per choice, each a (token ids, SamplingParams) pair) and
    returns a concurrent Future of their ids (it raises the engine's ParameterError, nothing
    added, if any of them is refused: all are made with `make_request` before any is queued);
    `abort(ids)`; `call(fn)` runs fn(engine) in the engine thread between steps and returns a
    Future of its result (tests and benchmarks look at the engine this way). Each `Delta` of
    those requests, or one `EngineFailure`, goes to `sink(item)` through `deliver`: after
    every step the engine thread calls deliver([(sink, item), ...]) once with all of the
    step's items (default: call each sink there and then; it must not block). The server's
    deliver hands the whole list to the event loop in one `call_soon_threadsafe`, where each
    sink is an asyncio queue's put_nowait: one wake-up of the event loop per step, not one per
    token (vLLM's AsyncLLM also moves a step's outputs as one batch). After a request's last
    item its sink is dropped; an aborted request's last output is dropped too (nobody is
    listening). An output with an `error` (its row refused) becomes an EngineFailure for that
    request alone. A step that raises fails the requests it scheduled (it learns them as an
    observer, `on_plan`: one tuple kept per step, no trace). `start()` / `stop()` (which, once
    the thread has ended, also stops what the engine runs beside it: S16's async worker thread
    or worker process) / `alive`;
    `steps` counts engine steps, `failed_steps` the ones that raised.
    """

    def __init__(self, engine, deliver: Callable[[list], None] | None = None):
        self.engine = engine
        self.deliver = deliver or _call_each
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._sinks: dict[str, tuple[Callable, int]] = {}   # id -> (sink, choice index)
        self._scheduled: tuple[str, ...] = ()   # the ids the step in progress scheduled
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.failed_steps = 0
        self._next_id = 0
        engine.observers.append(self)

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
            if self._thread.is_alive():     # a step still running: it owns the engine
                log.warning("the engine thread did not stop in %.0f s", timeout)
                return
        # what the engine runs beside it (S16: the async loop's worker thread, a worker
        # process), stopped once no step can use it
        s16_host.shutdown_engine(self.engine)

    def _command(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(fn)
            self._cond.notify()

    def submit(self, requests: Sequence[tuple[list[int], object]], sink: Callable,
               cache_salt=None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def add() -> None:
            try:                              # all or nothing: every check before any queue
                made = [self.engine.make_request(prompt, params, self._new_id(),
                                                 cache_salt=cache_salt)
                        for prompt, params in requests]
            except Exception as err:
                future.set_exception(err)
                return
            ids = []
            for k, request in enumerate(made):
                ids.append(self.engine.queue(request))
                self._sinks[ids[-1]] = (sink, k)
            future.set_result(ids)

        self._command(add)
        return future

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = list(request_ids)

        def abort() -> None:
            for rid in ids:
                if self._sinks.pop(rid, None) is not None:
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

    # --- the engine's observer (engine thread) --------------------------------------------

    def on_plan(self, engine, plan) -> None:
        self._scheduled = plan.scheduled_ids

    def on_step(self, engine, result) -> None:
        pass

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
        self._scheduled = ()
        try:
            outputs = self.engine.step()
        except Exception as err:            # fail the requests of this step, keep serving
            self.failed_steps += 1
            self._fail(err)
            return
        self.steps += 1
        batch = []
        for out in outputs:
            entry = self._sinks.get(out.request_id)
            if entry is None:               # aborted: its last output has no listener
                continue
            sink, index = entry
            item = (to_delta(out, index) if out.error is None
                    else EngineFailure.from_output(out.error))
            batch.append((sink, item))
            if out.finished:
                del self._sinks[out.request_id]
        if batch:
            self.deliver(batch)

    def _fail(self, err: Exception) -> None:
        """A step raised (its plan was taken back: the requests keep their place and KV as
        before the step). Every request it scheduled fails with a 500 and is aborted; the
        others go on. When it failed before scheduling anyone (no plan seen), every request
        fails: nothing else to blame, and a loop that retried would spin."""
        ids = [rid for rid in self._scheduled if rid in self._sinks] or list(self._sinks)
        log.error("engine step failed for %s: %s: %s", ids, type(err).__name__, err)
        failure = EngineFailure(f"the engine failed while running this request "
                                f"({type(err).__name__}: {err})")
        batch = []
        for rid in ids:
            sink, _ = self._sinks.pop(rid)
            self.engine.abort(rid)
            batch.append((sink, failure))
        if batch:
            self.deliver(batch)


def _call_each(batch: list) -> None:
    for sink, item in batch:
        sink(item)


def to_delta(out, index: int) -> Delta:
    """One engine output (S09's `RequestOutput`) as the protocol's Delta of choice `index`:
    its new tokens, text, logprobs (the step's `TokenLogprobs`, when asked) and the prompt
    tokens the prefix cache held for it."""
    logprobs = tuple(out.logprobs) if out.logprobs and out.new_token_ids else None
    return Delta(index, tuple(out.new_token_ids), out.text_delta, out.finished,
                 out.finish_reason, logprobs, out.num_cached_tokens)


# ---------------------------------------------------------------------------------------------
# The HTTP app
# ---------------------------------------------------------------------------------------------

def build_app(engine, tokenizer, model_name: str = DEFAULT_MODEL_NAME, chat_template=None,
              engine_loop: EngineLoop | None = None):
    """The FastAPI app serving `engine` (built by `make_engine`) as `model_name`.

    tokenizer: the server's own, the one the engine was built with (the server encodes every
    prompt and hands the engine the ids). chat_template: a `s19_protocol.ChatTemplate`
    (default: the course's template). The app starts its `EngineLoop` on startup and stops it
    on shutdown; `app.state.engine_loop` is it (tests look at the engine through
    `app.state.engine_loop.call`)."""
    loop_ = engine_loop or EngineLoop(engine)
    template = chat_template or proto.ChatTemplate(None)
    per_token = proto.max_token_chars(tokenizer)    # once now, not on the first request
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

    @app.exception_handler(ClientGone)
    async def client_gone(request, err: ClientGone):
        # Nobody reads this answer; 499 is nginx's name for it. Not an error of the server.
        log.info("%s %s: %s", request.method, request.url.path, err)
        return Response(status_code=499)

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
        # Starlette re-raises the error after this answer, and uvicorn logs it with its
        # traceback ("Exception in ASGI application"): logged once, there.
        return ErrorResponse(proto.error_body(f"internal error: {type(err).__name__}: {err}",
                                             "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        # 503 once the engine's thread (or S20's engine process) is gone, as vLLM's /health
        if not loop_.alive:
            return ErrorResponse(proto.error_body("the engine is not running", "server_error",
                                                  code="engine_dead"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created_at, "owned_by": "llm-course",
                                            "max_model_len": engine.max_context}]}

    def parse(raw: bytes, kind: str) -> proto.ParsedRequest:
        return proto.parse_request(kind, proto.parse_json_body(raw), model_name, tokenizer,
                                   engine.max_context, template, per_token)

    async def serve(request: Request, kind: str):
        check_content_type(request)
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
                [(list(parsed.prompt_ids), p) for p in parsed.params], queue.put_nowait,
                parsed.cache_salt))
        except ParameterError as err:       # the engine refused it: its rule, its field
            raise parsed.refusal(err) from None
        prefix = "chatcmpl-" if kind == proto.CHAT else "cmpl-"
        meta = proto.ResponseMeta(prefix + uuid.uuid4().hex, int(time.time()), model_name,
                                  parsed, tokenizer)
        if parsed.stream:
            writer = proto.StreamWriter(meta)
            return EventStream(stream(writer, queue),
                               on_close=lambda: writer.done or loop_.abort(ids))
        return await collect(request, meta, queue, ids)

    async def stream(writer, queue):
        for line in writer.start():
            yield line
        while not writer.done:
            item = await queue.get()
            if isinstance(item, EngineFailure):
                for line in writer.error(item.api_error(writer.meta.request)):
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
                    raise ClientGone("the client disconnected before its answer")
                item = get.result()
                if isinstance(item, EngineFailure):
                    raise item.api_error(meta.request)
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


def check_content_type(request: Request) -> None:
    """A 415 (code "unsupported_media_type") unless the body is declared as JSON: media type
    application/json, parameters such as charset allowed, the header required. vLLM refuses
    the same bodies (`validate_json_request`, vLLM #11171 / PR #13193; it answers 400 since
    PR #17664 only to fit its OpenAPI schema), and FastAPI parses a body without this header
    as JSON only when told to (its "Strict Content-Type" default): a page a browser opens may
    POST text/plain or a header-less body to a server on this machine without a CORS
    preflight, and this server has no authentication."""
    given = request.headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        shown = repr(given[:80]) if given else "no Content-Type header"
        raise APIError(415, f"the request body must be JSON, sent with Content-Type: "
                            f"{JSON_MEDIA_TYPE} (got {shown})", None, "unsupported_media_type")


async def read_body(request: Request) -> bytes:
    """The request body, refused with a 413 when larger than MAX_BODY_BYTES: at once when its
    Content-Length says so, else as soon as that many bytes have come. A client that
    disconnects before the whole body came is `ClientGone` (Starlette's ClientDisconnect,
    which the app would otherwise treat as the server's own failure and log, traceback and
    all, twice: its 500 handler, then uvicorn)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large(int(length))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large(size)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected while sending its body ({size} bytes "
                         f"came)") from None
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
    """The client disconnected before its answer: while sending its body, or while a
    non-streaming request ran (then its choices are aborted)."""


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


def serve_in_thread(engine, tokenizer, model_name: str = DEFAULT_MODEL_NAME,
                    chat_template=None, host: str = "127.0.0.1", port: int = 0) -> ServerThread:
    """`build_app(engine, tokenizer, ...)` served by uvicorn in a thread on a free port
    (port 0)."""
    return ServerThread(build_app(engine, tokenizer, model_name, chat_template), host, port)


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

def record_stream(engine, tokenizer, body: dict, kind: str = proto.COMPLETION,
                  model_name: str = DEFAULT_MODEL_NAME, companions: Sequence[tuple] = (),
                  chat_template=None, max_steps: int = 10_000) -> dict:
    """Run one streaming request in-process, without HTTP, and record what the server would
    send beside the engine steps that produced them.

    engine: idle, built by `make_engine` with `tokenizer`. body: the request's JSON body (its
    "stream" is forced true). companions: other requests running beside it, (prompt,
    SamplingParams) pairs added to the engine first (ids "c0", "c1", ...), so the trace shows
    batching. Uses the server's own parser, token ids and `StreamWriter`, so the lines are the
    server's (id "cmpl-0" / "chatcmpl-0" and created 0, to be reproducible); S09's
    `StepTracer` is attached for the run and taken off after. Returns {"kind", "request":
    body, "prompt_tokens", "start": lines before any step (chat's role chunks), "steps":
    [{"step", "num_tokens", "token_budget", "scheduled": [{"id", "tokens", "kind" ("prefill"
    / "decode"), "start" (its computed tokens before the step), "total" (its tokens when
    scheduled), "sampled"}], "lines" (this request's SSE lines from this step, maybe [])}],
    "end": the usage chunk and [DONE] (or the error event and [DONE], as the server sends a
    failure after streaming began)}. Raises APIError or ParameterError (mapped as the
    server maps it) for a bad body, ValueError when the engine is busy."""
    if engine.has_unfinished_requests():
        raise ValueError("record_stream needs an idle engine")
    body = dict(body, stream=True)
    parsed = proto.parse_request(kind, body, model_name, tokenizer, engine.max_context,
                                 chat_template)
    ids = [f"choice{i}" for i in range(parsed.n)]
    try:
        made = [engine.make_request(list(parsed.prompt_ids), params, rid,
                                    cache_salt=parsed.cache_salt)
                for rid, params in zip(ids, parsed.params)]
    except ParameterError as err:
        raise parsed.refusal(err) from None
    tracer = s09_trace.trace(engine)
    try:
        for k, (prompt, params) in enumerate(companions):
            engine.add_request(prompt, params, request_id=f"c{k}")
        for request in made:
            engine.queue(request)
        meta = proto.ResponseMeta(("chatcmpl-" if kind == proto.CHAT else "cmpl-") + "0", 0,
                                  model_name, parsed, tokenizer)
        writer = proto.StreamWriter(meta)
        trace = {"kind": kind, "request": body, "prompt_tokens": parsed.prompt_tokens,
                 "start": writer.start(), "steps": [], "end": []}
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            recorded = tracer.num_recorded
            outputs = engine.step()
            record = tracer.records[-1] if tracer.num_recorded > recorded else None
            lines = []
            for out in outputs:
                if out.request_id not in ids or trace["end"]:
                    continue
                if out.error is not None:       # as the server: the error event, the rest off
                    failure = EngineFailure.from_output(out.error)
                    trace["end"] = writer.error(failure.api_error(parsed))
                    for rid in ids:
                        engine.abort(rid)
                    continue
                lines += writer.feed(to_delta(out, ids.index(out.request_id)))
            if record is None:                  # a step that ran no model (last outputs)
                if lines:
                    trace["steps"].append({"step": None, "num_tokens": 0, "token_budget": None,
                                           "scheduled": [], "lines": lines})
                continue
            trace["steps"].append({
                "step": record.step, "num_tokens": record.num_tokens,
                "token_budget": record.token_budget,
                "scheduled": [{"id": rid, "tokens": n, "kind": kind_, "start": start,
                               "total": total, "sampled": rid in record.sampled}
                              for rid, n, kind_, start, total in zip(
                                  record.running, record.num_scheduled_tokens, record.kinds,
                                  record.num_computed_tokens, record.request_num_tokens)],
                "lines": lines})
        trace["end"] = trace["end"] or writer.finish()
    finally:
        engine.observers.remove(tracer)
    return trace


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags: the model, where to listen, the engine's budgets, Part III's flags
    (code/s19_engine_flags.py), --device and --threads. S20's server adds its own to these."""
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
    # S14's --quantize, --kv-cache-dtype; S15's --speculative; S16's --compile, --cuda-graphs,
    # --async-scheduling; S17's --attention-backend; S18's --tensor-parallel-size; ...
    engine_flags.add_engine_arguments(parser)
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, as S07 (default: %(default)s)")


def check_server_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2) before a model loads: --threads, --device, --port,
    --max-num-seqs, and Part III's rules that need no model."""
    s08_cli.check_common_arguments(parser, args)     # --threads, --device
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535] (got {args.port})")
    if args.max_num_seqs < 1:
        parser.error(f"--max-num-seqs must be >= 1 (got {args.max_num_seqs})")
    engine_flags.check_engine_arguments(parser, args)   # Part III's rules that need no model


def served_name(args: argparse.Namespace) -> str:
    """The name clients pass as `model` (--served-model-name, else 'bundled' or --model)."""
    return args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)


@dataclass
class Served:
    """What `build_served` made: the engine, the server's tokenizer and chat template, and
    the start-up line's description of the model and engine."""

    engine: object
    tokenizer: object
    template: proto.ChatTemplate
    description: str


def build_served(args: argparse.Namespace, base=None, **engine_options) -> Served:
    """The engine the flags ask for over the served model (`base`: the builder under Part
    III's layers, default ENGINE_BUILDER), its decode step compiled for every bucket when
    --compile asks (vLLM compiles and captures at start up too, before the server listens),
    and the model itself dropped (the engine holds what it runs; with N ranks, rank 0's share
    only). engine_options: more keywords for the builder (S20 passes S13's
    enable_prefix_caching through every layer). Sets torch's threads (--threads). Raises ParameterError naming the engine's
    parameter (map it with `engine_flags.flag_message`) or ValueError (a checkpoint, a failed
    compile), before anything is served."""
    import torch
    torch.set_num_threads(args.threads)
    model, tokenizer, template, directory = load_served(args.model, args.device)
    # ENGINE_BUILDER, or S14's, with S15's, S17's or S18's, then S16's over it, as asked
    builder, options = engine_flags.engine_builder(
        args, ENGINE_BUILDER if base is None else base, directory)
    options.update(engine_options)
    engine = make_engine(model, tokenizer, args.max_num_seqs, args.max_num_batched_tokens,
                         args.max_context, builder=builder, **options)
    description = (f"{model.config.model_type}, {s03.parameter_count(model.config):,} "
                   f"parameters{engine_flags.describe_engine(engine, model, args)}, "
                   f"{builder_name(builder)}, context {engine.max_context}, chat template "
                   f"{template.name}")
    del model
    runner = engine.runner
    if isinstance(runner, s16_static.StaticDecodeRunner) and runner.compile and not runner.graphs:
        # every bucket compiled now, not on the first requests that need it (CUDA graphs were
        # captured, compiled, when the engine was built)
        print(f"compiling the decode step for buckets {', '.join(map(str, runner.sizes))} ...",
              flush=True)
        try:
            times = runner.warmup()
        except Exception as err:         # inductor's own failure: said in one line, no trace
            s16_host.shutdown_engine(engine)
            raise ValueError(f"--compile: compiling the decode step failed "
                             f"({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0][:300]})") from None
        print(f"compiled in {sum(times.values()):.1f} s", flush=True)
    return Served(engine, tokenizer, template, description)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 19: an OpenAI-compatible streaming server over the step engine "
                    f"({builder_name()}: S13's prefix caching over S12's paged KV and S11's "
                    "chunked prefill; S14's with --quantize / --kv-cache-dtype; S15's "
                    "speculative decoding over it with --speculative; S16's static, compiled "
                    "or graph-captured decode steps and async scheduling with --compile, "
                    "--cuda-graphs, --async-scheduling; S17's attention backends with "
                    "--attention-backend; S18's model split over ranks with "
                    "--tensor-parallel-size).")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    check_server_arguments(parser, args)
    try:
        served = build_served(args)
    except ParameterError as err:            # named by the flag that set the parameter
        parser.error(engine_flags.flag_message(err))
    except ValueError as err:
        parser.error(str(err))
    name = served_name(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(f"serving {name} ({served.description}) on http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(build_app(served.engine, served.tokenizer, name, served.template),
                host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    sys.exit(main())
