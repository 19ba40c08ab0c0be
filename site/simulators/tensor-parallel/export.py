"""Data for the S18 "Try it" simulator: one layer's forward split over N ranks, ranks side by
side, run by code/s18_layers.py's real layers.

The model is a tiny Qwen3 built as S06's `TorchTransformer` from a seeded state dict with HF
names (`state_dict()`): hidden C = 8, H = 4 query heads and Hkv = 2 key/value heads of D = 4,
an MLP of I = 8, V = 16 tokens, one layer, a tied head, q/k norms. Every weight is a multiple
of 1/8 drawn with Python's random.Random(SEED).random() (a sequence Python keeps across
versions), so the inputs are the same on every machine. N = 1, 2 and 4 all divide it: at N = 2
each rank holds one key/value head; at N = 4 there are more ranks than key/value heads, so each
is replicated on the two ranks whose query heads read it (`s18_layers.kv_head_range`).

For each N the export runs `s18_layers.run_ranks(N, fn, trace)`: N threads, each holding its
share (`shard_model`), each running S06's forward of TOKEN_IDS step by step on its share
(embedding, `qkv`, S06's `attention`, `finish`, `head`: what `TPTransformer.run` does, so its
intermediates can be kept); forward hooks (a public seam) keep the column-parallel gate/up
output and the row-parallel layers' inputs; the communicators' trace keeps every collective's
parts by rank and their sum. The export then checks its step-by-step run against the ranks'
own `logits` (bitwise), the collectives against `allreduce_plan` and the communicators' counts,
and the gathered logits against S06's unsplit model (within TOLERANCE), and raises
RuntimeError if any differs. Exported per N and rank: the shard of every weight and its place
in the full matrix, the rank's activations (its heads' q, k, v and attention output, its
slice of the MLP), its partial sums before each all-reduce and its logits before the gather;
per all-reduce the sum every rank gets; the bytes each rank holds (`shard_bytes`, and the
model's own `weight_bytes`) and each all-reduce carries.

`replay_world` and the functions above it are the page's logic in plain Python floats:
simulator.js is a line-by-line transcription. On load the page recomputes every rank's
products from the exported weights and the token ids and checks them against the exported
torch run within TOLERANCE (a banner and a console error if one differs).

The data is committed beside this file as data.json (`python export.py` rewrites it; `--check`
says whether it is current); the site build calls `export()` itself.

What it does not handle
    One layer and one sequence without a KV cache (a prefill of 3 tokens; the cache is per
    rank, Hkv/N heads wide, which the chapter's memory table counts); float32; GPT-2 (S18
    refuses it).

Run it
    python site/simulators/tensor-parallel/export.py           # write data.json
    python site/simulators/tensor-parallel/export.py --check   # is data.json current?

Tests
    tests/test_s18_simulator_data.py (data.json current; every shard a slice of the full weight
    by the hand rules; the partial sums adding to S06's unsplit layer; the replay against
    both), tests/test_s18_simulator_browser.py (the page, offline, against this file's replay).

References
    Shoeybi et al., Megatron-LM (2019), section 3 and figure 3 (the column / row split and the
    two all-reduces per layer); vLLM's QKVParallelLinear (key/value heads replicated when there
    are more ranks than heads) and VocabParallelEmbedding.
"""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

import s03_checkpoint  # noqa: E402  (code/ is not a package)
import s03_transformer as s03  # noqa: E402
import s06_torch as s06  # noqa: E402
import s18_layers  # noqa: E402

DATA = Path(__file__).with_name("data.json")
SEED = 18
CONFIG = dict(model_type="qwen3", vocab_size=16, hidden_size=8, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=8,
              max_position_embeddings=16, norm_eps=1e-6, tie_word_embeddings=True,
              rope_theta=10000.0, qk_norm=True)
