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

from collections import deque

import s01_generation_loop as s01
import s08_static_batching as s08
from s01_generation_loop import ParameterError

MAX_REQUESTS_PER_CALL = 4096   # prompts one generate(prompts) call may queue


class LLM:
    """Part I's and S08's calls over an engine (see the module docstring).

    `generate(prompt, max_tokens=16, temperature=None, seed=None, **options)` -> Part I's
    `Completion`; with a list of prompts (each text or a list of token ids: one prompt of
    token ids is `[[5, 6, 7]]`, since a list is always several prompts) and params (one
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
        steps = _Steps(self, ids)
        if single:
            return s01.CompletionStream(_Outputs(steps), requests[0].seq)
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
        last output), no open stream of this LLM and no request made in this call holds."""
        taken = ({r.request_id for r in made} | self.engine.request_ids_in_use()
                 | set(self._inboxes))
        k = 0
        while str(k) in taken:
            k += 1
        return str(k)


class _Steps:
    """One stream's steps: each `next` yields the stream's outputs of the next step that
    made some (stepping the engine as needed; other streams' outputs go to their inboxes)
    until each of its requests has had its last output. `close` (also when it ends, fails,
    or is dropped, before its first step too) aborts its unfinished requests, their KV
    freed at once, and gives its ids back."""

    def __init__(self, llm: LLM, ids: list[str]):
        self.llm, self.ids = llm, ids
        self.inboxes = {rid: deque() for rid in ids}
        llm._inboxes.update(self.inboxes)
        self.done: set[str] = set()
        self.closed = False

    def __iter__(self) -> "_Steps":
        return self

    def __next__(self) -> list[s01.RequestOutput]:
        try:
            return self._next()
        except BaseException:          # StopIteration included: the stream is over
            self.close()
            raise

    def _next(self) -> list[s01.RequestOutput]:
        llm = self.llm
        while not self.closed:
            ready = [box.popleft() for box in self.inboxes.values() for _ in range(len(box))]
            self.done.update(o.request_id for o in ready if o.finished)
            if ready:
                return ready
            if len(self.done) == len(self.ids):
                break
            llm._check_owned()
            if not llm.engine.has_unfinished_requests():
                lost = sorted(set(self.ids) - self.done)
                raise ValueError(f"requests {lost} left the engine without a last output "
                                 "(aborted by the engine's own abort? an LLM owns its engine)")
            for output in llm.engine.step():
                inbox = llm._inboxes.get(output.request_id)
                if inbox is not None:
                    inbox.append(output)
        raise StopIteration

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        llm = self.llm
        for rid, box in self.inboxes.items():
            if llm._inboxes.get(rid) is box:          # this stream's: let it go
                del llm._inboxes[rid]
            if rid not in self.done:
                llm.engine.abort(rid)
                if rid in llm.engine.request_ids_in_use():   # its last output is pending
                    llm._dropped.add(rid)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:    # at interpreter exit the engine may already be gone
            pass


class _Outputs:
    """A single-prompt stream's outputs one by one, over its `_Steps` (closed with it)."""

    def __init__(self, steps: _Steps):
        self.steps, self.pending = steps, deque()

    def __iter__(self) -> "_Outputs":
        return self

    def __next__(self) -> s01.RequestOutput:
        while not self.pending:
            self.pending.extend(next(self.steps))
        return self.pending.popleft()

    def close(self) -> None:
        self.steps.close()
