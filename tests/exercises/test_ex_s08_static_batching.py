"""Graded tests for the S08 exercises (see exercises/s08_static_batching.py).

Oracles, none of them the solution: for the batch planner, the S08 `Engine` itself (it refuses
a batch over its `max_batch_size`, and its `BatchStats.padding_slots` counts the padding of
each batch it runs), each request run alone through S06's single-request engine, FIFO batching
and sorted fixed-size chunks of the same requests run through the same engine, and a
brute-force search over every split of small workloads into the same number of batches; slot
counts worked by hand, a step-by-step simulation of a static batch written here, and the
`BatchStats` S08's tested `Engine` records on real batches of the bundled model (EOS on, mixed
max_tokens); and, for the right-padding exercise, Hugging Face transformers run on each prompt
alone (the bundled model and a tiny random GPT-2 with learned positions), with the model's
calls watched through a forward pre-hook (one call, on a right-padded (B, T) block).
"""
import random
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s08_static_batching as s08
from exercise_loader import load_exercise

ex = load_exercise("s08_static_batching")
HAVE_MODEL = (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file()
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="data/model has no bundled model")


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled():
    return s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")


def random_prompts(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    """Token-id prompts of exactly these lengths (ids valid in the bundled model)."""
    return [[rng.randrange(1, 2000) for _ in range(n)] for n in lengths]


def check_plan(plan, lengths: list[int], max_batch_size: int) -> None:
    n, call = len(lengths), f"plan_batches({lengths}, {max_batch_size})"
    flat = [i for batch in plan for i in batch]
    assert sorted(flat) == list(range(n)), \
        f"got {plan}, expected every request index 0 to {n - 1} exactly once, from {call}"
    sizes = [len(batch) for batch in plan]
    assert all(1 <= size <= max_batch_size for size in sizes), \
        f"got batches of {sizes} requests, expected 1 to {max_batch_size} each, from {call}"
    want = -(-n // max_batch_size)
    assert len(plan) == want, \
        f"got {len(plan)} batches, expected {want} (as many as FIFO makes), from {call}"


def run_plan(engine: s08.Engine, prompts, plan, max_tokens: int = 1):
    """Run each planned batch as one static batch of the real engine: (padding slots the
    engine counted over all batches, each request's token ids in request order)."""
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    padding, tokens = 0, [None] * len(prompts)
    for batch in plan:
        done = engine.generate([prompts[i] for i in batch], params)
        padding += engine.last_batch.padding_slots
        for i, completion in zip(batch, done):
            tokens[i] = completion.token_ids
    return padding, tokens


def dict_diff(got: dict, want: dict) -> str:
    """The keys where two dicts differ, each with what was got and what was expected."""
    if not isinstance(got, dict):
        return f"got {got!r}, expected {want}"
    keys = [k for k in {**want, **got} if got.get(k) != want.get(k)]
    return "; ".join(f"{k}: got {got.get(k)}, expected {want.get(k)}" for k in keys)


def fifo(n: int, max_batch_size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + max_batch_size))) for i in range(0, n, max_batch_size)]


