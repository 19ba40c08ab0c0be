"""Tests for chapter S03: the NumPy transformer against Hugging Face transformers.

Oracles: HF `transformers` (logits of GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM in
float32 with eager attention, and `generate(do_sample=False)` token ids), the `safetensors`
package (tensor reading), torch's FlopCounterMode (FLOPs of an HF decode step), sums of HF
parameter sizes (parameter count), and closed-form values worked out by hand.
Tiny random models (tests/model_testing.py) are built from configs and saved in a temporary
directory: no download.
"""
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from model_testing import (
    EOS_UNUSED, PAD, TINY, V, IdTokenizer, build_tiny, first_difference, hf_greedy, hf_logits,
)
from s01_generation_loop import Engine
from s03_checkpoint import (
    CheckpointError, CheckpointTokenizer, MissingTensorError, UnsupportedArchitectureError,
    bfloat16_to_float32, config_from_hf_dict, load, load_config, load_state_dict,
    read_safetensors, resolve_checkpoint,
)
from s03_transformer import (
    BUNDLED_MODEL_DIR, Transformer, TransformerConfig, apply_rope, attention, bytes_per_token,
    cost_breakdown, flops_per_token, format_cost_table, layer_breakdown, main, parameter_count,
    rms_norm, rope, rope_inv_freq,
)

N_GENERATE = 36


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    """(name, HF model, checkpoint directory)."""
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, build_tiny(request.param, directory), directory


# --- the two oracle assertions on tiny random models ----------------------------------------

def test_logits_match_transformers_at_every_position(tiny):
    name, hf, directory = tiny
    ours = Transformer.from_pretrained(directory)
    ids = np.random.default_rng(0).integers(0, V, size=90).tolist()
    ref = hf_logits(hf, ids)
    got = ours.forward(ids)
    assert got.dtype == np.float32 and got.shape == (90, V)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5, err_msg=name)


def test_greedy_tokens_through_s01_loop_match_hf_generate(tiny):
    name, hf, directory = tiny
    ours = Transformer.from_pretrained(directory)
    prompt = [5, 17, 42, 8, 63]
    expected = hf_greedy(hf, prompt, N_GENERATE, eos_id=EOS_UNUSED)
    assert len(expected) == N_GENERATE  # EOS_UNUSED is not produced: all 36 tokens compared
    engine = Engine(ours, IdTokenizer(), max_context=ours.config.max_position_embeddings)
    result = engine.generate(" ".join(map(str, prompt)), max_tokens=N_GENERATE)
    assert result.token_ids == expected, first_difference(result.token_ids, expected)
    assert result.finish_reason == "length"


def test_eos_stop_matches_hf_generate(tiny):
    """With EOS set to a token greedy decoding does produce, both stop right after it."""
    name, hf, directory = tiny
    ours = Transformer.from_pretrained(directory)
    prompt = [5, 17, 42, 8, 63]
    free_run = hf_greedy(hf, prompt, N_GENERATE, eos_id=EOS_UNUSED)
    eos = next(t for t in free_run[3:] if t not in (PAD, EOS_UNUSED))  # a token produced later on
    expected = hf_greedy(hf, prompt, N_GENERATE, eos_id=eos)
    assert expected[-1] == eos and len(expected) < N_GENERATE
    result = Engine(ours, IdTokenizer(eos), max_context=96).generate(
        " ".join(map(str, prompt)), max_tokens=N_GENERATE)
    assert result.token_ids == expected, first_difference(result.token_ids, expected)
    assert result.finish_reason == "stop"


# --- size and cost from the config ----------------------------------------------------------

def test_parameter_count_matches_sum_of_hf_tensor_sizes(tiny):
    name, hf, directory = tiny
    config = load_config(directory)
    # model.parameters() yields a tied embedding / head matrix once.
    assert parameter_count(config) == sum(p.numel() for p in hf.parameters()), name


@pytest.mark.parametrize("context_len", [1, 7, 40])
def test_flops_per_token_match_torch_flop_counter_on_an_hf_decode_step(tiny, context_len):
    """FlopCounterMode counts 2*M*N*K for every matmul HF runs in one decode step: one new
    token after context_len - 1 cached ones, so its query meets exactly context_len keys."""
    from torch.utils.flop_counter import FlopCounterMode

    name, hf, directory = tiny
    config = load_config(directory)
    ids = torch.arange(2, 2 + context_len).unsqueeze(0) % V
    with torch.no_grad():
        cache = hf(ids[:, :-1], use_cache=True).cache if context_len > 1 else None
        counter = FlopCounterMode(display=False)
        with counter:
            hf(ids[:, -1:], cache=cache, use_cache=True)
    assert flops_per_token(config, context_len) == counter.get_total_flops(), name


