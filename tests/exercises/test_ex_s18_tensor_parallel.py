"""Graded tests for the S18 exercises (see exercises/s18_tensor_parallel.py).

Oracles, none of them the solution:
- Exercise 1 (shard a weight): the chapter's own split (code/s18_layers.py:
  `ColumnParallelLinear.shard`, `RowParallelLinear.shard`, `shard_shapes`, and the tensors the
  real `TPTransformer` holds on each rank of the bundled model and of two random ones, GQA
  with key/value heads split and replicated, biases included); and the unsplit products: your
  shards run through the real `ColumnParallelLinear` / `RowParallelLinear` with N ranks as
  threads (`run_ranks`, a real all-reduce between them) must give the MLP computed whole with
  `F.linear`, and the attention computed whole with torch's `scaled_dot_product_attention`
  (SDPA) over every head (key/value heads repeated for GQA).
- Exercise 2 (the all-reduce count): what the real communicator counts (`num_all_reduce`,
  `all_reduce_bytes`, and the tensors of its trace) in a real sharded forward of the bundled
  model and of a random one (float32 and bfloat16), N = 2 .. 6; and hand counts (Llama-3-70B's
  shape, the benchmarks' mid-size shape) written out below.
- Exercise 3 (when TP pays): cases worked by hand, the arithmetic in the comments; the closed
  form of the crossover (TP pays exactly when the read time it saves, W (1 - 1/N) / bandwidth,
  is more than the all-reduces cost) over a grid; and, once the chapter's benchmark has written
  chapters/figures/s18_tensor_parallel.json, its measured runs (`recorded_crossover`).
Every test takes well under a second: ranks are threads, the models tiny.
"""
from __future__ import annotations

import functools
import itertools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from exercise_loader import ROOT, load_exercise

ex = load_exercise("s18_tensor_parallel")

import s03_checkpoint  # noqa: E402  (code/ is on the path once the loader ran)
import s03_transformer as s03  # noqa: E402
import s06_torch as s06  # noqa: E402
import s18_layers as s18  # noqa: E402

RECORD = ROOT / "chapters" / "figures" / "s18_tensor_parallel.json"
QKV = ("q_proj", "k_proj", "v_proj")


@functools.cache
def bundled() -> s06.TorchTransformer:
    """The bundled model (Qwen3 layout: L 6, C 128, H 4, Hkv 2, D 32, I 384, V 2048)."""
    return s06.load()[0]


def random_model(dtype: torch.dtype = torch.float32, **shape) -> s06.TorchTransformer:
    """An S06 model of this shape with random weights (N(0, 0.3^2), seeded)."""
    config = s03.TransformerConfig(max_position_embeddings=64, norm_eps=1e-5, rope_theta=1e4,
                                   **shape)
    rng = np.random.default_rng(1800)
    state = {name: rng.normal(0, 0.3, size).astype(np.float32)
             for name, size in s03_checkpoint.expected_tensors(config).items()}
    return s06.TorchTransformer(config, state, "cpu", dtype)


# Llama layout, one key/value head (replicated on every rank), biases everywhere, untied head.
LLAMA_MQA = dict(model_type="llama", vocab_size=96, hidden_size=48, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=1, head_dim=8,
                 intermediate_size=72, tie_word_embeddings=False, attention_bias=True,
                 mlp_bias=True)
# Qwen3 layout, 8 query heads on 4 key/value heads (split at N = 2, 4; replicated at N = 8).
QWEN_GQA = dict(model_type="qwen3", vocab_size=96, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=64,
                tie_word_embeddings=True, qk_norm=True)


@functools.cache
def llama_mqa() -> s06.TorchTransformer:
    return random_model(**LLAMA_MQA)


@functools.cache
def qwen_gqa() -> s06.TorchTransformer:
    return random_model(**QWEN_GQA)


def tp_models(model: s06.TorchTransformer, world_size: int) -> list[s18.TPTransformer]:
    """Every rank's share of `model`, split by the chapter's `shard_model`."""
    return s18.run_ranks(world_size, lambda comm: s18.shard_model(model, comm))


