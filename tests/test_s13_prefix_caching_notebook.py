"""The S13 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it builds S13's engine with
`s13_prefix_caching.build_engine`, reads its steps from S09's, S12's and S13's tracers (never an
`engine.trace`), and defines none of the cache's or the engine's code; its plots are there
(prompt tokens computed and steps to the first token against the shared fraction, the
benchmark's TTFT) and no legend covers data (tests/legend_check.py); the hand-worked hits equal
the engine's (worked out by hand below); the tokens are the same with the cache on and off, and
once idle no block is held while some stay cached; the live sweep finds, for each shared
fraction, the shared prefix rounded down to whole blocks (closed form here), computes the rest,
and takes ceil(computed / budget) steps to the first token, against the whole prompt without the
cache; of two identical chunked prompts added together, the second is admitted in the first step
that leaves budget over and finds the first one's blocks written so far (closed form here); the
benchmark's rows are printed as chapters/figures/s13_prefix_caching.json records them. Timings
are printed, never asserted.
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
NOTEBOOK = ROOT / "notebooks" / "s13_prefix_caching.ipynb"
RECORD = ROOT / "chapters" / "figures" / "s13_prefix_caching.json"
# Worked by hand (blocks of 4; the notebook's markdown says why): A computes all 10; B shares
# A's two full blocks; C is A's prompt, at most (10 - 1) // 4 = 2 blocks; D shares the first
# block only; E's salt changes its first block's name and so every later one.
HAND = {"A": 0, "B": 8, "C": 8, "D": 4, "E": 0}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engine_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s13_prefix_caching import build_engine, format_cache_table, trace_cache" in source
    assert "from s09_trace import trace" in source and ".trace" not in source
    for name in ("LLMEngine", "PrefixCachingKVCacheManager", "PrefixCachingBlockPool",
                 "CacheTracer", "hash_block_tokens", "hash_request_tokens",
                 "get_computed_blocks", "format_cache_table"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert "FRACTIONS = [0.0, 0.25, 0.5, 0.75, 0.9]" in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 2
    assert figures_checked(executed) >= 2
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_the_hand_worked_hits_are_the_engines(executed):
    text = stream_text(executed)
    found = dict(re.findall(r"^request (\w): (\d+) of 10 prompt tokens found cached, \d+ computed",
                            text, re.MULTILINE))
    assert {k: int(v) for k, v in found.items()} == HAND
    assert re.search(r"^\s+1\s+\d+\s+B 8/10 \| A:\[1x2,2x2,3\] B:\[1x2,2x2,\d+\]", text,
                     re.MULTILINE), text[:3000]            # B holds A's two blocks
    assert "same tokens with the cache on and off: True" in text
    m = re.search(r"after the run: (\d+) of (\d+) blocks free, (\d+) of them still cached", text)
    assert m and m.group(1) == m.group(2) and int(m.group(3)) > 0
    assert f"prompt tokens computed, cache on: {50 - sum(HAND.values())} off: 50" in text


@pytest.mark.slow
def test_the_live_sweep(executed):
    text = stream_text(executed)
    rows = re.findall(r"^shared (\S+) \(\s*(\d+) tokens\): found cached\s+(\d+); computed\s+(\d+) on "
                      r"vs\s+(\d+) off; first token after (\d+) vs (\d+) steps", text, re.MULTILINE)
    assert [float(r[0]) for r in rows] == [0.0, 0.25, 0.5, 0.75, 0.9]
    for f, shared, cached, on, off, s_on, s_off in rows:
        shared, cached, on, off = int(shared), int(cached), int(on), int(off)
        assert shared == round(float(f) * 240)
        assert cached == shared // 16 * 16                  # whole blocks of 16
        assert on == 240 - cached and off == 240
        assert int(s_on) == math.ceil(on / 32) and int(s_off) == math.ceil(240 / 32)


@pytest.mark.slow
def test_a_chunked_prompt_is_found_while_it_is_computed(executed):
    # Two copies of a 183-token prompt, added together, 32 tokens per step, blocks of 16: the
    # first takes the whole budget while it has 32 or more tokens left, so the second is
    # admitted in the first step s with 183 - 32 s < 32, when 32 s tokens of the first are
    # written: every full block of them is named, at most (183 - 1) // 16 blocks are taken.
    text = stream_text(executed)
    m = re.search(r"the second copy was admitted in step (\d+), when the first had (\d+) of its "
                  r"183 tokens computed, and found (\d+) of them cached \((\d+) blocks\)", text)
    assert m, text[-3000:]
    step = next(s for s in range(10) if 183 - 32 * s < 32)
    done = 32 * step
    found = min(done // 16, (183 - 1) // 16) * 16
    assert [int(g) for g in m.groups()] == [step, done, found, found // 16]
    assert re.search(rf"^\s+{step}\s+32\s+second {found}/183 \|", text, re.MULTILINE)


@pytest.mark.slow
def test_the_benchmark_record_is_printed_as_recorded(executed):
    text = stream_text(executed)
    record = json.loads(RECORD.read_text())
    for r in record["system_prompt"]:
        assert (f"shared {r['fraction']:4.2f}: cached {r['cached_tokens']:>4} of "
                f"{r['prompt_tokens']}; TTFT {r['ttft_ms']['on']:8.1f} ms on, "
                f"{r['ttft_ms']['off']:8.1f} ms off (off / on per repeat, median "
                f"{r['speedup']:.2f}x)") in text
    assert f"{record['hit_rate']['hits']} of {record['hit_rate']['queries']} tokens" in text
