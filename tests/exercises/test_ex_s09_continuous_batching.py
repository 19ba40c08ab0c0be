"""Graded tests for the S09 exercises (see exercises/s09_continuous_batching.py).

Oracles, none of them the solution: S09's synchronous engine (`LLM(build_engine(...))`) on the
same requests, and the order of plans, launches and step reports seen through the engine's
observer seam and the launch function the test hands in; admissions and batches worked by
hand; a plain loop that builds the flat metadata token by token; the greedy tokens S06's
single-request engine makes for each prompt alone, compared with what S09's tested
`RaggedRunner` computes on the learner's flattened batch; closed forms for equal output
lengths; and the trace (`s09_trace.trace`'s records) of S09's tested engine serving real
requests of the bundled model, with aborts.
"""
import random

import pytest
import torch

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s09_continuous_batching as s09
import s09_ragged
import s09_trace
from exercise_loader import load_exercise
from s09_llm import LLM

ex = load_exercise("s09_continuous_batching")
HAVE_MODEL = (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file()
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="data/model has no bundled model")


# Exercise 1 ----------------------------------------------------------------------------------

AHEAD_PROMPTS = ["ROMEO.\nWhat light", "To be, or not", "Now is the winter of our",
                 "O Romeo, Romeo!", "Friends, Romans", "All the world's a stage"]


def ahead_params():
    """Lengths from 1 to 15 tokens, one request stopped by EOS and one by a stop string (they
    finish while the next step is already planned)."""
    return [s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore, stop=stop)
            for n, ignore, stop in ((12, True, None), (1, True, None), (20, False, None),
                                    (9, True, ["e"]), (15, True, None), (3, True, None))]


@pytest.fixture(scope="module")
def bundled():
    return s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")


class Events:
    """The test's observer and launch function: every plan, launch, wait and step report in
    the order they happen (the plan's step number labels each)."""

    def __init__(self, engine):
        self.engine, self.log = engine, []

    def on_plan(self, engine, plan):
        if plan.num_scheduled_tokens:
            self.log.append(("plan", plan.step, tuple(plan.num_scheduled_tokens)))

    def on_step(self, engine, result):
        kv = engine.scheduler.kv
        for out in result.outputs:                 # a finished request's slot is free now
            assert not out.finished or kv.num_tokens(out.request_id) == 0, out.request_id
        self.log.append(("step", result.plan.step, ()))

    def launch(self, plan, requests):
        self.log.append(("launch", plan.step, tuple(plan.num_scheduled_tokens)))
        run = self.engine.runner.execute_model(plan, requests)
        log = self.log

        class Handle:
            def result(self):
                log.append(("wait", plan.step, ()))
                return run
        return Handle()


def check_against_sync(got, ref, engine, m):
    assert len(got) == len(ref), \
        f"max_num_seqs {m}: got output lists for {len(got)} requests, expected {len(ref)}"
    for i, (outs, want) in enumerate(zip(got, ref)):
        case = f"max_num_seqs {m}, request {i} ({AHEAD_PROMPTS[i]!r})"
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == want.token_ids, \
            f"{case}: got token ids {tokens}, expected {want.token_ids} (the synchronous engine)"
        text = "".join(o.text_delta for o in outs)
        assert text == want.text, f"{case}: got text {text!r}, expected {want.text!r}"
        finished = [o.finished for o in outs]
        assert finished == [False] * (len(outs) - 1) + [True], \
            f"{case}: got finished flags {finished}, expected only the last one True"
        assert outs[-1].finish_reason == want.finish_reason, (
            f"{case}: got finish_reason {outs[-1].finish_reason!r}, "
            f"expected {want.finish_reason!r}")
    kv = engine.scheduler.kv
    assert kv.free_slots == list(range(m)), \
        f"max_num_seqs {m}: got free slots {kv.free_slots} at the end, expected {list(range(m))}"
    assert kv.num_used_tokens == 0, \
        f"max_num_seqs {m}: got {kv.num_used_tokens} tokens still held at the end, expected 0"