def least_padding_by_brute_force(lengths: list[int], max_batch_size: int) -> int:
    """The least total padding over EVERY split of the requests into ceil(n / max_batch_size)
    batches of at most max_batch_size (each set partition enumerated once: request i joins a
    batch already opened or opens the next one)."""
    n, num_batches = len(lengths), -(-len(lengths) // max_batch_size)
    best = [float("inf")]

    def place(i: int, batches: list[list[int]]) -> None:
        if i == n:
            if len(batches) == num_batches:
                best[0] = min(best[0], sum(len(b) * max(b) - sum(b) for b in batches))
            return
        if len(batches) + (n - i) < num_batches:
            return
        for batch in batches:
            if len(batch) < max_batch_size:
                batch.append(lengths[i])
                place(i + 1, batches)
                batch.pop()
        if len(batches) < num_batches:
            batches.append([lengths[i]])
            place(i + 1, batches)
            batches.pop()

    place(0, [])
    return best[0]


def least_padding_with_one_short_batch(lengths: list[int], max_batch_size: int) -> int:
    """The least padding of the plans that cut the sorted lengths into full batches and at
    most one short one, wherever it goes: enough on many queues, not on all."""
    ordered, n = sorted(lengths, reverse=True), len(lengths)
    num_batches = -(-n // max_batch_size)
    short = n - (num_batches - 1) * max_batch_size
    best = None
    for where in range(num_batches):
        sizes = [max_batch_size] * num_batches
        sizes[where] = short
        padding, start = 0, 0
        for size in sizes:
            run = ordered[start:start + size]
            padding += len(run) * run[0] - sum(run)
            start += size
        best = padding if best is None else min(best, padding)
    return best


def clustered_lengths(rng: random.Random) -> tuple[list[int], int]:
    """(lengths, max_batch_size) of a queue in as many clusters of near-equal prompts as it
    needs batches, two or more of the clusters smaller than a batch: the least padding then
    leaves several batches short, and a plan with one short batch mixes clusters."""
    max_batch_size = rng.choice([3, 4])
    num_batches = rng.choice([3, 4] if max_batch_size == 3 else [2, 3])
    n = rng.randint((num_batches - 1) * max_batch_size + 1,
                    min(10, num_batches * max_batch_size - 2))
    sizes = [max_batch_size] * num_batches
    for where in rng.sample(range(num_batches), 2):         # two short clusters at least
        sizes[where] -= 1
    while sum(sizes) > n:
        where = rng.choice([k for k, size in enumerate(sizes) if size > 1])
        sizes[where] -= 1
    bases = sorted(rng.sample(range(2, 40, 3), num_batches))
    lengths = [base + rng.randint(0, 1) for base, size in zip(bases, sizes)
               for _ in range(size)]
    rng.shuffle(lengths)
    return lengths, max_batch_size


@needs_model
@pytest.mark.points(1)
def test_plan_is_valid_and_runs_on_the_engine(bundled):
    model, tokenizer = bundled
    with pytest.raises(ValueError):
        ex.plan_batches([], 4)
    with pytest.raises(ValueError):
        ex.plan_batches([3, 0], 4)
    with pytest.raises(ValueError):
        ex.plan_batches([3, 2], 0)
    rng = random.Random(81)
    lengths = [rng.randint(1, 40) for _ in range(20)]
    prompts = random_prompts(rng, lengths)
    plan = ex.plan_batches(lengths, 6)
    check_plan(plan, lengths, 6)
    engine = s08.Engine(model, tokenizer, 256, max_batch_size=6)   # refuses a bigger batch
    padding, tokens = run_plan(engine, prompts, plan, max_tokens=3)
    single = s06.Engine(model, tokenizer, 256)
    greedy = s04.SamplingParams(temperature=0.0, max_tokens=3)
    want = [single.generate(p, greedy).token_ids for p in prompts]
    wrong = [i for i, (g, w) in enumerate(zip(tokens, want)) if g != w]
    assert not wrong, (f"plan {plan} of lengths {lengths}: requests {wrong} got "
                       f"{[tokens[i] for i in wrong]}, expected {[want[i] for i in wrong]} "
                       f"(each run alone)")
    fifo_padding, _ = run_plan(engine, prompts, fifo(20, 6))
    assert padding < fifo_padding, (f"padding: got {padding}, expected less than FIFO's "
                                    f"{fifo_padding}; plan {plan} of lengths {lengths}")
    # The chapter's two examples, measured by the engine: no padding at all (sorted chunks of 2
    # pad 5 on one of them, whichever end they are cut from). The third needs two short
    # batches, [10, 10], [6, 6], [3, 3, 3]: sorted chunks of 3 from either end pad 8, and the
    # best of sorted cuts with one short batch pads 4.
    for lengths, max_batch_size in (([10, 5, 5], 2), ([5, 10, 10], 2),
                                    ([10, 10, 6, 6, 3, 3, 3], 3)):
        plan = ex.plan_batches(lengths, max_batch_size)
        check_plan(plan, lengths, max_batch_size)
        got = run_plan(s08.Engine(model, tokenizer, 256, max_batch_size=max_batch_size),
                       random_prompts(rng, lengths), plan)[0]
        assert got == 0, (f"plan_batches({lengths}, {max_batch_size}) = {plan}: got padding "
                          f"{got}, expected 0")


@needs_model
@pytest.mark.points(1)
def test_plan_pads_as_little_as_any_split_can(bundled):
    model, tokenizer = bundled
    rng = random.Random(82)
    workloads = []
    for _ in range(30):
        n, max_batch_size = rng.randint(1, 8), rng.randint(1, 4)
        workloads.append(([rng.choice([1, 2, 3, 5, 8, 13, 21]) for _ in range(n)],
                          max_batch_size))
    workloads += [clustered_lengths(rng) for _ in range(12)]
    several_short = 0
    for lengths, max_batch_size in workloads:
        plan = ex.plan_batches(lengths, max_batch_size)
        check_plan(plan, lengths, max_batch_size)
        engine = s08.Engine(model, tokenizer, 256, max_batch_size=max_batch_size)
        padding, _ = run_plan(engine, random_prompts(rng, lengths), plan)
        want = least_padding_by_brute_force(lengths, max_batch_size)
        assert padding == want, (f"got padding {padding}, expected {want} (the least of any "
                                 f"split) from plan_batches({lengths}, {max_batch_size}) = {plan}")
        several_short += want < least_padding_with_one_short_batch(lengths, max_batch_size)
    assert several_short >= 5, several_short      # queues that need more than one short batch


@needs_model
@pytest.mark.points(1)
def test_plan_beats_fifo_and_sorted_chunks_on_a_longer_queue(bundled):
    model, tokenizer = bundled
    rng = random.Random(83)
    lengths = [rng.choice([4, 6, 9, 12, 30, 31, 60, 61, 62, 120]) for _ in range(48)]
    prompts = random_prompts(rng, lengths)
    engine = s08.Engine(model, tokenizer, 256, max_batch_size=8)
    plan = ex.plan_batches(lengths, 8)
    check_plan(plan, lengths, 8)
    padding, _ = run_plan(engine, prompts, plan)
    fifo_padding, _ = run_plan(engine, prompts, fifo(48, 8))
    by_length = sorted(range(48), key=lambda i: lengths[i])
    chunks = [by_length[i:i + 8] for i in range(0, 48, 8)]
    chunk_padding, _ = run_plan(engine, prompts, chunks)
    # Both baselines are valid plans with the same number of batches: the least padding can
    # be no more than either.
    assert padding <= chunk_padding < fifo_padding, (
        f"padding: got {padding}, expected at most sorted chunks' {chunk_padding} (FIFO "
        f"{fifo_padding}); plan_batches({lengths}, 8) = {plan}")


# Exercise 2 ----------------------------------------------------------------------------------

def simulate(prompt_lens, output_lens):
    """A static batch step by step: the prefill, then decode columns until the longest is done."""
    t_len, batch = max(prompt_lens), len(prompt_lens)
    made = [1] * batch                            # the prefill yields every row's first token
    counts = dict(slots=batch * t_len, useful=sum(prompt_lens),
                  padding=sum(t_len - n for n in prompt_lens), idle=0, decode_row_steps=0)
    while any(m < n for m, n in zip(made, output_lens)):
        for i in range(batch):
            counts["slots"] += 1
            counts["decode_row_steps"] += 1
            if made[i] < output_lens[i]:
                counts["useful"] += 1
                made[i] += 1
            else:
                counts["idle"] += 1
    counts["idle_row_steps"] = counts["idle"]
    return counts


@pytest.mark.points(1)
def test_waste_by_hand():
    assert ex.static_batch_waste([3, 1], [2, 4]) == dict(
        slots=12, useful=8, padding=2, idle=2, decode_row_steps=6, idle_row_steps=2)
    # One request: no padding, no idle row; 5 + 9 slots.
    assert ex.static_batch_waste([5], [10]) == dict(
        slots=14, useful=14, padding=0, idle=0, decode_row_steps=9, idle_row_steps=0)
    # Four prompts of 8 tokens, one runs 64 tokens, three stop after 1: 3 x 63 idle slots.
    assert ex.static_batch_waste([8] * 4, [64, 1, 1, 1])["idle"] == 189
    assert ex.ragged_slots([3, 1], [2, 4]) == 8
    assert ex.ragged_slots([8] * 4, [64, 1, 1, 1]) == 32 + 63
    for bad in (([], []), ([1, 2], [3]), ([0], [1]), ([1], [0])):
        with pytest.raises(ValueError):
            ex.static_batch_waste(*bad)


@pytest.mark.points(1)
def test_waste_matches_a_step_by_step_simulation():
    rng = random.Random(9)
    for _ in range(100):
        batch = rng.randint(1, 9)
        prompts = [rng.randint(1, 40) for _ in range(batch)]
        outputs = [rng.randint(1, 30) for _ in range(batch)]
        call = f"({prompts}, {outputs})"
        got, want = ex.static_batch_waste(prompts, outputs), simulate(prompts, outputs)
        assert got == want, f"{dict_diff(got, want)} from static_batch_waste{call}"
        ragged = ex.ragged_slots(prompts, outputs)
        assert ragged == want["useful"], \
            f"got {ragged}, expected {want['useful']} from ragged_slots{call}"


@needs_model
@pytest.mark.points(2)
def test_waste_matches_the_engine_on_real_batches():
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    engine = s08.Engine(model, tokenizer, 256)
    texts = ["ROMEO.\nBut soft, what light", "First Citizen.\nBefore we proceed",
             "KING.", "HAMLET.\nTo be, or not to be, that is the question:\nWhether",
             "To-morrow, and to-morrow,"]
    for max_tokens in ([40, 3, 17, 25, 8], [1, 1, 1, 1, 1], [60, 60, 2, 9, 33]):
        params = [s04.SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
        done = engine.generate(texts, params)
        stats = engine.last_batch
        prompts = [len(tokenizer.encode(t)) for t in texts]
        outputs = [len(c.token_ids) for c in done]
        got = ex.static_batch_waste(prompts, outputs)
        want = dict(slots=stats.slots, useful=stats.useful, padding=stats.padding_slots,
                    idle=stats.idle, decode_row_steps=stats.decode_row_steps,
                    idle_row_steps=stats.idle_row_steps)
        assert got == want, (f"{dict_diff(got, want)} (the engine's BatchStats) from "
                             f"static_batch_waste({prompts}, {outputs}), max_tokens {max_tokens}")


# Exercise 3 ----------------------------------------------------------------------------------

def alone(hf, prompts):
    with torch.inference_mode():
        return [int(hf(input_ids=torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]


@contextmanager
def watched(hf):
    """Record the input_ids of every call of the model (a forward pre-hook, PyTorch's public
    seam), so a test can see how the learner's code calls it."""
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(None if ids is None else ids.detach().clone())

    handle = hf.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def first_tokens_in_one_call(hf, prompts, pad_id):
    """The learner's first_tokens, held to one right-padded (B, T_max) forward call."""
    with watched(hf) as calls:
        got = ex.first_tokens(hf, prompts, pad_id)
    assert len(calls) == 1, f"first_tokens must make one batched call (made {len(calls)})"
    ids = calls[0]
    assert ids is not None and tuple(ids.shape) == (len(prompts), max(map(len, prompts))), \
        f"the one call must take input_ids (B, T_max) (got {None if ids is None else ids.shape})"
    for row, prompt in enumerate(prompts):       # right padding: each prompt starts its row
        assert ids[row, :len(prompt)].tolist() == list(prompt), f"row {row} is not right-padded"
    return got


@needs_model
@pytest.mark.points(1)
def test_first_tokens_on_the_bundled_model():
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(2047) for _ in range(n)] for n in (12, 3, 30, 1, 7, 30, 19)]
    expected = alone(hf, prompts)
    assert ex.buggy_first_tokens(hf, prompts, 2047) != expected    # the batch shows the bug
    assert first_tokens_in_one_call(hf, prompts, 2047) == expected


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.mark.points(1)
def test_first_tokens_on_gpt2_learned_positions():
    hf = tiny_gpt2()
    rng = random.Random(4)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (5, 40, 2, 17, 40, 9)]
    assert first_tokens_in_one_call(hf, prompts, 0) == alone(hf, prompts)


@pytest.mark.points(1)
def test_first_tokens_do_not_depend_on_pad_id_or_batch_mates():
    hf = tiny_gpt2()
    rng = random.Random(5)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (3, 11, 1, 25)]
    expected = alone(hf, prompts)
    lengths = [len(p) for p in prompts]
    for pad_id in (0, 7, 95):
        got = first_tokens_in_one_call(hf, prompts, pad_id)
        assert got == expected, (f"pad_id {pad_id}, prompt lengths {lengths}: got {got}, "
                                 f"expected {expected} (each prompt alone)")
    order = [2, 0, 3, 1]
    got = first_tokens_in_one_call(hf, [prompts[i] for i in order], 1)
    assert got == [expected[i] for i in order], (f"prompts reordered {order}: got {got}, "
                                                 f"expected {[expected[i] for i in order]}")
    got = first_tokens_in_one_call(hf, prompts[1:2], 1)
    assert got == expected[1:2], f"prompt 1 alone in a batch: got {got}, expected {expected[1:2]}"
