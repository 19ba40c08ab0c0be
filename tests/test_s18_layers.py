"""Tests for S18's tensor-parallel layers (code/s18_layers.py), with no process started: the
ranks run as threads of this process (`run_ranks`, `ThreadCommunicator`).

Oracles: shard shapes and bytes counted by hand from the bundled config (6 layers, hidden
C = 128, 4 query heads, 2 KV heads of D = 32, intermediate I = 384, V = 2048, tied head); the
full `F.linear` / `F.embedding` of the unsplit tensors; S06's unsplit model (its logits, and
its weights sliced by hand for the loader); the all-reduce count and bytes of a forward worked
out from the config by hand (one for the embedding, two per layer, T x C float32 each).

The shared-memory all-reduce (`ShmCommunicator`) spins on flags written by other processes,
so it is not run in threads here: tests/test_s18_tensor_parallel.py runs it through the
executor, whose default on x86 it is.
"""
import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F

import s03_transformer as s03
import s06_torch as s06
import s18_layers as tp
from s01_generation_loop import ParameterError

# The bundled model's sizes, written out (not read from its config): the hand counts below.
C, L, H, HKV, D, I, V = 128, 6, 4, 2, 32, 384, 2048
# Float32 logits of N ranks against S06's unsplit model: the row-parallel products are summed
# over ranks (x_0 W_0 + x_1 W_1 instead of one dot product of length C or I), so the last bits
# differ. Measured on the bundled model: 9.5e-6 at N = 2 and 4 (logits of order 10). 1e-4 is
# the rule S16 and S17 use against the runner they replace.
LOGITS_ATOL = 1e-4
PROMPT = "Ham.\nTo be, or not to be, that is the question:"


@pytest.fixture(scope="module")
def bundled():
    return s06.load()


