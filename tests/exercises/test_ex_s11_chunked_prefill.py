"""Graded tests for the S11 exercises (see exercises/s11_chunked_prefill.py).

Oracles, none of them the solution: plans, masks and rows worked by hand (each hand-worked plan
is a state S11's scheduler reaches, and the test checks that it does); S11's tested
`ChunkedScheduler` (code/s11_chunked_prefill.py) driven by a fake model on random queues (random
prompt and output lengths, seats, token budgets, per-request limits and arrivals; KV large
enough that nobody is preempted), asked before every `schedule()` what it is about to plan;
S03's NumPy attention over the whole prompt at once (code/s03_transformer.py, itself held to HF
transformers), whose rows a chunk must reproduce. For the step orders of exercise 3: the stock
`ChunkedScheduler`'s own plans, outputs and latencies on the same seeded arrivals (the
"admission" order must reproduce them; the others must keep every token and the budget), the
notebook's measured time to first token at each budget (recorded from the real engine and model
with S09's `StepTracer`; the chapter quotes it), and counts of gaps and first tokens the tests
make themselves from the steps. A running request counts as decoding when it has sampled and
lacks exactly one token in the cache (the exercise's rule): worked cases hold the orders to it
on a prompt's last chunk and on a recompute after a preemption (the one case with KV short of
every seat's context). No model is needed. What your functions return is compared as
lists of tuples, so any sequence of pairs is accepted.
"""
import random
from types import SimpleNamespace

import numpy as np
import pytest

from exercise_loader import load_exercise
import s03_transformer as s03
from s09_scheduler import Request
from s10_scheduler import TokenKVPool
from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig

ex = load_exercise("s11_chunked_prefill")
MAX_MODEL_LEN = 64


def plan_step(*args, **kwargs):
    return [tuple(p) for p in ex.plan_step(*args, **kwargs)]


def scheduler(seats: int, budget: int, threshold: int) -> ChunkedScheduler:
    """S11's scheduler with KV for every seat's whole context (nobody is preempted)."""
    return ChunkedScheduler(
        ChunkedSchedulerConfig(seats, MAX_MODEL_LEN, budget,
                               long_prefill_token_threshold=threshold),
        TokenKVPool(seats, MAX_MODEL_LEN, seats * MAX_MODEL_LEN))


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: int) -> Request:
    """A model-free request; arrival is what the engine would number it."""
    return Request.for_tokens(rid, [5] * prompt_len, max_tokens, arrival=arrival)


def sampling(out, by_id) -> list[str]:
    """The planned requests whose new tokens reach the end of their token ids, as they are
    when planned: they sample in the step (the runner's rule)."""
    return [rid for rid, n in out.num_scheduled_tokens.items()
            if out.num_computed_tokens[rid] + n == by_id[rid].num_tokens]


def fake_model_step(out, by_id) -> list[str]:
    """One token for each request that samples; returns those that reached max_tokens."""
    finished = []
    for rid in sampling(out, by_id):
        req = by_id[rid]
        req.append_token(1000 + req.num_tokens)
        if len(req.output_ids) >= req.params.max_tokens:
            finished.append(rid)
    return finished


