"""Data for the S17 "Try it" simulator: tiled causal attention one tile at a time, and a decode
query's walk over a block table, replayed from code/s17_flash.py.

Two views, both small enough to read every number:

1. Tiles. One request's attention, one head (head_dim D = 4, scale 1/2), causal with
   the diagonal bottom-right (query i of T sees keys 0 .. S - T + i), in three cases: a prompt
   (T = S = 12), a chunk of 6 new queries after 10 cached keys (T = 6, S = 16), and the prompt
   with its queries 32 times larger (scores up to about 128: e^score alone would overflow
   float32, the running max keeps every exponent at or below 0). Each with query tiles of
   block_m in BLOCK_MS rows and key tiles of block_n in BLOCK_NS keys. Per setting: the tiles
   visited, in order, and after each the running max m and sum l of every row of the query
   tile (`s17_flash.tile_trace`, one call per row of the tile) and its unnormalised output acc
   (`s17_flash.online_softmax_update` replayed on the same tiles: `tile_trace` reports m and l
   only; its m and l must be the replay's exactly, or the export fails); and the outputs of
   `s17_flash.attend_tiles`. Per case: q (T x D), k and v (S x D), the scaled scores q k^T / 2
   (T x S, unmasked), and the reference torch.softmax(masked scores) @ v.
2. The paged walk. One decode query (T = 1) of a request whose block table is BLOCK_TABLE
   (blocks of BLOCK_SIZE positions, SEQ_LEN positions: the last block partial) in a pool of
   NUM_BLOCKS blocks that also holds another request's blocks and stale free ones. Per block of
   the table: the block id read, the valid offsets, their scores, m, l and acc after it (the
   online softmax replayed with `online_softmax_update` as `s17_flash.paged_attention` walks);
   the output of `s17_flash.paged_attention`, and the reference: S12's `PagedKVCache.gather`
   of the request's blocks, then torch's scaled_dot_product_attention.

All inputs are multiples of 1/8 drawn with Python's random.Random(SEED).random() (a sequence
Python keeps across versions), so every score is exact in float32 and the same on any machine;
only the exponentials may differ in the last bit between CPUs. Numbers are float32 values
written as the doubles they are.

`replay_tiles`, `tile_states` and `replay_paged` below are the page's logic in plain Python
floats: simulator.js is a line-by-line transcription of them. On load the page recomputes every
visit of every setting and the walk from the exported scores, values, query and pool, and
checks them against the exported torch trace within TOLERANCE (a banner and a console error if
one differs).

The data is committed beside this file as data.json (`python export.py` rewrites it;
`--check` says whether it is current); the site build calls `export()` itself.

What it does not handle
    One head (GQA's grouping is in the kernels and their tests), no split-K (the chapter's
    merge is drawn in prose), float32 only.

Run it
    python site/simulators/tiled-attention/export.py           # write data.json
    python site/simulators/tiled-attention/export.py --check   # is data.json current?

Tests
    tests/test_s17_simulator_data.py (data.json current; the trace against torch.softmax over
    each prefix of keys, in float64; the visits against a brute-force mask; the walk against
    the gather and SDPA; the transcription against both), tests/test_s17_simulator_browser.py
    (the page, offline, against this file's replay and the references).

References
    Milakov and Gimelshein, "Online normalizer calculation for softmax" (2018); Dao et al.,
    FlashAttention (2022) and FlashAttention-2 (2023), Algorithm 1 (the running max, sum and
    rescale); Kwon et al., PagedAttention (SOSP 2023) (the block table).
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
import torch.nn.functional as F  # noqa: E402

import s12_engine as s12  # noqa: E402  (code/ is not a package)
import s17_flash  # noqa: E402

DATA = Path(__file__).with_name("data.json")
SEED = 17
HEAD_DIM = 4
SCALE = 1 / math.sqrt(HEAD_DIM)          # 0.5: exact, so every score is exact in float32
BLOCK_MS = (2, 4)
BLOCK_NS = (2, 4, 8)
# (id, title, new queries T, keys S, factor on q)
CASES = (
    ("prompt", "a prompt of 12 tokens (T = S = 12)", 12, 12, 1),
    ("chunk", "a chunk of 6 new queries after 10 cached keys (T = 6, S = 16)", 6, 16, 1),
    ("large", "the prompt with queries x 32 (scores above 100: e^score overflows float32)",
     12, 12, 32),
)
DEFAULT = {"case": 0, "block_m": 4, "block_n": 4}
BLOCK_SIZE = 4
NUM_BLOCKS = 12
BLOCK_TABLE = (7, 2, 9, 4)
SEQ_LEN = 14
OTHER_TABLE = (3, 10, 5)                 # another request's blocks in the same pool
OTHER_LEN = 11
TOLERANCE = 1e-5                         # the page's check: |a - b| <= TOLERANCE (1 + |b|)
NEG_INF = -math.inf


# ---------------------------------------------------------------------------------------------
# The page's logic (simulator.js transcribes these line by line)
# ---------------------------------------------------------------------------------------------

def tile_states(t_len: int, s_len: int, block_m: int, block_n: int) -> list[list[str]]:
    """Per query tile (rows of block_m), per key tile (block_n keys): "full" (every query of
    the tile sees every key of it), "partial" (it crosses the diagonal: visited, some pairs
    masked) or "skipped" (wholly above the diagonal: never loaded). Bottom-right causal."""
    offset = s_len - t_len
    grid = []
    for i0 in range(0, t_len, block_m):
        i1 = min(i0 + block_m, t_len)
        row = []
        for j0 in range(0, s_len, block_n):
            j1 = min(j0 + block_n, s_len)
            if j0 > offset + i1 - 1:
                row.append("skipped")
            elif j1 - 1 > offset + i0:
                row.append("partial")
            else:
                row.append("full")
        grid.append(row)
    return grid


def replay_tiles(scores: list[list[float]], values: list[list[float]], block_m: int,
                 block_n: int) -> list[dict]:
    """The online softmax of every row, tile by tile, in Python floats (doubles).

    scores: T rows of S scaled scores (unmasked); values: S rows of D. Query i sees keys
    0 .. S - T + i. Visits the tiles `s17_flash.attend_tiles` visits, in its order; returns per
    visit {"i0", "j0", "j1", "rows": per row of the query tile {"m", "l", "alpha" (the rescale
    exp(m_old - m_new) applied to the old l and acc; 0 at the first tile), "acc" (D),
    "seen" (keys of this tile the row sees)}}.
    """
    t_len, s_len, dim = len(scores), len(scores[0]), len(values[0])
    offset = s_len - t_len
    visits = []
    for i0 in range(0, t_len, block_m):
        i1 = min(i0 + block_m, t_len)
        state = [(NEG_INF, 0.0, [0.0] * dim) for _ in range(i0, i1)]
        j0 = 0
        while j0 < offset + i1:
            j1 = min(j0 + block_n, s_len)
            rows = []
            for r in range(i1 - i0):
                i = i0 + r
                m, l, acc = state[r]
                last = min(j1, offset + i + 1)       # keys j0 .. last - 1 are visible
                m_new = m
                for j in range(j0, last):
                    m_new = max(m_new, scores[i][j])
                base = 0.0 if m_new == NEG_INF else m_new
                alpha = math.exp(m - base)           # 0 before the first key
                l = l * alpha
                acc = [a * alpha for a in acc]
                for j in range(j0, last):
                    p = math.exp(scores[i][j] - base)
                    l = l + p
                    acc = [a + p * x for a, x in zip(acc, values[j])]
                state[r] = (m_new, l, acc)
                rows.append({"m": m_new, "l": l, "alpha": alpha, "acc": acc,
                             "seen": max(0, last - j0)})
            visits.append({"i0": i0, "j0": j0, "j1": j1, "rows": rows})
            j0 += block_n
    return visits


def replay_paged(q: list[float], k_pool, v_pool, block_table, seq_len: int, block_size: int,
                 scale: float) -> list[dict]:
    """One decode query's walk over its block table in Python floats: per table entry j, the
    block id, the valid offsets n (positions j block_size .. + n - 1), their slots (block
    block_size + offset), scores (q . k, summed in order, times scale), and m, l, alpha, acc
    after the block. k_pool, v_pool: [block][offset] -> D floats."""
    m, l, acc = NEG_INF, 0.0, [0.0] * len(q)
    walk = []
    for j in range(-(-seq_len // block_size)):
        block = block_table[j]
        n = min(block_size, seq_len - j * block_size)
        scores = []
        for o in range(n):
            dot = 0.0
            for a, b in zip(q, k_pool[block][o]):
                dot = dot + a * b
            scores.append(dot * scale)
        m_new = max([m] + scores)
        base = 0.0 if m_new == NEG_INF else m_new
        alpha = math.exp(m - base)
        l = l * alpha
        acc = [a * alpha for a in acc]
        for o in range(n):
            p = math.exp(scores[o] - base)
            l = l + p
            acc = [a + p * x for a, x in zip(acc, v_pool[block][o])]
        m = m_new
        walk.append({"j": j, "block": block, "n": n,
                     "slots": [block * block_size + o for o in range(n)],
                     "scores": scores, "m": m, "l": l, "alpha": alpha, "acc": acc})
    return walk


# ---------------------------------------------------------------------------------------------
# The inputs
# ---------------------------------------------------------------------------------------------

def eighths(rng: random.Random, *shape: int, factor: int = 1) -> torch.Tensor:
    """A float32 tensor of multiples of 1/8 in [-2, 2] (times factor), from rng.random()."""
    count = math.prod(shape)
    values = [round((rng.random() * 4 - 2) * 8) / 8 * factor for _ in range(count)]
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def masked(scores: torch.Tensor, offset: int) -> torch.Tensor:
    """scores (T, S) with -inf where key j > offset + i (bottom-right causal)."""
    t_len, s_len = scores.shape
    cols = torch.arange(s_len)[None, :]
    rows = torch.arange(t_len)[:, None]
    return scores.masked_fill(cols > offset + rows, -math.inf)


# ---------------------------------------------------------------------------------------------
# View 1: the tiles
# ---------------------------------------------------------------------------------------------

def torch_visits(q, k, v, block_m: int, block_n: int) -> list[dict]:
    """The visits with m and l from `s17_flash.tile_trace` (one call per row of a tile) and acc
    from `online_softmax_update` replayed tile by tile on the same (1 KV head, rows, n) shapes
    as `attend_tiles`. Raises RuntimeError if the replay's m or l is not tile_trace's."""
    t_len, s_len = q.shape[0], k.shape[0]
    offset = s_len - t_len
    traces = [s17_flash.tile_trace(q, k, v, SCALE, block_m, block_n, row=r)
              for r in range(block_m)]
    keys, values = k.transpose(0, 1), v.transpose(0, 1)                  # (1, S, D)
    visits, n = [], 0
    for i0 in range(0, t_len, block_m):
        i1 = min(i0 + block_m, t_len)
        rows = i1 - i0
        q_tile = q[i0:i1].permute(1, 0, 2)                                # (1, rows, D)
        pos = offset + torch.arange(i0, i1)
        m = torch.full((1, rows), -math.inf)
        l = torch.zeros(1, rows)
        acc = torch.zeros(1, rows, HEAD_DIM)
        for j0 in range(0, offset + i1, block_n):
            j1 = min(j0 + block_n, s_len)
            scores = (q_tile @ keys[:, j0:j1].transpose(1, 2)) * SCALE       # (1, rows, n)
            cols = torch.arange(j0, j1)
            scores = scores.masked_fill(cols[None, :] > pos[:, None], -math.inf)
            m, l, acc = s17_flash.online_softmax_update(m, l, acc, scores, values[:, j0:j1])
            got = [traces[r][n] for r in range(rows)]
            if any((t.i0, t.j0) != (i0, j0) for t in got) or \
                    [t.m for t in got] != m[0].tolist() or [t.l for t in got] != l[0].tolist():
                raise RuntimeError(f"tile ({i0}, {j0}): the replay is not tile_trace's")
            visits.append({"i0": i0, "j0": j0, "m": m[0].tolist(), "l": l[0].tolist(),
                           "acc": acc[0].tolist()})
            n += 1
    if any(len(t) != n for t in traces):
        raise RuntimeError("tile_trace visited other tiles")
    return visits


def export_case(rng: random.Random, key: str, title: str, t_len: int, s_len: int,
                factor: int) -> dict:
    q = eighths(rng, t_len, 1, HEAD_DIM, factor=factor)                 # (T, H = 1, D)
    k = eighths(rng, s_len, 1, HEAD_DIM)                                 # (S, Hkv = 1, D)
    v = eighths(rng, s_len, 1, HEAD_DIM)
    offset = s_len - t_len
    scores = (q[:, 0] @ k[:, 0].T) * SCALE                               # (T, S), exact
    probs = torch.softmax(masked(scores, offset), dim=-1)
    reference = probs @ v[:, 0]                                          # (T, D)
    settings = []
    for block_m in BLOCK_MS:
        for block_n in BLOCK_NS:
            out, lse = s17_flash.attend_tiles(q, k, v, SCALE, block_m, block_n)
            settings.append({"block_m": block_m, "block_n": block_n,
                             "visits": torch_visits(q, k, v, block_m, block_n),
                             "out": out[:, 0].tolist(), "lse": lse[:, 0].tolist()})
    return {"id": key, "title": title, "t_len": t_len, "s_len": s_len, "offset": offset,
            "q_factor": factor, "q": q[:, 0].tolist(), "k": k[:, 0].tolist(),
            "scores": scores.tolist(), "values": v[:, 0].tolist(),
            "reference": reference.tolist(), "settings": settings}


# ---------------------------------------------------------------------------------------------
# View 2: the paged walk
# ---------------------------------------------------------------------------------------------

def export_paged(rng: random.Random) -> dict:
    """One decode query against a pool of NUM_BLOCKS blocks (see the module docstring)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM)                        # (nb, bs, Hkv, D)
    k_pool, v_pool = eighths(rng, *shape), eighths(rng, *shape)
    k_pool[0] = 0                                                       # the null block
    v_pool[0] = 0
    last, used = BLOCK_TABLE[-1], SEQ_LEN - (len(BLOCK_TABLE) - 1) * BLOCK_SIZE
    k_pool[last, used:] = 0            # not written yet: S12 zeroes a block it hands out
    v_pool[last, used:] = 0
    other_last, other_used = OTHER_TABLE[-1], OTHER_LEN - (len(OTHER_TABLE) - 1) * BLOCK_SIZE
    k_pool[other_last, other_used:] = 0
    v_pool[other_last, other_used:] = 0
    q = eighths(rng, 1, 1, HEAD_DIM)                                     # (N = 1, H = 1, D)
    table = torch.tensor([BLOCK_TABLE], dtype=torch.int64)              # (B = 1, M)
    out = s17_flash.paged_attention(q, k_pool, v_pool, [0, 1], [SEQ_LEN], table, SCALE)

    cache = s12.PagedKVCache(1, NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM, max_seq_len=16)
    cache.k[0].copy_(k_pool)
    cache.v[0].copy_(v_pool)
    keys, values = cache.gather(0, table, SEQ_LEN)                     # (1, Hkv, S, D)
    reference = F.scaled_dot_product_attention(q.permute(1, 0, 2)[None], keys, values,
                                               scale=SCALE)            # (1, H, 1, D)

    walk = []
    m = torch.full((1, 1), -math.inf)
    l = torch.zeros(1, 1)
    acc = torch.zeros(1, 1, HEAD_DIM)
    for j, block in enumerate(BLOCK_TABLE):                            # paged_attention's walk
        n = min(BLOCK_SIZE, SEQ_LEN - j * BLOCK_SIZE)
        scores = (q[:, 0][None] @ k_pool[block, :n].transpose(0, 1).transpose(1, 2)) * SCALE
        m, l, acc = s17_flash.online_softmax_update(m, l, acc, scores,
                                                    v_pool[block, :n].transpose(0, 1))
        walk.append({"j": j, "block": block, "n": n, "scores": scores[0, 0].tolist(),
                     "m": m.item(), "l": l.item(), "acc": acc[0, 0].tolist()})
    final, _ = s17_flash.finish(m, l, acc)
    if not torch.equal(final[0], out[0]):
        raise RuntimeError("the replayed walk is not s17_flash.paged_attention's")
    return {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "null_block": 0,
            "block_table": list(BLOCK_TABLE), "seq_len": SEQ_LEN,
            "other": {"block_table": list(OTHER_TABLE), "seq_len": OTHER_LEN},
            "q": q[0, 0].tolist(), "k_pool": k_pool[:, :, 0].tolist(),
            "v_pool": v_pool[:, :, 0].tolist(), "walk": walk, "out": out[0, 0].tolist(),
            "reference": reference[0, 0, 0].tolist()}


