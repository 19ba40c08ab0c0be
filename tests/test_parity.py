"""The parity chain: every engine x prompt x model gives the same greedy tokens.

Invariant 1 of the course plan: greedy decoding of any engine equals the S01 loop on the same
model, token for token (float32, CPU). Invariant 2: models that exist in HF `transformers` match
its `generate(do_sample=False)`. Each chapter's own tests check its engine against its
neighbours; this module runs the whole chain in one place, so a change anywhere shows up here
with the first index where the ids differ and both decoded texts.

Engines: S01 loop (no cache), S04 (sampling engine, still no cache), S05 (NumPy KV cache),
S06 (PyTorch, manual and SDPA attention). Models: the tiny random GPT-2 / Qwen3 / Llama of
S03's tests and the bundled model.
"""
import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
from test_s03_transformer import EOS_UNUSED, PAD, TINY, V, IdTokenizer, build_tiny

MAX_CONTEXT = 96
NEW_TOKENS = 24


def first_difference(name: str, ours: list[int], reference: list[int], decode) -> str:
    """A failure message: the first index where the ids differ and both decoded texts."""
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                 min(len(ours), len(reference)))
    return (f"{name}: greedy ids differ from the S01 loop first at index {index}\n"
            f"  engine: {ours}\n  s01:    {reference}\n"
            f"  engine text: {decode(ours)!r}\n  s01 text:    {decode(reference)!r}")


ENGINES = ["s04", "s05", "s06_manual", "s06_sdpa"]


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_setup(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"parity_{request.param}")
    hf = build_tiny(request.param, directory)
    model = s03.Transformer.from_pretrained(directory)
    torch_models = {
        f"s06_{impl}": s06.TorchTransformer.from_pretrained(directory, torch.device("cpu"),
                                                            torch.float32, impl)
        for impl in ("manual", "sdpa")}
    return request.param, hf, model, torch_models


def tiny_prompts():
    rng = np.random.default_rng(2026)
    # 1 token, a short and a long prompt, and one that ends NEW_TOKENS short of the context,
    # so the context-full stop fires in the middle of generation.
    return [rng.integers(0, V, size=n).tolist() for n in (1, 7, 40, MAX_CONTEXT - 10)]


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=EOS_UNUSED, pad_token_id=PAD)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_every_engine_matches_the_s01_loop_and_hf_on_tiny_models(tiny_setup):
    name, hf, model, torch_models = tiny_setup
    tokenizer = IdTokenizer()
    for ids in tiny_prompts():
        prompt = " ".join(map(str, ids))
        budget = min(NEW_TOKENS, MAX_CONTEXT - len(ids))
        reference = s01.Engine(model, tokenizer, MAX_CONTEXT).generate(prompt, NEW_TOKENS).token_ids
        assert len(reference) == budget  # EOS_UNUSED never appears; budget or context stops
        hf_ids = hf_greedy(hf, ids, budget)
        assert reference == hf_ids, first_difference(f"{name} HF vs", hf_ids, reference,
                                                     tokenizer.decode)
        for engine in ENGINES:
            got = greedy_ids_for(engine, model, torch_models, tokenizer, prompt)
            assert got == reference, first_difference(f"{name} {engine} (prompt {len(ids)})",
                                                       got, reference, tokenizer.decode)


def greedy_ids_for(engine: str, model, torch_models, tokenizer, prompt: str) -> list[int]:
    params = s04.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    if engine == "s04":
        return s04.Engine(model, tokenizer, MAX_CONTEXT).generate(prompt, params).token_ids
    if engine == "s05":
        return s05.Engine(model, tokenizer, MAX_CONTEXT).generate(prompt, params).token_ids
    return s06.Engine(torch_models[engine], tokenizer, MAX_CONTEXT).generate(
        prompt, params).token_ids


bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model missing (scripts/train_bundled_model.py)")

BUNDLED_PROMPTS = [
    "Rom.\nBut soft! what light through yonder window breaks?",
    "Ham.\nTo be, or not to be, that is the question:",
    "First Citizen.\n",
    "O",
]


@bundled
@pytest.mark.slow
def test_every_engine_matches_the_s01_loop_and_hf_on_the_bundled_model():
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    model, tokenizer = s03.load()
    hf_tokenizer = Tokenizer.from_file(str(s03.BUNDLED_MODEL_DIR / "tokenizer.json"))
    torch_models = {
        f"s06_{impl}": s06.TorchTransformer.from_pretrained(s03.BUNDLED_MODEL_DIR,
                                                            torch.device("cpu"), torch.float32, impl)
        for impl in ("manual", "sdpa")}
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    max_context = model.config.max_position_embeddings
    for prompt in BUNDLED_PROMPTS:
        reference = s01.Engine(model, tokenizer, max_context).generate(prompt, 30).token_ids
        ids = tokenizer.encode(prompt)
        assert ids == hf_tokenizer.encode(prompt).ids      # HF gets the ids HF would make
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=30, do_sample=False, eos_token_id=tokenizer.eos_id,
                              pad_token_id=tokenizer.eos_id)
        hf_ids = out[0, len(ids):].tolist()
        assert hf_ids == reference, first_difference("HF", hf_ids, reference, tokenizer.decode)
        params = s04.SamplingParams(temperature=0.0, max_tokens=30)
        for engine in ENGINES:
            if engine == "s04":
                got = s04.Engine(model, tokenizer, max_context).generate(prompt, params).token_ids
            elif engine == "s05":
                got = s05.Engine(model, tokenizer, max_context).generate(prompt, params).token_ids
            else:
                got = s06.Engine(torch_models[engine], tokenizer, max_context).generate(
                    prompt, params).token_ids
            assert got == reference, first_difference(engine, got, reference, tokenizer.decode)
