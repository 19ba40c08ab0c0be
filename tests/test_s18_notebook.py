"""The S18 notebook runs top to bottom headless and shows what it promises.

Executed once per test run with nbclient on a temporary copy (the notebook in the repository is
never written), from notebooks/ (tests/notebook_testing.py; the run is shared with the legend
test and the site build). Checks: no cell fails; it runs the chapter's pieces
(`ColumnParallelLinear.shard`, `RowParallelLinear`, `run_ranks`, `shard_model`, `shard_bytes`,
`allreduce_plan`, `rank_config`, `check_tensor_parallel`, S12's pool, the benchmark's
`measure_allreduce`) and defines none of them; its plots are there and no legend covers data
(tests/legend_check.py); its printed numbers keep their arithmetic, held to hand counts (times
are printed, never asserted):

- the worked example: each rank's gate/up shards (I/N, C) and down shard (C, I/N), the weight
  bytes 3 (I/N) C 4 of the unsplit 3 I C 4, a partial sum that is not the output, the sum that
  is S06's unsplit MLP, one all-reduce of T C 4 bytes;
- the whole forward: 1 + 2 L all-reduces of T C 4 bytes, logits equal to S06's, each rank's
  weight bytes counted here by hand;
- memory: S12's pool bytes and the hand formula 2 L positions Hkv_rank D 4, each row of the
  table (weights by hand, the key/value heads split or replicated), N = 8 refused for the
  bundled model (4 query heads);
- the all-reduce table: every size measured, every sum right, and the step plan (1 + 2 L
  messages of B C 4 bytes, their time the count x the printed median);
- the crossover: both models at T = 1 and 32, positive times, the ratios the printed times'
  ratios, logits of the split within 1e-4 of the unsplit; with a record, its rows as printed.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s18_tensor_parallel.ipynb"
RECORD = ROOT / "chapters" / "figures" / "s18_tensor_parallel.json"
NUM = r"(-?[\d.]+(?:e[-+]\d+)?)"
MIB = 2 ** 20
# The bundled model and MID_SHAPE, written out (the oracle does not read them from the code).
BUNDLED = dict(L=6, C=128, H=4, Hkv=2, D=32, I=384, V=2048)
MID = dict(L=8, C=512, H=8, Hkv=4, D=64, I=1536, V=8192)
POSITIONS = {"bundled": 64 * 256, "mid": 32 * 2048}

pytestmark = pytest.mark.skipif(not (ROOT / "data" / "model" / "model.safetensors").is_file(),
                                reason="data/model has no bundled model")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=120)


@pytest.fixture(scope="module")
def text(executed):
    return stream_text(executed)


def kv_heads(m: dict, n: int) -> int:
    """Key/value heads on a rank: Hkv / N when it divides, else one replicated head."""
    return m["Hkv"] // n if m["Hkv"] % n == 0 else 1


def weight_bytes(m: dict, n: int) -> int:
    """A rank's weight bytes, by hand: vocabulary rows, per layer two norms, its q rows, its
    key/value rows, its o columns, the q/k norms, its gate/up rows and down columns; the final
    norm; the head tied to the embedding."""
    c, d = m["C"], m["D"]
    layer = (2 * c + (m["H"] // n) * d * c + 2 * kv_heads(m, n) * d * c + c * (m["H"] // n) * d
             + 2 * d + 3 * (m["I"] // n) * c)
    return 4 * (m["V"] // n * c + m["L"] * layer + c)


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_uses_the_chapter_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    for line in ("import s18_layers", "import s06_torch as s06", "import s12_engine as s12",
                 "import bench_s18_tensor_parallel as bench"):
        assert line in source, line
    for call in ("s18_layers.ColumnParallelLinear.shard(", "s18_layers.RowParallelLinear(",
                 "s18_layers.run_ranks(", "s18_layers.shard_model(", "s18_layers.shard_bytes(",
                 "s18_layers.allreduce_plan(", "s18_layers.rank_config(",
                 "s18_layers.check_tensor_parallel(", "s12.PagedKVCache.for_model(",
                 "bench.measure_allreduce(", "bench.mid_config("):
        assert call in source, call
    for name in ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                 "ParallelLMHead", "TPTransformer", "TPQwen3Block", "shard_model", "shard_bytes",
                 "shard_shapes", "allreduce_plan", "run_ranks", "ThreadCommunicator",
                 "ShmCommunicator", "DistCommunicator", "rank_config", "kv_head_range",
                 "measure_allreduce", "TPExecutor", "build_engine"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3
    assert figures_checked(executed) >= 3
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_the_worked_example_is_the_unsplit_mlp(text):
    b = BUNDLED
    head = re.search(r"^T = (\d+) tokens, C = (\d+), I = (\d+), N = (\d+) ranks$", text, re.M)
    assert head, text[:3000]
    t_len, n = int(head.group(1)), int(head.group(4))
    assert (int(head.group(2)), int(head.group(3)), n) == (b["C"], b["I"], 2)
    rows = re.findall(r"^rank (\d): gate_proj \((\d+), (\d+)\), up_proj \((\d+), (\d+)\), "
                      r"down_proj \((\d+), (\d+)\); its features \((\d+), (\d+)\); reads "
                      r"([\d,]+) weight bytes of the unsplit ([\d,]+)$", text, re.M)
    assert [r[0] for r in rows] == ["0", "1"]
    part = b["I"] // n
    for r in rows:
        nums = [int(x.replace(",", "")) for x in r[1:]]
        assert nums[:8] == [part, b["C"], part, b["C"], b["C"], part, t_len, part]
        assert nums[8] == 3 * part * b["C"] * 4 and nums[9] == 3 * b["I"] * b["C"] * 4
    partial = re.search(rf"rank 0's partial sum against the whole output: max \|difference\| = "
                        rf"{NUM}", text)
    summed = re.search(rf"the all-reduce's sum against S06's unsplit MLP: max \|difference\| = "
                       rf"{NUM}", text)
    assert float(partial.group(1)) > 1e-2 and float(summed.group(1)) < 1e-5
    call = re.search(r"the all-reduce: (\d+) call of ([\d,]+) bytes per rank", text)
    assert int(call.group(1)) == 1
    assert int(call.group(2).replace(",", "")) == t_len * b["C"] * 4
    forward = re.search(r"one forward of (\d+) tokens on 2 ranks: (\d+) all-reduces = 1 \+ 2 x "
                        r"(\d+) layers \(the plan: (\d+)\), ([\d,]+) bytes each \(the plan: "
                        r"([\d,]+)\), ([\d,]+) bytes in all per rank", text)
    assert forward, text[:5000]
    count = 1 + 2 * b["L"]
    each = t_len * b["C"] * 4
    got = [int(x.replace(",", "")) for x in forward.groups()]
    assert got == [t_len, count, b["L"], count, each, each, count * each]
    logits = re.search(rf"logits against S06's unsplit model: max \|difference\| = {NUM}; "
                       rf"greedy next tokens equal: (True|False)", text)
    assert float(logits.group(1)) < 1e-4 and logits.group(2) == "True"
    per_rank = re.search(r"weight bytes per rank: \[([\d, ]+)\] \(shard_bytes says \[([\d, ]+)\]",
                         text)
    want = weight_bytes(b, 2)
    assert [int(x) for x in per_rank.group(1).split(",")] == [want, want]
    assert [int(x) for x in per_rank.group(2).split(",")] == [want, want]


@pytest.mark.slow
def test_memory_per_rank_by_hand(text):
    b = BUNDLED
    checks = re.findall(r"^N = (\d): S12's pool of 8 blocks on rank 0: ([\d,]+) bytes, the "
                        r"formula ([\d,]+); weight_bytes \[([\d, ]+)\], shard_bytes \[([\d, ]+)\]",
                        text, re.M)
    assert [int(c[0]) for c in checks] == [2, 4]
    for n, pool, formula, weights, shards in checks:
        n = int(n)
        want = 2 * b["L"] * 8 * 16 * kv_heads(b, n) * b["D"] * 4
        assert int(pool.replace(",", "")) == int(formula.replace(",", "")) == want
        assert [int(x) for x in weights.split(",")] == [weight_bytes(b, n)] * n
        assert [int(x) for x in shards.split(",")] == [weight_bytes(b, n)] * n
    rows = re.findall(r"^\s*(bundled|mid)\s+(\d)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                      r"([\d.]+)$", text, re.M)
    assert [(r[0], int(r[1])) for r in rows] == [("bundled", 1), ("bundled", 2), ("bundled", 4),
                                                 ("mid", 1), ("mid", 2), ("mid", 4), ("mid", 8)]
    for key, n, heads, weights, share, kv, total in rows:
        m, n = (BUNDLED if key == "bundled" else MID), int(n)
        assert int(heads) == kv_heads(m, n)
        assert float(weights) == pytest.approx(weight_bytes(m, n) / MIB, abs=0.006)
        assert float(share) == pytest.approx(weight_bytes(m, n) / weight_bytes(m, 1), abs=6e-4)
        kv_bytes = 2 * m["L"] * POSITIONS[key] * kv_heads(m, n) * m["D"] * 4
        assert float(kv) == pytest.approx(kv_bytes / MIB, abs=0.006)
        assert float(total) == pytest.approx((weight_bytes(m, n) + kv_bytes) / MIB, abs=0.011)
    refused = re.search(r"^\s*bundled\s+8\s+refused: (.*)$", text, re.M)
    assert refused and "4 query heads must divide" in refused.group(1)


@pytest.mark.slow
def test_the_allreduce_table_and_the_step_plan(text):
    head = re.search(r"^\s+bytes((?:\s+(?:gloo|shm) us)+)\s+sum right$", text, re.M)
    assert head, text[-6000:]
    comms = head.group(1).split()[::2]
    assert comms[0] == "gloo"
    rows = re.findall(r"^\s*(\d+)((?:\s+[\d.]+)+)\s+(True|False)$", text, re.M)
    sizes = [int(r[0]) for r in rows]
    assert sizes == [512, 2048, 16384, 65536, 1 << 20]
    median = {}
    for size, times, right in rows:
        values = [float(x) for x in times.split()]
        assert len(values) == len(comms) and all(v > 0 for v in values)
        assert right == "True"                              # every sum checked by the peer's
        median.update({(c, int(size)): v for c, v in zip(comms, values)})
    plan = re.findall(r"^\s*(bundled|mid)\s+(\d+)\s+(\d+)\s+(\d+)((?:\s+[\d.]+)+)$", text, re.M)
    assert [(p[0], int(p[1])) for p in plan] == [("bundled", 1), ("bundled", 32), ("mid", 1),
                                                 ("mid", 32)]
    for key, batch, count, each, ms in plan:
        m = BUNDLED if key == "bundled" else MID
        assert int(count) == 1 + 2 * m["L"] and int(each) == int(batch) * m["C"] * 4
        for c, value in zip(comms, ms.split()):
            assert float(value) == pytest.approx(int(count) * median[(c, int(each))] / 1e3,
                                                 rel=2e-3, abs=2e-3)


@pytest.mark.slow
def test_the_crossover_table(text):
    start = text.index("measured in this run, ranks as threads")
    rows = re.findall(rf"^\s*(bundled|mid)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}x\s+{NUM}x\s+"
                      rf"{NUM}$", text[start:], re.M)
    assert [(r[0], int(r[1])) for r in rows[:4]] == [("bundled", 1), ("bundled", 32),
                                                     ("mid", 1), ("mid", 32)]
    for key, t_len, one, two, split, ratio, ratio2, diff in rows[:4]:
        one, two, split = float(one), float(two), float(split)
        assert one > 0 and two > 0 and split > 0
        assert float(ratio) == pytest.approx(one / split, rel=0.02, abs=0.01)
        assert float(ratio2) == pytest.approx(two / split, rel=0.02, abs=0.01)
        assert float(diff) < 1e-4                          # the split is the same model
    crossover = json.loads(RECORD.read_text()).get("tp", {}).get("crossover", []) \
        if RECORD.is_file() else []
    if not crossover:
        assert "(no recorded crossover: the plot shows this run only)" in text
        return
    block = text[text.index("recorded in chapters/figures/s18_tensor_parallel.json: the engine"):]
    printed = re.findall(rf"^\s*(bundled|mid)\s+(\d+)((?:\s+{NUM}x?)+)$", block, re.M)
    assert len(printed) >= len(crossover)
    for row, (key, batch, numbers, *_) in zip(crossover, printed):
        values = [float(x.rstrip("x")) for x in numbers.split()]
        want = [row["tp1_ms"], row["tp1_2threads_ms"], row["tp2_shm_ms"], row["tp2_gloo_ms"],
                row["speedup_shm"], row["speedup_gloo"]]
        assert (key, int(batch)) == (row["model"], row["batch"])
        assert values == pytest.approx(want, abs=0.006)
    assert math.isfinite(sum(r["speedup_shm"] for r in crossover))
