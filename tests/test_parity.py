"""The parity chain: every engine x prompt x model gives the same greedy tokens.

Invariant 1 of the course plan: greedy decoding of any engine equals the S01 loop on the same
model, token for token (float32, CPU). Invariant 2: models that exist in HF `transformers` match
its `generate(do_sample=False)`. Each chapter's own tests check its engine against its
neighbours; this module runs the whole chain in one place, so a change anywhere shows up here
with the first index where the ids differ and both decoded texts.

Engines: S01 loop (no cache), S04 (sampling engine, still no cache), S05 (NumPy KV cache),
S06 (PyTorch, manual and SDPA attention), S08 (a static batch of one), S09 (the
step-based engine, Part I's call as a loop over add_request / step), S10 (S09 driven by the
scheduler, at its smallest token budget), S11 (prompts chunked 8 tokens a step), S12 (blocks
of 4), S13 (prefix caching), S15 (S13's engine with n-gram speculative decoding, 3 drafts a
step), S17 (S13's engine with the paged C kernel as its attention), S18 (S13's engine with
the bundled model split over 2 ranks, handed over from memory: one executor per process, so
the bundled model only). Every engine is
driven through the same public call (S01's `generate(prompt, max_tokens)` and `stream`),
with no per-engine dispatch: that they can
all stand where the S01 engine stood is part of what is tested. Models: the tiny random GPT-2 / Qwen3 / Llama of
S03's tests and the bundled model.
"""
import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
import s08_static_batching as s08
import s09_continuous_batching as s09
import s10_scheduler as s10
import s11_chunked_prefill as s11
import s12_engine as s12
import s13_prefix_caching as s13
import s15_speculative as s15
import s17_attention as s17
import s18_tensor_parallel as s18
from model_testing import EOS_UNUSED, PAD, TINY, V, IdTokenizer, build_tiny
from s09_llm import LLM

MAX_CONTEXT = 96
NEW_TOKENS = 24


def first_difference(name: str, ours: list[int], reference: list[int], decode) -> str:
    """A failure message: the first index where the ids differ and both decoded texts."""
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                 min(len(ours), len(reference)))
    return (f"{name}: greedy ids differ from the S01 loop first at index {index}\n"
            f"  engine: {ours}\n  s01:    {reference}\n"
            f"  engine text: {decode(ours)!r}\n  s01 text:    {decode(reference)!r}")


def engines(model, torch_models, tokenizer, max_context):
    """Every engine of Part I on one model, by name. Only construction differs (each takes the
    model it runs: NumPy or torch); the call that follows is the same for all of them."""
    return {
        "s01": s01.Engine(model, tokenizer, max_context),
        "s04": s04.Engine(model, tokenizer, max_context),
        "s05": s05.Engine(model, tokenizer, max_context),
        **{name: s06.Engine(torch_model, tokenizer, max_context)
           for name, torch_model in torch_models.items()},
        **{f"s08_{name[4:]}": s08.Engine(torch_model, tokenizer, max_context)
           for name, torch_model in torch_models.items()},   # a static batch of one
        **{f"s09_{name[4:]}": LLM(s09.build_engine(torch_model, tokenizer,
                                                   max_context=max_context))
           for name, torch_model in torch_models.items()},   # add_request / step underneath
        **{f"s10_{name[4:]}": LLM(s10.build_engine(torch_model, tokenizer,
                                                   max_context=max_context,
                                                   max_num_batched_tokens=max_context))
           for name, torch_model in torch_models.items()},   # S09 with S10's scheduler
        **{f"s11_{name[4:]}": LLM(s11.build_engine(torch_model, tokenizer,
                                                   max_context=max_context, max_num_seqs=4,
                                                   max_num_batched_tokens=8))
           for name, torch_model in torch_models.items()},   # prompts chunked 8 tokens a step
        **{f"s12_{name[4:]}": LLM(s12.build_engine(torch_model, tokenizer,
                                                   max_context=max_context, max_num_seqs=4,
                                                   max_num_batched_tokens=8, block_size=4))
           for name, torch_model in torch_models.items()},   # KV in blocks of 4 tokens
        **{f"s13_{name[4:]}": LLM(s13.build_engine(torch_model, tokenizer,
                                                   max_context=max_context, max_num_seqs=4,
                                                   max_num_batched_tokens=8, block_size=4))
           for name, torch_model in torch_models.items()},   # full blocks shared by hash
        **{f"s15_{name[4:]}": LLM(s15.build_engine(torch_model, tokenizer,
                                                   max_context=max_context, max_num_seqs=4,
                                                   max_num_batched_tokens=8, block_size=4,
                                                   speculative="ngram",
                                                   num_speculative_tokens=3))
           for name, torch_model in torch_models.items()},   # n-gram drafts, 3 a step
        **{f"s17_{name[4:]}": LLM(s17.build_engine(torch_model, tokenizer,
                                                   attention_backend="paged",
                                                   max_context=max_context, max_num_seqs=4,
                                                   max_num_batched_tokens=8, block_size=4))
           for name, torch_model in torch_models.items()},   # the C kernel reads the blocks
    }


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