def shard(weight, rank, world_size, kind) -> torch.Tensor:
    """Your shard_weight, checked to return a tensor."""
    got = ex.shard_weight(weight, rank, world_size, kind)
    assert torch.is_tensor(got), f"shard_weight must return a tensor (got {type(got).__name__})"
    return got


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: your shard has shape {tuple(got.shape)}, the chapter's {tuple(want.shape)}")
    assert torch.equal(got.to(want.dtype), want), f"{what}: same shape, other values"


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_shard_weight_is_the_real_layers_split_and_the_real_models_weights():
    g = torch.Generator().manual_seed(1801)
    for rows, cols, sizes in ((12, 8, (1, 2, 4)), (12, 6, (3,)), (5, 10, (5,))):
        w, b = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
        for n in sizes:
            for r in range(n):
                if cols % n == 0:
                    same(shard(w, r, n, "row"), s18.RowParallelLinear.shard(w, r, n),
                         f"W {tuple(w.shape)}, row-parallel, rank {r} of {n}")
                if rows % n == 0:
                    same(shard(w, r, n, "column"), s18.ColumnParallelLinear.shard(w, r, n),
                         f"W {tuple(w.shape)}, column-parallel, rank {r} of {n}")
                    same(shard(b, r, n, "column"), s18.ColumnParallelLinear.shard(b, r, n),
                         f"bias {tuple(b.shape)}, column-parallel, rank {r} of {n}")
    # The bundled model: its shares as the chapter's TPTransformer holds them.
    model = bundled()
    state = s18.s06_state_dict(model)
    for n in (2, 4):
        for r, tp in enumerate(tp_models(model, n)):
            shapes = s18.shard_shapes(model.config, r, n)
            where = f"bundled model, rank {r} of {n}"
            name = "model.embed_tokens.weight"        # column: the vocabulary's rows
            got = shard(state[name], r, n, "column")
            assert tuple(got.shape) == shapes[name], (name, tuple(got.shape), shapes[name])
            same(got, tp.embed_tokens, f"{where}: {name}")
            for i, block in enumerate(tp.blocks):
                p = f"model.layers.{i}."
                for name, real in (("self_attn.o_proj.weight", block.o_proj.weight),
                                   ("mlp.down_proj.weight", block.down_proj.weight)):
                    got = shard(state[p + name], r, n, "row")
                    assert tuple(got.shape) == shapes[p + name], (p + name, tuple(got.shape))
                    same(got, real, f"{where}: {p + name} (row-parallel)")
                # S06 fuses gate and up into one (2 I, C) weight: a rank's fused share is its
                # gate rows then its up rows (cutting the fused weight in two would give rank 0
                # all of gate and rank 1 all of up)
                gate = shard(state[p + "mlp.gate_proj.weight"], r, n, "column")
                up = shard(state[p + "mlp.up_proj.weight"], r, n, "column")
                assert tuple(gate.shape) == shapes[p + "mlp.gate_proj.weight"]
                same(torch.cat([gate, up]), block.gate_up_proj.weight,
                     f"{where}: layer {i}'s gate and up rows (column-parallel)")


