"""Graded tests for the S08 exercises (see exercises/s08_static_batching.py).

Oracles, none of them the solution: position ids counted by hand, and by a plain Python loop
over random masks; the positions S08's tested `BatchRunner` feeds in its decode steps; slot
counts worked by hand, a step-by-step simulation of a static batch written here, and the
`BatchStats` S08's tested `Engine` records on real batches of the bundled model (EOS on, mixed
max_tokens); and, for the right-padding exercise, Hugging Face transformers run on each prompt
alone (the bundled model and a tiny random GPT-2 with learned positions).
"""
import random

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


def loop_positions(mask: list[list[int]]) -> list[list[int]]:
    out = []
    for row in mask:
        seen, positions = 0, []
        for real in row:
            positions.append(seen if real else 0)
            seen += bool(real)
        out.append(positions)
    return out


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_position_ids_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)
    got = ex.position_ids(mask)
    assert got.dtype == torch.int64
    assert got.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])                  # 0/1 ints, right padding
    assert ex.position_ids(right).tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    with pytest.raises(ValueError):
        ex.position_ids(torch.ones(4, dtype=torch.bool))


@pytest.mark.points(1)
def test_position_ids_match_a_counting_loop_on_random_masks():
    rng = random.Random(8)
    for _ in range(50):
        batch, t_len = rng.randint(1, 6), rng.randint(1, 12)
        mask = [[rng.random() < 0.6 for _ in range(t_len)] for _ in range(batch)]
        got = ex.position_ids(torch.tensor(mask, dtype=torch.bool))
        assert got.tolist() == loop_positions(mask)


@needs_model
@pytest.mark.points(1)
def test_decode_positions_are_the_ones_the_batch_runner_feeds():
    assert ex.decode_position_ids(torch.tensor([[0, 0, 1], [1, 1, 1]], dtype=torch.bool),
                                  1).tolist() == [1, 3]
    with pytest.raises(ValueError):
        ex.decode_position_ids(torch.ones(2, 3, dtype=torch.bool), 0)
    model, _ = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16]]
    runner = s08.BatchRunner(model)
    runner.prefill(prompts, max_new_tokens=5)
    mask = torch.tensor([[0] * (6 - len(p)) + [1] * len(p) for p in prompts], dtype=torch.bool)
    for step in range(1, 5):
        runner.decode(torch.full((4,), 3, dtype=torch.int64))
        assert ex.decode_position_ids(mask, step).tolist() == runner.positions.tolist()
        assert runner.positions.tolist() == [len(p) - 1 + step for p in prompts]   # by hand


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
        got = ex.static_batch_waste(prompts, outputs)
        assert got == simulate(prompts, outputs)
        assert got["useful"] + got["padding"] + got["idle"] == got["slots"]
        assert ex.ragged_slots(prompts, outputs) == got["useful"]


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
        assert got == dict(slots=stats.slots, useful=stats.useful, padding=stats.padding_slots,
                           idle=stats.idle, decode_row_steps=stats.decode_row_steps,
                           idle_row_steps=stats.idle_row_steps)


# Exercise 3 ----------------------------------------------------------------------------------

def alone(hf, prompts):
    with torch.inference_mode():
        return [int(hf(input_ids=torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]


@needs_model
@pytest.mark.points(1)
def test_first_tokens_on_the_bundled_model():
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(2047) for _ in range(n)] for n in (12, 3, 30, 1, 7, 30, 19)]
    expected = alone(hf, prompts)
    assert ex.buggy_first_tokens(hf, prompts, 2047) != expected    # the batch shows the bug
    assert ex.first_tokens(hf, prompts, 2047) == expected


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
    assert ex.first_tokens(hf, prompts, 0) == alone(hf, prompts)


@pytest.mark.points(1)
def test_first_tokens_do_not_depend_on_pad_id_or_batch_mates():
    hf = tiny_gpt2()
    rng = random.Random(5)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (3, 11, 1, 25)]
    expected = alone(hf, prompts)
    for pad_id in (0, 7, 95):
        assert ex.first_tokens(hf, prompts, pad_id) == expected
    order = [2, 0, 3, 1]
    assert ex.first_tokens(hf, [prompts[i] for i in order], 1) == [expected[i] for i in order]
    assert ex.first_tokens(hf, prompts[1:2], 1) == expected[1:2]