class Run:
    """The real chunked scheduler, a fake model (one token for each request whose new tokens
    reach its end) and random arrivals. KV holds every seat's whole context: no preemption."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        seats = rng.randint(1, 5)
        budget = rng.randint(seats, 40)
        self.sched = scheduler(seats, budget, rng.choice([0, 0, rng.randint(1, 24)]))
        self.reqs: dict[str, Request] = {}

    def arrive(self, count: int) -> None:
        for _ in range(count):
            rid = f"r{len(self.reqs)}"
            prompt = self.rng.randint(1, 50)
            req = make_request(rid, prompt, self.rng.randint(1, MAX_MODEL_LEN - prompt),
                               len(self.reqs))
            self.sched.add_request(req)
            self.reqs[rid] = req

    def step(self):
        out = self.sched.schedule()
        self.sampled = sampling(out, self.reqs)
        self.sched.update_from_output(out, fake_model_step(out, self.reqs))
        return out


def runs(seed: int, trials: int, steps: int):
    rng = random.Random(seed)
    for _ in range(trials):
        run = Run(rng)
        run.arrive(rng.randint(1, 4))
        for _ in range(steps):
            yield run
            if rng.random() < 0.3:
                run.arrive(1)


def left(req) -> int:
    return req.num_tokens - req.num_computed_tokens


# Exercise 1 ----------------------------------------------------------------------------------

# Worked by hand: (running, waiting, token budget, seats, threshold) -> the plan, and the
# arrivals (id, prompt length) before each step by which S11's scheduler reaches that state.
BY_HAND = [
    # Two decodes; p, 26 short of its 40-token prompt, takes the 14 they leave; q waits.
    (([("a", 1), ("b", 1), ("p", 26)], [("q", 9)], 16, 4, 0),
     [("a", 1), ("b", 1), ("p", 14)], [[("a", 3), ("b", 3)], [("p", 40)], [("q", 9)]]),
    # Two decodes, then a 30-token prompt joins with what is left of 16.
    (([("a", 1), ("b", 1)], [("p", 30), ("q", 5)], 16, 4, 0),
     [("a", 1), ("b", 1), ("p", 14)], [[("a", 3), ("b", 3)], [("p", 30), ("q", 5)]]),
    # A per-request limit of 8: the prompt takes 8 and the next one joins beside it.
    (([("a", 1), ("b", 1)], [("p", 30), ("q", 5)], 16, 4, 8),
     [("a", 1), ("b", 1), ("p", 8), ("q", 5)], [[("a", 3), ("b", 3)], [("p", 30), ("q", 5)]]),
    # The limit holds a running chunk to 8 ahead of a decode; a newcomer takes the last 7.
    (([("p", 22), ("a", 1)], [("q", 9)], 16, 4, 8),
     [("p", 8), ("a", 1), ("q", 7)], [[("p", 38)], [("a", 5)], [("q", 9)]]),
    # Seats: one free seat, so q waits whatever the budget.
    (([("a", 1), ("b", 1), ("c", 1)], [("p", 3), ("q", 5)], 32, 4, 0),
     [("a", 1), ("b", 1), ("c", 1), ("p", 3)],
     [[("a", 2), ("b", 2), ("c", 2)], [("p", 3), ("q", 5)]]),
    # The last chunk of a prompt is whatever is left of it.
    (([("p", 5)], [], 16, 2, 0), [("p", 5)], [[("p", 21)], []]),
    (([], [], 4, 4, 0), [], [[]]),
]


def reached(budget: int, seats: int, threshold: int, arrivals) -> tuple:
    """S11's real scheduler, a fake model (nobody finishes) and arrivals[k] added before step
    k: the queues, as (id, tokens left), before the last step's plan, and that plan."""
    sched = scheduler(seats, budget, threshold)
    reqs = {}
    for new in arrivals:
        for rid, prompt in new:
            reqs[rid] = make_request(rid, prompt, MAX_MODEL_LEN - prompt, len(reqs))
            sched.add_request(reqs[rid])
        state = ([(r.request_id, left(r)) for r in sched.running],
                 [(r.request_id, left(r)) for r in sched.waiting])
        out = sched.schedule()
        fake_model_step(out, reqs)
        sched.update_from_output(out)
    return state, list(out.num_scheduled_tokens.items())


@pytest.mark.points(1)
def test_plan_step_by_hand():
    for (running, waiting, budget, seats, limit), want, arrivals in BY_HAND:
        # each case is a state the real scheduler reaches, and it plans what was worked out
        assert reached(budget, seats, limit, arrivals) == ((running, waiting), want)
        got = plan_step(running, waiting, budget, seats, limit)
        assert got == want, (f"got {got}, expected {want} from "
                             f"plan_step({running}, {waiting}, {budget}, {seats}, {limit})")
    for bad in (([], [], 3, 4), ([("a", 1)], [], 4, 0), ([("a", 1)] * 3, [], 8, 2),
                ([("a", 0)], [], 4, 2), ([], [("a", 0)], 4, 2)):
        with pytest.raises(ValueError):
            plan_step(*bad)
    with pytest.raises(ValueError):
        plan_step([], [], 4, 2, -1)