@pytest.mark.points(1)
def test_an_mlp_on_your_shards_through_the_real_layers_is_the_unsplit_mlp():
    g = torch.Generator().manual_seed(1802)
    t_len, c, inter = 5, 16, 24
    x = torch.randn(t_len, c, generator=g)
    w_up, b_up = torch.randn(inter, c, generator=g), torch.randn(inter, generator=g)
    w_down, b_down = torch.randn(c, inter, generator=g), torch.randn(c, generator=g)
    want = F.linear(F.silu(F.linear(x, w_up, b_up)), w_down, b_down)           # (T, C)
    for n in (1, 2, 3, 4):
        def rank(comm, n=n):
            up = s18.ColumnParallelLinear(shard(w_up, comm.rank, n, "column"),
                                          shard(b_up, comm.rank, n, "column"))
            h = up(x)                                                          # (T, I/N)
            assert tuple(h.shape) == (t_len, inter // n), (
                f"rank {comm.rank} of {n}: the column-parallel output is {tuple(h.shape)}, "
                f"want (T, I/N) = {(t_len, inter // n)}")
            down = s18.RowParallelLinear(shard(w_down, comm.rank, n, "row"), b_down, comm)
            return down(F.silu(h)), comm.num_all_reduce                         # (T, C)
        for r, (y, count) in enumerate(s18.run_ranks(n, rank)):
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-5), (
                f"N = {n}, rank {r}: the row-parallel sum of your shards is off the unsplit "
                f"MLP by {(y - want).abs().max().item():.3g}")
            assert count == 1, f"one all-reduce per MLP (rank {r} did {count})"
    w = torch.zeros(12, 8)
    for args in ((w, 0, 2, "diagonal"), (w, 0, 5, "column"), (w, 0, 3, "row"),
                 (w, 2, 2, "column"), (w, -1, 2, "row"), (w, 0, 0, "column"),
                 (torch.zeros(12), 0, 2, "row")):
        with pytest.raises(ValueError):
            ex.shard_weight(*args)


def qkv_of(block_state: dict, suffix: str):
    return [block_state[f"self_attn.{n}.{suffix}"] for n in QKV]


@pytest.mark.points(1)
def test_shard_qkv_is_what_the_real_model_holds():
    for model, sizes in ((bundled(), (1, 2, 4)), (llama_mqa(), (2, 3, 6)),
                         (qwen_gqa(), (2, 4, 8))):
        cfg = model.config
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        state = s18.s06_state_dict(model)
        for n in sizes:
            for r, tp in enumerate(tp_models(model, n)):
                for i, block in enumerate(tp.blocks):
                    layer = s03_checkpoint.strip_prefix(state, f"model.layers.{i}.")
                    where = (f"H {heads[0]}, Hkv {heads[1]}, D {heads[2]}, rank {r} of {n}, "
                             f"layer {i}")
                    got = ex.shard_qkv(*qkv_of(layer, "weight"), r, n, *heads)
                    assert torch.is_tensor(got), "shard_qkv must return a tensor"
                    same(got, block.local.qkv_proj, f"{where}: the fused q/k/v weight")
                    shapes = s18.shard_shapes(cfg, r, n)
                    rows = sum(shapes[f"model.layers.{i}.self_attn.{name}.weight"][0]
                               for name in QKV)
                    assert got.shape[0] == rows, (where, tuple(got.shape), rows)
                    if cfg.attention_bias:
                        got = ex.shard_qkv(*qkv_of(layer, "bias"), r, n, *heads)
                        same(got, block.local.qkv_bias, f"{where}: the fused q/k/v bias")


