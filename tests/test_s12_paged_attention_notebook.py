"""The S12 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it builds S12's engine with `s12_engine.build_engine`,
reads its steps from S09's and S12's tracers (never an `engine.trace`), and defines none of the
pool's, the manager's, the scheduler's or the engine's code; its plots are there and no legend
covers data (tests/legend_check.py); the memory run made S11's tokens and its peaks are ordered
(used <= paged < contiguous, the contiguous peak 256 per request of the 8); at the same KV
memory the paged engine ran at least 3 times the requests at once (the issue's target) with the
same tokens; the block-size sweep covers 1 to 256, wastes nothing at block size 1, never more
than block_size - 1 per request, more as blocks grow, with tables that shrink as cdiv(longest
context, block_size), every block size making the same tokens, a mean waste per request and step
that agrees with the share printed and the tokens a request holds on average; the printed slot
mapping equals the block-table arithmetic worked here (table[p // 8] * 8 + p % 8) and the pool
is empty after the run, with the preemptions the small pool forces; the KV budget of
published configs (s12_kv_budget's PUBLISHED_CONFIGS, not a copy) gives Llama-3.1-8B's blocks,
tokens and requests as worked by hand in the test, fp8 twice the blocks, under a header and a
legend.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s12_paged_attention.ipynb"
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=600)


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engine_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s12_engine import build_engine, format_block_table, trace_blocks" in source
    assert "from s09_trace import trace" in source and ".trace" not in source
    for name in ("LLMEngine", "ChunkedScheduler", "KVCacheManager", "BlockPool",
                 "FreeBlockQueue", "PagedKVCache", "PagedRunner", "BlockTracer",
                 "allocate_slots", "slot_mapping", "format_block_table", "cdiv"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert f"BLOCK_SIZES = {BLOCK_SIZES}" in source
    # The published configs come from the calculator's presets, not a second copy here.
    assert "CONFIGS = kvb.PUBLISHED_CONFIGS" in source
    assert "num_key_value_heads" not in source and "intermediate_size" not in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 2
    assert figures_checked(executed) >= 2
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_reserved_against_used(executed):
    text = stream_text(executed)
    assert "same tokens as S11's contiguous engine: True" in text
    m = re.search(r"peak: used (\d+) tokens, paged (\d+) positions, contiguous (\d+) positions",
                  text)
    assert m, text[:2000]
    used, paged, contiguous = map(int, m.groups())
    assert used <= paged < contiguous == 8 * 256
    assert paged - used < 8 * 16                     # at most one part-filled block each
    m = re.search(r"paged uses ([\d.]+)% of what it holds, contiguous ([\d.]+)% of what it "
                  r"reserves", text)
    assert m and float(m.group(1)) > 2 * float(m.group(2))


@pytest.mark.slow
def test_more_requests_fit_in_the_same_memory(executed):
    text = stream_text(executed)
    rows = dict((name, (int(most), float(mean))) for name, most, mean in re.findall(
        r"^\s*(contiguous|paged): at most\s+(\d+) running,\s+([\d.]+) on average", text, re.M))
    assert rows["contiguous"][0] == 1024 // 256
    assert rows["paged"][0] >= 3 * rows["contiguous"][0]
    assert rows["paged"][1] > rows["contiguous"][1]
    assert "same tokens: True" in text


@pytest.mark.slow
def test_waste_and_table_size_against_block_size(executed):
    text = stream_text(executed)
    found = re.findall(
        r"^block size\s+(\d+): waste\s+([\d.]+)% of the positions held \(worst per request\s+"
        r"(\d+)\), longest block table\s+(\d+) blocks, mean waste\s+([\d.]+) positions per "
        r"request and step", text, re.M)
    rows = [(int(b), float(w), int(worst), int(t)) for b, w, worst, t, _ in found]
    means = {int(b): float(m) for b, _, _, _, m in found}
    assert [r[0] for r in rows] == BLOCK_SIZES
    assert rows[0][1] == 0.0 and rows[0][2] == 0
    waste = [r[1] for r in rows]
    assert waste == sorted(waste)
    longest = rows[0][3]                                 # block size 1: one block per token
    for bs, _, worst, table in rows:
        assert worst <= bs - 1
        assert table == -(-longest // bs), (bs, table)   # cdiv(longest context, block size)
    assert "every block size made the same tokens: True" in text
    assert means[1] == 0.0
    for bs, _, worst, _ in rows:
        assert 0 <= means[bs] <= worst
    # Per request, held - used is the mean waste at the first run's block size (16), and the
    # share printed for 16 is that waste over the positions held.
    m = re.search(r"a running request holds ([\d.]+) tokens on average over its steps, in "
                  r"([\d.]+) positions at block size 16", text)
    assert m, text[-2000:]
    tokens, positions = map(float, m.groups())
    assert abs((positions - tokens) - means[16]) < 0.11
    share16 = next(w for b, w, _, _ in rows if b == 16)
    assert abs(100 * means[16] / positions - share16) < 0.2


@pytest.mark.slow
def test_one_step_slot_mapping_and_an_empty_pool(executed):
    text = stream_text(executed)
    rows = re.findall(r"request (\S+): block table \[([\d, ]+)\], positions (\d+)\.\.(\d+) -> "
                      r"slots \[([\d, ]+)\]; by hand: (\w+)", text)
    assert len(rows) >= 2
    for _, table, start, end, slots, ok in rows:
        table = [int(x) for x in table.split(",")]
        want = [table[p // 8] * 8 + p % 8 for p in range(int(start), int(end) + 1)]
        assert [int(x) for x in slots.split(",")] == want and ok == "True"
    m = re.search(r"preempted \(step, request\): (\[.*\])", text)
    assert m and len(ast.literal_eval(m.group(1))) >= 1
    assert "after the run: 13 of 13 blocks free, block tables {}" in text


@pytest.mark.slow
def test_kv_budget_of_real_configs(executed):
    # The calculator on published configs: Llama-3.1-8B's numbers worked by hand here
    # (2 x 32 layers x 8 KV heads x 128 dims x 2 bytes a token; 0.9 x 80e9 - 2 x 8,030,261,248
    # bytes of weights - 2 GiB reserve, in blocks of 16 tokens, block 0 the null block).
    text = stream_text(executed)
    assert "Llama-3.1-8B: 8,030,261,248 parameters, 131,072 bytes of KV per token" in text
    assert "Qwen3-0.6B: 596,049,920 parameters, 114,688 bytes of KV per token" in text
    kv_bytes = 72 * 10**9 - 2 * 8_030_261_248 - 2 * 2**30
    assert len(re.findall(r"^model\s+KV/token\s+blocks\s+tokens\s+max_model_len\s+contiguous"
                          r"\s+paged@2,048$", text, re.M)) == 2
    rows = re.findall(r"^(\S+)\s+([\d.]+) KiB\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+(\d+)\s+"
                      r"([\d,]+)$", text, re.M)
    assert len(rows) == 6, text[-3000:]
    assert [r[0] for r in rows] == 2 * ["Llama-3.1-8B", "Qwen3-0.6B", "Qwen2.5-7B-Instruct"]
    assert re.search(r"^  paged@2,048 +requests of 2,048 tokens", text, re.M)   # the legend
    as_int = lambda s: int(s.replace(",", ""))                             # noqa: E731
    bf16, fp8 = rows[:3], rows[3:]
    name, kib, blocks, tokens, max_len, contiguous, paged = bf16[0]
    assert name == "Llama-3.1-8B" and float(kib) == 128.0
    assert as_int(blocks) == kv_bytes // (16 * 131072) == 25_650
    assert as_int(tokens) == 25_649 * 16
    assert as_int(max_len) == 131072 and int(contiguous) == kv_bytes // (131072 * 131072) == 3
    assert as_int(paged) == 25_649 // (2048 // 16) == 200
    assert as_int(fp8[0][2]) == kv_bytes // (16 * 65536)                   # fp8: twice the blocks
    for (_, _, b16, _, _, c16, _), (_, _, b8, _, _, c8, _) in zip(bf16, fp8):
        assert as_int(b8) in (2 * as_int(b16), 2 * as_int(b16) + 1) and int(c8) >= 2 * int(c16)
    lens = re.findall(r"^max_model_len\s+([\d,]+): contiguous\s+(\d+) requests, paged\s+(\d+)",
                      text, re.M)
    assert [as_int(m) for m, _, _ in lens] == [4096, 8192, 16384, 32768, 65536, 131072]
    for m, c, p in lens:
        assert int(c) == kv_bytes // (as_int(m) * 131072) and int(p) == 200