WORLD_SIZES = (1, 2, 4)
TOKEN_IDS = (2, 7, 13)          # at N = 4 (vocabulary ranges of 4) rank 2 holds none of them
DEFAULT_WORLD = 2
TOLERANCE = 1e-5                # the page's check: |a - b| <= TOLERANCE (1 + |b|)
DTYPE_BYTES = 4                 # float32
# The steps of the page: (id, title, kind). "local": every rank computes alone; "all_reduce":
# the ranks' partial sums are added and every rank gets the sum; "gather": rank 0 gets them.
STAGES = (
    ("split", "the split: who holds which slice of each weight", "local"),
    ("embed", "vocabulary-parallel embedding: each rank looks up its own tokens", "local"),
    ("allreduce_embed", "all-reduce 1: the embeddings summed", "all_reduce"),
    ("qkv", "input norm, then column-parallel q, k, v: each rank its heads", "local"),
    ("attention", "attention, head by head, on each rank's own heads", "local"),
    ("o_proj", "row-parallel output projection: a partial sum per rank", "local"),
    ("allreduce_attn", "all-reduce 2: the partial sums added, then the residual", "all_reduce"),
    ("gate_up", "norm, then column-parallel gate and up, SiLU(gate) x up", "local"),
    ("down_proj", "row-parallel down projection: a partial sum per rank", "local"),
    ("allreduce_mlp", "all-reduce 3: the partial sums added, then the residual", "all_reduce"),
    ("head", "final norm, then vocabulary-parallel head: logits of each rank's tokens",
     "local"),
    ("gather", "the logits gathered on rank 0, where the sampler runs", "gather"),
)


def config() -> s03.TransformerConfig:
    return s03.TransformerConfig(**CONFIG)


def state_dict() -> dict[str, torch.Tensor]:
    """The seeded weights by HF name (S03's `expected_tensors` order): matrices multiples of 1/8
    in [-1, 1], norm weights multiples of 1/8 in [0.5, 1.5]; float32, exact."""
    rng = random.Random(SEED)
    out = {}
    for name, shape in s03_checkpoint.expected_tensors(config()).items():
        count = math.prod(shape)
        if name.endswith("norm.weight"):
            values = [0.5 + round(rng.random() * 8) / 8 for _ in range(count)]
        else:
            values = [round((rng.random() * 2 - 1) * 8) / 8 for _ in range(count)]
        out[name] = torch.tensor(values, dtype=torch.float32).reshape(shape)
    return out


def build_model() -> s06.TorchTransformer:
    """S06's unsplit model of `state_dict()` (float32, CPU, manual attention)."""
    return s06.TorchTransformer(config(), state_dict())


# ---------------------------------------------------------------------------------------------
# The page's logic (simulator.js transcribes these line by line)
# ---------------------------------------------------------------------------------------------

def matmul_t(x: list[list[float]], w: list[list[float]]) -> list[list[float]]:
    """x (T, in) times w^T, w (out, in): (T, out), each sum in index order."""
    out = []
    for row in x:
        line = []
        for wrow in w:
            acc = 0.0
            for a, b in zip(row, wrow):
                acc = acc + a * b
            line.append(acc)
        out.append(line)
    return out


def rms_norm(row: list[float], weight: list[float], eps: float) -> list[float]:
    mean = 0.0
    for a in row:
        mean = mean + a * a
    inv = 1.0 / math.sqrt(mean / len(row) + eps)
    return [a * inv * w for a, w in zip(row, weight)]


def rope(vec: list[float], cos: list[float], sin: list[float]) -> list[float]:
    """Rotate-half RoPE: pair (i, i + D/2) turned by the position's angle."""
    half = len(vec) // 2
    rotated = [-a for a in vec[half:]] + vec[:half]
    return [a * c + r * s for a, r, c, s in zip(vec, rotated, cos, sin)]


def silu(a: float) -> float:
    return a / (1.0 + math.exp(-a))


