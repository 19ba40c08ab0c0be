"""S09's offline call style: Part I's `generate` / `stream` as a thin loop over the step engine.

What is here
    `LLM(engine)` (vLLM's offline `LLM` class, the same idea): `generate(prompt, max_tokens)`
    and `stream(...)` as Part I's engines take them, and S08's `generate(prompts, params)`
    for a list, over any Part II engine's `add_request` / `step` / `abort`. So the parity
    chain (tests/test_parity.py) makes the same call on every engine of the course, from the
    S01 loop to S13's prefix-caching engine.

    - The requests of one call are all checked before any is queued (`make_request`), so a
      bad prompt or params raises ParameterError (prefixed "prompt i: " or "params[i]: " for
      a list) with nothing queued.
    - A stream's requests are queued by the `stream` call; the stream steps the engine
      until each of them has had its last output. Streams of one `LLM` may be advanced in
      turns (each step's outputs go to the stream whose request they are). Closing a stream
      early, a failure, or dropping it unread aborts its unfinished requests (their KV
      freed at once).
    - The `LLM` owns its engine: it refuses to start while the engine holds requests it did
      not add, unfinished or with a last output not yet returned (its steps would take their
      outputs); use the engine's own `add_request` / `step` for those (S19's server does).

Tests
    tests/test_s09_continuous_batching.py (generate and stream against the engine's steps),
    tests/test_parity.py.

References
    vLLM's `LLM.generate` (vllm/entrypoints/llm.py: add every request, then step the engine
    until none is unfinished).
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Iterator

import s01_generation_loop as s01
import s08_static_batching as s08
from s01_generation_loop import ParameterError

MAX_REQUESTS_PER_CALL = 4096   # prompts one generate(prompts) call may queue


class LLM:
    """Part I's and S08's calls over an engine (see the module docstring).

    `generate(prompt, max_tokens=16, temperature=None, seed=None, **options)` -> Part I's
    `Completion`; with a list of prompts (each text or token ids) and params (one
    SamplingParams, a list of one per prompt, or Part I's keywords) -> one `Completion` per
    prompt, in order. `stream(...)`: Part I's `CompletionStream` for one prompt, S08's
    `BatchStream` (lists of the step's outputs; its `stats` is None: nothing idles here to
    count) for a list. temperature None means greedy in this call style, as in Part I.
    """

    def __init__(self, engine):
        self.engine = engine
        self._inboxes: dict[str, deque] = {}     # outputs kept for the open streams, by id
        self._dropped: set[str] = set()          # ids of requests closed streams aborted

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def generate(self, prompts, params=None, temperature: float | None = None,
                 seed: int | None = None, **options):
        return s01.run_to_end(self.stream(prompts, params, temperature, seed, **options))

    def stream(self, prompts, params=None, temperature: float | None = None,
               seed: int | None = None, **options):
        """Check every request, queue them, and return the stream (nothing runs until it is
        iterated, or until another stream of this LLM steps the engine). Raises
        ParameterError before anything is queued (see the module docstring), and ValueError
        while the engine holds requests (or pending last outputs) this LLM did not add."""
        self._check_owned()
        single = isinstance(prompts, str)
        prompts = [prompts] if single else prompts
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ParameterError("prompts must be a string or a non-empty list of prompts "
                                 f"(got {prompts!r:.80})", "prompt")
        if len(prompts) > MAX_REQUESTS_PER_CALL:
            raise ParameterError(f"one call takes at most {MAX_REQUESTS_PER_CALL} prompts (got "
                                 f"{len(prompts)}): split them", "prompt")
        all_params = self.engine.processor.make_batch_params(len(prompts), params, temperature,
                                                             seed, options)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, all_params)):
            try:
                requests.append(self.engine.make_request(prompt, p, self._new_id(requests)))
            except ParameterError as err:
                where = (f"prompt {i}: " if err.parameter == "prompt" else
                         f"params[{i}]: " if isinstance(params, (list, tuple)) else "")
                if single or not where:
                    raise
                raise ParameterError(where + str(err), err.parameter, err.value) from None
        ids = [self.engine.queue(request) for request in requests]
        self._inboxes.update((rid, deque()) for rid in ids)
        steps = self._run(ids)
        # Dropped before it ends (never iterated, say), the stream's requests are aborted
        # (a generator closed before it starts runs no code, so its `finally` cannot).
        weakref.finalize(steps, self._let_go, ids, ())
        if single:
            return s01.CompletionStream((o for outputs in steps for o in outputs),
                                        requests[0].seq)
        return s08.BatchStream(steps, [r.seq for r in requests], None)

    def _check_owned(self) -> None:
        """Raise ValueError while the engine holds requests this LLM did not add (unfinished,
        or with a last output not yet returned): this LLM's steps would take their outputs."""
        in_use = self.engine.request_ids_in_use()
        self._dropped &= in_use                  # their last outputs have been drained
        foreign = in_use - set(self._inboxes) - self._dropped
        if foreign:
            raise ValueError(f"the engine holds {len(foreign)} requests this LLM did not add "
                             "(unfinished, or with a last output not yet returned): step or "
                             "abort them first (an LLM owns its engine)")

    def _new_id(self, made: list) -> str:
        """The lowest number that no request of the engine (unfinished, or with a pending
        last output) and no request made in this call holds."""
        taken = {r.request_id for r in made} | self.engine.request_ids_in_use()
        k = 0
        while str(k) in taken:
            k += 1
        return str(k)

    def _run(self, ids: list[str]) -> Iterator[list[s01.RequestOutput]]:
        """Step until each request has had its last output, yielding their outputs of each
        step (other streams' outputs go to their inboxes). Closed or failed before the end,
        it aborts those unfinished (their KV freed; their last outputs, which nobody will
        read, are dropped)."""
        inboxes = {rid: self._inboxes[rid] for rid in ids}
        done: set[str] = set()
        try:
            while True:
                ready = [inboxes[rid].popleft() for rid in ids
                         for _ in range(len(inboxes[rid]))]
                done.update(o.request_id for o in ready if o.finished)
                if ready:
                    yield ready
                if len(done) == len(ids):
                    return
                self._check_owned()
                for output in self.engine.step():
                    inbox = self._inboxes.get(output.request_id)
                    if inbox is not None:
                        inbox.append(output)
        finally:
            self._let_go(ids, done)

    def _let_go(self, ids: list[str], done) -> None:
        """A stream is over: its inboxes go, and its requests that have not finished are
        aborted (their last outputs dropped when the engine returns them)."""
        for rid in ids:
            if self._inboxes.pop(rid, None) is not None and rid not in done:
                if self.engine.abort(rid):
                    self._dropped.add(rid)
