"""Tests for chapter S16's async scheduling loop (code/s16_async.py).

Oracles: the synchronous S09 loop (`LLMEngine.step`) on a fresh engine from the same builder
with the same options, whose outputs S09-S13's own tests pin to S05 / HF alone; S06's
single-request engine alone for a greedy anchor; the plans the observers and a runner wrapper
of the test's own see (who is scheduled, from which token, on which thread, before or after
which report); S12 / S13's block books (`kv.check()`, no block held when idle).

What is checked:
- every request's outputs equal the synchronous loop's, output by output (token ids, text
  deltas, finished, finish_reason, stop_reason, logprobs), through `step()` and through
  `LLM.generate`, under EOS, max_tokens, stop strings that really fire, seeded sampling,
  chunked prefill (S11, S13), preemption (both loops really preempt), prefix hits and
  aborts of waiting and running requests (the rows in flight dropped unsampled), on S09's
  slot engine, S11's and S13's; a request that reaches the context's end or outgrows the
  KV pool ends "length" with the same tokens; per-request stats unchanged;
- the loop is really asynchronous: each forward runs on the worker thread and waits (in the
  test's runner) until the host has made the next plan, which a synchronous loop never does;
  at most one forward runs at a time and it reads only tokens that exist; a decoding
  request's num_computed_tokens counts the steps planned for it before their tokens exist,
  one output placeholder per such step;
- idle: after the last output (or after aborting everything) the engine is idle within two
  steps, holds no KV block, no request keeps a placeholder, and `shutdown` returns;
- a forward that raises on the worker: `step()` raises, both plans are taken back, KV books
  right, and the next steps give every request the clean synchronous run's outputs;
- refusals (speculative decoding, a flag that is not a bool); S16's static decode runner
  and the worker process (code/s16_worker.py, sync and async, a step failing there, no
  process left after shutdown) under the async loop; CUDA (marked gpu).

Where the loops may legitimately differ, the tests pin what holds: a request added between
steps joins a plan at most two steps later than in the synchronous loop (so, aborted, it may
have made fewer tokens: a prefix of its whole run), and a plan made while a step runs cannot
hit blocks that step fills (fewer prefix hits under chunked prefill, never more).
"""
import threading
import time

import pytest

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s09_continuous_batching as s09
import s11_chunked_prefill as s11
import s12_engine as s12
import s13_prefix_caching as s13
import s16_async
import s16_host
import s16_static
from engine_testing import RunnerWrapper
from s01_generation_loop import ParameterError
from s09_llm import LLM
from s09_scheduler import RequestStatus

# Token counts with the bundled tokenizer: 20, 19, 24, 19, 11, 4 (the first four are chunked
# by a budget of 16 tokens).
PROMPTS = ["First Citizen:\nBefore we proceed any further, hear me speak.\n",
           "KING RICHARD.\nNow is the winter of our discontent made glorious summer",
           "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind",
           "ROMEO.\nBut soft, what light through yonder window breaks?\n",
           "Friends, Romans, countrymen", "HAMLET.\n"]
# Stop strings the bundled model's greedy continuations of PROMPTS really contain (found by
# running it): "not so much" (prompts 0 and 3), "colour" (1), "SALARINO" (4), "know" (5).
STOPS = [["not so"], ["colour"], ["zzz"], ["not so"], ["SALARINO"], ["know"]]


