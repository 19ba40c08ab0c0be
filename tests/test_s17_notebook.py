"""The S17 notebook runs top to bottom headless and shows what it promises.

Executed once per module with nbclient on a temporary copy (the notebook in the repository is
never written), from notebooks/. Checks: no cell fails; it runs the chapter's pieces
(`online_softmax_update`, `finish`, `merge_attn_states`, `flash_attention_varlen`, S06's
`attention`, `s17_attention.build_engine`, `attention_traffic`, S16's profiler) and defines none
of them; its plots are there and no legend covers data (tests/legend_check.py); its printed
numbers keep their arithmetic (times are printed, never asserted):

- the worked example, recomputed here from the printed scores and values in float64 with torch
  (the running max, sum and output after each of the two tiles, the rescale, the output, the
  log-sum-exp) and every route to the output (torch.softmax, the chapter's update, the merge)
  printing the same numbers;
- memory: the scores column is H T^2 4 bytes; the naive and tiled outputs agree; where the peak
  is measurable, the naive call holds at least its scores from T = 1024 on and the tiled one
  less than a quarter of them at T = 2048 (memory, not time: a tensor either exists or not);
- decode: each backend's forward time at each context is a positive number, and the three
  backends made the same greedy tokens;
- the traffic table: the numbers the hand formulas give (keys and values read once, the
  gather's copy written and read, the table entries), the ratios to paged, and the measured
  forward times printed beside it.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

import torch  # noqa: E402
from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s17_attention.ipynb"
NUM = r"(-?[\d.]+(?:e[-+]\d+)?)"
VEC = r"\[([^\]]*)\]"

pytestmark = pytest.mark.skipif(not (ROOT / "data" / "model" / "model.safetensors").is_file(),
                                reason="data/model has no bundled model")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=120)


@pytest.fixture(scope="module")
def text(executed):
    return stream_text(executed)


def floats(group: str) -> list[float]:
    return [float(x) for x in group.split(",")]


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_uses_the_chapter_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    for line in ("import s17_flash", "import s17_attention", "import s17_cpu",
                 "import s06_torch as s06", "import s16_profile as p16"):
        assert line in source, line
    for call in ("s17_flash.online_softmax_update(", "s17_flash.finish(",
                 "s17_flash.merge_attn_states(", "s17_flash.flash_attention_varlen(",
                 "s06.attention(", "s17_attention.build_engine(",
                 "s17_attention.attention_traffic(", "p16.profile(", "p16.summarize("):
        assert call in source, call
    for name in ("online_softmax_update", "finish", "merge_attn_states", "attend_tiles",
                 "flash_attention_varlen", "paged_attention", "attention", "attention_traffic",
                 "build_engine", "use_backend", "KernelRunner", "PagedCpuBackend",
                 "SdpaBackend"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert "torch.compile" not in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3
    assert figures_checked(executed) >= 3
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_the_worked_example_is_the_softmax(text):
    scores = torch.tensor(floats(re.search(rf"^scores = {VEC}", text, re.M).group(1)),
                          dtype=torch.float64)
    rows = re.search(r"^values = \[(.*)\]$", text, re.M).group(1)
    values = torch.tensor([floats(r) for r in re.findall(VEC, rows)], dtype=torch.float64)
    assert scores.shape == (4,) and values.shape == (4, 2)
    tile1 = re.search(rf"tile 1 \(keys 0, 1\): m = {NUM}, l = {NUM}, acc = {VEC}", text)
    tile2 = re.search(rf"tile 2 \(keys 2, 3\): m_old = {NUM}, m_new = {NUM}, rescale "
                      rf"e\^\(m_old - m_new\) = {NUM}, l = {NUM}, acc = {VEC}", text)
    assert tile1 and tile2, text[:3000]
    # by hand, in float64: the first tile, then the second rescaled onto the new max
    m1 = scores[:2].max()
    p1 = torch.exp(scores[:2] - m1)
    m2 = scores.max()
    alpha = torch.exp(m1 - m2)
    p2 = torch.exp(scores[2:] - m2)
    l2 = alpha * p1.sum() + p2.sum()
    acc2 = alpha * (p1 @ values[:2]) + p2 @ values[2:]
    assert float(tile1.group(1)) == pytest.approx(m1.item(), abs=1e-6)
    assert float(tile1.group(2)) == pytest.approx(p1.sum().item(), abs=1e-6)
    assert floats(tile1.group(3)) == pytest.approx((p1 @ values[:2]).tolist(), abs=1e-6)
    assert float(tile2.group(1)) == pytest.approx(m1.item(), abs=1e-6)
    assert float(tile2.group(2)) == pytest.approx(m2.item(), abs=1e-6)
    assert float(tile2.group(3)) == pytest.approx(alpha.item(), abs=1e-6) and alpha < 1
    assert float(tile2.group(4)) == pytest.approx(l2.item(), abs=1e-6)
    assert floats(tile2.group(5)) == pytest.approx(acc2.tolist(), abs=1e-6)
    want = (torch.softmax(scores, dim=0) @ values).tolist()
    assert want == pytest.approx((acc2 / l2).tolist(), abs=1e-12)
    for line in (r"out = acc / l = ", r"torch\.softmax\(scores\) @ v = ",
                 r"s17_flash\.online_softmax_update, two tiles: ",
                 r"merge_attn_states of the two tiles' own results: "):
        found = re.search(line + VEC, text)
        assert found, line
        assert floats(found.group(1)) == pytest.approx(want, abs=2e-6), line
    lse = re.search(rf"log-sum-exp: m \+ log l = {NUM}; torch\.logsumexp = {NUM}", text)
    assert float(lse.group(1)) == float(lse.group(2)) == pytest.approx(
        torch.logsumexp(scores, dim=0).item(), abs=1e-6)


@pytest.mark.slow
def test_memory_against_t(text):
    rows = re.findall(rf"^\s*(\d+)\s+{NUM}\s+(\S+)\s+(\S+)\s+{NUM}\s+{NUM}$", text, re.M)
    assert [int(r[0]) for r in rows] == [256, 512, 1024, 2048], text[-6000:]
    mib = 2 ** 20
    for t, scores, naive, tiled, tile, diff in rows:
        t = int(t)
        assert float(scores) == pytest.approx(4 * t * t * 4 / mib, abs=0.05)   # H T^2 4
        assert float(tile) == pytest.approx(4 * 128 * 128 * 4 / mib, abs=0.005)
        assert float(diff) < 1e-5                            # the same attention
        if "n/a" in (naive, tiled):
            assert "peak memory cannot be measured here" in text
            continue
        if t >= 1024:
            assert float(naive) >= float(scores)             # the scores matrix existed
        if t == 2048:
            assert float(tiled) < float(scores) / 4          # no T x T matrix did


@pytest.mark.slow
def test_decode_time_per_backend(text):
    head = re.search(r"^\s*context((?:\s+(?:gather|sdpa|paged))+)\s+same tokens as gather$",
                     text, re.M)
    assert head, text[-4000:]
    backends = head.group(1).split()
    assert backends[:2] == ["gather", "sdpa"]
    assert backends == ["gather", "sdpa", "paged"] or "the 'paged' backend is left out" in text
    rows = re.findall(r"^\s*(\d+)((?:\s+[\d.]+)+)\s+(True|False)$", text, re.M)
    assert [int(r[0]) for r in rows] == [32, 96, 192]
    for _, times, same in rows:
        assert len(times.split()) == len(backends)
        assert all(float(x) > 0 for x in times.split())
        assert same == "True"                                # greedy tokens, every backend


@pytest.mark.slow
def test_the_traffic_table_is_the_hand_count(text):
    """Per layer per decode step, counted by hand: keys and values (2 Hkv D bytes a position)
    read once where they live; the gather copies cdiv(S, 16) blocks per request and reads the
    copy back; paged adds one 8-byte table entry per block."""
    points = {"bundled model, B = 8, context 192": (8, 192, 2, 32, 4, 4, 1024),
              "32 heads (8 KV) of 128, bf16, B = 16, context 4096": (16, 4096, 8, 128, 32, 2,
                                                                     2 ** 20)}
    for title, (b, s, h_kv, d, h, size, unit) in points.items():
        start = text.index(title)
        block = text[start:start + 3000]
        rows = {m[0]: [float(x) for x in m[1].split()] for m in re.findall(
            r"^\s*(contiguous|gather|sdpa|paged|triton)((?:\s+[\d.]+){9})\s+([\d.]+)x$",
            block, re.M)[:5]}
        ratios = {m[0]: float(m[1]) for m in re.findall(
            r"^\s*(contiguous|gather|sdpa|paged|triton)(?:\s+[\d.]+){9}\s+([\d.]+)x$",
            block, re.M)[:5]}
        assert set(rows) == {"contiguous", "gather", "sdpa", "paged", "triton"}, block
        per_position = 2 * h_kv * d * size
        kv = b * s * per_position
        copy = b * math.ceil(s / 16) * 16 * per_position + b * s * per_position
        tables = b * math.ceil(s / 16) * 8
        kv_write, q_out = b * per_position, 2 * b * h * d * size
        scores = 4 * b * h * s * 4
        # columns: read, written, total, kv_read, kv_copy, scores, tables, kv_write, q_out
        for name, row in rows.items():
            assert row[3] == pytest.approx(kv / unit, abs=0.01), name
            assert row[7] == pytest.approx(kv_write / unit, abs=0.01)
            assert row[8] == pytest.approx(q_out / unit, abs=0.01)
            assert row[2] == pytest.approx(row[0] + row[1], abs=0.02)
        assert rows["gather"][4] == rows["sdpa"][4] == pytest.approx(copy / unit, abs=0.01)
        assert rows["gather"][5] == pytest.approx(scores / unit, abs=0.01)
        assert rows["paged"][6] == rows["triton"][6] == pytest.approx(tables / unit, abs=0.01)
        paged_total = kv + tables + kv_write + q_out
        assert rows["paged"][2] == pytest.approx(paged_total / unit, abs=0.01)
        assert rows["gather"][2] == pytest.approx((kv + copy + scores + kv_write + q_out) / unit,
                                                  abs=0.01)
        for name, row in rows.items():
            assert ratios[name] == pytest.approx(row[2] / rows["paged"][2], abs=0.01), name
        assert ratios["gather"] > ratios["sdpa"] > 2.9 and ratios["paged"] == 1.0
    beside = re.search(r"^beside it, measured in section 3 at B = 8, context 192 \(the whole "
                       r"forward of 6 layers per decode step\): (.*)$", text, re.M)
    assert beside, text[-3000:]
    times = dict(re.findall(rf"(gather|sdpa|paged) {NUM} ms", beside.group(1)))
    assert {"gather", "sdpa"} <= set(times) and all(float(x) > 0 for x in times.values())