@needs_model
@pytest.mark.points(2)
def test_ahead_makes_the_synchronous_engines_tokens(bundled):
    """Greedy tokens, text and finish reason of every request equal S09's synchronous engine,
    at 1, 2 and 4 running requests (2 with the default launch, on a worker thread); one output
    per token, the last one finished; every slot free at the end."""
    model, tokenizer = bundled
    params = ahead_params()
    for m in (1, 2, 4):
        ref = LLM(s09.build_engine(model, tokenizer, max_num_seqs=m)).generate(AHEAD_PROMPTS,
                                                                               params)
        engine = s09.build_engine(model, tokenizer, max_num_seqs=m)
        events = Events(engine)
        engine.observers.append(events)
        launch = None if m == 2 else events.launch
        got = ex.generate_ahead(engine, AHEAD_PROMPTS, params, launch)
        check_against_sync(got, ref, engine, m)


@needs_model
@pytest.mark.points(1)
def test_ahead_plans_the_next_step_before_the_current_one_reports(bundled):
    """Through the observer and the launch function: steps are launched one at a time, each
    after the previous one reported (at most one step of lag); while a request runs on, the
    plan of its next step is made before the current step reports; and no more than one plan
    is made ahead of the step in flight."""
    model, tokenizer = bundled
    for m in (2, 4):
        engine = s09.build_engine(model, tokenizer, max_num_seqs=m)
        events = Events(engine)
        engine.observers.append(events)
        ex.generate_ahead(engine, AHEAD_PROMPTS, ahead_params(), events.launch)
        log = events.log
        at = {(kind, step): i for i, (kind, step, _) in enumerate(log)}
        launches = [(step, ids) for kind, step, ids in log if kind == "launch"]
        labels = [step for step, _ in launches]
        assert labels == sorted(set(labels)), "each step launched once, in order"
        for step, _ in launches:
            assert at.get(("plan", step), len(log)) < at[("launch", step)] < at[("wait", step)] \
                < at[("step", step)], f"step {step}: plan, launch, wait, report"
        overlapped = 0
        for (a, ids_a), (b, ids_b) in zip(launches, launches[1:]):
            assert at[("step", a)] < at[("launch", b)], f"step {b} launched before {a} reported"
            if set(ids_a) & set(ids_b):               # a request runs on from a to b
                assert at[("plan", b)] < at[("step", a)], \
                    f"step {b} was planned after step {a} reported: not one step ahead"
                overlapped += 1
            ahead = [s for kind, s, _ in log[:at[("step", a)]] if kind == "plan" and s > a]
            assert len(ahead) <= 1, f"{len(ahead)} plans made ahead of step {a}"
        assert overlapped >= len(launches) // 2


# Exercise 2 ----------------------------------------------------------------------------------

def loop_flatten(new_tokens, num_cached):
    out = {"input_ids": [], "positions": [], "query_start_loc": [0], "context_lens": [],
           "sample_rows": []}
    for tokens, cached in zip(new_tokens, num_cached):
        for i, t in enumerate(tokens):
            out["input_ids"].append(t)
            out["positions"].append(cached + i)
        out["query_start_loc"].append(len(out["input_ids"]))
        out["context_lens"].append(cached + len(tokens))
        out["sample_rows"].append(len(out["input_ids"]) - 1)
    return out


def as_plain(meta: dict) -> dict:
    return {k: [int(x) for x in v] for k, v in meta.items()}


@pytest.mark.points(1)
def test_flatten_by_hand():
    got = as_plain(ex.flatten([[5, 6, 7], [9], [4, 2]], [0, 10, 3]))
    assert got == {"input_ids": [5, 6, 7, 9, 4, 2], "positions": [0, 1, 2, 10, 3, 4],
                   "query_start_loc": [0, 3, 4, 6], "context_lens": [3, 11, 5],
                   "sample_rows": [2, 3, 5]}
    for bad in (([], []), ([[1], []], [0, 0]), ([[1]], [-1]), ([[1], [2]], [0])):
        with pytest.raises(ValueError):
            ex.flatten(*bad)


@pytest.mark.points(1)
def test_flatten_matches_a_token_by_token_loop():
    rng = random.Random(10)
    for _ in range(100):
        b = rng.randint(1, 6)
        new = [[rng.randrange(100) for _ in range(rng.choice([1, 1, rng.randint(1, 9)]))]
               for _ in range(b)]
        cached = [rng.randint(0, 40) for _ in range(b)]
        got, want = as_plain(ex.flatten(new, cached)), loop_flatten(new, cached)
        diff = "; ".join(f"{k}: got {got.get(k)}, expected {want[k]}" for k in want
                         if got.get(k) != want[k]) or f"got keys {sorted(got)}"
        assert got == want, f"{diff} from flatten({new}, {cached})"


