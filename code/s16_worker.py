r"""S16, the forward in its own process: a runner the host launches and collects later.

What is new since S15
    On a GPU the host enqueues kernels and goes on: the forward runs beside the host's Python
    by construction, which is what async scheduling (code/s16_async.py) overlaps. On a CPU the
    "device" is the host's own cores, and a worker thread does not give it back: torch drops
    Python's GIL inside each op, but the ops of a small model last microseconds and the GIL is
    taken back between every two, so the thread and the host take turns (the chapter measures
    it). `ProcessRunner` gives the forward its own process, as vLLM's multiprocessing executor
    gives each worker its own (S18 takes this to several ranks):

    - The engine's runner (S12's `PagedRunner`, optionally made static by code/s16_static.py in
      the worker, compiled there) is sent to a spawned worker process once. Its weights and
      its KV pool are moved to shared memory first, so the two processes hold one copy; only
      the worker ever reads or writes the pool.
    - Each step the host sends the plan and, per scheduled request, the token ids the step
      reads (`submit`, which returns at once: a launch) and later takes the result (`.result()`:
      the logits, written by the worker into one of two shared buffers, and the step's
      counts). `execute_model` is the two in a row: S09's engine runs on it unchanged.
    - A worker that raises sends its error back (the step's exception, with the worker's
      traceback as text); a worker that dies is reported; `shutdown` (also at exit) stops it
      and leaves no process behind.

What it does not handle
    The batch-invariant reference (it reads every request's whole history each step; run it
    in-process). S14's quantized weights (their tensor subclass is not sent to another process
    here) and S15's draft model (its own runner stays in the host). One worker; S18 runs one
    per rank.

Run it
    python code/s16_host.py --async-scheduling --executor-backend mp

Tests
    tests/test_s16_async.py (the same outputs with the worker process, sync and async; no
    process left after shutdown or after the worker raised).

References
    vLLM `MultiprocExecutor` (vllm/v1/executor/multiproc_executor.py) and its
    `distributed_executor_backend` "mp" / "uni"; PyTorch's torch.multiprocessing (tensors sent
    through shared memory); nano-vllm's rank-0 loop writing each step's inputs to shared
    memory for its workers.
"""
from __future__ import annotations

import atexit
import signal
import time
import traceback
import weakref
from typing import Mapping

import torch
import torch.multiprocessing as mp

from s01_generation_loop import ParameterError
from s09_ragged import ModelRunnerOutput

EXECUTOR_BACKENDS = ("uni", "mp")      # vLLM's names: the host's process, or a worker process
READY_TIMEOUT_S = 600.0                # spawning, importing torch, compiling buckets


class TokenWindow:
    """What the runner reads of a request in the worker: token_ids of the right length, the
    positions this step reads filled in (the rest 0: never read)."""

    def __init__(self, start: int, window: list[int], length: int):
        self.token_ids = [0] * start + window + [0] * (length - start - len(window))


def token_window_args(plan, requests: Mapping) -> dict:
    """Per scheduled request (start, the ids the step reads, its length): what a worker
    process needs of the engine's requests to run the plan (S18's ranks too)."""
    tokens = {}
    for rid, n in plan.num_scheduled_tokens.items():
        start = plan.num_computed_tokens[rid]
        ids = requests[rid].token_ids
        tokens[rid] = (start, ids[start:start + n], len(ids))
    return tokens


