"""Graded tests for the S16 exercises (see exercises/s16_host.py).

Oracles, none of them the solution:
- Exercise 1 (the bucket and the padded inputs): the chapter's `pick_bucket`
  (code/s16_static.py) on random bucket lists; the chapter's `StaticDecodeRunner` on S13's
  engine (blocks of 4 tokens, buckets 1, 2, 4, 8) running six greedy requests on the bundled
  model until they end one after another (decode steps of 6, 5, ..., 1 requests): for every
  static step your padded inputs must be, value for value, what the runner wrote into its
  persistent buffers, and your bucket the one it ran. Then the chapter's `decode_step` itself
  runs on your buffers, from the KV pool as it was before each padded step: the real rows'
  logits must be those of the same rows run unpadded (and the engine's), within 1e-4, and the
  KV pool outside the null block must be what the unpadded step leaves (padded rows write
  nowhere a request owns).
- Exercise 2 (the placeholder books): the chapter's `AsyncScheduler` (code/s16_async.py)
  around S11's model-free `ChunkedScheduler` over S10's `TokenKVPool`, driven through the
  async loop of `AsyncLLMEngine.step` (plan step N + 1 before step N's tokens arrive, append
  them, launch N + 1, stop rules, `update_from_output(N)`, plan N + 2; aborts between steps;
  rows of requests that left or were preempted since their plan dropped unsampled) by a fake
  model whose next token is a fixed function of the context it computed
  (tests/scheduler_testing.py). The loop is checked before it grades: every plan asks the fake
  model for exactly the tokens after those it computed, and each request's output is the one
  the fake model gives without any scheduler. Your books are compared with the real requests'
  (num_tokens, num_computed_tokens, num_output_placeholders) after every event.
- Exercise 3 (the overhead arithmetic): the chapter's profiler (code/s16_profile.py) measures
  S13's engine on the bundled model live, at B = 1, 2, 4, 8, 16 (a timing run, and a counting
  run for the ops), with `per_op_overhead_s` on this machine. Your numbers are compared with
  the chapter's `StepProfile.host_s` / `host_fraction` and `overhead_estimate`, with the
  docstring's arithmetic written out here from the profile's phases, and with numpy's
  least-squares line through the medians the chapter's `summarize` gives; and with profiles
  made by hand. Timings are measured, never asserted: both sides use the same numbers.
"""
from __future__ import annotations

import copy
import functools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from engine_testing import greedy
from scheduler_testing import make_request, next_token

from exercise_loader import load_exercise

ex = load_exercise("s16_host")

import s03_transformer as s03  # noqa: E402  (code/ is on the path once the loader ran)
import s06_torch as s06  # noqa: E402
import s11_chunked_prefill as s11  # noqa: E402
import s13_prefix_caching as s13  # noqa: E402
import s16_async as s16a  # noqa: E402
import s16_profile as s16p  # noqa: E402
import s16_static as s16s  # noqa: E402
from s09_llm import LLM  # noqa: E402
from s09_scheduler import RequestStatus  # noqa: E402
from s10_scheduler import TokenKVPool  # noqa: E402