def export() -> dict:
    """The simulator's data (JSON-able, no NaN or infinity)."""
    rng = random.Random(SEED)
    cases = [export_case(rng, *case) for case in CASES]
    paged = export_paged(rng)
    setting = [(s["block_m"], s["block_n"]) for s in cases[0]["settings"]].index(
        (DEFAULT["block_m"], DEFAULT["block_n"]))
    return {
        "source": "code/s17_flash.py (tile_trace, attend_tiles, online_softmax_update, "
                  "paged_attention) in float32 on the CPU; the reference: torch.softmax over "
                  "the masked scores, and S12's PagedKVCache.gather with torch's "
                  "scaled_dot_product_attention",
        "head_dim": HEAD_DIM, "scale": SCALE, "seed": SEED, "tolerance": TOLERANCE,
        "block_ms": list(BLOCK_MS), "block_ns": list(BLOCK_NS),
        "defaults": {"case": DEFAULT["case"], "setting": setting,
                     "row": default_row(cases[DEFAULT["case"]], setting)},
        "cases": cases, "paged": paged,
    }


def default_row(case: dict, setting: int) -> int:
    """The row whose running max moves most often in this setting (the first of equals)."""
    s = case["settings"][setting]
    moves = [0] * case["t_len"]
    for a, b in zip(s["visits"], s["visits"][1:]):
        if a["i0"] == b["i0"]:
            for r, (m0, m1) in enumerate(zip(a["m"], b["m"])):
                moves[a["i0"] + r] += m1 > m0
    return moves.index(max(moves))


def text(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n"


if __name__ == "__main__":
    fresh = text(export())
    if "--check" in sys.argv[1:]:
        current = DATA.is_file() and DATA.read_text() == fresh
        print(f"{DATA.relative_to(ROOT)} is {'current' if current else 'NOT current'}")
        sys.exit(0 if current else 1)
    DATA.write_text(fresh)
    print(f"wrote {DATA.relative_to(ROOT)}: {len(fresh):,} bytes")