def greedy(max_tokens: int, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def seeded(i: int, max_tokens: int, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.8, seed=100 + i, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def bundled():
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists():
        pytest.skip("bundled model not trained yet")
    return s06.load()


def build_pair(bundled, build, **options):
    """A synchronous engine and an async one, fresh, from the same builder and options."""
    model, tok = bundled
    return build(model, tok, **options), s16_async.make_async(build(model, tok, **options))


# --- running a workload ---------------------------------------------------------------------

def completions(engine, prompts, params) -> list[tuple]:
    """`LLM.generate`: per prompt (token ids, text, finish_reason, stop_reason)."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
            for c in LLM(engine).generate(prompts, params)]


def row(out) -> tuple:
    """What a caller of `step()` sees of one output; logprobs as the ids (sampled, then the
    top ones) and, last, the values (compared within `LOGPROB_TOL` by `assert_same_rows`)."""
    ids = values = None
    if out.logprobs is not None:
        ids = [(lp.token_id, tuple(t for t, _ in lp.top_logprobs)) for lp in out.logprobs]
        values = [x for lp in out.logprobs for x in (lp.logprob, *(v for _, v in
                                                                  lp.top_logprobs))]
    return (tuple(out.new_token_ids), out.text_delta, out.finished, out.finish_reason,
            out.stop_reason, out.error is None, ids, values)


# The two loops may batch a request with other companions (the async one admits and frees
# later), and the fast mode's float rounding depends on the batch: values within this.
LOGPROB_TOL = 1e-4


class Requests:
    """An observer keeping every Request object the engine plans (to inspect them after they
    have left the engine)."""

    def __init__(self):
        self.seen = {}

    def on_plan(self, engine, plan):
        self.seen.update(engine.requests)

    def on_step(self, engine, result):
        pass


def run_steps(engine, requests, arrivals=None, aborts=None, injected=None, max_calls=600):
    """The manual loop: request i (prompt, params) is added before step call arrivals[i]
    (default 0), with id str(i); aborts: {call: [i, ...]} aborted before that call;
    injected(err): a RuntimeError the loop steps on past (after checking the books, `books`).
    Returns a `Run`. At the end the engine is idle (`idle`)."""
    arrivals = arrivals or [0] * len(requests)
    aborts = aborts or {}
    run, added, call = Run(), set(), 0
    while len(added) < len(requests) or engine.has_unfinished_requests():
        assert call < max_calls, "the engine does not drain"
        for i, at in enumerate(arrivals):
            if at == call:
                engine.add_request(requests[i][0], requests[i][1], str(i))
                added.add(i)
        for i in aborts.get(call, []):
            run.aborted[i] = engine.abort(str(i))
        call += 1
        try:
            outputs = engine.step()
        except RuntimeError as err:
            if injected is None or not injected(err):
                raise
            run.failures += 1
            books(engine)
            continue
        for out in outputs:
            run.rows.setdefault(int(out.request_id), []).append(row(out))
            run.cached[int(out.request_id)] = out.num_cached_tokens
        if outputs:
            run.last_output_call = call
    run.calls = call
    assert sorted(run.rows) == list(range(len(requests))), "a request without a last output"
    assert all(rows[-1][2] and sum(r[2] for r in rows) == 1 for rows in run.rows.values())
    idle(engine)
    return run


class Run:
    """What `run_steps` saw: rows {i: [row of each output]}, cached {i: num_cached_tokens of
    its last output}, aborted {i: what abort returned}, failures (injected errors stepped
    past), calls (step calls in all), last_output_call (the last call that returned any)."""

    def __init__(self):
        self.rows, self.cached, self.aborted = {}, {}, {}
        self.failures = self.calls = self.last_output_call = 0


def books(engine) -> None:
    """Between steps, with nothing in flight: S12/S13's block books (`kv.check()`, each
    block's ref_cnt the tables holding it), each running request holds KV for exactly its
    computed tokens, waiting ones hold none, and no request counts a placeholder."""
    kv, scheduler = engine.scheduler.kv, engine.scheduler
    kv.check()
    holders = {}
    for blocks in kv.req_blocks.values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in kv.pool.blocks[1:])
    for request in scheduler.running:
        assert kv.num_tokens(request.request_id) == request.num_computed_tokens
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0 and request.request_id not in kv.req_blocks
    assert all(r.num_output_placeholders == 0 for r in engine.requests.values())


def idle(engine) -> None:
    """Nothing waits, runs or is in flight; the KV manager holds no block (S12/S13; S09-S11:
    no token); the async loop keeps no plan, no step and no placeholder."""
    assert not engine.has_unfinished_requests()
    assert not engine.requests and not engine.scheduler.has_unfinished_requests()
    kv = engine.scheduler.kv
    if hasattr(kv, "num_used_blocks"):
        kv.check()
        assert kv.num_used_blocks == 0 and not kv.req_blocks
    assert kv.num_used_tokens == 0
    if isinstance(engine, s16_async.AsyncLLMEngine):
        assert engine.in_flight is None and not engine.ending
        assert not engine.scheduler.placeholders


def tokens(rows) -> list[int]:
    return [t for r in rows for t in r[0]]


def assert_same_rows(got, want, ids=None) -> None:
    """Each request's outputs equal, one by one (logprob values within LOGPROB_TOL)."""
    for i in sorted(want) if ids is None else ids:
        assert [r[:-1] for r in got[i]] == [r[:-1] for r in want[i]], (
            f"request {i}: async {tokens(got[i])} {got[i][-1][3:5]}, sync {tokens(want[i])} "
            f"{want[i][-1][3:5]}")
        for g, w in zip(got[i], want[i]):
            if w[-1] is not None:
                assert g[-1] == pytest.approx(w[-1], abs=LOGPROB_TOL)


# --- the same outputs as the synchronous loop -----------------------------------------------

class Plans:
    """An observer keeping each plan that schedules something, and whether a new request's
    prompt was ever cut into chunks."""

    def __init__(self):
        self.plans, self.chunked = [], False

    def on_plan(self, engine, plan):
        if plan.num_scheduled_tokens:
            self.plans.append(plan)
        for rid in plan.scheduled_new_ids:
            request = engine.requests[rid]
            if plan.num_scheduled_tokens[rid] + plan.num_computed_tokens[rid] < len(
                    request.prompt_ids):
                self.chunked = True

    def on_step(self, engine, result):
        pass


SCENARIOS = {
    # (builder, options, requests)
    "eos": (s13.build_engine, dict(max_num_seqs=4),
            [(p, greedy(4 if i % 2 else 50)) for i, p in enumerate(PROMPTS)]),
    "stop_strings": (s13.build_engine, dict(max_num_seqs=4),
                     [(p, greedy(60, stop=STOPS[i], ignore_eos=True))
                      for i, p in enumerate(PROMPTS)]),
    "max_tokens": (s09.build_engine, dict(max_num_seqs=4, max_context=64),
                   [(p, greedy(3 + 5 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]),
    "seeded": (s13.build_engine, dict(max_num_seqs=3),
               [(p, seeded(i, 12 + 7 * i, stop=STOPS[i] if i % 3 == 0 else None, logprobs=1))
                for i, p in enumerate(PROMPTS)]),
    "chunked_s13": (s13.build_engine, dict(max_num_seqs=4, max_num_batched_tokens=16),
                    [(p, seeded(i, 10 + 3 * i) if i % 2 else greedy(12 + 3 * i))
                     for i, p in enumerate(PROMPTS)]),
    "chunked_s11": (s11.build_engine, dict(max_num_seqs=4, max_num_batched_tokens=16,
                                           max_context=96),
                    [(p, greedy(10 + 3 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]),
    "preemption": (s13.build_engine, dict(max_num_seqs=4, num_blocks=8),
                   [(p, seeded(i, 40, ignore_eos=True) if i % 2 else
                     greedy(40, ignore_eos=True)) for i, p in enumerate(PROMPTS)]),
    "context_end": (s09.build_engine, dict(max_num_seqs=4, max_context=30),
                    [(p, greedy(100, ignore_eos=True)) for p in PROMPTS]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_step_outputs_equal_the_synchronous_loop(bundled, name):
    """Through `step()`: each request's outputs, one by one, equal the synchronous loop's,
    and the case really happens in both loops (the stop rule fires, prompts are chunked,
    requests are preempted, the context's end is reached)."""
    build, options, requests = SCENARIOS[name]
    sync, fast = build_pair(bundled, build, **options)
    traced = {id(e): Plans() for e in (sync, fast)}
    for engine in (sync, fast):
        engine.observers.append(traced[id(engine)])
    want = run_steps(sync, requests).rows
    got = run_steps(fast, requests).rows
    assert_same_rows(got, want)
    reasons = {rows[-1][3] for rows in want.values()}
    if name in ("eos", "stop_strings"):          # the stop rule really fired
        assert "stop" in reasons and "length" in reasons
    if name == "eos":
        assert any(rows[-1][3] == "stop" and rows[-1][4] is None for rows in want.values())
    if name == "stop_strings":
        fired = {want[i][-1][4] for i in want if want[i][-1][3] == "stop"}
        assert {"not so", "colour", "SALARINO"} <= fired
    if name.startswith("chunked"):
        assert all(traced[id(e)].chunked for e in (sync, fast))
    if name == "preemption":
        assert sync.scheduler.num_preemptions > 0 and fast.scheduler.num_preemptions > 0
    if name == "context_end":                   # "length" at the context's end, not max_tokens
        assert all(len(tokens(rows)) < 100 and rows[-1][3] == "length"
                   for rows in want.values())


@pytest.mark.parametrize("name", ["eos", "stop_strings", "seeded", "chunked_s13",
                                  "preemption"])
def test_llm_generate_equals_the_synchronous_loop(bundled, name):
    """Through `LLM.generate`: the same completions (ids, text, finish_reason,
    stop_reason)."""
    build, options, requests = SCENARIOS[name]
    sync, fast = build_pair(bundled, build, **options)
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    want = completions(sync, prompts, params)
    assert completions(fast, prompts, params) == want
    if name == "preemption":
        assert sync.scheduler.num_preemptions > 0 and fast.scheduler.num_preemptions > 0
    if name == "stop_strings":
        # The engine is reused: a second call, on an engine that may still have its last
        # (dropped) row in flight, gives the same again.
        assert completions(fast, prompts, params) == want


def test_greedy_equals_s06_alone(bundled):
    """An anchor outside the engines: greedy ids of the async loop equal S06's one-request
    engine's."""
    model, tok = bundled
    alone = s06.Engine(model, tok, 256)
    fast = s16_async.make_async(s13.build_engine(model, tok, max_num_seqs=3,
                                                 max_num_batched_tokens=16))
    params = greedy(12, ignore_eos=True)
    got = LLM(fast).generate(PROMPTS[:4], params)
    assert [c.token_ids for c in got] == [alone.generate(p, params).token_ids
                                          for p in PROMPTS[:4]]


def test_a_request_that_outgrows_the_kv_pool_ends_length_with_the_same_tokens(bundled):
    """S10's rule: a request whose context outgrows the whole pool is ended by the scheduler
    ("length"). The async plan counts the token in flight as a placeholder, so the plan made
    while that token is computed must not end the request before the token arrives."""
    requests = [(PROMPTS[5], greedy(100, ignore_eos=True)), (PROMPTS[4], greedy(6))]
    sync, fast = build_pair(bundled, s13.build_engine, max_num_seqs=2, num_blocks=4)
    want = run_steps(sync, requests).rows
    assert want[0][-1][3] == "length" and len(tokens(want[0])) < 100    # the pool ended it
    got = run_steps(fast, requests).rows
    assert_same_rows(got, want)


def test_per_request_stats_equal_the_synchronous_loop(bundled):
    """Part I's per-request `Stats`: the context length of each pass (the tokens the pass
    attended over) is the same whichever loop ran it."""
    build, options, requests = SCENARIOS["chunked_s13"]
    sync, fast = build_pair(bundled, build, **options)
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    want = LLM(sync).generate(prompts, params)
    got = LLM(fast).generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert (g.stats.prompt_tokens, g.stats.context_lens) == (w.stats.prompt_tokens,
                                                                 w.stats.context_lens)


# --- prefix hits ----------------------------------------------------------------------------

SHARED = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n"
SHARED_REQUESTS = [(SHARED + "A", greedy(6, ignore_eos=True)),
                   (SHARED + "B", greedy(6, ignore_eos=True)),
                   (SHARED + " C", greedy(6, ignore_eos=True))]


@pytest.mark.parametrize("arrivals", [[0, 8, 8], [0, 1, 2]], ids=["after", "during"])
def test_prefix_hits_give_the_same_outputs_and_cached_counts(bundled, arrivals):
    """Request 0 fills the cache; 1 and 2 share its first three blocks of 8 (24 tokens),
    arriving after it is done or while it runs: both loops hit them, with the same outputs
    and num_cached_tokens."""
    sync, fast = build_pair(bundled, s13.build_engine, max_num_seqs=4, block_size=8)
    want = run_steps(sync, SHARED_REQUESTS, arrivals)
    got = run_steps(fast, SHARED_REQUESTS, arrivals)
    assert_same_rows(got.rows, want.rows)
    assert want.cached == got.cached == {0: 0, 1: 24, 2: 24}


def test_prefix_hits_under_chunked_prefill_give_the_same_outputs(bundled):
    """All three arrive together under a budget of 16 tokens: the synchronous loop admits
    request 1 in step 1, after step 0 named request 0's first two blocks (a hit of 16); the
    async loop made that plan while step 0 ran, before any block had a name, so request 1
    misses. Outputs are equal; the async loop never hits more."""
    options = dict(max_num_seqs=4, block_size=8, max_num_batched_tokens=16)
    sync, fast = build_pair(bundled, s13.build_engine, **options)
    want = run_steps(sync, SHARED_REQUESTS)
    got = run_steps(fast, SHARED_REQUESTS)
    assert_same_rows(got.rows, want.rows)
    assert want.cached[1] == 16 and want.cached[2] == 24          # the case really hits
    assert all(got.cached[i] <= want.cached[i] for i in range(3))


# --- aborts ---------------------------------------------------------------------------------

def test_aborts_of_waiting_and_running_requests_give_the_same_outputs(bundled):
    """Requests 0 and 1 run from step 0 (two seats), 2 to 4 wait. 3 is aborted while it
    waits; 1 before call 4 and 0 before call 6, while a step holding their rows is in flight
    in the async loop (those rows are dropped unsampled). Every output is the same in both
    loops, the aborted requests' tokens included: a request running since step 0 and
    aborted before call k has made exactly k tokens."""
    requests = [(PROMPTS[0], seeded(0, 40, ignore_eos=True)),
                (PROMPTS[1], greedy(40, ignore_eos=True)), (PROMPTS[2], seeded(2, 8)),
                (PROMPTS[3], greedy(8)), (PROMPTS[4], greedy(8, ignore_eos=True))]
    aborts = {1: [3], 4: [1], 6: [0]}
    runs = [run_steps(engine, requests, aborts=aborts)
            for engine in build_pair(bundled, s13.build_engine, max_num_seqs=2)]
    want, got = runs[0].rows, runs[1].rows
    assert_same_rows(got, want)
    assert runs[0].aborted == runs[1].aborted == {3: True, 1: True, 0: True}
    assert [want[i][-1][3] for i in (0, 1, 3)] == ["abort"] * 3
    assert [len(tokens(want[i])) for i in (0, 1, 3)] == [6, 4, 0]
    assert want[2][-1][3] != "abort" and want[4][-1][3] == "length"


def test_aborts_with_arrivals_never_change_the_others(bundled):
    """Arrivals and aborts at fixed calls under chunked prefill. The async loop plans ahead,
    so a request added between steps is scheduled later than in the synchronous loop and,
    aborted, may have made fewer tokens; what it made is then a prefix of the same
    request's whole run, in both loops. The requests not aborted have the same outputs."""
    requests = [(p, seeded(i, 24, ignore_eos=True) if i % 2 else greedy(24, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    arrivals, aborts = [0, 0, 1, 2, 4, 6], {3: [1], 5: [3], 8: [0], 9: [5], 12: [4]}
    options = dict(max_num_seqs=3, max_num_batched_tokens=16)
    whole = run_steps(s13.build_engine(*bundled, **options), requests, arrivals).rows
    sync, fast = build_pair(bundled, s13.build_engine, **options)
    want = run_steps(sync, requests, arrivals, aborts).rows
    got = run_steps(fast, requests, arrivals, aborts).rows
    aborted = {i for i in want if want[i][-1][3] == "abort"}
    assert aborted == {i for i in got if got[i][-1][3] == "abort"} and len(aborted) >= 3
    assert_same_rows(got, want, sorted(set(want) - aborted))
    assert_same_rows(want, whole, sorted(set(want) - aborted))
    for i in aborted:
        for rows in (want[i], got[i]):
            made = tokens(rows)
            assert made == tokens(whole[i])[:len(made)]
            assert rows[-1][:3] == ((), "", True)


def test_a_request_added_between_steps_is_scheduled_at_most_two_steps_later(bundled):
    """The cost of planning ahead: a request added after step k's outputs joins a plan at
    most two steps after the one the synchronous loop puts it in."""
    firsts = []
    for engine in build_pair(bundled, s13.build_engine, max_num_seqs=4):
        plans = Plans()
        engine.observers.append(plans)
        run_steps(engine, [(PROMPTS[0], greedy(12, ignore_eos=True)),
                           (PROMPTS[4], greedy(3, ignore_eos=True))], [0, 5])
        firsts.append(min(p.step for p in plans.plans if "1" in p.num_scheduled_tokens))
    assert firsts[0] == 5 and firsts[0] <= firsts[1] <= firsts[0] + 2


# --- the loop really overlaps ---------------------------------------------------------------

class Events:
    """An observer recording ("plan", step) for each plan that schedules something, ("empty",)
    for one that does not, and ("step", step) for each step that ran."""

    def __init__(self):
        self.events = []

    def on_plan(self, engine, plan):
        self.events.append(("plan", plan.step) if plan.num_scheduled_tokens else ("empty",))

    def on_step(self, engine, result):
        if result.run is not None:
            self.events.append(("step", result.plan.step))


class Gate(RunnerWrapper):
    """Around the runner: each forward first waits (up to timeout seconds) until the host has
    made the plan after this step's, and records whether it came; also the threads it runs
    on, how many forwards run at once, and whether every token it computes exists."""

    def __init__(self, runner, events: list, timeout: float):
        super().__init__(runner)
        self.events, self.timeout = events, timeout
        self.lock = threading.Lock()
        self.active = self.max_active = 0
        self.threads, self.overlapped, self.inputs_known = set(), [], []

    def execute_model(self, plan, requests):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.threads.add(threading.get_ident())
            self.inputs_known.append(all(
                plan.num_computed_tokens[rid] + n <= len(requests[rid].token_ids)
                for rid, n in plan.num_scheduled_tokens.items()))
            mine = self.events.index(("plan", plan.step))
            deadline = time.monotonic() + self.timeout
            while not self.planned_after(mine) and time.monotonic() < deadline:
                time.sleep(0.0002)
            self.overlapped.append(self.planned_after(mine))
            return self.runner.execute_model(plan, requests)
        finally:
            with self.lock:
                self.active -= 1

    def planned_after(self, index: int) -> bool:
        """Whether a plan (empty or not) was made after events[index]."""
        return any(e[0] != "step" for e in self.events[index + 1:])


def test_the_next_plan_is_made_while_the_forward_runs(bundled):
    """Each forward of the async loop runs on the worker thread and, while it runs, the host
    makes the next plan (the runner waits for it: a synchronous loop would never make it);
    one forward at a time; each reads only tokens that exist; the plan after step k is
    made before step k is reported, and at most two plans are made ahead of a report."""
    model, tok = bundled
    requests = [(p, greedy(6, ignore_eos=True)) for p in PROMPTS[:4]]
    seen = {}
    for name, timeout in (("sync", 0.02), ("async", 10.0)):
        engine = s13.build_engine(model, tok, max_num_seqs=3, max_num_batched_tokens=32)
        observer = Events()
        engine.observers.append(observer)
        engine.runner = Gate(engine.runner, observer.events, timeout)
        if name == "async":
            engine = s16_async.make_async(engine)
        seen[name] = (run_steps(engine, requests).rows, engine.runner, observer.events)
    (want, sync_gate, _), (got, gate, events) = seen["sync"], seen["async"]
    assert sync_gate.threads == {threading.main_thread().ident}
    assert not any(sync_gate.overlapped)                 # the test tells the loops apart
    assert len(gate.overlapped) >= 8 and all(gate.overlapped)
    assert threading.main_thread().ident not in gate.threads and len(gate.threads) == 1
    assert gate.max_active == 1 and all(gate.inputs_known)
    for j, event in enumerate(events):
        if event[0] == "step":
            planned = events.index(("plan", event[1]))
            ahead = [e for e in events[planned + 1:j] if e[0] != "step"]
            assert 1 <= len(ahead) <= 2, (event, events)
    assert_same_rows(got, want)


class AtPlan:
    """An observer checking, at each plan, whether every scheduled request's
    num_computed_tokens already counts the plan's tokens."""

    def __init__(self):
        self.moved = []

    def on_plan(self, engine, plan):
        for rid, n in plan.num_scheduled_tokens.items():
            start = plan.num_computed_tokens[rid]
            self.moved.append(engine.requests[rid].num_computed_tokens == start + n)

    def on_step(self, engine, result):
        pass


def test_num_computed_tokens_moves_when_a_step_is_planned(bundled):
    """Between two calls of the async loop a decoding request has one step in flight (it
    reads the last token known): its num_computed_tokens already counts that step, and its
    output placeholder (the token the step will sample) makes num_tokens cover it. The next
    call plans the step after it first, which reads that placeholder's position. The
    synchronous loop moves the count after the step, and counts no placeholder."""
    model, tok = bundled
    requests = [(p, greedy(10, ignore_eos=True)) for p in PROMPTS[3:6]]
    checked = 0
    for name in ("sync", "async"):
        engine = s13.build_engine(model, tok, max_num_seqs=4)
        observer = AtPlan()
        engine.observers.append(observer)
        if name == "async":
            engine = s16_async.make_async(engine)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(prompt, params, str(i))
        while engine.has_unfinished_requests():
            engine.step()
            for rid, r in engine.requests.items():
                if not r.output_ids or r.status != RequestStatus.RUNNING:
                    continue
                known = len(r.token_ids)
                if name == "sync":
                    assert (r.num_computed_tokens, r.num_output_placeholders) == (known - 1, 0)
                    continue
                launched = engine.in_flight.plan
                if rid not in launched.num_scheduled_tokens:
                    continue
                assert launched.num_computed_tokens[rid] == known - 1
                assert launched.num_scheduled_tokens[rid] == 1
                assert r.num_computed_tokens == known
                assert r.num_output_placeholders == 1 and r.num_tokens == known + 1
                checked += 1
        assert all(observer.moved) == (name == "async") and any(observer.moved) == (
            name == "async")
    assert checked >= 10


# --- idle -----------------------------------------------------------------------------------

def test_idle_within_two_steps_of_the_last_output(bundled):
    """After the last output the loop has a dropped row in flight at most: within two more
    calls (which return nothing) it is idle (see `idle`), and shutdown returns."""
    requests = [(p, greedy(5 + 4 * i)) for i, p in enumerate(PROMPTS)]
    fast = s16_async.make_async(s13.build_engine(*bundled, max_num_seqs=3,
                                                 max_num_batched_tokens=16))
    run = run_steps(fast, requests)
    assert run.calls - run.last_output_call <= 2
    done = threading.Thread(target=fast.shutdown, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive()


def test_idle_after_aborting_everything_mid_run(bundled):
    """Abort every request (running, prefilling, waiting) while a step is in flight: the
    next calls return one "abort" output each, and within two calls the loop is idle with
    no block held."""
    fast = s16_async.make_async(s13.build_engine(*bundled, max_num_seqs=3,
                                                 max_num_batched_tokens=16))
    for i, p in enumerate(PROMPTS):
        fast.add_request(p, greedy(30, ignore_eos=True), str(i))
    for _ in range(3):
        fast.step()
    assert fast.in_flight is not None
    assert all(fast.abort(str(i)) for i in range(len(PROMPTS)))
    outputs, calls = [], 0
    while fast.has_unfinished_requests():
        outputs += fast.step()
        calls += 1
        assert calls <= 2
    assert sorted(o.request_id for o in outputs) == [str(i) for i in range(len(PROMPTS))]
    assert all(o.finish_reason == "abort" and not o.new_token_ids for o in outputs)
    idle(fast)
    fast.shutdown()


def test_after_generate_the_engine_is_idle_within_two_steps(bundled):
    """`LLM.generate` returns once every request had its last output; a last dropped row may
    still be in flight: at most two more calls, returning nothing, make the engine idle."""
    fast = s16_async.make_async(s13.build_engine(*bundled, max_num_seqs=4))
    LLM(fast).generate(PROMPTS[:3], greedy(6))
    for _ in range(2):
        if fast.has_unfinished_requests():
            assert fast.step() == []
    idle(fast)


def test_no_request_keeps_a_placeholder(bundled):
    """A placeholder counts a token a step in flight will sample. Once the loop is idle no
    token is coming for anyone: not for the requests that finished (their last rows were
    computed and dropped), nor the aborted ones (dropped unsampled), so every request made,
    finished or aborted, counts none and num_tokens is its tokens."""
    fast = s16_async.make_async(s13.build_engine(*bundled, max_num_seqs=3))
    seen = Requests()
    fast.observers.append(seen)
    run_steps(fast, [(p, greedy(8)) for p in PROMPTS], aborts={3: [0, 4]})
    assert len(seen.seen) == len(PROMPTS)
    assert {rid: r.num_output_placeholders for rid, r in seen.seen.items()} == {
        rid: 0 for rid in seen.seen}
    assert all(r.num_tokens == len(r.token_ids) for r in seen.seen.values())


# --- a forward that fails -------------------------------------------------------------------

class FailOnce(RunnerWrapper):
    """Runs the real forward, then raises RuntimeError once, for the first plan of step
    number `step`, remembering the thread it raised on."""

    def __init__(self, runner, step: int):
        super().__init__(runner)
        self.step, self.raised_on = step, None

    def execute_model(self, plan, requests):
        out = self.runner.execute_model(plan, requests)
        if self.raised_on is None and plan.step == self.step:
            self.raised_on = threading.get_ident()
            raise RuntimeError("injected: the forward failed")
        return out


@pytest.mark.parametrize("name, step", [("chunked_s13", 0), ("chunked_s13", 4),
                                        ("preemption", 9)])
def test_a_failing_forward_loses_nothing(bundled, name, step):
    """The forward of step `step` raises on the worker: `step()` raises it, both plans (the
    failed one and the one made after it) are taken back, the KV books are right at once
    (`books`), and the next steps give every request the outputs of a clean synchronous
    run, seeded ones included (the failed step drew nothing)."""
    build, options, requests = SCENARIOS[name]
    sync, fast = build_pair(bundled, build, **options)
    want = run_steps(sync, requests)
    fast.engine.runner = FailOnce(fast.engine.runner, step)
    got = run_steps(fast, requests, injected=lambda err: "injected" in str(err))
    assert got.failures == 1
    assert fast.runner.raised_on not in (None, threading.main_thread().ident)
    assert_same_rows(got.rows, want.rows)
    if name == "preemption":
        assert fast.scheduler.num_preemptions > 0


# --- refusals, and S16's static decode runner -----------------------------------------------

def test_speculative_decoding_is_refused(bundled):
    import s15_speculative as s15
    engine = s15.build_engine(*bundled, max_num_seqs=2)
    scheduler = engine.scheduler
    with pytest.raises(ParameterError, match="async_scheduling") as err:
        s16_async.make_async(engine)
    assert err.value.parameter == "async_scheduling"
    assert engine.scheduler is scheduler                  # left as it was


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_scheduling_must_be_a_bool(bundled, value):
    with pytest.raises(ParameterError, match="async_scheduling") as err:
        s16_host.build_engine(*bundled, async_scheduling=value)
    assert err.value.parameter == "async_scheduling"


def test_static_decode_runner_under_the_async_loop(bundled):
    """S16's static decode runner (eager: compile=False) under the async loop: the same
    outputs as under the synchronous loop, with its static steps really taken; and
    s16_host.build_engine(async_scheduling=True) gives the async loop, with the same
    completions as S13's synchronous engine."""
    model, tok = bundled
    requests = [(p, greedy(10 + 2 * i)) for i, p in enumerate(PROMPTS[:4])]
    sync = s16_static.make_static(s13.build_engine(model, tok, max_num_seqs=4))
    fast = s16_async.make_async(s16_static.make_static(s13.build_engine(model, tok,
                                                                        max_num_seqs=4)))
    assert isinstance(fast.runner, s16_static.StaticDecodeRunner)
    want = run_steps(sync, requests).rows
    got = run_steps(fast, requests).rows
    assert_same_rows(got, want)
    assert fast.runner.num_static_steps > 0 and sync.runner.num_static_steps > 0
    host = s16_host.build_engine(model, tok, async_scheduling=True, max_num_seqs=4)
    assert isinstance(host, s16_async.AsyncLLMEngine)
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    assert completions(host, prompts, params) == completions(
        s13.build_engine(model, tok, max_num_seqs=4), prompts, params)


# --- the forward in a worker process (code/s16_worker.py) -----------------------------------

class FailingPagedRunner(s12.PagedRunner):
    """S12's runner, raising RuntimeError once after computing the first plan of step number
    `fail_step`: sent to the worker process as it is (a plain subclass, so it pickles)."""

    @classmethod
    def around(cls, runner: s12.PagedRunner, fail_step: int) -> "FailingPagedRunner":
        failing = cls.__new__(cls)
        failing.__dict__.update(runner.__dict__)
        failing.fail_step, failing.raised = fail_step, False
        return failing

    def execute_model(self, plan, requests):
        out = super().execute_model(plan, requests)
        if plan.step == self.fail_step and not self.raised:
            self.raised = True
            raise RuntimeError("injected: the forward failed in the worker")
        return out


@pytest.mark.slow                   # a worker process spawned (importing torch): a few seconds
def test_the_worker_process_gives_the_same_outputs_sync_and_async():
    """The forward in a worker process (`s16_worker.make_process`, one spawn): the same
    outputs as the in-process synchronous engine through its synchronous loop, then through
    the async loop, in which the worker raises once (the step's error comes back, nothing
    is lost, the books are right); after shutdown no process is left."""
    import s16_worker
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists():
        pytest.skip("bundled model not trained yet")
    model, tok = s06.load()                # its own copy: the worker shares it in memory
    build, options, requests = SCENARIOS["chunked_s13"]
    options = dict(options, enable_prefix_caching=False)  # two runs on one pool, no hits
    reference = build(model, tok, **options)
    want = run_steps(reference, requests).rows
    engine = build(model, tok, **options)
    # the async run's fifth step fails: the schedule is the reference's, step for step
    engine.runner = FailingPagedRunner.around(engine.runner,
                                              reference.scheduler.num_steps + 4)
    engine = s16_worker.make_process(engine)
    process = engine.runner.process
    fast = None
    try:
        assert_same_rows(run_steps(engine, requests).rows, want)
        fast = s16_async.make_async(engine)
        assert fast.worker is None                       # the process runner launches
        got = run_steps(fast, requests, injected=lambda err: "injected" in str(err))
        assert got.failures == 1
        assert_same_rows(got.rows, want)
    finally:
        (fast or engine.runner).shutdown()
    assert not process.is_alive() and process.exitcode is not None


# --- CUDA -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_on_cuda_the_async_loop_gives_the_same_outputs():
    """On CUDA the worker thread launches the kernels and the host plans meanwhile: greedy
    outputs equal the synchronous loop's under chunked prefill and preemption."""
    model, tok = s06.load(device="cuda")
    requests = [(p, greedy(24, ignore_eos=True)) for p in PROMPTS]
    for options in (dict(max_num_seqs=4, max_num_batched_tokens=16),
                    dict(max_num_seqs=4, num_blocks=8)):
        sync, fast = build_pair((model, tok), s13.build_engine, **options)
        want = run_steps(sync, requests).rows
        assert_same_rows(run_steps(fast, requests).rows, want)
        fast.shutdown()


# --- one bad row, and an id taken again (review repros) -------------------------------------

def test_a_refused_row_ends_its_request_alone(bundled):
    """S09's rule under the async loop: the sampler refuses one request's row (NaN logits);
    that request ends "abort" with its error, and the others' outputs equal the synchronous
    loop's. The refused request's row was already planned into the next step, reading a
    token that was never sampled: it must be left out of that launch, not crash it."""
    from engine_testing import NaNRows
    model, tok = bundled
    prompts = PROMPTS[:3]
    results = {}
    for name in ("sync", "async"):
        engine = s13.build_engine(model, tok, max_num_seqs=4)
        engine.runner = NaNRows(engine.runner, bad="1", after=2)
        if name == "async":
            engine = s16_async.make_async(engine)
        for i, p in enumerate(prompts):
            engine.add_request(p, greedy(12, ignore_eos=True), str(i))
        rows = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                rows.setdefault(out.request_id, []).append(
                    (tuple(out.new_token_ids), out.finished, out.finish_reason))
        results[name] = rows
        if name == "async":
            idle(engine)
            engine.shutdown()
    assert results["async"] == results["sync"]
    assert results["sync"]["1"][-1][2] == "abort"
    assert all(results["sync"][rid][-1][2] == "length" for rid in ("0", "2"))


def test_an_id_taken_again_while_its_old_row_is_in_flight(bundled):
    """Request "a" finishes in step N; its row planned into N + 1 is still in flight when the
    caller adds a new request with the same id. The new one's outputs equal its run alone,
    the old row's record never counts for it, and the KV books end clean."""
    model, tok = bundled
    alone = s13.build_engine(model, tok, max_num_seqs=4)
    alone.add_request(PROMPTS[2], greedy(10, ignore_eos=True), "a")
    want = []
    while alone.has_unfinished_requests():
        want += [t for o in alone.step() for t in o.new_token_ids]
    fast = s16_async.make_async(s13.build_engine(model, tok, max_num_seqs=4))
    fast.add_request(PROMPTS[0], greedy(3, ignore_eos=True), "a")
    fast.add_request(PROMPTS[1], greedy(20, ignore_eos=True), "b")
    got, second = [], False
    while fast.has_unfinished_requests():
        for out in fast.step():
            if out.request_id == "a" and out.finished and not second:
                fast.add_request(PROMPTS[2], greedy(10, ignore_eos=True), "a")
                second = True
            elif out.request_id == "a" and second:
                got += out.new_token_ids
    assert second and got == want
    idle(fast)
    fast.shutdown()