def within(seconds, fn):
    """fn() on a daemon thread; fails the test (instead of hanging it) when fn has not
    returned in `seconds`. Returns fn's result or raises its exception."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as err:         # noqa: BLE001 (re-raised below)
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a rank hangs"
    if "error" in box:
        raise box["error"]
    return box["result"]


# --- shard shapes and bytes ------------------------------------------------------------------

def layer_shapes(n: int) -> dict[str, tuple[int, ...]]:
    """One layer's tensors on a rank of n (n = 1 or 2: the KV heads split), by hand."""
    return {
        "input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
        "self_attn.q_proj.weight": (H * D // n, C),            # its query heads' rows
        "self_attn.k_proj.weight": (HKV * D // n, C),          # its KV heads' rows
        "self_attn.v_proj.weight": (HKV * D // n, C),
        "self_attn.o_proj.weight": (C, H * D // n),            # row-parallel: its columns
        "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (I // n, C), "mlp.up_proj.weight": (I // n, C),
        "mlp.down_proj.weight": (C, I // n),
    }


@pytest.mark.parametrize("n", [1, 2])
def test_shard_shapes_and_bytes_equal_the_hand_count(bundled, n):
    config = bundled[0].config
    want = {"model.embed_tokens.weight": (V // n, C), "model.norm.weight": (C,)}
    for i in range(L):
        want.update({f"model.layers.{i}.{k}": s for k, s in layer_shapes(n).items()})
    for rank in range(n):
        assert tp.shard_shapes(config, rank, n) == want
    # Parameters per layer: q 128x128, k and v 64x128, o 128x128, gate, up and down 384x128,
    # q/k norms 2x32, the two layer norms 2x128 = 196,928; embedding 2048x128 (the tied head:
    # the same tensor), final norm 128: 1,443,840 in all, 5,775,360 bytes in float32. At N = 2
    # every matrix is halved, norms whole: 98,624 a layer, 722,944 in all, 2,891,776 bytes.
    want_bytes = {1: [5_775_360], 2: [2_891_776, 2_891_776]}[n]
    assert tp.shard_bytes(config, n) == want_bytes
    assert tp.shard_bytes(config, n, dtype_bytes=2) == [b // 2 for b in want_bytes]


def test_kv_heads_are_replicated_when_the_ranks_outnumber_them(bundled):
    """Hkv = 2 on N = 4 ranks: each rank's one query head uses KV head rank // 2 (query heads
    0, 1 share KV head 0; 2, 3 share head 1), so ranks 0, 1 hold head 0 and ranks 2, 3 head 1;
    its k/v rows are those D rows of the full matrix. Hkv = 4 on N = 2: two heads each."""
    config = bundled[0].config
    assert [tp.kv_head_range(config, r, 4) for r in range(4)] == [
        slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    for r in range(4):
        shapes = tp.shard_shapes(config, r, 4)
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (D, C)
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (D, C)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (C, I // 4)
    assert tp.rank_config(config, 4).num_key_value_heads == 1
    four = dataclasses.replace(config, num_attention_heads=8, num_key_value_heads=4)
    assert [tp.kv_head_range(four, r, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]

    model = bundled[0]
    full_k = model.blocks[0].qkv_proj[H * D:(H + HKV) * D]           # (Hkv D, C)
    full_v = model.blocks[0].qkv_proj[(H + HKV) * D:]
    shares = tp.run_ranks(4, lambda comm: tp.shard_model(model, comm))
    for r, share in enumerate(shares):
        qkv = share.blocks[0].local.qkv_proj                          # q, k, v rows: D each
        head = r // 2
        assert torch.equal(qkv[:D], model.blocks[0].qkv_proj[r * D:(r + 1) * D])
        assert torch.equal(qkv[D:2 * D], full_k[head * D:(head + 1) * D])
        assert torch.equal(qkv[2 * D:], full_v[head * D:(head + 1) * D])


# --- Megatron's layers against the unsplit products -----------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_column_and_row_parallel_linears_equal_the_full_product(n):
    gen = torch.Generator().manual_seed(18)
    weight = torch.randn(12, 8, generator=gen)                       # (out, in)
    bias = torch.randn(12, generator=gen)
    x = torch.randn(5, 8, generator=gen)                             # (T, in)
    want = F.linear(x, weight, bias)

    def column(comm):
        layer = tp.ColumnParallelLinear(tp.ColumnParallelLinear.shard(weight, comm.rank, n),
                                        tp.ColumnParallelLinear.shard(bias, comm.rank, n))
        return layer(x), comm.num_all_reduce

    outs = tp.run_ranks(n, column)
    assert [o.shape for o, _ in outs] == [(5, 12 // n)] * n           # its features only
    assert all(count == 0 for _, count in outs)                       # no communication
    torch.testing.assert_close(torch.cat([o for o, _ in outs], dim=-1), want)

    def row(comm):
        cols = slice(comm.rank * 8 // n, (comm.rank + 1) * 8 // n)    # its slice of the input
        layer = tp.RowParallelLinear(tp.RowParallelLinear.shard(weight, comm.rank, n), bias,
                                     comm)
        assert layer.weight.shape == (12, 8 // n)
        return layer(x[:, cols]), comm.num_all_reduce, comm.all_reduce_bytes

    for out, count, nbytes in tp.run_ranks(n, row):                  # the sum, on every rank
        torch.testing.assert_close(out, want)                         # bias added once
        assert (count, nbytes) == (1, 5 * 12 * 4)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_vocab_parallel_embedding_equals_the_full_lookup(n):
    table = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([0, 5, 15, 8, 3, 12, 7, 4, 11])       # in every rank's range at N = 4

    def embed(comm):
        rows = table[comm.rank * 16 // n:(comm.rank + 1) * 16 // n]
        return tp.VocabParallelEmbedding(rows, 16, comm.rank, n, comm)

    for out in tp.run_ranks(n, lambda comm: embed(comm)(ids)):
        assert torch.equal(out, F.embedding(ids, table))    # one rank adds its row, others 0

    for bad in ([0, 16], [-1, 3]):
        raised = {}

        def lookup(comm, bad=bad):
            try:
                return embed(comm)(torch.tensor(bad))
            except ValueError as err:
                raised[comm.rank] = err
                raise

        with pytest.raises(ValueError, match=r"token id must be an integer in \[0, V=16\)"):
            within(10, lambda: tp.run_ranks(n, lookup))
        assert sorted(raised) == list(range(n)), "every rank refuses the id, none waits"


# --- a rank's share of S06's model ----------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_n_ranks_give_s06s_logits_with_one_plus_two_l_all_reduces(bundled, n):
    model, tok = bundled
    ids = tok.encode(PROMPT)
    t_len = len(ids)
    want = torch.from_numpy(model(ids))                               # (T, V), unsplit
    trace = []

    def forward(comm):
        share = tp.shard_model(model, comm)
        assert share.config.num_attention_heads == H // n and share.full_config == model.config
        return share.logits(ids), comm.num_all_reduce, comm.all_reduce_bytes

    results = tp.run_ranks(n, forward, trace=trace)
    logits = results[0][0]
    assert logits.shape == (t_len, V) and logits.dtype == torch.float32
    assert all(r[0] is None for r in results[1:])                     # logits on rank 0 only
    if n == 1:
        assert torch.equal(logits, want)                              # nothing split: S06's bits
    else:
        assert (logits - want).abs().max().item() <= LOGITS_ATOL
    # One all-reduce for the embedding, two per layer (after attention, after the MLP): 13,
    # each of the (T, C) float32 hidden states: T x 128 x 4 bytes.
    per = t_len * C * 4
    assert [r[1:] for r in results] == [(1 + 2 * L, (1 + 2 * L) * per)] * n
    kinds = [kind for kind, _, _ in trace]
    assert kinds == ["all_reduce"] * (1 + 2 * L) + ["gather"]
    for kind, parts, total in trace:
        assert len(parts) == n
        if kind == "all_reduce":
            assert total.numel() * total.element_size() == per
        else:
            assert [p.shape for p in parts] == [(t_len, V // n)] * n  # each rank's V/N logits


@pytest.mark.parametrize("n", [2, 4])
def test_biases_and_an_untied_head_split_too(bundled, n):
    """A small random Llama-layout model with every bias (q/k/v and gate/up: sliced with their
    rows; o and down: whole, added once after the sum) and its own LM head (vocabulary rows
    like the embedding), 8 query heads on 2 KV heads: split (N = 2) and replicated (N = 4).
    Logits within LOGITS_ATOL of the unsplit model's; the untied head is not the embedding."""
    import s03_checkpoint
    config = dataclasses.replace(
        bundled[0].config, model_type="llama", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=256, qk_norm=False, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, bos_token_id=255, eos_token_ids=(255,), pad_token_id=255)
    gen = torch.Generator().manual_seed(2026)
    state = {name: 0.2 * torch.randn(shape, generator=gen)
             for name, shape in s03_checkpoint.expected_tensors(config).items()}
    model = s06.TorchTransformer(config, state)
    assert model.blocks[0].o_bias is not None and model.blocks[0].down_bias is not None
    ids = [3, 17, 255, 0, 128, 64, 9, 200]
    want = torch.from_numpy(model(ids))

    def forward(comm):
        share = tp.shard_model(model, comm)
        assert share.lm_head is not share.embed_tokens
        assert share.lm_head.shape == (256 // n, 64)
        return share.logits(ids)

    logits = tp.run_ranks(n, forward)[0]
    assert (logits - want).abs().max().item() <= LOGITS_ATOL


def test_load_shard_reads_only_its_slice_and_equals_s06s_weights_sliced(bundled):
    model = bundled[0]
    shares = tp.run_ranks(2, lambda comm: tp.load_shard(s03.BUNDLED_MODEL_DIR, comm))
    whole = (s03.BUNDLED_MODEL_DIR / "model.safetensors").stat().st_size
    for r, share in enumerate(shares):
        # Its share (every matrix halved, the norms whole), not the file's 5,775,360 bytes
        # of tensors: a safetensors slice reads only its rows or columns.
        assert share.bytes_read == 2_891_776 and whole > 5_775_360
        assert share.weight_bytes() == 2_891_776
        assert torch.equal(share.embed_tokens, model.embed_tokens[r * V // 2:(r + 1) * V // 2])
        assert share.lm_head is share.embed_tokens                    # tied: one tensor
        assert torch.equal(share.final_norm, model.final_norm)
        q, kv, half_i = H * D // 2, HKV * D // 2, I // 2
        for block, full in zip(share.blocks, model.blocks):
            local = block.local
            rows = torch.cat([full.qkv_proj[r * q:(r + 1) * q],                     # q heads
                              full.qkv_proj[H * D + r * kv:H * D + (r + 1) * kv],     # k heads
                              full.qkv_proj[(H + HKV) * D + r * kv:(H + HKV) * D + (r + 1) * kv]])
            assert torch.equal(local.qkv_proj, rows)
            assert torch.equal(local.o_proj, full.o_proj[:, r * q:(r + 1) * q])
            assert torch.equal(local.gate_up_proj, torch.cat([
                full.gate_up_proj[r * half_i:(r + 1) * half_i],                       # gate
                full.gate_up_proj[I + r * half_i:I + (r + 1) * half_i]]))             # up
            assert torch.equal(local.down_proj, full.down_proj[:, r * half_i:(r + 1) * half_i])
            for name in ("input_norm", "post_attention_norm", "q_norm", "k_norm"):
                assert torch.equal(getattr(local, name), getattr(full, name))


# --- refusals ---------------------------------------------------------------------------------

def configs(config):
    replace = dataclasses.replace
    return {
        "heads": (config, 3, "the 4 query heads must divide"),
        "vocabulary": (replace(config, vocab_size=2050), 4, r"vocabulary \(2050 tokens\)"),
        "kv heads": (replace(config, num_attention_heads=6, num_key_value_heads=3), 2,
                     "the 3 key/value heads must divide by the rank count, or the rank count"),
        "intermediate": (replace(config, intermediate_size=386), 4, "intermediate size 386"),
        "gpt2": (replace(config, model_type="gpt2"), 2, "not GPT-2's"),
        "zero": (config, 0, "must be an integer >= 1"),
        "bool": (config, True, "must be an integer >= 1"),
        "float": (config, 2.0, "must be an integer >= 1"),
    }


@pytest.mark.parametrize("case", ["heads", "vocabulary", "kv heads", "intermediate", "gpt2",
                                  "zero", "bool", "float"])
def test_check_tensor_parallel_refuses_sizes_that_do_not_split(bundled, case):
    config, n, message = configs(bundled[0].config)[case]
    with pytest.raises(ParameterError, match=message) as err:
        tp.check_tensor_parallel(config, n)
    assert "tensor_parallel_size" in str(err.value)
    assert err.value.parameter == "tensor_parallel_size"
    if case == "heads":                       # the same rule guards every way in
        for call in (lambda: tp.shard_shapes(config, 0, n), lambda: tp.rank_config(config, n),
                     lambda: tp.run_ranks(n, lambda comm: tp.shard_model(bundled[0], comm))):
            with pytest.raises(ParameterError, match=message):
                within(10, call)


# --- a checkpoint that breaks S03's rules: refused by its headers, before any slice ---------

def write_checkpoint(directory, tensors, index=None):
    """The bundled model's config files and these tensors: model.safetensors, or (index given:
    its weight_map's file name per tensor) shards a and b (no other file the index may name)
    and model.safetensors.index.json."""
    import json
    import shutil
    from safetensors.torch import save_file
    directory.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(s03.BUNDLED_MODEL_DIR / name, directory / name)
    if index is None:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    for shard in ("a.safetensors", "b.safetensors"):
        save_file({k: v for k, v in tensors.items() if index.get(k) == shard},
                  str(directory / shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return directory


def broken(tensors, case):
    """(tensors, index) of the bundled checkpoint broken one way."""
    tensors = dict(tensors)
    names = sorted(tensors)
    halves = {k: "a.safetensors" if i < len(names) // 2 else "b.safetensors"
              for i, k in enumerate(names)}
    down, up = "model.layers.0.mlp.down_proj.weight", "model.layers.3.mlp.up_proj.weight"
    if case == "longer":        # 400 columns, not 384: each rank's slice would fit, silently
        tensors[down] = torch.zeros(C, 400)
    elif case == "shorter":
        tensors[down] = torch.zeros(C, 380)
    elif case == "missing":
        del tensors[up]
    elif case == "integer":
        tensors["model.norm.weight"] = torch.ones(C, dtype=torch.int8)
    elif case == "unexpected":  # a bias the config does not announce
        tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(C)
    elif case == "outside":     # a shard outside the directory
        return tensors, dict(halves, **{names[-1]: "../b.safetensors"})
    elif case == "shard missing":
        return tensors, dict(halves, **{names[-1]: "c.safetensors"})
    return tensors, None


@pytest.fixture(scope="module")
def bundled_tensors():
    from safetensors.torch import load_file
    return load_file(str(s03.BUNDLED_MODEL_DIR / "model.safetensors"))


@pytest.mark.parametrize("case", ["longer", "shorter", "missing", "integer", "unexpected",
                                  "outside", "shard missing"])
def test_load_shard_refuses_what_s03_refuses(bundled_tensors, tmp_path, case):
    """Oracle: S03's own loader (load_state_dict, check_state_dict) refuses each checkpoint;
    every rank's load_shard refuses it too, with S03's CheckpointError, before reading a
    slice. (Before: a tensor longer than the config's was sliced silently on every rank, a
    shorter one on rank 0; an integer tensor was cast; the others raised deep errors.)"""
    import s03_checkpoint
    directory = write_checkpoint(tmp_path / case, *broken(bundled_tensors, case))
    with pytest.raises(s03_checkpoint.CheckpointError):
        s03_checkpoint.check_state_dict(s03_checkpoint.load_config(directory),
                                        s03_checkpoint.load_state_dict(directory))
    raised = {}

    def load(comm):
        try:
            return tp.load_shard(directory, comm)
        except s03_checkpoint.CheckpointError as err:
            raised[comm.rank] = err
            raise

    with pytest.raises(s03_checkpoint.CheckpointError):
        within(10, lambda: tp.run_ranks(2, load))
    assert sorted(raised) == [0, 1]


def test_a_sharded_checkpoint_loads_s06s_weights(bundled, bundled_tensors, tmp_path):
    """model.safetensors.index.json and two shards: each rank's share equals S06's weights
    sliced (the embedding's rows, a down projection's columns)."""
    names = sorted(bundled_tensors)
    index = {k: "a.safetensors" if i % 2 else "b.safetensors" for i, k in enumerate(names)}
    directory = write_checkpoint(tmp_path / "sharded", bundled_tensors, index)
    model = bundled[0]
    for r, share in enumerate(tp.run_ranks(2, lambda comm: tp.load_shard(directory, comm))):
        assert torch.equal(share.embed_tokens, model.embed_tokens[r * V // 2:(r + 1) * V // 2])
        assert torch.equal(share.blocks[5].local.down_proj,
                           model.blocks[5].down_proj[:, r * I // 2:(r + 1) * I // 2])
