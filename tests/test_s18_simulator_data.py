"""The S18 tensor-parallel simulator: its data is current, and every number in it is what an
independent computation gives.

site/simulators/tensor-parallel/export.py runs code/s18_layers.py's layers (`shard_model`,
`run_ranks` with the communicators' trace, `shard_shapes`, `shard_bytes`, `allreduce_plan`) on a
seeded tiny Qwen3 for N = 1, 2 and 4 ranks and writes site/simulators/tensor-parallel/data.json;
it also holds `replay_world`, the Python the page's JavaScript transcribes
(tests/test_s18_simulator_browser.py holds the page to it). The oracles here use none of
s18_layers' code:

- the committed data.json is what export() makes now (structure exactly; numbers to float32's
  last bits, since another CPU may round a product differently);
- every exported shard is the slice of the full weight the hand rules give (query heads, their
  key/value heads split or, at N = 4 > Hkv = 2, replicated on rank pairs; rows of the
  column-parallel weights, columns of the row-parallel ones, vocabulary ranges), with the
  shapes and bytes counted here by hand; the collectives counted by hand (1 + 2 L all-reduces
  of T C float32 each, a gather of V/N logits per row);
- S06's unsplit model, run here step by step on the same weights: the ranks' embeddings add up
  to its embedding (exactly), their heads' q, k, v and attention are its heads', their partial
  sums before each all-reduce add up to its attention projection and MLP output, their slices
  of the MLP are its columns, and the gathered logits are its logits (float32, within 1e-5);
- the transcription (`replay_world`, doubles) agrees with the exported float32 run within the
  page's tolerance, with S06 the same way, and with itself across N to 1e-12 (splitting a sum
  changes only its rounding).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import s06_torch as s06
from sim_browser import SIMULATORS, load_exporter

tp = load_exporter("tensor-parallel", "s18_sim_export_data")
COMMITTED = SIMULATORS / "tensor-parallel" / "data.json"
LAYER = "model.layers.0."


@pytest.fixture(scope="module")
def data():
    return json.loads(tp.text(tp.export()))        # what the page gets


@pytest.fixture(scope="module")
def weights():
    return tp.state_dict()


@pytest.fixture(scope="module")
def unsplit(weights, data):
    """S06's model on the same weights, run step by step (its own pieces, no s18 code)."""
    cfg = tp.config()
    model = s06.TorchTransformer(cfg, weights)
    block = model.blocks[0]
    ids = torch.tensor(data["token_ids"])
    t_len = len(ids)
    with torch.inference_mode():
        x = model.embed_ids(ids)
        q, k, v = block.qkv(x, model.cos[:t_len], model.sin[:t_len])
        attn = s06.attention(q, k, v, 0, block.scale)
        o = F.linear(attn.transpose(0, 1).reshape(t_len, -1), block.o_proj)
        h = x + o
        m = s06.rms_norm(h, block.post_attention_norm, cfg.norm_eps)
        gate, up = F.linear(m, block.gate_up_proj).chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = F.linear(act, block.down_proj)
        out = h + down
        logits = torch.from_numpy(model.forward(data["token_ids"]))
    assert torch.equal(out, block.finish(x, attn))           # the pieces are S06's layer
    return dict(x=x, q=q, k=k, v=v, attn=attn, o=o, h=h, gate=gate, up=up, act=act,
                down=down, out=out, logits=logits)


