"""Graded tests for the S09 exercises (see exercises/s09_continuous_batching.py).

Oracles, none of them the solution: admissions and batches worked by hand; a plain loop that
builds the flat metadata token by token; the greedy tokens S06's single-request engine makes
for each prompt alone, compared with what S09's tested `RaggedRunner` computes on the learner's
flattened batch; closed forms for equal output lengths; and the trace (`s09_trace.trace`'s
records) of S09's tested engine serving real requests of the bundled model, with aborts.
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

ex = load_exercise("s09_continuous_batching")
HAVE_MODEL = (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file()
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="data/model has no bundled model")


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_admit_by_hand():
    assert ex.admit(["a", "b", "c"], [3, 1]) == [("a", 1), ("b", 3)]
    assert ex.admit(["a"], [2, 0, 5]) == [("a", 0)]
    assert ex.admit([], [0, 1]) == []
    assert ex.admit(["a", "b"], []) == []
    with pytest.raises(ValueError):
        ex.admit(["a"], [1, 1])
    with pytest.raises(ValueError):
        ex.admit(["a"], [-1])


@pytest.mark.points(2)
def test_admit_is_fifo_into_the_lowest_slots_and_leaves_no_slot_idle():
    rng = random.Random(9)
    for _ in range(200):
        waiting = [f"r{i}" for i in range(rng.randint(0, 8))]
        free = rng.sample(range(12), rng.randint(0, 8))
        w_copy, f_copy = list(waiting), list(free)
        got = ex.admit(waiting, free)
        assert waiting == w_copy and free == f_copy                    # inputs untouched
        count = min(len(waiting), len(free))                            # nobody waits by a free slot
        assert len(got) == count
        assert [rid for rid, _ in got] == waiting[:count]               # oldest first
        remaining = list(free)
        for _, slot in got:                                             # each the lowest still free
            assert slot == min(remaining)
            remaining.remove(slot)


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
        assert as_plain(ex.flatten(new, cached)) == loop_flatten(new, cached)


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
        assert ex.simulate(lens, m, aborts) == engine_steps, (lens, m, aborts)
        assert engine.scheduler.kv.free_slots == list(range(m))