@pytest.mark.points(3)
def test_plan_step_matches_the_scheduler():
    checked = chunked = 0
    for run in runs(seed=21, trials=80, steps=30):
        sched = run.sched
        args = ([(r.request_id, left(r)) for r in sched.running],
                [(r.request_id, left(r)) for r in sched.waiting],
                sched.max_num_batched_tokens, sched.max_num_seqs,
                sched.config.long_prefill_token_threshold)
        got = plan_step(*args)
        out = run.step()
        assert out.preempted_ids == (), "oracle check: KV is never short here"
        want = list(out.num_scheduled_tokens.items())
        assert got == want, \
            f"got {got}, expected {want} (the scheduler's plan) from plan_step{args}"
        checked += bool(want)
        chunked += any(rid not in run.sampled for rid in out.num_scheduled_tokens)
    assert checked > 500 and chunked > 100


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_chunk_mask_by_hand_and_against_the_whole_prompt():
    assert np.array_equal(ex.chunk_mask(2, 2), [[True, True, True, False],
                                                [True, True, True, True]])
    assert np.array_equal(ex.chunk_mask(0, 1), [[True]])
    for start, n in ((0, 5), (3, 1), (7, 4), (10, 10)):
        whole = np.tril(np.ones((start + n, start + n), dtype=bool))   # the prompt at once
        got = np.asarray(ex.chunk_mask(start, n))
        assert got.dtype == bool and np.array_equal(got, whole[start:]), (start, n)
    for bad in ((-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            ex.chunk_mask(*bad)


@pytest.mark.points(2)
def test_chunk_attention_equals_rows_of_attention_over_the_whole_prompt():
    rng = np.random.default_rng(11)
    for heads, kv_heads, dim, length in ((2, 2, 8, 9), (4, 2, 16, 13), (6, 1, 4, 7)):
        q = rng.standard_normal((heads, length, dim)).astype(np.float32)
        k = rng.standard_normal((kv_heads, length, dim)).astype(np.float32)
        v = rng.standard_normal((kv_heads, length, dim)).astype(np.float32)
        pos = np.arange(length)
        whole = s03.attention(q, k, v, pos, pos)                     # (H, P, D), S03's
        for start in range(length):
            for end in range(start + 1, length + 1):                # every chunk [start, end)
                got = ex.chunk_attention(q[:, start:end], k[:, :end], v[:, :end], start)
                assert got.shape == (heads, end - start, dim)
                np.testing.assert_allclose(got, whole[:, start:end], rtol=1e-5, atol=1e-6,
                                           err_msg=f"chunk {start}..{end - 1}")
    with pytest.raises(ValueError):
        ex.chunk_attention(q[:, :2], k[:, :3], v[:, :3], 0)          # S != start + T
    with pytest.raises(ValueError):
        ex.chunk_attention(np.zeros((3, 1, 4), np.float32), np.zeros((2, 1, 4), np.float32),
                           np.zeros((2, 1, 4), np.float32), 0)      # 3 heads over 2


# Exercise 3 ----------------------------------------------------------------------------------

# The chapter's Motivation run: prompts of 29, 14, 9 and 28 tokens arrive before steps 0 to 3 and
# make 48 tokens each; a 183-token prompt arrives before step 6; 8 seats. (step, id, prompt, max)
MOTIVATION = ((0, "0", 29, 48), (1, "1", 14, 48), (2, "2", 9, 48), (3, "3", 28, 48),
              (6, "4", 183, 48))
# The long prompt's time to first token in steps (sampling step included) at each budget, as
# the notebook measured it with the real engine and model and S09's StepTracer (chapter, "The
# trade"): the golden figures the stock scheduler must reproduce here with a fake model.
NOTEBOOK_TTFT = {8: 50, 16: 16, 32: 7, 64: 4, 128: 2, 256: 1}
ORDERS = ("admission", "decode-first", "prefill-first")


class Served:
    """One run of a scheduler over timed arrivals with a fake model whose token depends on the
    whole context (so a token sampled from a wrong context would show): per step, the plan as
    (id, tokens, start, decoding?, running before the step?) in schedule order, the running
    requests that were decoding before it, and the ids that sampled; each request's outputs at
    the end. KV holds every seat's whole context (nobody is preempted) unless `capacity` (in
    tokens) says less; then the number of preemptions is counted."""

    def __init__(self, make, arrivals, seats: int, budget: int, threshold: int = 0,
                 capacity: int | None = None):
        context = max(p + m for _, _, p, m in arrivals)
        sched = make(ChunkedSchedulerConfig(seats, context, budget,
                                            long_prefill_token_threshold=threshold),
                     TokenKVPool(seats, context, capacity or seats * context))
        self.preemptions = 0
        pending = sorted(arrivals)
        self.arrivals, reqs = {}, {}
        self.plans, self.decoding, self.sampled = [], [], []
        while pending or sched.has_unfinished_requests():
            step = len(self.plans)
            while pending and pending[0][0] <= step:
                _, rid, prompt, max_tokens = pending.pop(0)
                reqs[rid] = Request.for_tokens(rid, [3 + len(reqs)] * prompt, max_tokens,
                                               arrival=len(reqs))
                sched.add_request(reqs[rid])
                self.arrivals[rid] = step
            self.decoding.append({r.request_id for r in sched.running if decoding(r)})
            out = sched.schedule()
            def where():                      # built only when an assertion fails
                return (f"step {step} of arrivals (step, id, prompt, max_tokens) {arrivals}, "
                        f"{seats} seats, budget {budget}, threshold {threshold}"
                        + (f", KV for {capacity} tokens" if capacity else ""))
            planned = dict(out.num_scheduled_tokens)
            self.preemptions += len(out.preempted_ids)
            assert (capacity or out.preempted_ids == ()) and len(planned) <= seats, (
                f"got plan {planned}, preempted {list(out.preempted_ids)}: expected at most "
                f"{seats} requests and no preemption; {where()}")
            assert out.total_num_scheduled_tokens <= budget, \
                f"got {out.total_num_scheduled_tokens} tokens planned, budget {budget}; {where()}"
            assert planned or not (sched.running or sched.waiting), \
                f"got an empty plan with requests running or waiting; {where()}"
            self.plans.append([(rid, n, out.num_computed_tokens[rid],
                                decoding(reqs[rid], out.num_computed_tokens[rid]),
                                rid in out.scheduled_running_ids)
                               for rid, n in out.num_scheduled_tokens.items()])
            self.sampled.append(set(sampling(out, reqs)))
            finished = []
            for rid in self.sampled[-1]:
                req = reqs[rid]
                req.append_token(1000 + sum(i * t for i, t in enumerate(req.token_ids)) % 997)
                if len(req.output_ids) >= req.params.max_tokens:
                    finished.append(rid)
            sched.update_from_output(out, finished)
            assert step < 2000, f"the run does not end; {where()}"
        self.outputs = {rid: list(r.output_ids) for rid, r in reqs.items()}
        short = {rid: len(r.output_ids) for rid, r in reqs.items()
                 if len(r.output_ids) != r.params.max_tokens}
        assert not short, f"got {short} tokens, expected each request's max_tokens; {arrivals}"

    def allocations(self) -> list[list[tuple[str, int]]]:
        return [sorted((rid, n) for rid, n, *_rest in plan) for plan in self.plans]


def decoding(req, computed: int | None = None) -> bool:
    """Sampled before and one token short of its end in the cache (the test's own rule)."""
    computed = req.num_computed_tokens if computed is None else computed
    return bool(req.output_ids) and req.num_tokens - computed == 1


def gaps_and_ttft(served) -> tuple[int, dict[str, int]]:
    """The test's own count over a `Served` run (or anything with `sampled` and `arrivals`):
    worst steps between two tokens of a request, and TTFT in steps from arrival with the
    sampling step included."""
    steps: dict[str, list[int]] = {}
    for k, ids in enumerate(served.sampled):
        for rid in ids:
            steps.setdefault(rid, []).append(k)
    worst = max((b - a for ks in steps.values() for a, b in zip(ks, ks[1:])), default=0)
    return worst, {rid: ks[0] - served.arrivals[rid] + 1 for rid, ks in steps.items()}


def stock(config, kv):
    return ChunkedScheduler(config, kv)


def ordered(order: str):
    return lambda config, kv: ex.OrderedScheduler(config, kv, order)


def workloads(seed: int, count: int):
    """Seeded arrivals with enough seats for everyone (so no order delays an admission) and
    KV for every seat: (arrivals, seats, budget, threshold)."""
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(3, 7)
        arrivals = []
        for i in range(n):
            prompt = rng.randint(1, 60)
            arrivals.append((rng.randint(0, 12), f"r{i}", prompt, rng.randint(1, 40)))
        yield arrivals, n, rng.randint(n, 40), rng.choice([0, 0, rng.randint(1, 24)])


@pytest.mark.points(1)
def test_latency_in_steps_by_hand_and_against_the_notebook():
    got = ex.latency_in_steps([{"a"}, {"a"}, {"b"}, {"a", "b"}], {"a": 0, "b": 1})
    assert (got[0], dict(got[1])) == (2, {"a": 1, "b": 2})
    got = ex.latency_in_steps([set(), {"x"}], {"x": 0, "y": 1})
    assert (got[0], dict(got[1])) == (0, {"x": 2})                 # y never sampled
    for bad in (([{"a"}], {}), ([{"a"}], {"a": 1})):
        with pytest.raises(ValueError):
            ex.latency_in_steps(*bad)
    for budget, ttft in NOTEBOOK_TTFT.items():                      # the stock scheduler
        served = Served(stock, MOTIVATION, 8, budget)
        worst, got = ex.latency_in_steps(served.sampled, served.arrivals)
        assert got["4"] == ttft, \
            f"budget {budget}: got TTFT {got['4']} steps for request 4, expected {ttft} (notebook)"
        want = gaps_and_ttft(served)
        assert want[0] == 1, "oracle check: the stock scheduler's worst gap is 1 step"
        assert (worst, dict(got)) == want, (f"budget {budget}: got (worst gap, TTFT) "
                                            f"{(worst, dict(got))}, expected {want}")
    rng = random.Random(31)
    for _ in range(200):                                            # any pattern of tokens
        ids = [f"r{i}" for i in range(rng.randint(1, 5))]
        arrivals = {rid: rng.randint(0, 6) for rid in ids}
        sampled = [{rid for rid in ids if arrivals[rid] <= k and rng.random() < 0.4}
                   for k in range(rng.randint(1, 25))]
        worst, got = ex.latency_in_steps(sampled, arrivals)
        want = gaps_and_ttft(SimpleNamespace(sampled=sampled, arrivals=arrivals))
        assert (worst, dict(got)) == want, (f"got {(worst, dict(got))}, expected {want} from "
                                            f"latency_in_steps({sampled}, {arrivals})")


# Worked cases for the step orders: (name, arrivals, seats, budget, threshold, KV capacity).
ORDER_CASES = [
    # r0's 9-token prompt goes in chunks of 4, 4, 1: in step 2 r0 lacks one token, the last of
    # its prompt, but has sampled nothing: a chunk, not a decode. r1 (2 tokens, admitted in
    # step 1) decodes in step 2 and must come first under decode-first.
    ("a prompt's last chunk", ((0, "r0", 9, 4), (1, "r1", 2, 4)), 2, 10, 4, None),
    # KV for 15 tokens: requests are preempted and recompute their prompt and outputs. In
    # step 10, r1 (preempted after 4 outputs) recomputes its second chunk of 4 while r2 has
    # recomputed all it had and decodes: r2 first under decode-first, though r1 has sampled.
    ("a recompute after a preemption", ((1, "r0", 3, 8), (2, "r1", 4, 6), (3, "r2", 3, 4)),
     3, 15, 4, 15),
]


@pytest.mark.points(1)
def test_step_orders_keep_tokens_budget_and_their_order():
    with pytest.raises(ValueError):
        ordered("shortest-first")(ChunkedSchedulerConfig(2, 16, 8), TokenKVPool(2, 16))
    cases = list(ORDER_CASES) + [(f"workloads(seed=33) case {k}", *w, None)
                                 for k, w in enumerate(workloads(seed=33, count=25))]
    preempted = 0
    for name, arrivals, seats, budget, threshold, capacity in cases:
        base = Served(stock, arrivals, seats, budget, threshold, capacity)   # budget checked
        preempted += base.preemptions > 0
        for order in ORDERS:
            where = (f"order {order!r}, {name}: arrivals (step, id, prompt, max_tokens) "
                     f"{arrivals}, {seats} seats, budget {budget}, threshold {threshold}"
                     + (f", KV for {capacity} tokens" if capacity else ""))
            served = Served(ordered(order), arrivals, seats, budget, threshold, capacity)
            for rid, want in base.outputs.items():                 # tokens unchanged
                assert served.outputs.get(rid) == want, \
                    f"request {rid}: got tokens {served.outputs.get(rid)}, expected {want}; {where}"
            # the running requests' order (newcomers are admitted after them in every order)
            kinds = [[dec for *_rest, dec, was_running in plan if was_running]
                     for plan in served.plans]
            for step, plan in enumerate(served.plans):
                if order == "admission":                            # S11's own schedule
                    want = base.plans[step] if step < len(base.plans) else None
                    assert plan == want, (f"step {step}: got plan (id, tokens, start, decoding, "
                                          f"was running) {plan}, expected {want}; {where}")
                elif order == "decode-first":
                    assert kinds[step] == sorted(kinds[step], reverse=True), (
                        f"step {step}: got a decode after a chunk in plan (id, tokens, start, "
                        f"decoding, was running) {plan}, expected the decodes first; {where}")
                else:
                    assert kinds[step] == sorted(kinds[step]), (
                        f"step {step}: got a chunk after a decode in plan (id, tokens, start, "
                        f"decoding, was running) {plan}, expected the chunks first; {where}")
            if order == "admission":
                assert len(served.plans) == len(base.plans), \
                    f"got {len(served.plans)} steps, expected {len(base.plans)}; {where}"
    assert preempted >= 1, "oracle check: one case preempts"


@pytest.mark.points(1)
def test_decode_first_never_stalls_and_prefill_first_answers_first():
    base = Served(stock, MOTIVATION, 8, 32)
    first = Served(ordered("decode-first"), MOTIVATION, 8, 32)
    rush = Served(ordered("prefill-first"), MOTIVATION, 8, 32)
    got, want = gaps_and_ttft(first), gaps_and_ttft(base)          # 1 step, long prompt 7
    assert got == want, (f"decode-first on the Motivation run, budget 32: got (worst gap, "
                         f"TTFT by id) {got}, expected {want} (S11's admission order)")
    worst, ttft = gaps_and_ttft(rush)
    assert ttft["4"] == 6 < NOTEBOOK_TTFT[32] and worst == 5, (     # 28 + 5 x 32 >= 183
        f"prefill-first on the Motivation run, budget 32: got TTFT {ttft['4']} for the long "
        f"prompt and worst gap {worst}, expected 6 and 5")
    lower = 0
    for case, (arrivals, seats, budget, threshold) in enumerate(workloads(seed=35, count=30)):
        where = (f"workloads(seed=35) case {case}: arrivals (step, id, prompt, max_tokens) "
                 f"{arrivals}, {seats} seats, budget {budget}, threshold {threshold}")
        base = Served(stock, arrivals, seats, budget, threshold)
        first = Served(ordered("decode-first"), arrivals, seats, budget, threshold)
        rush = Served(ordered("prefill-first"), arrivals, seats, budget, threshold)
        # decode-first: every request decoding before a step gets its token in that step,
        # and it spends each step's budget exactly as S11's admission order does
        for step, (plan, dec) in enumerate(zip(first.plans, first.decoding)):
            skipped = dec - {rid for rid, *_rest in plan}
            assert not skipped, (f"decode-first, step {step}: running decodes {sorted(skipped)} "
                                 f"were skipped (plan {plan}); {where}")
        got_alloc, want_alloc = first.allocations(), base.allocations()
        step = next((k for k, (g, w) in enumerate(zip(got_alloc, want_alloc)) if g != w),
                    min(len(got_alloc), len(want_alloc)))
        assert got_alloc == want_alloc, (
            f"decode-first, step {step}: got (id, tokens) {got_alloc[step:step + 1]}, expected "
            f"{want_alloc[step:step + 1]} (S11's admission order); {where}")
        # prefill-first: nobody's first token comes later than under S11's order
        base_ttft, rush_ttft = gaps_and_ttft(base)[1], gaps_and_ttft(rush)[1]
        for r in base_ttft:
            assert rush_ttft.get(r, float("inf")) <= base_ttft[r], (
                f"prefill-first, request {r}: got TTFT {rush_ttft.get(r)} steps, expected at "
                f"most {base_ttft[r]} (S11's admission order); {where}")
        lower += sum(rush_ttft.values()) < sum(base_ttft.values())
    assert lower >= 5
