"""Graded tests for the S11 exercises (see exercises/s11_chunked_prefill.py).

Oracles, none of them the solution: plans, masks and rows worked by hand (each hand-worked plan
is a state S11's scheduler reaches, and the test checks that it does); S11's tested
`ChunkedScheduler` (code/s11_chunked_prefill.py) driven by a fake model on random queues (random
prompt and output lengths, seats, token budgets, per-request limits and arrivals; KV large
enough that nobody is preempted), asked before every `schedule()` what it is about to plan;
S03's NumPy attention over the whole prompt at once (code/s03_transformer.py, itself held to HF
transformers), whose rows a chunk must reproduce; and S09's `RaggedBatch.build`, whose
`sample_rows` are the rows the engine reads, for the requests of S11's plans whose new tokens
reach the end of their token ids (the runner's rule). No model is needed. What your functions
return is compared as lists of tuples, so any sequence of pairs is accepted.
"""
import random

import numpy as np
import pytest

from exercise_loader import load_exercise
import s03_transformer as s03
from s09_scheduler import Request
from s09_ragged import RaggedBatch
from s10_scheduler import TokenKVPool
from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig

ex = load_exercise("s11_chunked_prefill")
MAX_MODEL_LEN = 64


def plan_step(*args, **kwargs):
    return [tuple(p) for p in ex.plan_step(*args, **kwargs)]


def rows_to_sample(batch):
    return [tuple(p) for p in ex.rows_to_sample(batch)]


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
        assert plan_step(running, waiting, budget, seats, limit) == want, (running, waiting)
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
        want = plan_step([(r.request_id, left(r)) for r in sched.running],
                         [(r.request_id, left(r)) for r in sched.waiting],
                         sched.max_num_batched_tokens, sched.max_num_seqs,
                         sched.config.long_prefill_token_threshold)
        out = run.step()
        assert out.preempted_ids == ()                           # KV is never short here
        got = list(out.num_scheduled_tokens.items())
        assert want == got, (sched.max_num_batched_tokens,
                             sched.config.long_prefill_token_threshold)
        checked += bool(got)
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

@pytest.mark.points(1)
def test_rows_to_sample_by_hand():
    assert rows_to_sample([("a", 0, 5, 9), ("b", 7, 1, 8), ("c", 0, 3, 3)]) == [
        ("b", 5), ("c", 8)]
    assert rows_to_sample([("a", 4, 5, 9)]) == [("a", 4)]           # the last chunk samples
    assert rows_to_sample([("a", 0, 4, 9), ("b", 0, 2, 3)]) == []   # two chunks, no token
    assert rows_to_sample([]) == []
    for bad in ([("a", -1, 2, 5)], [("a", 0, 0, 5)], [("a", 3, 3, 5)]):
        with pytest.raises(ValueError):
            rows_to_sample(bad)


@pytest.mark.points(2)
def test_rows_to_sample_matches_the_scheduler_and_the_ragged_batch():
    checked = skipped = 0
    for run in runs(seed=23, trials=60, steps=30):
        by_id = {r.request_id: r for r in run.sched.running}
        out = run.sched.schedule()
        by_id.update({r.request_id: r for r in run.sched.running})
        ids = list(out.num_scheduled_tokens)
        if not ids:
            run.sched.update_from_output(out)
            continue
        run.rng.shuffle(ids)                                         # any batch order
        batch = [(rid, out.num_computed_tokens[rid], out.num_scheduled_tokens[rid],
                  by_id[rid].num_tokens) for rid in ids]
        sampled = sampling(out, by_id)
        ragged = RaggedBatch.build(
            [by_id[rid].token_ids[s:s + n] for rid, s, n, _ in batch], [s for _, s, _, _ in batch],
            [(b,) for b in range(len(batch))], [rid in sampled for rid, *_rest in batch])
        want = list(zip([rid for rid, *_rest in batch if rid in sampled],
                        ragged.sample_rows.tolist()))
        assert rows_to_sample(batch) == want, batch
        checked += 1
        skipped += len(want) < len(batch)
        run.sched.update_from_output(out, fake_model_step(out, run.reqs))   # as Run.step
    assert checked > 500 and skipped > 100