def test_bytes_per_token_from_hf_parameter_sizes(tiny):
    """Weights read once (the embedding table only one row; a tied head still reads the whole
    table), plus K and V for every layer and position, in float32 and in bf16."""
    name, hf, directory = tiny
    config = load_config(directory)
    params = sum(p.numel() for p in hf.parameters())
    c, v = config.hidden_size, config.vocab_size
    tables = v * c
    if name == "gpt2":
        tables += config.max_position_embeddings * c  # learned positions: one row read
        lookups = 2 * c
    else:
        lookups = c
    head_again = v * c if config.tie_word_embeddings else 0
    kv_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    for dtype_bytes in (4, 2):
        weights = (params - tables + lookups + head_again) * dtype_bytes
        assert bytes_per_token(config, 33, dtype_bytes) == weights + 33 * kv_per_position * dtype_bytes


def test_cost_breakdown_closed_form_by_hand():
    """A Llama-shaped config small enough to count on paper.
    C=8, I=16, V=10, L=1, H=2, Hkv=1, D=4, untied head.
    embedding 10*8 = 80; layer: q 8*8=64, k 8*4=32, v 32, o 64, mlp 3*8*16=384, norms 2*8=16
    -> 592; final norm 8; head 80; total 760.
    FLOPs at S=5: projections 2*192=384, attention 2*2*(2*4)*5=160, mlp 2*384=768 -> 1312;
    head 2*8*10=160; total 1472."""
    config = TransformerConfig(model_type="llama", vocab_size=10, hidden_size=8,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=4, intermediate_size=16, max_position_embeddings=32,
                               norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e4)
    rows = {r.part: r for r in cost_breakdown(config, context_len=5)}
    assert [r for r in rows] == ["embedding", "layer 0", "final norm", "lm head"]
    inside = [(r.params, r.flops) for r in layer_breakdown(config, context_len=5)]
    assert inside == [(192, 384), (0, 160), (384, 768), (16, 0)]
    assert (rows["layer 0"].params, rows["layer 0"].flops) == (592, 1312)
    assert parameter_count(config) == 760
    assert flops_per_token(config, 5) == 1472
    # bytes (float32): embedding row 8*4=32; layer 592*4 + K,V of 4 cached positions read and
    # 1 written: 2*4*5*4 = 160 -> 2528; final norm 32; head 80*4 = 320; total 2912.
    assert bytes_per_token(config, 5) == 2912
    table = format_cost_table(config, 5)
    assert "layer 0" in table and "1,472" in table


def test_cost_breakdown_rejects_bad_arguments():
    config = TransformerConfig(model_type="llama", vocab_size=10, hidden_size=8,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=4, intermediate_size=16, max_position_embeddings=32,
                               norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e4)
    with pytest.raises(ValueError, match="context_len must be >= 1"):
        cost_breakdown(config, context_len=0)
    with pytest.raises(ValueError, match="dtype_bytes must be >= 1"):
        bytes_per_token(config, 4, dtype_bytes=0)


# --- the building blocks against closed forms -----------------------------------------------

def test_rms_norm_by_hand():
    x = np.array([[3.0, 4.0]], dtype=np.float32)  # mean square 12.5
    w = np.array([1.0, 2.0], dtype=np.float32)
    expected = np.array([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]], dtype=np.float32)
    np.testing.assert_allclose(rms_norm(x, w, eps=0.0), expected, rtol=1e-6)


def test_rope_rotates_pairs_by_position_times_frequency():
    # D=4, theta=100: inv_freq = [1, 100^(-1/2)] = [1, 0.1]. Position 2 rotates pair (x0, x2)
    # by 2 rad and pair (x1, x3) by 0.2 rad.
    inv_freq = rope_inv_freq(4, 100.0)
    np.testing.assert_allclose(inv_freq, [1.0, 0.1], rtol=1e-6)
    cos, sin = rope([2], inv_freq)
    x = np.array([[[1.0, 0.0, 0.0, 1.0]]], dtype=np.float32)  # (H=1, T=1, D=4)
    got = apply_rope(x, cos, sin)[0, 0]
    # (x0, x2) = (1, 0) -> (cos 2, sin 2); (x1, x3) = (0, 1) -> (-sin 0.2, cos 0.2)
    expected = [math.cos(2), -math.sin(0.2), math.sin(2), math.cos(0.2)]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_rope_scores_depend_only_on_distance():
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(1, 1, 8)).astype(np.float32), rng.normal(size=(1, 1, 8)).astype(np.float32)
    inv_freq = rope_inv_freq(8, 10000.0)

    def score(pq, pk):
        return float(apply_rope(q, *rope([pq], inv_freq))[0, 0] @ apply_rope(k, *rope([pk], inv_freq))[0, 0])

    assert score(7, 3) == pytest.approx(score(24, 20), rel=1e-5)