def add(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def heads_of(flat: list[list[float]], first: int, count: int, dim: int) -> list:
    """Heads first .. first + count - 1 of a token-major (T, heads x D) product: (count, T, D)."""
    return [[row[(first + h) * dim:(first + h + 1) * dim] for row in flat] for h in range(count)]


def attention(q: list, k: list, v: list, scale: float) -> list:
    """Causal attention of local heads: q (h, T, D); k, v (hkv, T, D); query head i reads
    key/value head i // (h / hkv). Returns (h, T, D)."""
    group = len(q) // len(k)
    out = []
    for i, q_head in enumerate(q):
        keys, values = k[i // group], v[i // group]
        rows = []
        for t, q_row in enumerate(q_head):
            scores = []
            for s in range(t + 1):                       # causal: keys 0 .. t
                dot = 0.0
                for a, b in zip(q_row, keys[s]):
                    dot = dot + a * b
                scores.append(dot * scale)
            top = max(scores)
            probs = [math.exp(x - top) for x in scores]
            total = 0.0
            for p in probs:
                total = total + p
            row = [0.0] * len(q_row)
            for s, p in enumerate(probs):
                row = [a + p / total * b for a, b in zip(row, values[s])]
            rows.append(row)
        out.append(rows)
    return out


def sum_parts(parts: list) -> list[list[float]]:
    """The all-reduce: the ranks' (T, C) parts added in rank order (as the communicators do)."""
    total = [row[:] for row in parts[0]]
    for part in parts[1:]:
        total = add(total, part)
    return total


def replay_rank_embed(rank: dict, token_ids: list[int], hidden: int) -> list[list[float]]:
    """A rank's embedding partial: its row for a token in its vocabulary range, else zeros."""
    lo, hi = rank["vocab"]
    return [rank["weights"]["embed_tokens"][t - lo][:] if lo <= t < hi else [0.0] * hidden
            for t in token_ids]


def replay_world(data: dict, world: dict) -> dict:
    """Every rank's forward of the layer for one N, in Python floats, from the exported weights
    and token ids: per rank {"embed", "h_norm", "q", "k", "v", "attn", "o_partial", "gate",
    "up", "act", "down_partial", "logits_partial"}; the all-reduces' sums, the residual stream
    ("x", "h", "out"), the final norm and the gathered logits."""
    cfg, rep = data["config"], data["replicated"]
    eps, dim = cfg["norm_eps"], cfg["head_dim"]
    scale = 1.0 / math.sqrt(dim)
    ids, cos, sin = data["token_ids"], data["cos"], data["sin"]
    ranks = [{} for _ in world["ranks"]]
    for r, rank in enumerate(world["ranks"]):
        ranks[r]["embed"] = replay_rank_embed(rank, ids, cfg["hidden_size"])
    x = sum_parts([mine["embed"] for mine in ranks])                         # all-reduce 1
    for r, rank in enumerate(world["ranks"]):
        w, mine = rank["weights"], ranks[r]
        h_norm = [rms_norm(row, rep["input_layernorm"], eps) for row in x]
        n_q, n_kv = rank["num_heads"], rank["num_kv_heads"]
        q = heads_of(matmul_t(h_norm, w["q_proj"]), 0, n_q, dim)
        k = heads_of(matmul_t(h_norm, w["k_proj"]), 0, n_kv, dim)
        v = heads_of(matmul_t(h_norm, w["v_proj"]), 0, n_kv, dim)
        q = [[rope(rms_norm(row, rep["q_norm"], eps), cos[t], sin[t])
              for t, row in enumerate(head)] for head in q]
        k = [[rope(rms_norm(row, rep["k_norm"], eps), cos[t], sin[t])
              for t, row in enumerate(head)] for head in k]
        attn = attention(q, k, v, scale)
        flat = [[a for head in attn for a in head[t]] for t in range(len(ids))]   # (T, h D)
        mine.update(h_norm=h_norm, q=q, k=k, v=v, attn=attn,
                    o_partial=matmul_t(flat, w["o_proj"]))
    attn_sum = sum_parts([mine["o_partial"] for mine in ranks])               # all-reduce 2
    h = add(x, attn_sum)
    m_norm = [rms_norm(row, rep["post_attention_layernorm"], eps) for row in h]
    for r, rank in enumerate(world["ranks"]):
        w, mine = rank["weights"], ranks[r]
        gate, up = matmul_t(m_norm, w["gate_proj"]), matmul_t(m_norm, w["up_proj"])
        act = [[silu(g) * u for g, u in zip(gr, ur)] for gr, ur in zip(gate, up)]
        mine.update(gate=gate, up=up, act=act, down_partial=matmul_t(act, w["down_proj"]))
    mlp_sum = sum_parts([mine["down_partial"] for mine in ranks])             # all-reduce 3
    out = add(h, mlp_sum)
    final = [rms_norm(row, rep["norm"], eps) for row in out]
    for r, rank in enumerate(world["ranks"]):
        ranks[r]["logits_partial"] = matmul_t(final, rank["weights"]["embed_tokens"])
    logits = [[a for mine in ranks for a in mine["logits_partial"][t]]       # the gather
              for t in range(len(ids))]
    return {"ranks": ranks, "x": x, "attn_sum": attn_sum, "h": h, "m_norm": m_norm,
            "mlp_sum": mlp_sum, "out": out, "final_norm": final, "logits": logits}


# ---------------------------------------------------------------------------------------------
# The torch run, on the real layers
# ---------------------------------------------------------------------------------------------

def as_list(x: torch.Tensor) -> list:
    return x.detach().float().tolist()


def run_world(model: s06.TorchTransformer, world_size: int) -> dict:
    """One N: each rank's share, weights, activations, collectives and byte counts, from the
    real layers run as N threads. Raises RuntimeError if the step-by-step run is not the
    ranks' own `logits`, or a collective is not what `allreduce_plan` says."""
    cfg = model.config
    t_len = len(TOKEN_IDS)
    trace: list = []

    def forward(comm):
        tp = s18_layers.shard_model(model, comm)
        block = tp.blocks[0]
        kept: dict = {}
        hooks = [
            block.gate_up_proj.register_forward_hook(
                lambda mod, args, out: kept.__setitem__("gate_up", out.clone())),
            block.o_proj.register_forward_hook(
                lambda mod, args, out: kept.__setitem__("o_in", args[0].clone())),
            block.down_proj.register_forward_hook(
                lambda mod, args, out: kept.__setitem__("act", args[0].clone())),
        ]
        ids = tp.check_ids(list(TOKEN_IDS))
        x = tp.embed_ids(ids)                                     # TPTransformer.run, 1 layer
        cos, sin = tp.cos[:t_len], tp.sin[:t_len]
        q, k, v = block.qkv(x, cos, sin)
        attn = s06.attention(q, k, v, 0, block.scale, tp.attention_impl)
        out = block.finish(x, attn)
        logits = tp.head(out)
        for hook in hooks:
            hook.remove()
        local = block.local
        rc = tp.config
        n_q, n_kv = rc.num_attention_heads * rc.head_dim, rc.num_key_value_heads * rc.head_dim
        gate, up = local.gate_up_proj.chunk(2, dim=0)
        weights = {"embed_tokens": tp.embed_tokens, "q_proj": local.qkv_proj[:n_q],
                   "k_proj": local.qkv_proj[n_q:n_q + n_kv],
                   "v_proj": local.qkv_proj[n_q + n_kv:], "o_proj": local.o_proj,
                   "gate_proj": gate, "up_proj": up, "down_proj": local.down_proj}
        replicated = {"input_layernorm": local.input_norm,
                      "post_attention_layernorm": local.post_attention_norm,
                      "q_norm": local.q_norm, "k_norm": local.k_norm, "norm": tp.final_norm}
        return {"x": x.clone(), "q": q.clone(), "k": k.clone(), "v": v.clone(),
                "attn": attn.clone(), "out": out.clone(), "logits": logits,
                "kept": kept, "weights": {n: w.detach().clone() for n, w in weights.items()},
                "replicated": {n: w.detach().clone() for n, w in replicated.items()},
                "config": rc, "weight_bytes": tp.weight_bytes(),
                "lo": tp.embedding.lo, "hi": tp.embedding.hi}

    results = s18_layers.run_ranks(world_size, forward, trace)

    def own_logits(comm):                    # the ranks' own forward, and what it sends
        tp = s18_layers.shard_model(model, comm)
        logits = tp.logits(list(TOKEN_IDS))
        return logits, comm.num_all_reduce, comm.all_reduce_bytes

    own = s18_layers.run_ranks(world_size, own_logits)
    if not torch.equal(own[0][0], results[0]["logits"]):
        raise RuntimeError(f"N={world_size}: the step-by-step run is not the ranks' logits")
    plan = s18_layers.allreduce_plan(cfg, t_len, world_size, DTYPE_BYTES)
    kinds = [kind for kind, _, _ in trace]
    if kinds != ["all_reduce"] * plan["all_reduce"] + ["gather"]:
        raise RuntimeError(f"N={world_size}: collectives {kinds}, the plan says "
                           f"{plan['all_reduce']} all-reduces and a gather")
    for logits, count, nbytes in own:
        if count != plan["all_reduce"] or nbytes != count * plan["all_reduce_bytes"]:
            raise RuntimeError(f"N={world_size}: {count} all-reduces of {nbytes} bytes")
    block = model.blocks[0]
    whole = {"input_layernorm": block.input_norm, "q_norm": block.q_norm,
             "post_attention_layernorm": block.post_attention_norm, "k_norm": block.k_norm,
             "norm": model.final_norm}
    for r, res in enumerate(results):
        for name, w in res["replicated"].items():
            if not torch.equal(w, whole[name]):
                raise RuntimeError(f"N={world_size}: rank {r}'s {name} is not the model's")
    embed_parts, attn_parts, mlp_parts = (trace[i][1] for i in range(3))
    ranks = []
    for r, res in enumerate(results):
        rc = res["config"]
        gate, up = res["kept"]["gate_up"].chunk(2, dim=-1)
        ranks.append({
            "rank": r, "vocab": [res["lo"], res["hi"]],
            "q_heads": bounds(s18_layers.shard_range(cfg.num_attention_heads, r, world_size)),
            "kv_heads": bounds(s18_layers.kv_head_range(cfg, r, world_size)),
            "intermediate": bounds(s18_layers.shard_range(cfg.intermediate_size, r,
                                                          world_size)),
            "num_heads": rc.num_attention_heads, "num_kv_heads": rc.num_key_value_heads,
            "shapes": {n: list(s) for n, s in
                       s18_layers.shard_shapes(cfg, r, world_size).items()},
            "slices": {n: slice_info(n, cfg, r, world_size) for n in
                       s03_checkpoint.expected_tensors(cfg)},
            "weight_bytes": res["weight_bytes"],
            "weights": {n: as_list(w) for n, w in res["weights"].items()},
            "embed_partial": as_list(embed_parts[r]),
            "q": as_list(res["q"]), "k": as_list(res["k"]), "v": as_list(res["v"]),
            "attn": as_list(res["attn"]), "o_partial": as_list(attn_parts[r]),
            "gate": as_list(gate), "up": as_list(up), "act": as_list(res["kept"]["act"]),
            "down_partial": as_list(mlp_parts[r]),
            "logits_partial": as_list(trace[3][1][r]),
        })
        if not torch.equal(res["kept"]["o_in"], res["attn"].transpose(0, 1).reshape(t_len, -1)):
            raise RuntimeError("the output projection read something else than the attention")
    x, out = results[0]["x"], results[0]["out"]
    h = x + trace[1][2]                        # finish's residual: x + the all-reduced sum
    if not torch.equal(h + trace[2][2], out):
        raise RuntimeError(f"N={world_size}: the residual stream is not finish's")
    return {
        "world_size": world_size,
        "kv_replicated": cfg.num_key_value_heads % world_size != 0,
        "shard_bytes": s18_layers.shard_bytes(cfg, world_size, DTYPE_BYTES),
        "kv_bytes_per_token": [2 * cfg.num_hidden_layers * res["config"].num_key_value_heads
                               * cfg.head_dim * DTYPE_BYTES for res in results],
        "plan": {"all_reduce": plan["all_reduce"], "all_reduce_bytes": plan["all_reduce_bytes"],
                 "gather_bytes_per_row": plan["gather_bytes_per_row"],
                 "tokens": t_len},
        "counts": [{"num_all_reduce": c, "all_reduce_bytes": b} for _, c, b in own],
        "ranks": ranks,
        "all_reduces": [{"id": key, "sum": as_list(trace[i][2])} for i, key in
                        enumerate(("embed", "attn", "mlp"))],
        "x": as_list(x), "h": as_list(h), "out": as_list(out),
        "logits": as_list(results[0]["logits"]),
    }


def hf_name(short: str) -> str:
    """The HF name of an exported weight of layer 0."""
    if short == "embed_tokens":
        return "model.embed_tokens.weight"
    part = "self_attn" if short in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.0.{part}.{short}.weight"


def bounds(part: slice) -> list[int]:
    return [part.start, part.stop]


def slice_info(name: str, cfg, rank: int, world_size: int) -> dict:
    """Where rank's shard of tensor `name` sits in the full one: dim cut (None: whole) and the
    [start, stop) range along it."""
    shape = s03_checkpoint.expected_tensors(cfg)[name]
    rule = s18_layers.shard_rule(name, cfg)
    index = rule.slice_of(shape, cfg, rank, world_size)
    if rule.dim is None:
        return {"dim": None, "range": [0, 0]}
    start, stop, _ = index[rule.dim].indices(shape[rule.dim])
    return {"dim": rule.dim, "range": [start, stop]}


def export() -> dict:
    """The simulator's data (JSON-able, no NaN or infinity). Raises RuntimeError (see
    `run_world`) and when the ranks' logits are not S06's unsplit model's within TOLERANCE."""
    torch.manual_seed(SEED)
    model = build_model()
    cfg = model.config
    with torch.inference_mode():
        reference = torch.from_numpy(model.forward(list(TOKEN_IDS)))
    worlds = [run_world(model, n) for n in WORLD_SIZES]
    for world in worlds:
        got = torch.tensor(world["logits"])
        if not torch.allclose(got, reference, rtol=TOLERANCE, atol=TOLERANCE):
            raise RuntimeError(f"N={world['world_size']}: logits differ from S06's by "
                               f"{(got - reference).abs().max().item():.2e}")
    t_len = len(TOKEN_IDS)
    rep = {"input_layernorm": "model.layers.0.input_layernorm.weight",
           "post_attention_layernorm": "model.layers.0.post_attention_layernorm.weight",
           "q_norm": "model.layers.0.self_attn.q_norm.weight",
           "k_norm": "model.layers.0.self_attn.k_norm.weight", "norm": "model.norm.weight"}
    weights = state_dict()
    return {
        "source": "code/s18_layers.py (shard_model, run_ranks with ThreadCommunicator's trace, "
                  "shard_shapes, shard_bytes, allreduce_plan) on a seeded tiny Qwen3 in "
                  "float32 on the CPU; the reference: S06's unsplit TorchTransformer",
        "seed": SEED, "tolerance": TOLERANCE, "dtype_bytes": DTYPE_BYTES,
        "config": {k: v for k, v in CONFIG.items() if k != "model_type"},
        "full_shapes": {n: list(s) for n, s in s03_checkpoint.expected_tensors(cfg).items()},
        "full_bytes": DTYPE_BYTES * sum(math.prod(s) for s in
                                        s03_checkpoint.expected_tensors(cfg).values()),
        "token_ids": list(TOKEN_IDS),
        "cos": as_list(model.cos[:t_len]), "sin": as_list(model.sin[:t_len]),
        "replicated": {k: as_list(weights[n]) for k, n in rep.items()},
        "stages": [{"id": i, "title": t, "kind": k} for i, t, k in STAGES],
        "defaults": {"world": WORLD_SIZES.index(DEFAULT_WORLD)},
        "reference_logits": as_list(reference),
        "worlds": worlds,
    }


def text(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n"


if __name__ == "__main__":
    torch.set_num_threads(1)
    fresh = text(export())
    if "--check" in sys.argv[1:]:
        current = DATA.is_file() and DATA.read_text() == fresh
        print(f"{DATA.relative_to(ROOT)} is {'current' if current else 'NOT current'}")
        sys.exit(0 if current else 1)
    DATA.write_text(fresh)
    print(f"wrote {DATA.relative_to(ROOT)}: {len(fresh):,} bytes")
