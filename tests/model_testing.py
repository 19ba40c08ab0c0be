"""Tiny random Hugging Face models and the tokenizer the tests drive them with.

Shared by the tests that run a model with random weights (S03 on, the parity module): the
tiny random GPT-2, Qwen3 and Llama models (`TINY`, `build_tiny`: built from configs and saved
in a temporary directory, no download), the `IdTokenizer` whose prompts are token ids written
as text, and the two HF oracles on them (`hf_logits`, `hf_greedy`). Not a test module: test
modules import from here, never from each other.
"""
import numpy as np
import torch
from transformers import (
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

V = 97          # a vocabulary size no real tokenizer has, so nothing matches by accident
EOS_UNUSED = 0  # an EOS id that the random models below do not produce in 40 greedy tokens
PAD = 1

# name -> (HF model class, config). Between them: learned positions and fused QKV (gpt2),
# GQA 4:2 with head_dim != hidden/heads, tied head, qk-norm, theta 1e6 (qwen3_gqa_tied), no GQA,
# untied head, theta 1e4 (qwen3_mha_untied), GQA 8:2 with biases and Llama 3 rope scaling
# (llama_gqa_rope_scaling), plain Llama with linear scaling and a tied head (llama_linear_tied).
TINY = {
    "gpt2": (GPT2LMHeadModel, lambda: GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=96,
        bos_token_id=EOS_UNUSED, eos_token_id=EOS_UNUSED, pad_token_id=PAD)),
    "qwen3_gqa_tied": (Qwen3ForCausalLM, lambda: Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, intermediate_size=96, vocab_size=V, max_position_embeddings=96,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        eos_token_id=EOS_UNUSED, pad_token_id=PAD)),
    "qwen3_mha_untied": (Qwen3ForCausalLM, lambda: Qwen3Config(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
        head_dim=16, intermediate_size=80, vocab_size=V, max_position_embeddings=96,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        eos_token_id=EOS_UNUSED, pad_token_id=PAD)),
    "llama_gqa_rope_scaling": (LlamaForCausalLM, lambda: LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=96, vocab_size=V, max_position_embeddings=96, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
        bos_token_id=PAD, eos_token_id=EOS_UNUSED, pad_token_id=PAD)),
    "llama_linear_tied": (LlamaForCausalLM, lambda: LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, vocab_size=V, max_position_embeddings=96, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 2e4, "factor": 2.0},
        bos_token_id=PAD, eos_token_id=EOS_UNUSED, pad_token_id=PAD)),
}


def build_tiny(name: str, directory) -> torch.nn.Module:
    """A random HF model, every parameter (norm weights included, so a norm applied in the
    wrong place shows) drawn from N(0, 0.3^2) so logits are spread and greedy is decisive."""
    cls, make_config = TINY[name]
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(sorted(TINY).index(name))
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return model


class IdTokenizer:
    """Prompts are token ids written as text ("5 17 3"): the tiny models have no tokenizer.
    vocab_size is the tiny models' V (S02's engine and its heirs check that the tokenizer
    covers every id the model can produce)."""

    eos_id = EOS_UNUSED
    vocab_size = V

    def __init__(self, eos_id: int = EOS_UNUSED):
        self.eos_id = eos_id

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def hf_logits(model, ids) -> np.ndarray:
    """HF's logits at every position of ids, from one forward pass: (len(ids), vocab)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model, ids, max_new_tokens, eos_id) -> list[int]:
    """HF `generate(do_sample=False)` on ids alone: the new token ids, stopping after eos_id."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=PAD)
    return out[0, len(ids):].tolist()


def first_difference(a, b) -> str:
    """A failure message: the first index where id lists a (ours) and b (the oracle) differ."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at index {i}: {x} != {y}\nours: {a}\nHF:   {b}"
    return f"lengths differ: {len(a)} != {len(b)}\nours: {a}\nHF:   {b}"