def test_attention_gqa_head_sharing_and_causal_mask_by_hand():
    """H=2 query heads share Hkv=1 key/value head. With all-zero queries the weights are
    uniform over the visible keys, so query t outputs the mean of values 0..t."""
    q = np.zeros((2, 3, 2), dtype=np.float32)
    k = np.ones((1, 3, 2), dtype=np.float32)
    v = np.array([[[0.0, 3.0], [6.0, 3.0], [3.0, 0.0]]], dtype=np.float32)
    pos = np.arange(3)
    out = attention(q, k, v, pos, pos)
    expected = np.array([[0.0, 3.0], [3.0, 3.0], [3.0, 2.0]], dtype=np.float32)
    for head in range(2):
        np.testing.assert_allclose(out[head], expected, rtol=1e-6)
    # A decode step: one query at position 2 against all three keys gives row 2.
    np.testing.assert_allclose(attention(q[:, 2:], k, v, pos[2:], pos)[0], expected[2:], rtol=1e-6)


def test_attention_rejects_bad_head_counts_and_empty_rows():
    q = np.zeros((3, 1, 2), dtype=np.float32)
    kv = np.zeros((2, 1, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="must be a multiple of key/value heads"):
        attention(q, kv, kv, np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="at least one key at or before its position"):
        attention(q[:2], kv, kv, np.array([0]), np.array([1]))


# --- reading checkpoints --------------------------------------------------------------------

def test_read_safetensors_matches_the_safetensors_package(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.float16),
               "c": torch.randn(2, 2, 2).to(torch.bfloat16), "i": torch.arange(6).reshape(2, 3)}
    save_torch(tensors, str(tmp_path / "t.safetensors"))
    got = read_safetensors(tmp_path / "t.safetensors")
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        expected = t.float().numpy() if t.is_floating_point() else t.numpy()
        assert got[name].dtype == expected.dtype
        np.testing.assert_array_equal(got[name], expected)  # bf16/f16 -> f32 widening is exact


def test_bfloat16_bits_by_hand():
    # 0x3F80 is 1.0, 0xC000 is -2.0, 0x3EAA is 0.33203125 (0x3EAA0000 as a float32).
    raw = np.array([0x3F80, 0xC000, 0x3EAA], dtype=np.uint16)
    np.testing.assert_array_equal(bfloat16_to_float32(raw), [1.0, -2.0, 0.33203125])


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf = build_tiny("qwen3_gqa_tied", tmp_path / "sharded")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    (tmp_path / "sharded" / "model.safetensors").unlink(missing_ok=True)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_allclose(Transformer.from_pretrained(tmp_path / "sharded").forward(ids),
                               hf_logits(hf, ids), rtol=1e-4, atol=2e-5)