@needs_model
@pytest.mark.points(2)
def test_the_model_on_your_flat_batch_makes_each_prompts_tokens_alone():
    """Your metadata drives S09's RaggedRunner for two steps: a prefill of two prompts, then
    their decodes beside a third prompt's prefill. Every sampled row must be the greedy token
    S06's engine makes for that prompt alone."""
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    prompts = [tokenizer.encode(t) for t in ("ROMEO.\nWhat light", "To be, or not",
                                             "Now is the winter of our")]
    single = s06.Engine(model, tokenizer, 256)
    alone = [single.generate(tokenizer.decode(p), s04.SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True)).token_ids for p in prompts]
    runner = s09_ragged.RaggedRunner(model, s09_ragged.SlotKVCache.for_model(model, 3, 256))

    def run(new_tokens, cached, slots):
        meta = as_plain(ex.flatten(new_tokens, cached))
        ids = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        batch = s09_ragged.RaggedBatch(ids(meta["input_ids"]), ids(meta["positions"]),
                                       meta["query_start_loc"], meta["context_lens"],
                                       [(slot,) for slot in slots],
                                       ids([[slot] for slot in slots]), [True] * len(slots),
                                       ids(meta["sample_rows"]))
        return runner.forward(batch).argmax(-1).tolist()

    first = run([prompts[0], prompts[1]], [0, 0], [0, 1])
    assert first == [alone[0][0], alone[1][0]]
    second = run([[first[0]], [first[1]], prompts[2]], [len(prompts[0]), len(prompts[1]), 0],
                 [0, 1, 2])
    assert second == [alone[0][1], alone[1][1], alone[2][0]]


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_simulate_by_hand_and_closed_forms():
    assert ex.simulate([2, 1, 1], 2) == [[(0, 0), (1, 1)], [(0, 0), (2, 1)]]
    # One slot: requests one after the other, each for its own length.
    assert ex.simulate([2, 3], 1) == [[(0, 0)]] * 2 + [[(1, 0)]] * 3
    # Aborted before step 1: request 0 leaves, request 2 takes its slot 0.
    assert ex.simulate([5, 3, 2], 2, {0: 1}) == [[(0, 0), (1, 1)], [(2, 0), (1, 1)],
                                                 [(2, 0), (1, 1)]]
    # n requests of equal length L in M slots: ceil(n / M) rounds of L steps.
    for n, m, length in ((7, 3, 4), (8, 4, 2), (1, 5, 6)):
        assert len(ex.simulate([length] * n, m)) == -(-n // m) * length
    with pytest.raises(ValueError):
        ex.simulate([1], 0)
    with pytest.raises(ValueError):
        ex.simulate([0], 2)


@needs_model
@pytest.mark.points(2)
def test_simulate_equals_the_engines_trace_with_finishes_and_aborts():
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    cases = (([6, 2, 9, 3, 3, 5, 1, 4], 3, {}),
             ([8, 2, 7, 3, 5, 2], 2, {2: 3, 4: 1, 1: 9}),   # a running, a waiting, a finished
             ([4, 4, 4, 4, 4], 4, {0: 2, 3: 2}))
    for lens, m, aborts in cases:
        engine = s09.build_engine(model, tokenizer, max_context=256, max_num_seqs=m)
        records = s09_trace.trace(engine).records
        for i, n in enumerate(lens):
            engine.add_request(f"Request {i}: tell me", s04.SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True), request_id=str(i))
        while engine.has_unfinished_requests():
            for i, when in aborts.items():
                if when == len(records):
                    engine.abort(str(i))
            engine.step()
        # a record lists the running requests in schedule order; the batch is in slot order
        engine_steps = [sorted(((int(r), s) for r, s in zip(rec.running, rec.slots)),
                               key=lambda pair: pair[1]) for rec in records]
        got = ex.simulate(lens, m, aborts)
        first = next((k for k, (g, w) in enumerate(zip(got, engine_steps)) if g != w),
                     min(len(got), len(engine_steps)))
        assert got == engine_steps, (
            f"simulate({lens}, {m}, {aborts}): first difference at step {first}: got "
            f"{got[first:first + 1]}, expected {engine_steps[first:first + 1]} (the engine's "
            f"trace; {len(got)} steps against {len(engine_steps)})")
        assert engine.scheduler.kv.free_slots == list(range(m)), "oracle check: slots all free"