@pytest.mark.points(1)
def test_attention_on_your_qkv_shards_through_the_real_layers_is_the_whole_attention():
    g = torch.Generator().manual_seed(1803)
    t_len, c, d = 6, 24, 8
    x = torch.randn(t_len, c, generator=g)
    #     H, Hkv, N: split 1:1, split with GQA, replicated (2 and 4 ranks per key/value head),
    # one key/value head for all (MQA), no GQA
    for h, hkv, n in ((4, 2, 2), (6, 3, 3), (4, 2, 4), (8, 4, 8), (6, 1, 3), (6, 1, 2),
                      (8, 8, 2)):
        q_w = torch.randn(h * d, c, generator=g) / math.sqrt(c)
        k_w, v_w = (torch.randn(hkv * d, c, generator=g) / math.sqrt(c) for _ in range(2))
        o_w = torch.randn(c, h * d, generator=g) / math.sqrt(h * d)
        # whole: query head j attends with key/value head j // (H / Hkv)
        q = F.linear(x, q_w).view(t_len, h, d).transpose(0, 1)                  # (H, T, D)
        k, v = (F.linear(x, w).view(t_len, hkv, d).transpose(0, 1).repeat_interleave(
            h // hkv, dim=0) for w in (k_w, v_w))                               # (H, T, D)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (H, T, D)
        want = F.linear(attn.transpose(0, 1).reshape(t_len, h * d), o_w)        # (T, C)
        kv_local = hkv // n if hkv % n == 0 else 1

        def rank(comm, h=h, hkv=hkv, n=n, q_w=q_w, k_w=k_w, v_w=v_w, o_w=o_w, kv=kv_local):
            qkv_w = ex.shard_qkv(q_w, k_w, v_w, comm.rank, n, h, hkv, d)
            rows = (h // n + 2 * kv) * d
            assert tuple(qkv_w.shape) == (rows, c), (
                f"H {h}, Hkv {hkv}, rank {comm.rank} of {n}: your fused shard is "
                f"{tuple(qkv_w.shape)}, want ((H/N + 2 Hkv_r) D, C) = {(rows, c)}")
            qkv = s18.ColumnParallelLinear(qkv_w)(x)                 # (T, (H/N + 2 Hkv_r) D)
            ql, kl, vl = (part.view(t_len, -1, d).transpose(0, 1) for part in
                          qkv.split([h // n * d, kv * d, kv * d], dim=1))
            group = (h // n) // kv                  # the rank's query heads per KV head
            out = F.scaled_dot_product_attention(ql, kl.repeat_interleave(group, 0),
                                                 vl.repeat_interleave(group, 0), is_causal=True)
            o_proj = s18.RowParallelLinear(s18.RowParallelLinear.shard(o_w, comm.rank, n),
                                           None, comm)
            return o_proj(out.transpose(0, 1).reshape(t_len, -1))                 # (T, C)

        for r, y in enumerate(s18.run_ranks(n, rank)):
            assert torch.allclose(y, want, rtol=1e-4, atol=1e-5), (
                f"H {h}, Hkv {hkv}, N {n}, rank {r}: attention on your shards, summed over "
                f"the ranks, is off the whole attention by {(y - want).abs().max().item():.3g}")
    q_w, kv_w = torch.zeros(6 * d, c), torch.zeros(2 * d, c)
    for args in ((q_w, kv_w, kv_w, 0, 3, 6, 2, d),          # Hkv 2 and N 3: neither divides
                 (torch.zeros(4 * d, c), kv_w, kv_w, 0, 3, 4, 2, d),   # H 4 over 3 ranks
                 (q_w, torch.zeros(4 * d, c), torch.zeros(4 * d, c), 0, 2, 6, 4, d),  # 6 % 4
                 (q_w, kv_w, kv_w, 2, 2, 6, 2, d),          # rank 2 of 2
                 (q_w, kv_w, kv_w, 0, 2, 6, 2, d + 1)):     # the rows are not H D
        with pytest.raises(ValueError):
            ex.shard_qkv(*args)


# Exercise 2 ----------------------------------------------------------------------------------

def counted(model, world_size: int, ids: list[int], dtype_bytes: int):
    """Your (count, bytes each) and what the real forward did: per rank (num_all_reduce,
    all_reduce_bytes), and the all-reduced tensors' bytes from rank 0's trace."""
    got = ex.allreduce_per_step(model.config, len(ids), world_size, dtype_bytes=dtype_bytes)
    assert isinstance(got, tuple) and len(got) == 2, "return (count, bytes each)"
    trace: list = []
    ranks = s18.run_ranks(world_size, lambda comm: (
        s18.shard_model(model, comm).logits(ids), comm.num_all_reduce, comm.all_reduce_bytes),
        trace=trace)
    sizes = [total.numel() * total.element_size() for kind, _, total in trace
             if kind == "all_reduce"]
    return tuple(int(v) for v in got), [(c, b) for _, c, b in ranks], sizes


@pytest.mark.points(2)
def test_allreduce_count_is_what_a_real_sharded_forward_does():
    for model, n, num_tokens, dtype, what in (
            (bundled(), 2, 5, torch.float32, "bundled model"),
            (bundled(), 2, 1, torch.float32, "bundled model, one token"),
            (bundled(), 4, 7, torch.float32, "bundled model"),
            (llama_mqa(), 3, 9, torch.float32, "random Llama, L 3, C 48"),
            (llama_mqa(), 6, 2, torch.float32, "random Llama, L 3, C 48"),
            (random_model(torch.bfloat16, **QWEN_GQA), 2, 4, torch.bfloat16,
             "random Qwen3 in bfloat16, L 2, C 32")):
        ids = [(7 * j + 3) % model.config.vocab_size for j in range(num_tokens)]
        dtype_bytes = torch.finfo(dtype).bits // 8
        (count, each), by_rank, sizes = counted(model, n, ids, dtype_bytes)
        where = f"{what}, N = {n}, T = {num_tokens}, {dtype_bytes}-byte activations"
        for r, (real_count, real_bytes) in enumerate(by_rank):
            assert count == real_count, (
                f"{where}: you count {count} all-reduces; rank {r} of the real forward did "
                f"{real_count}")
            assert count * each == real_bytes, (
                f"{where}: {count} all-reduces of {each} bytes is {count * each} bytes; rank "
                f"{r} all-reduced {real_bytes}")
        assert sizes == [each] * count, (
            f"{where}: the real all-reduces carried {sorted(set(sizes))} bytes each, you say "
            f"{each}")


@pytest.mark.points(1)
def test_allreduce_count_hand_cases():
    def config(**shape):
        return s03.TransformerConfig(norm_eps=1e-5, rope_theta=5e5, **shape)

    bundled_cfg = bundled().config                # L 6, C 128
    # 1 (embedding) + 2 x 6 (o_proj, down_proj) = 13; 5 tokens x 128 x 4 bytes = 2560
    assert ex.allreduce_per_step(bundled_cfg, 5, 2) == (13, 2560)
    # the same at N = 4 (the count and size do not depend on N); bfloat16: 2 bytes a value
    assert ex.allreduce_per_step(bundled_cfg, 5, 4, dtype_bytes=2) == (13, 1280)
    # one rank sums nothing
    assert tuple(ex.allreduce_per_step(bundled_cfg, 5, 1)) == (0, 0)
    # Llama-3-70B's shape (L 80, C 8192, H 64, Hkv 8, I 28672, V 128256) on 8 GPUs, bfloat16:
    # 1 + 2 x 80 = 161 all-reduces; a decode of one request: 1 x 8192 x 2 = 16384 bytes each;
    # of 64 requests: 64 x 8192 x 2 = 1048576 (1 MiB) each
    llama70b = config(model_type="llama", vocab_size=128256, hidden_size=8192,
                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=28672, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    assert ex.allreduce_per_step(llama70b, 1, 8, dtype_bytes=2) == (161, 16384)
    assert ex.allreduce_per_step(llama70b, 64, 8, dtype_bytes=2) == (161, 1048576)
    # the benchmarks' mid-size shape (L 8, C 512): 1 + 16 = 17; 32 decodes x 512 x 4 = 65536
    mid = config(model_type="qwen3", vocab_size=8192, hidden_size=512, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 intermediate_size=1536, max_position_embeddings=2048,
                 tie_word_embeddings=True)
    assert ex.allreduce_per_step(mid, 32, 2) == (17, 65536)
    for cfg, num_tokens, n in ((bundled_cfg, 5, 3),     # 4 heads over 3 ranks
                               (bundled_cfg, 5, 8),     # 4 heads over 8 ranks
                               (bundled_cfg, 0, 2),     # a step computes a token at least
                               (mid, 1, 0)):
        with pytest.raises(ValueError):
            ex.allreduce_per_step(cfg, num_tokens, n)


# Exercise 3 ----------------------------------------------------------------------------------

def close(got, want: float) -> bool:
    return math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-15)


def pays(*args) -> bool:
    """Your tp_pays, checked to return a bool."""
    got = ex.tp_pays(*args)
    assert isinstance(got, (bool, np.bool_)), f"tp_pays must return a bool (got {got!r})"
    return bool(got)


@pytest.mark.points(1)
def test_tp_step_time_hand_cases():
    # the docstring's: 2 GB at 1 TB/s is 2 ms on one rank; on 2: 1 ms + 10 x 50 us = 1.5 ms
    assert close(ex.tp_step_time(2e9, 1e12, 10, 50e-6, 1), 2e-3)
    assert close(ex.tp_step_time(2e9, 1e12, 10, 50e-6, 2), 1.5e-3)
    # one rank all-reduces nothing, however slow an all-reduce would be: 6 MB / 10 GB/s
    assert close(ex.tp_step_time(6e6, 1e10, 13, 1.0, 1), 6e-4)
    # no all-reduce at all: the read splits exactly, 8 GB / 4 ranks / 2 TB/s = 1 ms
    assert close(ex.tp_step_time(8e9, 2e12, 0, 1.0, 4), 1e-3)
    # a 70B model in bfloat16 (140 GB) at 3.5 TB/s: 40 ms on one GPU (if it fit); on 8:
    # 140e9 / 8 / 3.5e12 = 5 ms, plus 161 all-reduces x 20 us = 3.22 ms: 8.22 ms
    assert close(ex.tp_step_time(140e9, 3.5e12, 161, 20e-6, 1), 40e-3)
    assert close(ex.tp_step_time(140e9, 3.5e12, 161, 20e-6, 8), 8.22e-3)
    for args in ((-1.0, 1e9, 1, 1e-6, 2), (1e6, 0.0, 1, 1e-6, 2), (1e6, 1e9, -1, 1e-6, 2),
                 (1e6, 1e9, 1, -1e-6, 2), (1e6, 1e9, 1, 1e-6, 0)):
        with pytest.raises(ValueError):
            ex.tp_step_time(*args)


@pytest.mark.points(1)
def test_tp_pays_hand_cases():
    # the docstring's: 1 ms + 10 x 50 us = 1.5 ms < 2 ms pays; 1 ms + 10 x 150 us = 2.5 ms not
    assert pays(2e9, 1e12, 10, 50e-6, 2) is True
    assert pays(2e9, 1e12, 10, 150e-6, 2) is False
    # a tie does not pay: 2000 B at 1000 B/s = 2 s; N = 2: 1 s + 1 x 1 s = 2 s
    assert pays(2000.0, 1000.0, 1, 1.0, 2) is False
    assert pays(2000.0, 1000.0, 1, 0.999, 2) is True
    # one rank is the baseline, even with free all-reduces
    assert pays(2e9, 1e12, 0, 0.0, 1) is False
    # a small model (about the bundled one: 6 MB float32, 13 all-reduces) at 10 GB/s: 0.6 ms
    # on one rank. Through gloo (about 470 us a 512-byte all-reduce alone in the chapter's
    # record): 0.3 ms + 13 x 0.47 ms = 6.41 ms, no. Through shared memory (about 20 us):
    # 0.3 ms + 0.26 ms = 0.56 ms, yes, in this model; measured (the chapter's benchmark) it
    # is slower all the same, since the step's host work (scheduling, the Python between ops)
    # does not split: the model's "pays" is necessary, not sufficient
    assert pays(6e6, 1e10, 13, 470e-6, 2) is False
    assert pays(6e6, 1e10, 13, 20e-6, 2) is True
    # the same all-reduces (100 us) against more weights: 6 MB -> 0.3 ms + 1.3 ms > 0.6 ms,
    # no; 600 MB -> 60 ms alone, 30 ms + 1.3 ms on 2 ranks and 7.5 ms + 1.3 ms on 8, yes
    assert pays(6e6, 1e10, 13, 100e-6, 2) is False
    assert pays(600e6, 1e10, 13, 100e-6, 2) is True
    assert pays(600e6, 1e10, 13, 100e-6, 8) is True
    with pytest.raises(ValueError):
        pays(6e6, 0.0, 13, 100e-6, 2)


def recorded_crossover(record: dict) -> list[dict]:
    """The measured TP runs of the chapter's record (benchmarks/bench_s18_tensor_parallel.py),
    one dict per (model, B, all-reduce) with: weight_bytes (the whole model's), step_s_tp1
    (the decode step on one rank, one thread, timed alone), step_s (the step at world_size
    ranks), world_size, num_all_reduce (per step) and all_reduce_s (one all-reduce of that
    step's message, measured alone on the same path, shared memory or gloo: its fastest call,
    the most favourable reading). From the tp section's crossover rows and weight bytes, and
    the allreduce section's plan of a step and its measured sizes; a (model, B) or a path the
    record does not price is left out."""
    tp, allreduce = record.get("tp", {}), record.get("allreduce", {})
    assert tp.get("crossover") and allreduce.get("plan"), (
        f"{RECORD.name} lacks the tp section's crossover rows or the allreduce section's plan "
        f"(record['tp']['crossover'], record['allreduce']['plan']); see recorded_crossover")
    plans = {(p["model"], p["batch"]): p for p in allreduce["plan"]}
    fastest_us = {(r["comm"], r["bytes"]): r["min_us"] for r in allreduce.get("rows", [])}
    rows = []
    for row in tp["crossover"]:
        plan = plans.get((row["model"], row["batch"]))
        if plan is None:
            continue
        for comm in ("shm", "gloo"):
            latency_us = fastest_us.get((comm, plan["bytes_each"]))
            step_ms = row.get(f"tp2_{comm}_ms")
            if latency_us is None or step_ms is None:
                continue                          # not measured at this size, or this path
            rows.append({"model": row["model"], "batch": row["batch"], "all_reduce": comm,
                         "weight_bytes": tp["models"][row["model"]]["weight_bytes"]["full"],
                         "step_s_tp1": row["tp1_ms"] / 1e3, "step_s": step_ms / 1e3,
                         "world_size": allreduce.get("world_size", 2),
                         "num_all_reduce": plan["all_reduce_per_step"],
                         "all_reduce_s": latency_us / 1e6})
    return rows


def check_against_record(record: dict) -> int:
    """Where the record measured TP faster than one rank, your model must say TP pays. The
    model is the most favourable reading of the run: the whole one-rank step taken as weight
    reading (bandwidth = weight bytes / step), which splits perfectly; the all-reduces as
    measured alone. A real step only adds what does not split, so where the record shows a
    gain, a right model allows it. Returns the rows checked."""
    rows = recorded_crossover(record)
    for row in rows:
        bandwidth = row["weight_bytes"] / row["step_s_tp1"]
        allowed = pays(row["weight_bytes"], bandwidth, int(row["num_all_reduce"]),
                       row["all_reduce_s"], int(row["world_size"]))
        if row["step_s"] < row["step_s_tp1"]:
            assert allowed, (
                f"{RECORD.name}: {row} measured TP = {row['world_size']} faster than one "
                f"rank, and your model says it cannot pay")
    return len(rows)


@pytest.mark.points(1)
def test_tp_pays_is_the_crossover_and_allows_the_recorded_gains():
    # TP at N pays exactly when the read time it saves, W (1 - 1/N) / bandwidth, is more than
    # the all-reduces cost, n x latency (the closed form; near a tie, floats may go either way)
    for w, bw, n, lat, size in itertools.product((1e6, 3e7, 1e9, 1.4e11), (1e10, 3.35e12),
                                                 (0, 13, 161), (0.0, 5e-6, 2e-3), (1, 2, 3, 8)):
        saved, cost = w * (1 - 1 / size) / bw, n * lat
        if size > 1 and abs(saved - cost) <= 1e-9 * max(saved, cost):
            continue
        want = size > 1 and saved > cost
        got = pays(w, bw, n, lat, size)
        assert got == want, (
            f"{w:g} B at {bw:g} B/s, {n} all-reduces of {lat:g} s, N = {size}: one rank "
            f"{w / bw:.4g} s, N ranks {w / size / bw + (size > 1) * cost:.4g} s; you say "
            f"{got}")
        step = ex.tp_step_time(w, bw, n, lat, size)
        assert close(step, w / size / bw + (cost if size > 1 else 0.0)), (w, bw, n, lat, size)
    if RECORD.exists():        # the chapter's benchmark, once recorded
        assert check_against_record(json.loads(RECORD.read_text(encoding="utf-8"))) > 0, (
            f"{RECORD.name}: no TP run the record prices (see recorded_crossover)")