def check_same_call(name: str, all_engines: dict, prompt: str, max_tokens: int, decode) -> list[int]:
    """Run every engine through the same public call, S01's `generate(prompt, max_tokens)` and
    `stream(...)`; all must give the S01 loop's ids, and each stream must join to its result."""
    reference = all_engines["s01"].generate(prompt, max_tokens)
    for engine_name, engine in all_engines.items():
        got = engine.generate(prompt, max_tokens)
        assert got.token_ids == reference.token_ids, first_difference(
            f"{name} {engine_name}", got.token_ids, reference.token_ids, decode)
        assert (got.text, got.finish_reason, got.stop_reason) == (
            reference.text, reference.finish_reason, reference.stop_reason), engine_name
        stream = engine.stream(prompt, max_tokens)
        outputs = list(stream)
        assert [t for o in outputs for t in o.new_token_ids] == reference.token_ids, engine_name
        assert "".join(o.text_delta for o in outputs) == stream.result.text == reference.text
        assert outputs[-1].finished and outputs[-1].finish_reason == reference.finish_reason
    return reference.token_ids


@pytest.mark.slow
def test_every_engine_matches_the_s01_loop_and_hf_on_tiny_models(tiny_setup):
    name, hf, model, torch_models = tiny_setup
    tokenizer = IdTokenizer()
    all_engines = engines(model, torch_models, tokenizer, MAX_CONTEXT)
    for ids in tiny_prompts():
        prompt = " ".join(map(str, ids))
        budget = min(NEW_TOKENS, MAX_CONTEXT - len(ids))
        reference = check_same_call(f"{name} (prompt {len(ids)})", all_engines, prompt,
                                    NEW_TOKENS, tokenizer.decode)
        assert len(reference) == budget  # EOS_UNUSED never appears; budget or context stops
        hf_ids = hf_greedy(hf, ids, budget)
        assert reference == hf_ids, first_difference(f"{name} HF vs", hf_ids, reference,
                                                     tokenizer.decode)


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
def test_every_engine_matches_the_s01_loop_and_hf_on_the_bundled_model(request):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    model, tokenizer = s03_checkpoint.load()
    hf_tokenizer = Tokenizer.from_file(str(s03.BUNDLED_MODEL_DIR / "tokenizer.json"))
    torch_models = {
        f"s06_{impl}": s06.TorchTransformer.from_pretrained(s03.BUNDLED_MODEL_DIR,
                                                            torch.device("cpu"), torch.float32, impl)
        for impl in ("manual", "sdpa")}
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    max_context = model.config.max_position_embeddings
    all_engines = engines(model, torch_models, tokenizer, max_context)
    tp2 = s18.build_engine(torch_models["s06_manual"], tokenizer, tensor_parallel_size=2,
                           max_context=max_context, max_num_seqs=4, max_num_batched_tokens=8,
                           block_size=4)            # 2 ranks, each with half of every matrix
    request.addfinalizer(tp2.runner.shutdown)       # the engine owns its ranks
    all_engines["s18_tp2"] = LLM(tp2)
    for prompt in BUNDLED_PROMPTS:
        reference = check_same_call("bundled", all_engines, prompt, 30, tokenizer.decode)
        ids = tokenizer.encode(prompt)
        assert ids == hf_tokenizer.encode(prompt).ids      # HF gets the ids HF would make
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=30, do_sample=False, eos_token_id=tokenizer.eos_id,
                              pad_token_id=tokenizer.eos_id)
        hf_ids = out[0, len(ids):].tolist()
        assert hf_ids == reference, first_difference("HF", hf_ids, reference, tokenizer.decode)
