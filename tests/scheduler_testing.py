"""Model-free helpers for the scheduler tests of S10 to S13 (in the spirit of vLLM's
tests/v1/core/test_scheduler.py): requests made of token ids alone, a fake model step, the
scheduler's invariants, and the pieces the hypothesis state machines share.

The fake model's next token is a fixed function of the context it has computed (its own
record of the tokens the scheduler sent it), so a request's outputs do not depend on the
schedule: a run with unbounded KV capacity is the reference, and a lost, duplicated or
mis-positioned token under preemption changes every token after it.
"""
from hypothesis import strategies as st

from s09_scheduler import Request, RequestStatus

VOCAB = 97


def ceil_div(a: int, b: int) -> int:
    """The tests' own ceiling division (blocks for a tokens), not the code's `cdiv`."""
    return -(-a // b)


def make_request(request_id: str, prompt_len: int, max_tokens: int, arrival: int = 0,
                 priority: int = 0, cache_salt: str | None = None) -> Request:
    """A model-free `Request` whose prompt is a fixed function of its length."""
    prompt = [(7 * i + prompt_len) % VOCAB for i in range(prompt_len)]
    return Request.for_tokens(request_id, prompt, max_tokens, arrival=arrival,
                              priority=priority, cache_salt=cache_salt)


def next_token(context: list[int]) -> int:
    return (31 * sum(context) + 7 * len(context) + context[-1]) % VOCAB


class FakeModel:
    """Runs a scheduler's plans: keeps each request's computed context (what a KV cache would
    hold), checks the scheduler asked for exactly the tokens after it, and samples a token
    for each request whose scheduled tokens reach the end of its token_ids. A request stops
    at its max_tokens or when its context reaches max_model_len (Part I's stop rules).
    `add` checks a request as the engine does (`check_request`) and gives it its arrival."""

    def __init__(self, scheduler, max_model_len: int):
        self.scheduler, self.max_model_len = scheduler, max_model_len
        self.kv: dict[str, list[int]] = {}
        self.by_id: dict[str, Request] = {}
        self.ended: dict[str, str] = {}       # request id -> "length" / "stop" / "abort"
        self.plans: list = []

    def add(self, request: Request) -> Request:
        self.scheduler.check_request(request)
        request.arrival = len(self.by_id)
        self.scheduler.add_request(request)
        self.by_id[request.request_id] = request
        return request

    def step(self):
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        for rid in plan.finished_ids:
            self.ended[rid] = "length"
        finished = []
        for rid, n in plan.num_scheduled_tokens.items():
            req, start = self.by_id[rid], plan.num_computed_tokens[rid]
            assert start == req.num_computed_tokens and n >= 1
            kept = self.kv.get(rid, [])[:start]
            assert len(kept) == start, "the scheduler claims KV the model never computed"
            self.kv[rid] = kept + req.token_ids[start:start + n]
            if start + n == req.num_tokens:
                assert self.kv[rid] == req.token_ids
                req.append_token(next_token(self.kv[rid]))
                if (len(req.output_ids) >= req.params.max_tokens
                        or req.num_tokens >= self.max_model_len):
                    finished.append(rid)
                    self.ended[rid] = "stop"
        self.scheduler.update_from_output(plan, finished)
        check_invariants(self.scheduler, plan)
        return plan

    def drain(self, limit: int = 10_000) -> None:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < limit, "the scheduler never drains (a hang)"


def check_invariants(s, plan) -> None:
    """The budgets, and KV accounting: each running request holds exactly its computed
    tokens, waiting ones hold none, the pool's total is their sum; no request in two
    queues."""
    assert plan.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    assert 0 <= s.kv.num_used_tokens <= s.kv_capacity
    ids = [r.request_id for r in (*s.running, *s.waiting)]
    assert len(ids) == len(set(ids)), "a request in two queues"
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        assert s.kv.num_tokens(r.request_id) == r.num_computed_tokens
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert s.kv.num_tokens(r.request_id) == 0
    assert s.kv.num_used_tokens == sum(r.num_computed_tokens for r in s.running)


def alone(prompt_len: int, max_tokens: int, max_model_len: int) -> list[int]:
    """The fake model's tokens for one request with all the room it wants."""
    req = make_request("x", prompt_len, max_tokens)
    while len(req.output_ids) < max_tokens and req.num_tokens < max_model_len:
        req.append_token(next_token(req.token_ids))
    return req.output_ids


def abort_drawn(machine, data) -> str:
    """The `abort` rule of the fake-model machines (S10-S12): abort a drawn id among those
    added; the scheduler takes it out exactly when it was queued. Returns the id."""
    rid = str(data.draw(st.integers(0, machine.count - 1)))
    held = any(r.request_id == rid for r in (*machine.s.running, *machine.s.waiting))
    assert machine.s.finish_requests([rid]) == ([rid] if held else [])
    if held:
        machine.aborted.add(rid)
        machine.model.ended[rid] = "abort"
    return rid


def drain(machine, work: int) -> None:
    """Step the machine until its scheduler has nothing unfinished, in at most `work` steps."""
    steps = 0
    while machine.s.has_unfinished_requests():
        machine.step()
        steps += 1
        assert steps <= work, "the scheduler does not drain within the work it has"


def check_outputs_alone(machine, max_model_len: int) -> None:
    """After `drain`: every request not aborted has exactly the fake model's tokens for it
    alone, as many as its max_tokens, its context or the capacity allow, and the finish
    reason that says which; an aborted one has a prefix of them."""
    for rid, req in machine.model.by_id.items():
        want = alone(len(req.prompt_ids), req.params.max_tokens, max_model_len)
        if rid in machine.aborted:
            assert req.output_ids == want[:len(req.output_ids)]
            continue
        room = machine.s.kv_capacity - len(req.prompt_ids) + 1
        assert req.output_ids == want[:min(len(want), room)], rid
        assert machine.model.ended[rid] == ("length" if room < len(want) else "stop")


# --- S11-S13: schedulers over a block manager, observers, a fake model that reads its KV ----

def chunked_scheduler(kv, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      policy: str = "fcfs", long_prefill_token_threshold: int = 0):
    """S11's `ChunkedScheduler` over the KV manager `kv` (a `TokenKVPool`, S12's
    `KVCacheManager` or S13's `PrefixCachingKVCacheManager`), as S12's and S13's engines
    assemble it."""
    from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig
    return ChunkedScheduler(ChunkedSchedulerConfig(
        max_num_seqs, max_model_len, max_num_batched_tokens, policy,
        long_prefill_token_threshold), kv)


def alone_tokens(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """`alone` for a prompt given as token ids."""
    ids, out = list(prompt), []
    while len(out) < max_tokens and len(ids) < max_model_len:
        ids.append(next_token(ids))
        out.append(ids[-1])
    return out


class ObservedFakeModel(FakeModel):
    """`FakeModel` in the engine's place for observers (S09's `StepTracer`, S12's
    `BlockTracer`, S13's `CacheTracer`): it has the engine's `scheduler`, `requests` and
    `observers`, tells them `on_plan` after each plan and `on_step` after
    `update_from_output` (with the ids that sampled, in schedule order, and an output for
    each request that finished), as S09's engine does. `fail()` is a step whose model run
    raised: planned, observers told of the plan only, then reverted (the engine's path).
    Subclasses change what a scheduled request computes (`compute`) and the invariants
    checked after each step (`check`)."""

    def __init__(self, scheduler, max_model_len: int):
        super().__init__(scheduler, max_model_len)
        self.observers: list = []

    @property
    def requests(self) -> dict[str, Request]:
        """The requests not ended (the engine's unfinished ones)."""
        return {rid: r for rid, r in self.by_id.items() if rid not in self.ended}

    def schedule(self):
        """The scheduler's plan (a subclass may look at what planning changed)."""
        return self.scheduler.schedule()

    def plan(self):
        plan = self.schedule()
        self.plans.append(plan)
        for observer in self.observers:
            observer.on_plan(self, plan)
        for rid in plan.finished_ids:
            self.ended[rid] = "length"
        return plan

    def step(self):
        return self.run(self.plan())

    def fail(self):
        """Plan a step whose model run raises: the plan is reverted, observers hear no
        `on_step`. A plan that computes nothing runs no model, so it cannot fail: it goes on
        as a step."""
        plan = self.plan()
        if not plan.num_scheduled_tokens:
            return self.run(plan)
        self.scheduler.revert(plan)
        return plan

    def compute(self, plan, request: Request, start: int, n: int) -> list[int]:
        """Compute request's tokens start .. start + n - 1; returns the context its next
        token is drawn from when they reach its end. Here FakeModel's private record of what
        was computed (the scheduler must ask for exactly the tokens after it)."""
        rid = request.request_id
        kept = self.kv.get(rid, [])[:start]
        assert len(kept) == start, "the scheduler claims KV the model never computed"
        self.kv[rid] = kept + request.token_ids[start:start + n]
        if start + n == request.num_tokens:
            assert self.kv[rid] == request.token_ids
        return self.kv[rid]

    def check(self, plan) -> None:
        check_invariants(self.scheduler, plan)

    def run(self, plan):
        from types import SimpleNamespace

        from s09_continuous_batching import RequestOutput
        outputs = [RequestOutput(rid, [], "", True, "length") for rid in plan.finished_ids]
        sampled, finished = [], []
        for rid, n in plan.num_scheduled_tokens.items():
            req, start = self.by_id[rid], plan.num_computed_tokens[rid]
            assert start == req.num_computed_tokens and n >= 1
            context = self.compute(plan, req, start, n)
            if start + n != req.num_tokens:
                continue
            token = next_token(context)
            req.append_token(token)
            sampled.append(rid)
            done = (len(req.output_ids) >= req.params.max_tokens
                    or req.num_tokens >= self.max_model_len)
            if done:
                finished.append(rid)
                self.ended[rid] = "stop"
            outputs.append(RequestOutput(rid, [token], "", done, "stop" if done else None))
        self.scheduler.update_from_output(plan, finished)
        result = SimpleNamespace(plan=plan, run=None, req_ids=sampled, outputs=outputs,
                                 num_tokens=plan.total_num_scheduled_tokens, model_s=0.0,
                                 step_s=0.0)
        for observer in self.observers:
            observer.on_step(self, result)
        self.check(plan)
        return plan


class PagedFakeModel(ObservedFakeModel):
    """A fake model over a block manager (S12's or S13's) that keeps what each pool slot
    holds: the whole token prefix up to and including that position, and the cache salt of
    the request that wrote it (a real key/value vector depends on every token before it, so
    the prefix stands for it). For every scheduled request it checks that each position it
    reads (those before its start, through its block table, prefix hits included) holds
    exactly its own prefix written under its own salt, and that each position it writes is
    in a block only it holds and that has no name (a shared or cached block is never
    written). After every step: `check_block_manager`."""

    def __init__(self, scheduler, max_model_len: int):
        super().__init__(scheduler, max_model_len)
        self.slots: dict[int, tuple] = {}

    def compute(self, plan, request: Request, start: int, n: int) -> list[int]:
        rid, kv = request.request_id, self.scheduler.kv
        size, table = kv.block_size, plan.block_tables[rid]
        assert list(table) == kv.block_table(rid)
        assert len(table) == -(-(start + n) // size)
        for p in range(start):
            held = self.slots.get(table[p // size] * size + p % size)
            assert held == (tuple(request.token_ids[:p + 1]), request.cache_salt), \
                f"request {rid} reads wrong KV at position {p}"
        for p in range(start, start + n):
            block = kv.pool.blocks[table[p // size]]
            assert block.ref_cnt == 1 and getattr(block, "block_hash", None) is None, \
                f"request {rid} writes position {p} into a shared or cached block"
            self.slots[block.block_id * size + p % size] = (tuple(request.token_ids[:p + 1]),
                                                             request.cache_salt)
        return request.token_ids[:start + n]

    def check(self, plan) -> None:
        check_block_manager(self.scheduler)


def check_block_manager(s) -> None:
    """A block manager's accounting after a step (`kv.check()`: free + used == usable, blocks
    per request, no block both held and free, S13's cache map), every usable block's ref_cnt
    == the block tables holding it, running requests hold exactly their computed tokens,
    waiting ones hold nothing, and (S13) the hit counters are consistent."""
    kv = s.kv
    kv.check()
    holders: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in kv.pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block.block_id
    for r in s.running:
        assert kv.num_tokens(r.request_id) == r.num_computed_tokens
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and r.request_id not in kv.req_blocks
    stats = getattr(kv, "stats", None)
    if stats is not None:
        assert 0 <= stats.hits <= stats.queries and stats.hit_requests <= stats.requests
