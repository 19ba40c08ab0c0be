"""The S17 tiled-attention simulator: its data is current, and every number in it is what an
independent computation gives.

site/simulators/tiled-attention/export.py runs code/s17_flash.py (`tile_trace`, `attend_tiles`,
`online_softmax_update`, `paged_attention`) on small inputs (multiples of 1/8, so every score is
exact) and writes site/simulators/tiled-attention/data.json; it also holds `tile_states`,
`replay_tiles` and `replay_paged`, the Python the page's JavaScript transcribes
(tests/test_s17_simulator_browser.py holds the page to them). The oracles here use none of
s17_flash's code:

- the committed data.json is what export() makes now (structure exactly; numbers to float32's
  last bits, since exponentials may round differently on another CPU);
- the scores are q k^T / sqrt(D) in float64, exactly;
- after every tile, each row's running max is the largest score it has seen (exactly), its
  running sum sum(exp(score - m)) and its output acc / l torch.softmax over the keys seen so far
  @ v, in float64; every final output torch.softmax(masked scores) @ v and torch's
  scaled_dot_product_attention with the bottom-right causal mask;
- the tiles visited are, in row-major order, those holding at least one visible (query, key)
  pair, found by brute force over the mask; `tile_states` says "full" exactly when every pair
  is visible and "skipped" when none is;
- the paged walk reads position p at block table[p // block_size], offset p % block_size
  (counted here by hand), and ends equal to S12's `PagedKVCache.gather` + SDPA, run here;
- the transcription (`replay_tiles`, `replay_paged`, doubles) agrees with the float64 oracle to
  1e-12 and with the exported float32 trace within the page's own tolerance.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import s12_engine as s12
from sim_browser import SIMULATORS, load_exporter

ta = load_exporter("tiled-attention", "s17_sim_export_data")
COMMITTED = SIMULATORS / "tiled-attention" / "data.json"


@pytest.fixture(scope="module")
def data():
    return json.loads(ta.text(ta.export()))        # what the page gets


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


def f64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def visible(case: dict) -> torch.Tensor:
    """bool (T, S): query i sees key j iff j <= S - T + i (worked out here, not imported)."""
    t_len, s_len = case["t_len"], case["s_len"]
    return torch.tensor([[j <= s_len - t_len + i for j in range(s_len)] for i in range(t_len)])


def test_the_committed_data_is_current(data):
    assert COMMITTED.is_file(), "run python site/simulators/tiled-attention/export.py"
    committed = json.loads(COMMITTED.read_text())
    assert same_tree(data, committed) is None, same_tree(data, committed)
    json.dumps(committed, allow_nan=False)                    # no NaN, no infinity


def test_the_scores_and_the_reference_outputs(data):
    assert [c["id"] for c in data["cases"]] == ["prompt", "chunk", "large"]
    assert data["scale"] == 1 / math.sqrt(data["head_dim"]) == 0.5
    for case in data["cases"]:
        q, k, v = f64(case["q"]), f64(case["k"]), f64(case["values"])
        assert q.shape == (case["t_len"], 4) and k.shape == v.shape == (case["s_len"], 4)
        assert case["offset"] == case["s_len"] - case["t_len"]
        scores = q @ k.T * data["scale"]
        assert torch.equal(scores, f64(case["scores"]))       # exact: multiples of 1/8
        mask = visible(case)
        probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
        want = probs @ v
        sdpa = F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None],
                                              attn_mask=mask[None, None], scale=data["scale"])
        assert torch.allclose(want, sdpa[0, 0], atol=1e-12)
        assert torch.allclose(f64(case["reference"]), want, atol=1e-6, rtol=1e-6)
        for setting in case["settings"]:
            assert torch.allclose(f64(setting["out"]), want, atol=1e-6, rtol=1e-6), setting
            lse = torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1)
            assert torch.allclose(f64(setting["lse"]), lse, atol=1e-5, rtol=1e-6)
    shapes = [(c["t_len"], c["s_len"]) for c in data["cases"]]
    assert shapes == [(12, 12), (6, 16), (12, 12)]
    settings = {(s["block_m"], s["block_n"]) for c in data["cases"] for s in c["settings"]}
    assert settings == {(m, n) for m in data["block_ms"] for n in data["block_ns"]}


def test_the_tiles_visited_are_those_with_a_visible_pair(data):
    for case in data["cases"]:
        mask = visible(case)
        for setting in case["settings"]:
            bm, bn = setting["block_m"], setting["block_n"]
            want, states = [], []
            for i0 in range(0, case["t_len"], bm):
                row = []
                for j0 in range(0, case["s_len"], bn):
                    tile = mask[i0:i0 + bm, j0:j0 + bn]
                    if tile.any():
                        want.append((i0, j0))
                    row.append("full" if tile.all() else "partial" if tile.any() else "skipped")
                states.append(row)
            got = [(v["i0"], v["j0"]) for v in setting["visits"]]
            assert got == want, (case["id"], bm, bn)
            assert ta.tile_states(case["t_len"], case["s_len"], bm, bn) == states
            assert [(v["i0"], v["j0"]) for v in ta.replay_tiles(case["scores"], case["values"],
                                                                bm, bn)] == want
    skipped = sum(r.count("skipped") for r in ta.tile_states(12, 12, 2, 2))
    assert skipped == 15                    # 6 x 6 tiles, the 15 above the diagonal


def test_the_trace_is_the_softmax_of_the_keys_seen_so_far(data):
    """After each tile, row i has seen keys 0 .. min(j1, S - T + i + 1) - 1: its state is the
    softmax of those, in float64; the transcription is held to the same oracle."""
    tol = data["tolerance"]
    for case in data["cases"]:
        scores, v = f64(case["scores"]), f64(case["values"])
        offset = case["offset"]
        for setting in case["settings"]:
            replay = ta.replay_tiles(case["scores"], case["values"], setting["block_m"],
                                     setting["block_n"])
            assert len(replay) == len(setting["visits"])
            for visit, mine in zip(setting["visits"], replay):
                j1 = min(visit["j0"] + setting["block_n"], case["s_len"])
                rows = len(visit["m"])
                assert rows == len(mine["rows"]) == min(setting["block_m"],
                                                        case["t_len"] - visit["i0"])
                for r in range(rows):
                    i = visit["i0"] + r
                    last = min(j1, offset + i + 1)
                    seen = scores[i, :last]
                    m = seen.max()
                    l = torch.exp(seen - m).sum()
                    out = torch.softmax(seen, dim=-1) @ v[:last]
                    acc = f64(visit["acc"][r])
                    assert visit["m"][r] == m.item(), (case["id"], visit, r)    # exact
                    assert visit["l"][r] == pytest.approx(l.item(), rel=1e-6)
                    assert torch.allclose(acc / visit["l"][r], out, atol=1e-6, rtol=1e-6)
                    got = mine["rows"][r]                 # the transcription, in doubles
                    assert got["m"] == m.item() and got["seen"] == max(0, last - visit["j0"])
                    assert got["l"] == pytest.approx(l.item(), rel=1e-12)
                    assert torch.allclose(f64(got["acc"]) / got["l"], out, atol=1e-12)
                    assert abs(got["l"] - visit["l"][r]) <= tol * (1 + visit["l"][r])
                    assert all(abs(a - b) <= tol * (1 + abs(b))
                               for a, b in zip(got["acc"], visit["acc"][r]))


def test_the_rescale_is_exp_of_the_change_of_the_max(data):
    case = data["cases"][data["defaults"]["case"]]
    setting = case["settings"][data["defaults"]["setting"]]
    assert (setting["block_m"], setting["block_n"]) == (4, 4)
    replay = ta.replay_tiles(case["scores"], case["values"], 4, 4)
    row = data["defaults"]["row"]
    r = row % 4
    mine = [v["rows"][r] for v in replay if v["i0"] == row - r]
    assert mine[0]["alpha"] == 0.0                          # nothing before the first tile
    for before, after in zip(mine, mine[1:]):
        assert after["alpha"] == pytest.approx(math.exp(before["m"] - after["m"]), rel=1e-15)
        assert after["m"] >= before["m"]
    assert any(a["m"] > b["m"] for b, a in zip(mine, mine[1:])), "the default row's max moves"


def test_large_scores_stay_finite(data):
    """The "large" case: e^score overflows float32, the online softmax does not."""
    case = next(c for c in data["cases"] if c["id"] == "large")
    top = max(max(row[:case["offset"] + i + 1]) for i, row in enumerate(case["scores"]))
    assert torch.isinf(torch.exp(torch.tensor(top, dtype=torch.float32)))
    for setting in case["settings"]:
        numbers = [x for v in setting["visits"] for x in v["m"] + v["l"] + sum(v["acc"], [])]
        assert all(math.isfinite(x) for x in numbers)


def test_the_paged_walk(data):
    pg = data["paged"]
    bs, table, seq_len = pg["block_size"], pg["block_table"], pg["seq_len"]
    assert table == [7, 2, 9, 4] and seq_len == 14 and bs == 4
    assert seq_len % bs and len(table) == -(-seq_len // bs)            # last block partial
    assert not set(table) & set(pg["other"]["block_table"]) and pg["null_block"] not in table
    k_pool, v_pool, q = f64(pg["k_pool"]), f64(pg["v_pool"]), f64(pg["q"])
    assert not k_pool[pg["null_block"]].any() and not v_pool[pg["null_block"]].any()
    # the address arithmetic, by hand: position p at block table[p // bs], offset p % bs
    keys = torch.stack([k_pool[table[p // bs], p % bs] for p in range(seq_len)])
    values = torch.stack([v_pool[table[p // bs], p % bs] for p in range(seq_len)])
    scores = keys @ q * data["scale"]
    want = torch.softmax(scores, dim=0) @ values
    assert torch.allclose(f64(pg["reference"]), want, atol=1e-6)
    assert torch.allclose(f64(pg["out"]), want, atol=1e-6)
    # S12's gather of the table, then torch's SDPA, run here on the float32 pool
    cache = s12.PagedKVCache(1, pg["num_blocks"], bs, 1, 4, max_seq_len=16)
    cache.k[0, :, :, 0] = torch.tensor(pg["k_pool"])
    cache.v[0, :, :, 0] = torch.tensor(pg["v_pool"])
    k, v = cache.gather(0, torch.tensor([table]), seq_len)                 # (1, 1, S, D)
    sdpa = F.scaled_dot_product_attention(torch.tensor(pg["q"])[None, None, None], k, v,
                                          scale=data["scale"])
    assert torch.allclose(sdpa[0, 0, 0].double(), f64(pg["reference"]), atol=1e-7)
    # block by block: the state after block j is the softmax of positions 0 .. end of block j
    replay = ta.replay_paged(pg["q"], pg["k_pool"], pg["v_pool"], table, seq_len, bs,
                             data["scale"])
    assert [w["block"] for w in pg["walk"]] == [w["block"] for w in replay] == table
    assert [w["n"] for w in pg["walk"]] == [4, 4, 4, 2]
    for j, (walk, mine) in enumerate(zip(pg["walk"], replay)):
        end = j * bs + walk["n"]
        assert mine["slots"] == [table[j] * bs + o for o in range(walk["n"])]
        assert walk["scores"] == scores[j * bs:end].tolist() == mine["scores"]   # exact
        assert walk["m"] == mine["m"] == scores[:end].max().item()
        l = torch.exp(scores[:end] - scores[:end].max()).sum().item()
        out = torch.softmax(scores[:end], dim=0) @ values[:end]
        assert walk["l"] == pytest.approx(l, rel=1e-6) and mine["l"] == pytest.approx(l, rel=1e-12)
        assert torch.allclose(f64(walk["acc"]) / walk["l"], out, atol=1e-6)
        assert torch.allclose(f64(mine["acc"]) / mine["l"], out, atol=1e-12)