BUNDLED = s03.BUNDLED_MODEL_DIR
needs_model = pytest.mark.skipif(not (BUNDLED / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")
PROMPTS = ["To be, or not to be", "O Romeo, Romeo!", "Now is the winter of our discontent",
           "Friends, Romans, countrymen", "All the world's a stage", "Once more unto the breach"]


@functools.lru_cache(maxsize=1)
def bundled():
    return s06.load()


# Exercise 1 ----------------------------------------------------------------------------------

BUFFERS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")


@pytest.mark.points(1)
def test_bucket_for_is_the_chapters_rule():
    rng = random.Random(1601)
    lists = [s16s.bucket_sizes(m) for m in (1, 2, 3, 8, 17, 64, 200)]
    lists += [[1], [3], [2, 3, 6], [5, 7, 100], [1, 2, 4, 8, 16, 24, 32]]
    lists += [sorted(rng.sample(range(1, 60), rng.randint(1, 8))) for _ in range(40)]
    for sizes in lists:
        for n in range(1, sizes[-1] + 3):
            got = ex.bucket_for(list(sizes), n)
            want = s16s.pick_bucket(sizes, n)
            assert got == want, (f"sizes {sizes}, {n} rows: you say {got}, the chapter's rule "
                                 f"{want}")
    if (BUNDLED / "model.safetensors").is_file():     # the bucket each real step ran in
        for step in static_steps():
            n = len(step["rows"])
            got = ex.bucket_for(list(step["sizes"]), n)
            assert got == step["bucket"], (f"{n} rows, buckets {step['sizes']}: you say {got}, "
                                           f"the chapter's runner ran bucket {step['bucket']}")


class StaticRecorder:
    """A runner wrapper around the chapter's `StaticDecodeRunner`: for each step it ran
    static, the rows (token, position, block table, in batch order), the bucket it used, its
    buffers' first `bucket` rows and the logits; for the first step at each padded batch
    size, the KV pool as the step found it (the blocks the plan took zeroed, as the runner
    does)."""

    def __init__(self, engine):
        self.runner, engine.runner = engine.runner, self
        self.steps: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute_model(self, plan, requests):
        runner = self.runner
        before = dict(runner.steps_by_bucket)
        n = len(plan.num_scheduled_tokens)
        padded = n not in runner.sizes and n not in {len(s["rows"]) for s in self.steps
                                                     if s["k"] is not None}
        k = runner.cache.k.clone() if padded else None
        v = runner.cache.v.clone() if padded else None
        if padded and plan.new_block_ids:
            ids = torch.tensor(plan.new_block_ids)
            k.index_fill_(1, ids, 0)
            v.index_fill_(1, ids, 0)
        out = runner.execute_model(plan, requests)
        used = [b for b, c in runner.steps_by_bucket.items() if c != before.get(b, 0)]
        if used:
            rows = [(requests[rid].token_ids[plan.num_computed_tokens[rid]],
                     plan.num_computed_tokens[rid], tuple(plan.block_tables[rid]))
                    for rid in out.req_ids]
            self.steps.append(dict(
                rows=rows, bucket=used[0], sizes=list(runner.sizes),
                block_size=runner.cache.block_size, width=runner.blocks_per_table,
                buffers={name: getattr(runner, name)[:used[0]].cpu().clone()
                         for name in BUFFERS},
                logits=out.logits.clone(), k=k, v=v, form=runner.form))
        return out


@functools.lru_cache(maxsize=1)
def static_steps() -> list[dict]:
    model, tokenizer = bundled()
    params = [greedy(m, ignore_eos=True) for m in (4, 6, 8, 10, 12, 14)]
    plain = s13.build_engine(model, tokenizer, max_num_seqs=6, block_size=4)
    reference = [c.token_ids for c in LLM(plain).generate(PROMPTS, params)]
    engine = s13.build_engine(model, tokenizer, max_num_seqs=6, block_size=4)
    s16s.make_static(engine)
    recorder = StaticRecorder(engine)
    outputs = [c.token_ids for c in LLM(engine).generate(PROMPTS, params)]
    # the chapter's own guarantee, before its runner is an oracle
    assert outputs == reference
    assert recorder.runner.sizes == [1, 2, 4, 8]
    return recorder.steps


def padded(step: dict):
    return ex.pad_to_bucket([(t, p, tuple(b)) for t, p, b in step["rows"]], list(step["sizes"]),
                            step["block_size"], step["width"])


def as_long(value) -> torch.Tensor:
    return torch.as_tensor(value).to(torch.int64).cpu()


@needs_model
@pytest.mark.points(1)
def test_padded_inputs_are_the_static_runners_buffers():
    # The docstring's example, and the cases with no answer.
    got = ex.pad_to_bucket([(11, 5, (7, 2)), (12, 0, (3,)), (13, 8, (4, 6, 9))], [1, 2, 4],
                           4, 3)
    mine = {k: as_long(v).tolist() for k, v in got.items()}
    want = {"input_ids": [11, 12, 13, 0], "positions": [5, 0, 8, 0],
            "slot_mapping": [9, 12, 36, 0], "context_lens": [6, 1, 9, 1],
            "block_tables": [[7, 2, 0], [3, 0, 0], [4, 6, 9], [0, 0, 0]]}
    assert mine == want, f"the docstring's example: you return {mine}, it says {want}"
    assert ex.pad_to_bucket([(1, 0, (1,))] * 9, [1, 2, 4, 8], 4, 3) is None, (
        "9 rows and buckets up to 8: no bucket holds them (None)")
    with pytest.raises(ValueError):
        ex.pad_to_bucket([(1, 4, (1,))], [1, 2], 4, 3)        # position 4 is in block 1
    with pytest.raises(ValueError):
        ex.pad_to_bucket([], [1, 2], 4, 3)

    steps = static_steps()
    for step in steps:
        got = padded(step)
        n = len(step["rows"])
        assert got is not None, f"{n} rows, buckets {step['sizes']}: you say no bucket holds them"
        assert set(got) == set(BUFFERS), sorted(got)
        for name in BUFFERS:
            mine, want = as_long(got[name]), step["buffers"][name]
            assert mine.shape == want.shape, (
                f"{n} rows: your {name} has shape {tuple(mine.shape)}, the runner's bucket "
                f"{step['bucket']} gives {tuple(want.shape)}")
            assert torch.equal(mine, want), (
                f"{n} rows {step['rows']} (blocks of {step['block_size']}, tables of "
                f"{step['width']}): your {name} {mine.tolist()} != the runner's "
                f"{want.tolist()}")
    batches = {len(s["rows"]) for s in steps}
    assert batches == {1, 2, 3, 4, 5, 6}, batches         # padding at 3, 5 and 6 rows


@needs_model
@pytest.mark.points(1)
def test_padded_rows_change_nothing_real():
    model, _ = bundled()
    checked = 0
    for step in static_steps():
        if step["k"] is None:
            continue
        n, bucket = len(step["rows"]), step["bucket"]
        got = padded(step)
        inputs = [as_long(got[name]) for name in BUFFERS]
        assert inputs[0].shape[0] == bucket > n
        with torch.inference_mode():
            k_pad, v_pad = step["k"].clone(), step["v"].clone()
            logits_pad = s16s.decode_step(model, k_pad, v_pad, *inputs, form=step["form"])
            k_one, v_one = step["k"].clone(), step["v"].clone()
            logits_one = s16s.decode_step(model, k_one, v_one, *(t[:n] for t in inputs),
                                          form=step["form"])
        assert torch.isfinite(logits_pad).all(), (
            f"{n} rows padded to {bucket}: some padded row's logits are not finite (what does "
            "a padded row attend to?)")
        torch.testing.assert_close(logits_pad[:n], logits_one, atol=1e-4, rtol=0,
                                   msg=f"{n} rows padded to {bucket}: the real rows' logits "
                                       "differ from the same rows run unpadded")
        torch.testing.assert_close(logits_pad[:n], step["logits"], atol=1e-4, rtol=0,
                                   msg=f"{n} rows: the real rows' logits differ from the "
                                       "engine's")
        for name, pad, one in (("keys", k_pad, k_one), ("values", v_pad, v_one)):
            wrong = ((pad[:, 1:] - one[:, 1:]).abs() > 1e-5).nonzero()
            assert len(wrong) == 0, (
                f"{n} rows padded to {bucket}: the padded step wrote {name} into block "
                f"{int(wrong[0][1]) + 1}, a block a request owns (layer {int(wrong[0][0])}, "
                f"offset {int(wrong[0][2])}); padded rows may write only the null block 0")
        checked += 1
    assert checked == 3                                   # 3, 5 and 6 rows


# Exercise 2 ----------------------------------------------------------------------------------

MAX_MODEL_LEN = 48


def fake_output(prompt: list[int], max_tokens: int) -> list[int]:
    """The fake model's output for a request, run alone without any scheduler."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt):]


class AsyncLoop:
    """`AsyncLLMEngine.step`'s order of work, model-free: the chapter's `AsyncScheduler`
    around S11's scheduler, and a fake model (the forward is done when a plan is launched; its
    tokens are read when the step's result is taken). `events` and `books` (the requests'
    counts after each event) are what the exercise is graded on."""

    def __init__(self, seats: int, budget: int | None, capacity: int | None):
        config = s11.ChunkedSchedulerConfig(seats, MAX_MODEL_LEN, budget)
        slots = max(seats, -(-(capacity or 0) // MAX_MODEL_LEN))
        self.scheduler = s16a.AsyncScheduler(
            s11.ChunkedScheduler(config, TokenKVPool(slots, MAX_MODEL_LEN, capacity)))
        self.scheduler.stepping = True    # this loop is the one that plans with it
        self.requests = {}            # the engine's: added, not finished or aborted
        self.context: dict[str, list[int]] = {}     # what the fake model computed (its KV)
        self.in_flight = None         # (plan, preemptions at launch, {id: token sampled})
        self.planned = None
        self.events: list[tuple] = []
        self.books: list[dict] = []
        self.outputs: dict[str, list[int]] = {}
        self.aborted: set[str] = set()

    def note(self, event: tuple) -> None:
        self.events.append(event)
        self.books.append({rid: (r.num_tokens, r.num_computed_tokens, r.num_output_placeholders)
                           for rid, r in self.requests.items()})

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        request = make_request(rid, prompt_len, max_tokens, arrival=len(self.outputs))
        self.scheduler.check_request(request)
        self.scheduler.add_request(request)
        self.requests[rid] = request
        self.outputs[rid] = []
        self.note(("add", rid, prompt_len))

    def abort(self, rid: str) -> None:
        request = self.requests.pop(rid)
        self.outputs[rid] = list(request.output_ids)
        self.scheduler.finish_requests([rid])
        self.aborted.add(rid)
        self.note(("abort", rid))

    def busy(self) -> bool:
        return bool(self.requests) or self.in_flight is not None

    def plan(self):
        plan = self.scheduler.schedule()
        assert not plan.finished_ids, "the capacity holds every request whole"
        self.note(("plan", plan.step, dict(plan.num_scheduled_tokens),
                   tuple(plan.preempted_ids)))
        return plan

    def launch(self, plan) -> None:
        live = [rid for rid in plan.num_scheduled_tokens if rid in self.requests]
        if not live:
            return
        sampled = {}
        for rid in live:
            request = self.requests[rid]
            start, n = plan.num_computed_tokens[rid], plan.num_scheduled_tokens[rid]
            kept = self.context.get(rid, [])[:start]
            assert len(kept) == start, "the plan claims KV the fake model never computed"
            new = request.token_ids[start:start + n]
            assert len(new) == n, "the plan reads a token that has not arrived"
            self.context[rid] = kept + new
            if start + n == len(request.token_ids):          # the runner's rule: it samples
                sampled[rid] = next_token(self.context[rid])
        self.in_flight = (plan, {rid: self.requests[rid].num_preemptions for rid in live},
                          sampled)

    def step(self) -> None:
        if self.in_flight is None:
            plan = self.plan()
            if not plan.num_scheduled_tokens:
                return
            self.launch(plan)
            self.planned = self.plan()
        (plan, preemptions, sampled), self.in_flight = self.in_flight, None
        appended = []
        for rid, token in sampled.items():
            request = self.requests.get(rid)
            if request is None:
                continue
            if (request.status != RequestStatus.RUNNING
                    or request.num_preemptions != preemptions[rid]):
                self.scheduler.drop_placeholder(request)
                continue
            request.append_token(token)
            request.num_output_placeholders -= 1
            appended.append(rid)
        self.note(("tokens", plan.step))
        upcoming, self.planned = self.planned, None
        if upcoming is not None and upcoming.num_scheduled_tokens:
            self.launch(upcoming)
        finished = [rid for rid in appended
                    if len(self.requests[rid].output_ids) >= self.requests[rid].params.max_tokens]
        self.scheduler.update_from_output(plan, finished)
        for rid in finished:
            self.outputs[rid] = list(self.requests.pop(rid).output_ids)
        self.note(("update", plan.step, tuple(finished)))
        if self.in_flight is not None:
            self.planned = self.plan()


def async_run(seed: int, *, seats: int, budget: int | None, capacity: int | None,
              abort_p: float, num_requests: int = 10, max_tokens: int = 12) -> AsyncLoop:
    rng = random.Random(seed)
    loop = AsyncLoop(seats, budget, capacity)
    arrivals, tick = [], 0
    for i in range(num_requests):
        tick += rng.choice([0, 0, 1, 2, 3])
        arrivals.append((tick, f"r{i}", rng.randint(1, 20), rng.randint(1, max_tokens)))
    prompts = {rid: (p, m) for _, rid, p, m in arrivals}
    tick = 0
    while arrivals or loop.busy():
        while arrivals and arrivals[0][0] <= tick:
            _, rid, p, m = arrivals.pop(0)
            loop.add(rid, p, m)
        if loop.requests and rng.random() < abort_p:
            loop.abort(rng.choice(sorted(loop.requests)))
        loop.step()
        tick += 1
        assert tick < 2000, "the loop does not end"
    # The loop is the engine's before it grades: outputs as the fake model gives them alone.
    for rid, (p, m) in prompts.items():
        want = fake_output(make_request(rid, p, m).prompt_ids, m)
        got = loop.outputs[rid]
        assert got == want[:len(got)] and (rid in loop.aborted or got == want), rid
    return loop


def check_books(loop: AsyncLoop) -> None:
    got = ex.replay(copy.deepcopy(loop.events))
    got = list(got)
    assert len(got) == len(loop.events), (
        f"{len(loop.events)} events, you return {len(got)} states")
    for i, (event, want, mine) in enumerate(zip(loop.events, loop.books, got)):
        mine = {rid: tuple(int(x) for x in v) for rid, v in dict(mine).items()}
        if mine != want:
            ids = sorted(set(mine) ^ set(want)) or sorted(
                rid for rid in want if mine[rid] != want[rid])
            recent = "; ".join(map(str, loop.events[max(0, i - 6):i + 1]))
            raise AssertionError(
                f"after event {i} {event}: request(s) {ids}: you say "
                f"{ {r: mine.get(r) for r in ids} }, the AsyncScheduler's requests hold "
                f"{ {r: want.get(r) for r in ids} } (num_tokens, num_computed_tokens, "
                f"num_output_placeholders; None: gone). Events up to it: {recent}")


def seen(loops, test) -> int:
    """How many (event, books before, books after) triples across the runs pass `test`."""
    count = 0
    for loop in loops:
        for i, event in enumerate(loop.events):
            count += bool(test(event, loop.books[i - 1] if i else {}, loop.books[i]))
    return count


@pytest.mark.points(1)
def test_books_of_decode_steps_planned_one_ahead():
    mine = [{rid: tuple(v) for rid, v in dict(state).items()} for state in ex.replay(
        [("add", "a", 3), ("plan", 0, {"a": 3}, ()), ("plan", 1, {"a": 1}, ()),
         ("tokens", 0), ("update", 0, ())])]
    want = [{"a": (3, 0, 0)}, {"a": (4, 3, 1)}, {"a": (5, 4, 2)}, {"a": (5, 4, 1)},
            {"a": (5, 4, 1)}]
    assert mine == want, f"the docstring's example: you say {mine}, it says {want}"
    loops = [async_run(1610 + k, seats=4, budget=None, capacity=None, abort_p=0.0)
             for k in range(8)]
    for loop in loops:
        check_books(loop)
    # two tokens in flight for one request, between the plan of N + 1 and N's tokens
    assert seen(loops, lambda e, b, a: any(v[2] == 2 for v in a.values()))
    # a request finished by step N's tokens was already planned into N + 1
    assert seen(loops, lambda e, b, a: e[0] == "update" and any(b[r][2] for r in e[2]))


@pytest.mark.points(1)
def test_books_with_chunked_prompts():
    loops = [async_run(1620 + k, seats=4, budget=random.Random(k).randint(4, 12),
                       capacity=None, abort_p=0.0) for k in range(8)]
    for loop in loops:
        check_books(loop)
    # a chunk that does not reach the end of its prompt: computed moved, no placeholder
    assert seen(loops, lambda e, b, a: e[0] == "plan" and any(
        a[r][1] < a[r][0] and a[r][2] == b.get(r, (0, 0, 0))[2] for r in e[2]))


@pytest.mark.points(1)
def test_books_with_aborts_and_late_finishes():
    loops = [async_run(1630 + k, seats=3, budget=random.Random(k).choice([None, 8]),
                       capacity=None, abort_p=0.12, max_tokens=6) for k in range(10)]
    for loop in loops:
        check_books(loop)
    assert sum(len(loop.aborted) for loop in loops) >= 10
    # an abort while a token of the request is in flight
    assert seen(loops, lambda e, b, a: e[0] == "abort" and b[e[1]][2] > 0)


@pytest.mark.points(1)
def test_books_with_preemption_while_a_step_is_in_flight():
    loops = [async_run(1640 + k, seats=4, budget=random.Random(k).choice([None, 16]),
                       capacity=40 + 4 * k, abort_p=0.03, num_requests=12) for k in range(10)]
    for loop in loops:
        check_books(loop)
    preempted = seen(loops, lambda e, b, a: e[0] == "plan" and e[3])
    assert preempted >= 5, preempted
    # preempted holding a placeholder for the step in flight: nothing computed, the
    # placeholder kept until that step's tokens come (and then dropped, with no token)
    assert seen(loops, lambda e, b, a: e[0] == "plan" and any(a[r][1] == 0 and a[r][2] > 0
                                                              for r in e[3]))


# Exercise 3 ----------------------------------------------------------------------------------

BATCHES = (1, 2, 4, 8, 16)
TECHNIQUES = ("graphs", "async", "graphs+async")


@functools.lru_cache(maxsize=1)
def measured():
    """(profiles of timing runs at each B in BATCHES: one prefill step and 11 decode steps of
    B requests each; {(kind, B): model ops} from counting runs; per_op_overhead_s here)."""
    model, tokenizer = bundled()
    prompts = (PROMPTS * 3)[:max(BATCHES)]
    profiles, ops = [], {}
    for b in BATCHES:
        engine = s13.build_engine(model, tokenizer, max_num_seqs=b)
        timed = s16p.profile(engine)
        LLM(engine).generate(prompts[:b], greedy(12, ignore_eos=True))
        profiles += timed.profiles
        engine = s13.build_engine(model, tokenizer, max_num_seqs=b)
        counted = s16p.profile(engine, count_ops=True)
        LLM(engine).generate(prompts[:b], greedy(3, ignore_eos=True))
        for row in s16p.summarize(counted.profiles):
            ops[(row.kind, row.num_seqs)] = int(row.model_ops)
    assert {(p.kind, p.num_seqs) for p in profiles} == set(ops)
    return profiles, ops, s16p.per_op_overhead_s("cpu")


def made(num_seqs: int, forward_s: float, kind: str = "decode", **phases) -> s16p.StepProfile:
    """A profile by hand (seconds); step_s is the sum of the phases given."""
    fields = dict(propose_s=0.0, schedule_s=0.0, prepare_s=0.0, forward_s=forward_s,
                  sample_s=0.0, postprocess_s=0.0, update_s=0.0, other_s=0.0)
    fields.update(phases)
    return s16p.StepProfile(step=0, num_seqs=num_seqs, num_tokens=num_seqs, kind=kind,
                            step_s=sum(fields.values()), ops=None, model_ops=None,
                            segments=(), **fields)


@needs_model
@pytest.mark.points(1)
def test_host_and_overhead_of_measured_steps():
    profiles, ops, per_op = measured()
    for p in profiles:
        n = ops[(p.kind, p.num_seqs)]
        got = tuple(float(x) for x in ex.host_and_overhead(p, n, per_op))
        overhead = s16p.overhead_estimate(replace(p, model_ops=n), per_op, model_only=True)
        want = (p.host_s, p.host_fraction, overhead, overhead / (p.prepare_s + p.forward_s))
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (
            f"{p.kind} step of B={p.num_seqs} ({n} ops, {per_op * 1e6:.3f} us per op): you "
            f"say {got}, the chapter's profile and estimate give {want} (host_s, "
            "host_fraction, overhead_s, overhead_fraction)")
    with pytest.raises(ValueError):
        ex.host_and_overhead(profiles[0], 100, 0.0)
    with pytest.raises(ValueError):
        ex.host_and_overhead(profiles[0], 0, per_op)


def predicted(p, ops: int, per_op: float, technique: str) -> float:
    """The docstring's arithmetic, from the profile's phases."""
    model = p.prepare_s + p.forward_s
    rest = p.propose_s + p.schedule_s + p.postprocess_s + p.update_s + p.other_s
    if "graphs" in technique:
        model = max(per_op, model - (ops - 1) * per_op)
    if "async" in technique:
        return p.sample_s + max(model, rest)
    return rest + p.sample_s + model


@needs_model
@pytest.mark.points(1)
def test_predicted_step_times_from_measured_steps():
    ms = 1e-3
    example = made(1, 5 * ms, schedule_s=1 * ms, prepare_s=1 * ms, sample_s=1 * ms,
                   postprocess_s=1 * ms, update_s=0.5 * ms, other_s=0.5 * ms)
    for technique, want in (("graphs", 6 * ms), ("async", 7 * ms), ("graphs+async", 4 * ms)):
        got = float(ex.predicted_step_s(example, 401, 0.01 * ms, technique))
        assert got == pytest.approx(want, rel=1e-9), (technique, got, want)
    profiles, ops, per_op = measured()
    for p in profiles:
        n = ops[(p.kind, p.num_seqs)]
        for technique in TECHNIQUES:
            got = float(ex.predicted_step_s(p, n, per_op, technique))
            want = predicted(p, n, per_op, technique)
            assert got == pytest.approx(want, rel=1e-9), (
                f"{p.kind} step of B={p.num_seqs}, {technique}: you predict {got * 1e3:.4f} "
                f"ms, the arithmetic on its phases gives {want * 1e3:.4f} ms (measured "
                f"{p.step_s * 1e3:.4f} ms, {n} ops at {per_op * 1e6:.3f} us)")
    # the floor: a model call the overhead estimate more than explains is still one launch
    assert float(ex.predicted_step_s(made(1, 1 * ms), 10_000, 0.01 * ms, "graphs")) == \
        pytest.approx(0.01 * ms, rel=1e-9)
    with pytest.raises(ValueError):
        ex.predicted_step_s(example, 401, 0.01 * ms, "compile")


def fitted(profiles) -> tuple[float, float, int | None]:
    """numpy's least-squares line through the chapter's medians of decode forward_s per B."""
    rows = [r for r in s16p.summarize(profiles) if r.kind == "decode"]
    b, a = np.polyfit([r.num_seqs for r in rows], [r.forward_s for r in rows], 1)
    return float(a), float(b), None if b <= 0 else max(1, math.ceil(a / b))


def check_fit(profiles, what: str) -> None:
    a, b, batch = ex.compute_catches_up(list(profiles))
    want_a, want_b, want_batch = fitted(profiles)
    scale = max(abs(want_a), abs(want_b) * max(p.num_seqs for p in profiles))
    assert float(a) == pytest.approx(want_a, abs=1e-9 * scale), (what, a, want_a)
    assert float(b) == pytest.approx(want_b, abs=1e-9 * scale), (what, b, want_b)
    ratio = want_a / want_b if want_b else math.inf
    if abs(ratio - round(ratio)) > 1e-6 and abs(want_b) > 1e-9 * scale:  # not on a knife-edge
        assert batch == want_batch, (
            f"{what}: forward = {want_a * 1e3:.4f} ms + {want_b * 1e3:.5f} ms x B: the per-row "
            f"part reaches the fixed part at B = {want_batch}; you say {batch}")


@pytest.mark.points(1)
def test_compute_catches_up_fits_the_medians():
    ms = 1e-3
    # By hand: medians 1.06, 1.12, 1.24 ms (an outlier each, which the median ignores), and
    # prefill steps, which do not count: a = 1 ms, b = 0.06 ms, batch 17.
    hand = [made(b, f * ms) for b, f in ((1, 1.06), (1, 1.06), (1, 9.0), (2, 1.12), (2, 0.5),
                                         (2, 1.12), (4, 1.24), (4, 1.24), (4, 1.24))]
    hand += [made(b, 50 * ms, kind="prefill") for b in (1, 2, 8)]
    a, b, batch = ex.compute_catches_up(hand)
    assert (float(a), float(b)) == pytest.approx((1 * ms, 0.06 * ms), rel=1e-9)
    assert batch == 17
    check_fit(hand, "profiles by hand")
    flat = [made(1, 2 * ms), made(2, 2 * ms), made(3, 1.9 * ms)]
    assert ex.compute_catches_up(flat)[2] is None            # no per-row cost to catch up
    with pytest.raises(ValueError):
        ex.compute_catches_up([made(4, 1 * ms), made(4, 2 * ms), made(8, 3 * ms, "prefill")])
    if (BUNDLED / "model.safetensors").is_file():
        profiles, _, _ = measured()
        check_fit(profiles, "the bundled model's decode steps at B = 1, 2, 4, 8, 16")