def _worker_main(conn, runner, static_options, logits, threads) -> None:
    """The worker process: build the runner's static form if asked (compiling here), then run
    each plan it is sent until told to stop (None) or the host is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the host's to handle
    torch.set_num_threads(threads)
    try:
        if static_options is not None:
            import s16_static
            runner = s16_static.StaticDecodeRunner(runner, **static_options)
            if static_options.get("compile") or static_options.get("cuda_graphs"):
                runner.warmup()
        conn.send((0, "ready", None))
    except BaseException as err:       # noqa: BLE001 (reported to the host, then exit)
        conn.send((0, "error", (repr(err), traceback.format_exc())))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:               # the host is gone
            return
        if message is None:
            return
        number, plan, tokens, slot = message
        try:
            start = time.perf_counter()
            requests = {rid: TokenWindow(*t) for rid, t in tokens.items()}
            run = runner.execute_model(plan, requests)
            rows = run.logits.shape[0]
            logits[slot][:rows].copy_(run.logits)
            if logits[slot].device.type == "cuda":
                torch.cuda.synchronize()
            conn.send((number, "ok", (run.req_ids, rows, run.num_tokens, run.num_draft_tokens,
                                      run.prepare_s, time.perf_counter() - start,
                                      getattr(runner, "num_static_steps", 0))))
        except BaseException as err:   # noqa: BLE001 (the step's error goes to the host)
            conn.send((number, "error", (repr(err), traceback.format_exc())))


class WorkerError(RuntimeError):
    """A step failed in the worker process: its error and traceback, as text."""


class _Pending:
    """A step in flight in the worker: `result()` waits for its `ModelRunnerOutput`."""

    def __init__(self, runner: "ProcessRunner", number: int, slot: int):
        self.runner, self.number, self.slot, self._run = runner, number, slot, None

    def result(self) -> ModelRunnerOutput:
        if self._run is None:
            self._run = self.runner._collect(self)
        return self._run


class ProcessRunner:
    """A runner whose forward runs in a worker process (see the module docstring).

    runner: the engine's in-process runner (S12's `PagedRunner`; a `StaticDecodeRunner` is
    rebuilt in the worker from its inner runner and its options). max_rows: the most logits
    rows a step returns (max_num_seqs x (1 + drafts)). threads: torch threads in the worker.
    `submit(plan, requests)` launches a step and returns a handle whose `result()` is its
    `ModelRunnerOutput` (logits a view of a shared buffer, valid until the step after the next
    is submitted: the worker writes that buffer while it runs); `execute_model` does both.
    One step in flight at a time; call from one thread. Raises ParameterError for the batch-invariant mode and for a runner it cannot send;
    WorkerError when the worker fails to start or a step fails there (the worker keeps
    running after a failed step, and when it has stopped or died: build a new engine then).
    A step abandoned before its result was taken (an exception, Ctrl-C while waiting) is
    waited for and discarded before the next: every reply carries its step's number, so a
    late reply is never taken for a later step's."""

    def __init__(self, runner, max_rows: int, threads: int = 1):
        import s16_static
        static_options = None
        if isinstance(runner, s16_static.StaticDecodeRunner):
            static_options = dict(sizes=runner.sizes, compile=runner.compile,
                                  cuda_graphs=runner.cuda_graphs, form=runner.form)
            runner = runner.inner
        if runner.batch_invariant:
            raise ParameterError("the worker process runs the fast mode only (the "
                                 "batch-invariant reference reads every request's whole "
                                 "history each step): use executor_backend 'uni'",
                                 "executor_backend")
        self.model, self.cache = runner.model, runner.cache
        self.batch_invariant, self.attention = runner.batch_invariant, runner.attention
        self.static_options = static_options
        self.num_static_steps = 0
        for tensor in list(runner.model.parameters()) + list(runner.model.buffers()):
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                raise ParameterError("the worker process takes plain float weights; S14's "
                                     "quantized layers run with executor_backend 'uni'",
                                     "executor_backend")
        if runner.model.device.type == "cpu":
            runner.model.share_memory()
            runner.cache.k.share_memory_()
            runner.cache.v.share_memory_()
        self.logits = [torch.zeros(max_rows, runner.vocab_size, dtype=torch.float32,
                                   device=runner.model.device) for _ in range(2)]
        for buffer in self.logits:
            if buffer.device.type == "cpu":
                buffer.share_memory_()
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, name="s16-worker", daemon=True,
                                       args=(child, runner, static_options, self.logits,
                                             torch.get_num_threads() if threads is None
                                             else threads))
        try:
            self.process.start()                 # sends the runner: pickled
        except Exception as err:                 # noqa: BLE001 (what pickling raises varies)
            self.conn.close()
            child.close()
            raise ParameterError(f"the runner cannot be sent to a worker process ({err!r:.200}"
                                 "): use executor_backend 'uni'", "executor_backend") from err
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self.conn, self.process)
        atexit.register(self._finalizer)
        self._slot, self._number, self._in_flight = 0, 0, None
        if not self.conn.poll(READY_TIMEOUT_S):
            self.shutdown()
            raise WorkerError(f"the worker process did not start in {READY_TIMEOUT_S:.0f} s")
        _, status, detail = self._receive()
        if status != "ready":
            self.shutdown()
            raise WorkerError(f"the worker process failed to start: {detail[0]}\n{detail[1]}")

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def submit(self, plan, requests: Mapping) -> _Pending:
        """Send the plan to the worker and return at once (see the class docstring)."""
        if self._in_flight is not None:      # abandoned: its reply must not be taken for ours
            try:
                self._in_flight.result()
            except WorkerError:
                if not self.process.is_alive():
                    raise
        tokens = token_window_args(plan, requests)
        self._slot ^= 1
        self._number += 1
        try:
            self.conn.send((self._number, plan, tokens, self._slot))
        except (OSError, ValueError):            # closed by shutdown, or the worker is gone
            raise WorkerError(f"the worker process has stopped (exit code "
                              f"{self.process.exitcode}): build a new engine") from None
        self._in_flight = _Pending(self, self._number, self._slot)
        return self._in_flight

    def execute_model(self, plan, requests: Mapping) -> ModelRunnerOutput:
        return self.submit(plan, requests).result()

    def _collect(self, pending: _Pending) -> ModelRunnerOutput:
        while True:                          # replies of abandoned steps come first
            number, status, detail = self._receive()
            if number == pending.number:
                break
        self._in_flight = None
        slot = pending.slot
        if status != "ok":
            raise WorkerError(f"the step failed in the worker process: {detail[0]}\n"
                              f"{detail[1]}")
        req_ids, rows, num_tokens, drafts, prepare_s, model_s, static = detail
        self.num_static_steps = static
        return ModelRunnerOutput(req_ids, self.logits[slot][:rows], num_tokens, model_s,
                                 drafts, prepare_s)

    def _receive(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self._in_flight = None
            code = self.process.exitcode
            raise WorkerError(f"the worker process is gone (exit code {code}): build a new "
                              "engine") from None

    def shutdown(self) -> None:
        """Stop the worker (waiting for a step in flight) and release it; idempotent."""
        self._finalizer()


def _stop(conn, process) -> None:
    try:
        conn.send(None)
    except (OSError, ValueError):
        pass
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    conn.close()


def make_process(engine, threads: int = 1):
    """Move a built engine's forward into a worker process (`ProcessRunner`); returns the
    engine. Raises ParameterError for anything but an S09 `LLMEngine` (give the engine its
    worker before async scheduling wraps it) and as `ProcessRunner` does. A script that
    uses it needs Python's `if __name__ == "__main__":` guard: the worker is spawned, and
    spawning imports the main module again."""
    from s09_continuous_batching import LLMEngine
    if not isinstance(engine, LLMEngine):
        raise ParameterError("make_process takes an S09 LLMEngine (move the forward to a "
                             "worker before make_async wraps the engine)", "engine")
    drafts = 0 if engine.proposer is None else engine.proposer.num_speculative_tokens
    max_rows = engine.config.max_num_seqs * (1 + drafts)   # logits rows: sampling positions
    engine.runner = ProcessRunner(engine.runner, max_rows, threads)
    return engine