def test_original_gpt2_tensor_names_without_prefix_load(tmp_path):
    """The hub's openai-community/gpt2 names tensors "h.0.ln_1.weight" and stores the causal
    mask as "h.0.attn.bias"; both are handled."""
    hf = build_tiny("gpt2", tmp_path / "g")
    tensors = load_state_dict(tmp_path / "g")
    renamed = {k.removeprefix("transformer."): t for k, t in tensors.items()}
    renamed["h.0.attn.bias"] = np.tril(np.ones((96, 96), dtype=np.float32))[None, None]
    (tmp_path / "g" / "model.safetensors").unlink()
    save_numpy(renamed, str(tmp_path / "g" / "model.safetensors"))
    ids = [3, 1, 4, 1, 5]
    np.testing.assert_allclose(Transformer.from_pretrained(tmp_path / "g").forward(ids),
                               hf_logits(hf, ids), rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_errors")
    build_tiny("qwen3_gqa_tied", directory)
    return directory


@pytest.fixture(scope="module")
def qwen3_model(qwen3_dir):
    return Transformer.from_pretrained(qwen3_dir)


def copy_with(qwen3_dir, tmp_path, config_changes=None, drop_tensor=None):
    target = tmp_path / "ckpt"
    shutil.copytree(qwen3_dir, target)
    if config_changes:
        cfg = json.loads((target / "config.json").read_text())
        cfg.update(config_changes)
        (target / "config.json").write_text(json.dumps(cfg))
    if drop_tensor:
        tensors = read_safetensors(target / "model.safetensors")
        del tensors[drop_tensor]
        save_numpy(tensors, str(target / "model.safetensors"))
    return target


def test_unknown_architecture_is_a_clear_error(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path, {"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    with pytest.raises(UnsupportedArchitectureError, match=r"model_type 'mamba'.*implements gpt2, llama, qwen3"):
        Transformer.from_pretrained(target)


def test_unsupported_features_are_clear_errors(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path, {"use_sliding_window": True,
                                             "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window attention is not supported"):
        Transformer.from_pretrained(target)
    with pytest.raises(UnsupportedArchitectureError, match="rope_type 'yarn' is not supported"):
        config_from_hf_dict({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedArchitectureError, match="activation_function 'relu'"):
        config_from_hf_dict({"model_type": "gpt2", "activation_function": "relu"})


def test_missing_tensor_is_named(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path, drop_tensor="model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(MissingTensorError, match=r"missing 1 tensor\(s\).*model\.layers\.1\.self_attn\.k_norm\.weight"):
        Transformer.from_pretrained(target)


def test_untied_config_without_lm_head_is_missing_tensor(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path, {"tie_word_embeddings": False})
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        Transformer.from_pretrained(target)


def test_wrong_shape_is_named(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path, {"num_key_value_heads": 4})
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \[48, 64\], the config implies \[96, 64\]"):
        Transformer.from_pretrained(target)


def test_unexpected_tensor_is_an_error(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path)
    tensors = read_safetensors(target / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(96, dtype=np.float32)
    save_numpy(tensors, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not account for: model.layers.0.self_attn.q_proj.bias"):
        Transformer.from_pretrained(target)


def test_missing_files_are_clear_errors(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path)
    (target / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        Transformer.from_pretrained(target)
    (target / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        Transformer.from_pretrained(target)
    with pytest.raises(CheckpointError, match="is a file; pass the checkpoint's directory"):
        Transformer.from_pretrained(qwen3_dir / "config.json")


def test_hub_id_that_cannot_be_fetched_is_a_clear_error():
    # Offline here; online, the id does not exist. Either way the hub refuses.
    with pytest.raises(CheckpointError, match="is not a local directory and could not be fetched"):
        Transformer.from_pretrained("llm-inference-course/no-such-model-xyz")


@pytest.mark.parametrize("name_or_path", [
    "./no-such-checkpoint", "../no-such-checkpoint", "/no/such/checkpoint", "~/no-such-checkpoint",
    "checkpoints/qwen3/step-100", "checkpoints\\qwen3", "no-such-checkpoint/",
])
def test_a_local_path_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, monkeypatch,
                                                                  name_or_path):
    """A name a hub id ("name" or "namespace/name") can never be is a mistyped path: "no such
    directory", and the hub is not asked (its download function would fail the test)."""
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="^no such directory: " + re.escape(name_or_path)):
        resolve_checkpoint(name_or_path)
    with pytest.raises(CheckpointError, match="^no such directory: "):
        Transformer.from_pretrained(name_or_path)
    with pytest.raises(CheckpointError, match="^no such directory: "):
        load(tmp_path / "no-such-checkpoint")  # a Path object is always a path


def test_home_and_hub_ids_still_resolve(tmp_path, monkeypatch, qwen3_dir):
    """"~" is the home directory; "namespace/name" with no such local folder goes to the hub."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kwargs: asked.append(repo_id) or str(qwen3_dir))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(qwen3_dir, tmp_path / "ckpt")
    assert resolve_checkpoint("~/ckpt") == tmp_path / "ckpt" and asked == []
    assert resolve_checkpoint("Qwen/Qwen3-0.6B") == qwen3_dir and asked == ["Qwen/Qwen3-0.6B"]


def test_main_reports_a_missing_local_directory_as_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "./no-such-checkpoint", "--max-tokens", "2"])
    assert exit_info.value.code == 2
    assert "error: no such directory: ./no-such-checkpoint" in capsys.readouterr().err


def test_inconsistent_config_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of num_key_value_heads \(4\)"):
        TransformerConfig(model_type="llama", vocab_size=10, hidden_size=24, num_hidden_layers=1,
                          num_attention_heads=6, num_key_value_heads=4, head_dim=4,
                          intermediate_size=16, max_position_embeddings=32, norm_eps=1e-6,
                          tie_word_embeddings=True, rope_theta=1e4)


def test_forward_rejects_bad_input(qwen3_dir):
    model = Transformer.from_pretrained(qwen3_dir)
    with pytest.raises(ValueError, match="non-empty 1-D sequence"):
        model.forward([])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        model.forward([3, 97])
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_position_embeddings=96\)"):
        model.forward([3, 4], positions=[95, 96])
    with pytest.raises(ValueError, match="one entry per token"):
        model.forward([3, 4], positions=[0])


def test_forward_refuses_more_tokens_than_the_context_window(tiny):
    """Without explicit positions token t sits at position t: max_position_embeddings (96
    here) tokens run, one more is refused by name, for RoPE models (which would otherwise
    rotate past their trained window) and GPT-2 (which has no position row for it)."""
    name, hf, directory = tiny
    model = Transformer.from_pretrained(directory)
    limit = model.config.max_position_embeddings
    assert limit == hf.config.max_position_embeddings == 96
    ids = [i % V for i in range(limit + 1)]
    np.testing.assert_allclose(model.forward(ids[:limit])[-1], hf_logits(hf, ids[:limit])[-1],
                               rtol=1e-4, atol=2e-5, err_msg=name)
    with pytest.raises(ValueError, match=r"97 tokens do not fit the context window: .* must lie "
                                         r"in \[0, max_position_embeddings=96\)"):
        model.forward(ids)
    with pytest.raises(ValueError, match=r"max_position_embeddings=96"):
        model.check_positions(np.array(ids), None)


def test_explicit_positions_give_the_rows_of_a_longer_pass(qwen3_dir):
    """Blocks split as qkv -> attention -> finish: feeding the last token alone with the cached
    K/V of the earlier ones (what S05 will do) reproduces the last row of the full pass."""
    model = Transformer.from_pretrained(qwen3_dir)
    ids = [7, 3, 9, 11, 2, 5]
    full = model.forward(ids)
    pos = np.arange(len(ids))
    x_all = model.embed(np.array(ids), pos)
    x_last = x_all[-1:]
    for block in model.blocks:
        q_all, k_all, v_all = block.qkv(x_all, pos)
        q, k, v = block.qkv(x_last, pos[-1:])
        np.testing.assert_allclose(k, k_all[:, -1:], rtol=1e-5, atol=1e-6)
        k_cat = np.concatenate([k_all[:, :-1], k], axis=1)
        v_cat = np.concatenate([v_all[:, :-1], v], axis=1)
        x_last = block.finish(x_last, attention(q, k_cat, v_cat, pos[-1:], pos, block.attention_scale()))
        x_all = block.forward(x_all, pos)
    np.testing.assert_allclose(model.head(x_last)[0], full[-1], rtol=1e-4, atol=2e-5)


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.integers(0, V - 1), min_size=2, max_size=40), data=st.data())
def test_causality_a_prefix_gets_the_same_logits(qwen3_model, ids, data):
    """Row t depends only on tokens 0..t: the rows of a prefix pass equal the first rows of
    the full pass. (The property that lets S05 cache keys and values.)"""
    model = qwen3_model
    k = data.draw(st.integers(1, len(ids) - 1))
    np.testing.assert_allclose(model.forward(ids[:k]), model.forward(ids)[:k], rtol=1e-5, atol=1e-5)


# --- the bundled model ----------------------------------------------------------------------

bundled = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet (scripts/train_bundled_model.py)")


@pytest.fixture(scope="module")
def bundled_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)


@bundled
def test_bundled_model_logits_match_transformers(bundled_hf):
    hf, hf_tok = bundled_hf
    model, tokenizer = load(BUNDLED_MODEL_DIR)
    text = "Romeo.\nBut soft! what light through yonder window breaks?"
    ids = tokenizer.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    np.testing.assert_allclose(model.forward(ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


@bundled
@pytest.mark.parametrize("prompt, finish_reason", [
    ("Shall I compare thee to a summer's day?\n", "length"),  # greedy runs all 40 tokens
    ("Romeo.\n", "stop"),                                     # a short speech, then EOS
])
def test_bundled_model_greedy_matches_hf_generate(bundled_hf, prompt, finish_reason):
    hf, hf_tok = bundled_hf
    model, tokenizer = load(BUNDLED_MODEL_DIR)
    ids = tokenizer.encode(prompt)
    assert ids == hf_tok(prompt)["input_ids"]          # the tokenizer under test, against HF's
    eos = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_id == eos == hf.generation_config.eos_token_id == hf.config.eos_token_id
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    expected = out[0, len(ids):].tolist()
    result = Engine(model, tokenizer, max_context=model.config.max_position_embeddings).generate(prompt, 40)
    assert result.token_ids == expected, first_difference(result.token_ids, expected)
    assert result.finish_reason == finish_reason
    assert len(expected) == 40 if finish_reason == "length" else expected[-1] == eos
    assert result.text == hf_tok.decode(expected, skip_special_tokens=True)


def hf_load_messages(directory, caplog) -> list[str]:
    """Python warnings and transformers log records (WARNING and above) seen while
    AutoModelForCausalLM and AutoTokenizer load `directory`."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    caplog.clear()
    hf_logging.enable_propagation()
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
            warnings.simplefilter("always")
            AutoModelForCausalLM.from_pretrained(directory)
            AutoTokenizer.from_pretrained(directory)
    finally:
        hf_logging.disable_propagation()
    return [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records
                                               if r.levelno >= 30]


@bundled
def test_bundled_model_loads_in_transformers_without_config_warnings(caplog, tmp_path):
    assert hf_load_messages(BUNDLED_MODEL_DIR, caplog) == []
    # The check can fail: an EOS id outside the vocabulary is a config warning it catches.
    broken = tmp_path / "broken"
    shutil.copytree(BUNDLED_MODEL_DIR, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["eos_token_id"] = cfg["vocab_size"] + 5
    (broken / "config.json").write_text(json.dumps(cfg))
    assert any("eos_token_id" in m for m in hf_load_messages(broken, caplog))


@bundled
def test_main_prints_completion_and_breakdown(capsys):
    main(["--prompt", "Romeo.\n", "--max-tokens", "8"])
    out = capsys.readouterr().out
    assert "--- completion ---" in out and "layer 0" in out and "lm head" in out
    assert "inside one layer" in out and "mlp" in out


# --- broken checkpoints: every problem is a CheckpointError naming the file and the rule ----

def write_safetensors(path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand: 8-byte little-endian header length, JSON, data."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def two_tensor_file(tmp_path):
    """A valid file from the `safetensors` package ("a": F32 (2, 3), "b": F32 (4,)), with its
    header and data section split apart for editing."""
    path = tmp_path / "ok.safetensors"
    save_numpy({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                "b": np.ones(4, dtype=np.float32)}, str(path))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw, json.loads(raw[8:8 + n]), raw[8 + n:]


def edited(header, name, **changes):
    header = json.loads(json.dumps(header))
    header[name].update(changes)
    return header


@pytest.mark.parametrize("case, match", [
    ("empty", r"too short to be a safetensors file \(0 bytes"),
    ("not_utf8", "the header is not UTF-8 text"),
    ("not_json", "the header is not valid JSON"),
    ("list", "the header must be a JSON object mapping tensor names to entries, found a JSON array"),
    ("no_dtype", "tensor 'a': its header entry has no 'dtype'"),
    ("negative_offsets", r"tensor 'a' has data_offsets \[-24, 0\]: they must be two integers"),
    ("negative_shape", r"tensor 'a' has shape \[-2, -3\]: a shape must be a list of integers >= 0"),
    ("span", r"data_offsets \[0, 24\] span 24 bytes, but F32 \[2, 2\] takes 16 bytes"),
    ("overlap", "tensor 'b' starts at data byte 8, but the tensor before it ends at byte 24"),
    ("trailing", "4 bytes after the last tensor belong to no tensor"),
])
def test_broken_safetensors_files_are_named_errors(tmp_path, case, match):
    """Each file is also refused by the `safetensors` package itself (the oracle that the file
    is really broken); ours says which rule it breaks."""
    from safetensors.numpy import load_file
    raw, header, data = two_tensor_file(tmp_path)
    path = tmp_path / "broken.safetensors"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "not_utf8":
        path.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{}" + data)
    elif case == "not_json":
        path.write_bytes((4).to_bytes(8, "little") + b"{bad" + data)
    elif case == "list":
        path.write_bytes((2).to_bytes(8, "little") + b"[]")
    elif case == "no_dtype":
        header = json.loads(json.dumps(header))
        del header["a"]["dtype"]
        write_safetensors(path, header, data)
    elif case == "negative_offsets":
        write_safetensors(path, edited(header, "a", data_offsets=[-24, 0]), data)
    elif case == "negative_shape":
        write_safetensors(path, edited(header, "a", shape=[-2, -3]), data)
    elif case == "span":
        write_safetensors(path, edited(header, "a", shape=[2, 2]), data)
    elif case == "overlap":
        write_safetensors(path, edited(header, "b", data_offsets=[8, 24]), data)
    elif case == "trailing":
        write_safetensors(path, header, data + b"\0" * 4)
    with pytest.raises(Exception):
        load_file(str(path))
    with pytest.raises(CheckpointError, match=match) as err:
        read_safetensors(path)
    assert str(path) in str(err.value)


def test_truncated_safetensors_message_states_both_sizes(tmp_path):
    """The message gives the real size on disk and the size the header needs (the original
    file's length, known from the safetensors package that wrote it)."""
    raw, _, _ = two_tensor_file(tmp_path)
    path = tmp_path / "cut.safetensors"
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match=rf"the file is truncated: it has {len(raw) - 10} "
                                              rf"bytes, but its header places tensor data up to "
                                              rf"byte {len(raw)}$"):
        read_safetensors(path)


def test_integer_tensor_is_not_reinterpreted_as_weights(qwen3_dir, tmp_path):
    """An I32 tensor where a weight should be (same byte count as F32) is refused, naming
    the tensor and the dtype, instead of being cast to garbage floats."""
    target = copy_with(qwen3_dir, tmp_path)
    tensors = read_safetensors(target / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].view(np.int32)
    save_numpy(tensors, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight has dtype int32: model "
                                              "weights must be floating point"):
        Transformer.from_pretrained(target)


def test_broken_index_files_are_named_errors(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path)
    (target / "model.safetensors").rename(target / "shard-1.safetensors")
    index = target / "model.safetensors.index.json"
    index.write_text("{bad")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        load_state_dict(target)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match='needs a "weight_map" object mapping each tensor'):
        load_state_dict(target)
    index.write_text(json.dumps({"weight_map": {"x": "../shard-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="is not a file name; shards must sit in the "
                                              "checkpoint directory"):
        load_state_dict(target)
    shutil.copy(target / "shard-1.safetensors", target / "shard-2.safetensors")
    index.write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors",
                                                "y": "shard-2.safetensors"}}))
    with pytest.raises(CheckpointError, match="is stored in more than one shard"):
        load_state_dict(target)


@pytest.mark.parametrize("file, text, match", [
    ("config.json", "{not json", r"config\.json: not valid JSON \(Expecting property name"),
    ("config.json", "", r"config\.json: not valid JSON \(Expecting value at line 1 column 1\)"),
    ("config.json", "[1, 2]", r"config\.json: must hold a JSON object, found a JSON array"),
    ("generation_config.json", "{bad", r"generation_config\.json: not valid JSON"),
])
def test_broken_json_files_are_named_errors(qwen3_dir, tmp_path, file, text, match):
    target = copy_with(qwen3_dir, tmp_path)
    (target / file).write_text(text)
    with pytest.raises(CheckpointError, match=match):
        Transformer.from_pretrained(target)


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": None}, r"config field hidden_size must be an integer >= 1 \(got None\)"),
    ({"vocab_size": "97"}, r"config field vocab_size must be an integer >= 1 \(got '97'\)"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads must be an integer >= 1 \(got 0\)"),
    ({"max_position_embeddings": 96.5}, r"max_position_embeddings must be an integer >= 1 \(got 96.5\)"),
    ({"rms_norm_eps": -1.0}, r"rms_norm_eps must be a finite number > 0 \(got -1.0\)"),
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be a finite number > 0 \(got 0.0\)"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a finite number > 0 \(got nan\)"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false"),
    ({"eos_token_id": 97}, r"eos_token_id 97 \(config\.json\) must be a token id in \[0, vocab_size=97\)"),
    ({"eos_token_id": [0, -1]}, r"eos_token_id -1 \(config\.json\) must be a token id in \[0, vocab_size=97\)"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
     r"rope_parameters: factor must be a finite number > 0 \(got None\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     r"rope_parameters: rope_theta must be a finite number > 0 \(got 0\)"),
])
def test_config_values_that_break_a_rule_are_named(qwen3_dir, tmp_path, changes, match):
    target = copy_with(qwen3_dir, tmp_path, changes)
    with pytest.raises(CheckpointError, match=match):
        load_config(target)


def test_generation_config_eos_out_of_vocabulary_is_named(qwen3_dir, tmp_path):
    target = copy_with(qwen3_dir, tmp_path)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 200]}))
    with pytest.raises(CheckpointError, match=r"eos_token_id 200 \(generation_config\.json\) "
                                              r"must be a token id in \[0, vocab_size=97\)"):
        Transformer.from_pretrained(target)


@pytest.mark.parametrize("name, changes", [
    ("qwen3_gqa_tied", {"num_key_value_heads": None}),  # null: one K/V head per query head
    ("llama_linear_tied", {"num_key_value_heads": None, "head_dim": None}),
])
def test_null_fields_default_as_in_transformers(tmp_path, name, changes):
    """Only a null (or, for Llama, missing) num_key_value_heads means H; 0 is an error (above)."""
    from transformers import AutoConfig
    directory = tmp_path / name
    build_tiny(name, directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(directory)
    ours = load_config(directory)
    assert (ours.num_key_value_heads, ours.head_dim) == (hf.num_key_value_heads, hf.head_dim)
    assert ours.num_key_value_heads == ours.num_attention_heads


# --- the checkpoint tokenizer: user text never turns into special tokens --------------------

BUNDLED_TOKENIZER = BUNDLED_MODEL_DIR / "tokenizer.json"
TEXTS_WITH_SPECIALS = ["a<|endoftext|>b", "<|endoftext|>", "Romeo.<|endoftext|>\n<|endoftext|>x",
                       "<|endof", "x <|endoftext|> y"]


@pytest.mark.skipif(not BUNDLED_TOKENIZER.exists(), reason="no bundled tokenizer")
def test_checkpoint_tokenizer_encodes_special_strings_as_text_like_s02():
    """Oracles: S02's BPETokenizer on the same tokenizer.json (itself pinned to tiktoken), and
    HF tokenizers' own special-token matching for the explicit allowed_special="all"."""
    from tokenizers import Tokenizer

    from s02_tokenizer import BPETokenizer
    ours = CheckpointTokenizer(BUNDLED_TOKENIZER, [2047])
    s02 = BPETokenizer.load_hf(BUNDLED_TOKENIZER)
    hf = Tokenizer.from_file(str(BUNDLED_TOKENIZER))  # matches specials by default
    hf_ordinary = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    hf_ordinary.encode_special_tokens = True          # reads special-token text as plain text
    eos = s02.eos_id
    assert eos == hf.token_to_id("<|endoftext|>")
    for text in TEXTS_WITH_SPECIALS:
        assert ours.encode(text) == s02.encode(text) == hf_ordinary.encode(text).ids, text
        assert eos not in ours.encode(text), text
        assert ours.encode(text, allowed_special="all") == s02.encode(text, allowed_special="all") \
            == hf.encode(text).ids, text
        assert ours.encode(text, allowed_special={"<|endoftext|>"}) == hf.encode(text).ids, text
    with pytest.raises(ValueError, match=r"allowed_special names tokens that are not special tokens: \['<\|im_end\|>'\]"):
        ours.encode("x", allowed_special={"<|im_end|>"})
    with pytest.raises(ValueError, match="allowed_special must be 'all' or a collection"):
        ours.encode("x", allowed_special="<|endoftext|>")


@pytest.mark.skipif(not BUNDLED_TOKENIZER.exists(), reason="no bundled tokenizer")
def test_allowing_some_special_tokens_keeps_the_template(tmp_path):
    """A tokenizer with two special tokens and a BOS template (Llama style): allowing one of
    them gives what HF's own matching gives on text where only that one occurs, BOS included."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    hf = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    hf.add_special_tokens(["<|im_end|>"])
    bos = hf.token_to_id("<|endoftext|>")
    hf.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                           special_tokens=[("<|endoftext|>", bos)])
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = CheckpointTokenizer(tmp_path / "tokenizer.json", [bos])
    text = "Romeo<|im_end|> and<|im_end|>Juliet"
    expected = hf.encode(text).ids
    assert expected[0] == bos and expected.count(hf.token_to_id("<|im_end|>")) == 2
    assert ours.encode(text, allowed_special={"<|im_end|>"}) == expected
    plain = ours.encode(text)
    assert plain[0] == bos and hf.token_to_id("<|im_end|>") not in plain
    hf.encode_special_tokens = True                   # HF's reading of it as plain text
    assert plain == hf.encode(text).ids
    assert ours.decode(plain) == text


@pytest.mark.skipif(not BUNDLED_TOKENIZER.exists(), reason="no bundled tokenizer")
def test_checkpoint_tokenizer_rejects_text_that_is_not_unicode(tmp_path):
    ours = CheckpointTokenizer(BUNDLED_TOKENIZER, [2047])
    with pytest.raises(ValueError, match=r"text must be valid Unicode without lone surrogates: "
                                         r"'\\ud800' at index 2 has no UTF-8 encoding"):
        ours.encode("ab\ud800")
    with pytest.raises(ValueError, match="text must be a str"):
        ours.encode(b"ab")
    (tmp_path / "tokenizer.json").write_text("{bad")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a tokenizer\.json the HF "
                                              "tokenizers library can read"):
        CheckpointTokenizer(tmp_path / "tokenizer.json", [0])


@pytest.mark.skipif(not BUNDLED_TOKENIZER.exists(), reason="no bundled tokenizer")
def test_checkpoint_tokenizer_decode_refuses_ids_outside_the_vocabulary():
    """V from HF tokenizers itself; ids inside [0, V) decode as HF decodes them. HF alone
    raises OverflowError for -1 and drops an id >= V from the text without a word."""
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    v = hf.get_vocab_size()
    ours = CheckpointTokenizer(BUNDLED_TOKENIZER, [2047])
    ids = hf.encode("Romeo, Romeo! wherefore art thou Romeo?").ids + [v - 1, 0]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(np.array(ids)) == ours.decode(ids)  # NumPy integers are integers
    for bad in (-1, v, v + 1, 2**64):
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, vocab_size={v}\) "
                                             rf"\(got {bad}\)"):
            ours.decode([5, bad])
    for bad in (True, 2.7, 2.0, None, "3"):
        with pytest.raises(ValueError, match="token ids must be integers"):
            ours.decode([5, bad])


def test_forward_rejects_ids_that_are_not_integers_or_out_of_int64(qwen3_model):
    with pytest.raises(ValueError, match="token ids must be integers"):
        qwen3_model.forward([1.5])
    with pytest.raises(ValueError, match="token ids must be integers"):
        qwen3_model.forward([True, 3])
    for huge in (2**63, 2**70, -2**70):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
            qwen3_model.forward([3, huge])
    with pytest.raises(ValueError, match="positions must be integers"):
        qwen3_model.forward([3, 4], positions=[0.5, 1.7])


# --- the command line: bad input is an argparse error, never a traceback --------------------

@bundled
@pytest.mark.parametrize("file, content, match", [
    ("config.json", b"{bad", "config.json: not valid JSON"),
    ("model.safetensors", b"", "model.safetensors: too short to be a safetensors file"),
    ("tokenizer.json", b"{bad", "tokenizer.json: not a tokenizer.json"),
])
def test_main_reports_a_broken_checkpoint_as_a_usage_error(tmp_path, capsys, file, content, match):
    target = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL_DIR, target)
    (target / file).write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(target), "--max-tokens", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and match in err and str(target) in err


def test_main_rejects_a_prompt_that_is_not_utf8():
    """Run as a learner would: a prompt argument holding the byte 0xff (not UTF-8) reaches
    Python as a lone surrogate; the CLI answers with a usage error, exit status 2."""
    import subprocess
    import sys
    script = BUNDLED_MODEL_DIR.parents[1] / "code" / "s03_transformer.py"
    run = subprocess.run([sys.executable, str(script), "--prompt", b"ab\xff", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "error: --prompt must be valid Unicode without lone surrogates" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_path_too_long_for_the_file_system_is_a_checkpoint_error(tmp_path):
    from s03_checkpoint import resolve_checkpoint
    with pytest.raises(CheckpointError, match=r"not a usable path \(File name too long\)"):
        resolve_checkpoint(tmp_path / ("a" * 300))