def same_tree(a, b, path="data"):
    """a == b with floats compared to float32 rounding; returns the first difference or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            found = same_tree(a[k], b[k], f"{path}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = same_tree(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) or isinstance(b, float):
        ok = (isinstance(a, (int, float)) and isinstance(b, (int, float))
              and abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b)))
        return None if ok else f"{path}: {a!r} != {b!r}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a, b, tol=1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32),
                          torch.as_tensor(b, dtype=torch.float32), rtol=tol, atol=tol)


def kv_heads_by_hand(rank: int, n: int, hkv: int) -> list[int]:
    """Rank r's key/value heads: its Hkv/N when N divides Hkv; else the one its query heads
    read (query heads per KV head H/Hkv, query heads per rank H/N: head r // (N / Hkv))."""
    if hkv % n == 0:
        return list(range(rank * hkv // n, (rank + 1) * hkv // n))
    return [rank // (n // hkv)]


def test_committed_data_is_current(data):
    committed = json.loads(COMMITTED.read_text())
    assert same_tree(committed, data) is None, same_tree(committed, data)
    assert [w["world_size"] for w in data["worlds"]] == [1, 2, 4]
    assert [s["kind"] for s in data["stages"]].count("all_reduce") == 3
    assert data["stages"][-1]["kind"] == "gather"


def test_every_shard_is_its_slice_by_hand(data, weights):
    c = data["config"]
    h, hkv, d, i_size, v_size = (c["num_attention_heads"], c["num_key_value_heads"],
                                 c["head_dim"], c["intermediate_size"], c["vocab_size"])
    hidden = c["hidden_size"]
    assert (h, hkv, d, hidden, i_size, v_size) == (4, 2, 4, 8, 8, 16)
    full_bytes = 4 * sum(w.numel() for w in weights.values())
    assert data["full_bytes"] == full_bytes == 4 * (v_size * hidden + 2 * hidden + h * d * hidden
                                                    + 2 * hkv * d * hidden + hidden * h * d
                                                    + 2 * d + 3 * i_size * hidden + hidden)
    for world in data["worlds"]:
        n = world["world_size"]
        assert world["kv_replicated"] == (n > hkv)
        for r, rank in enumerate(world["ranks"]):
            qh = list(range(r * h // n, (r + 1) * h // n))
            kvh = kv_heads_by_hand(r, n, hkv)
            cols = slice(r * i_size // n, (r + 1) * i_size // n)
            vocab = slice(r * v_size // n, (r + 1) * v_size // n)
            rows = lambda heads: [x for hh in heads for x in range(hh * d, (hh + 1) * d)]  # noqa
            want = {
                "embed_tokens": weights["model.embed_tokens.weight"][vocab],
                "q_proj": weights[LAYER + "self_attn.q_proj.weight"][rows(qh)],
                "k_proj": weights[LAYER + "self_attn.k_proj.weight"][rows(kvh)],
                "v_proj": weights[LAYER + "self_attn.v_proj.weight"][rows(kvh)],
                "o_proj": weights[LAYER + "self_attn.o_proj.weight"][:, rows(qh)],
                "gate_proj": weights[LAYER + "mlp.gate_proj.weight"][cols],
                "up_proj": weights[LAYER + "mlp.up_proj.weight"][cols],
                "down_proj": weights[LAYER + "mlp.down_proj.weight"][:, cols],
            }
            assert rank["q_heads"] == [qh[0], qh[-1] + 1] and rank["kv_heads"] == [kvh[0],
                                                                                   kvh[-1] + 1]
            assert rank["vocab"] == [vocab.start, vocab.stop]
            assert rank["num_heads"] == h // n and rank["num_kv_heads"] == len(kvh)
            for name, tensor in want.items():
                assert torch.equal(t(rank["weights"][name]), tensor), (n, r, name)
                full = tp.hf_name(name)
                assert rank["shapes"][full] == list(tensor.shape), (n, r, name)
            # every tensor the rank holds: the eight above plus the norms, whole
            held = sum(x.numel() for x in want.values()) + 2 * hidden + 2 * d + hidden
            assert sum(math.prod(s) for s in rank["shapes"].values()) == held
            assert world["shard_bytes"][r] == rank["weight_bytes"] == 4 * held
            assert world["kv_bytes_per_token"][r] == 2 * 1 * len(kvh) * d * 4
            sl = rank["slices"]
            assert sl[LAYER + "self_attn.o_proj.weight"] == {"dim": 1, "range": [qh[0] * d,
                                                                               (qh[-1] + 1) * d]}
            assert sl[LAYER + "mlp.gate_proj.weight"] == {"dim": 0, "range": [cols.start,
                                                                            cols.stop]}
            assert sl["model.norm.weight"]["dim"] is None
    for name, values in data["replicated"].items():
        key = {"norm": "model.norm.weight", "q_norm": LAYER + "self_attn.q_norm.weight",
               "k_norm": LAYER + "self_attn.k_norm.weight"}.get(name, LAYER + name + ".weight")
        assert torch.equal(t(values), weights[key]), name
    halves = [w["shard_bytes"][0] for w in data["worlds"]]
    assert halves[0] > halves[1] > halves[2] > halves[0] / 4   # norms whole, KV replicated


def test_the_collectives_by_hand(data):
    c = data["config"]
    t_len, hidden = len(data["token_ids"]), c["hidden_size"]
    for world in data["worlds"]:
        n = world["world_size"]
        plan = world["plan"]
        assert plan["all_reduce"] == 1 + 2 * c["num_hidden_layers"] == 3
        assert plan["all_reduce_bytes"] == t_len * hidden * 4 == 96
        assert plan["gather_bytes_per_row"] == c["vocab_size"] // n * 4
        for counts in world["counts"]:                         # every rank's communicator
            assert counts == {"num_all_reduce": 3, "all_reduce_bytes": 3 * 96}
        for r, rank in enumerate(world["ranks"]):
            for key in ("embed_partial", "o_partial", "down_partial"):
                assert torch.tensor(rank[key]).shape == (t_len, hidden)
            assert torch.tensor(rank["logits_partial"]).shape == (t_len, c["vocab_size"] // n)


def test_partial_sums_add_to_s06_unsplit_layer(data, weights, unsplit):
    ids = data["token_ids"]
    assert close(data["reference_logits"], unsplit["logits"], 1e-6)
    for world in data["worlds"]:
        n, ranks = world["world_size"], world["ranks"]
        # the embedding: each id on exactly the rank whose range holds it; the sum is exact
        for r, rank in enumerate(ranks):
            lo, hi = rank["vocab"]
            for row, token in zip(rank["embed_partial"], ids):
                want = weights["model.embed_tokens.weight"][token] if lo <= token < hi else 0
                assert torch.equal(t(row), torch.zeros(8) + want)
        embed_sum = sum(t(rank["embed_partial"]) for rank in ranks)
        assert torch.equal(embed_sum, unsplit["x"]) and torch.equal(t(world["x"]), unsplit["x"])
        assert torch.equal(t(world["all_reduces"][0]["sum"]), unsplit["x"])
        # each rank's heads are S06's heads (a replicated KV head is S06's on both ranks)
        for r, rank in enumerate(ranks):
            a, b = rank["q_heads"]
            assert close(rank["q"], unsplit["q"][a:b]) and close(rank["attn"], unsplit["attn"][a:b])
            a, b = rank["kv_heads"]
            assert close(rank["k"], unsplit["k"][a:b]) and close(rank["v"], unsplit["v"][a:b])
        # the row-parallel partial sums add up to the unsplit products
        o_sum = sum(t(rank["o_partial"]) for rank in ranks)
        assert close(o_sum, unsplit["o"]) and close(world["all_reduces"][1]["sum"], unsplit["o"])
        assert close(world["h"], unsplit["h"])
        if n > 1:                                      # a partial is not the whole
            assert not close(ranks[0]["o_partial"], unsplit["o"], 1e-2)
        for key in ("gate", "up", "act"):             # column parallel: the columns, in order
            assert close(torch.cat([t(rank[key]) for rank in ranks], dim=-1), unsplit[key]), key
        down_sum = sum(t(rank["down_partial"]) for rank in ranks)
        assert close(down_sum, unsplit["down"])
        assert close(world["all_reduces"][2]["sum"], unsplit["down"])
        assert close(world["out"], unsplit["out"])
        gathered = torch.cat([t(rank["logits_partial"]) for rank in ranks], dim=-1)
        assert torch.equal(gathered, t(world["logits"]))
        assert close(gathered, unsplit["logits"])


def test_the_replay_is_the_run_and_s06(data, unsplit):
    tol = data["tolerance"]

    def near(a, b) -> bool:
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        return a.shape == b.shape and bool(((a - b).abs() <= tol * (1 + b.abs())).all())

    logits = []
    for world in data["worlds"]:
        got = tp.replay_world(data, world)
        for mine, rank in zip(got["ranks"], world["ranks"]):
            for key, exported in (("embed", "embed_partial"), ("q", "q"), ("k", "k"),
                                  ("v", "v"), ("attn", "attn"), ("o_partial", "o_partial"),
                                  ("gate", "gate"), ("up", "up"), ("act", "act"),
                                  ("down_partial", "down_partial"),
                                  ("logits_partial", "logits_partial")):
                assert near(mine[key], rank[exported]), (world["world_size"], key)
        for key in ("x", "h", "out", "logits"):
            assert near(got[key], world[key]), key
        assert near(got["attn_sum"], unsplit["o"].tolist())
        assert near(got["mlp_sum"], unsplit["down"].tolist())
        assert near(got["logits"], unsplit["logits"].tolist())
        logits.append(torch.tensor(got["logits"], dtype=torch.float64))
    for other in logits[1:]:                  # doubles: the split changes only the rounding
        assert torch.allclose(other, logits[0], rtol=0, atol=1e-12)
