"""The S19 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it starts the real server (`code/s19_server.py`, in a
subprocess on a free loopback port) and talks to it with the official client and with plain
HTTP, and defines none of the server's or the engine's code; it shuts the server down (the
process exits); the greedy completion, streamed or not, equals S06's engine alone (printed by
the notebook, and held here to the text the notebook printed); the raw stream is
`text/event-stream`, every non-blank line a `data:` event, the last one `data: [DONE]`, and
the finish reason comes only in the last chunk; every bad request got a 4xx (each status
printed is checked here) and the server answered afterwards; the concurrent streams each
equal their prompt alone; the benchmark plot is drawn from the committed JSON, and no legend
covers data (tests/legend_check.py). Timings are printed, never asserted.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("openai")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s19_server.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=600)


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_starts_the_real_server_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert 'ROOT / "code" / "s19_server.py"' in source and "subprocess.Popen" in source
    assert "openai.OpenAI(base_url=" in source and "server.terminate()" in source
    for name in ("build_app", "EngineLoop", "StreamWriter", "parse_request", "record_stream",
                 "LLMEngine", "collect_response", "make_engine"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert 'chapters" / "figures" / "s19_server.json"' in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 1
    assert figures_checked(executed) >= 1
    assert legend_coverings(executed) == []
    assert re.search(r"server exited with -?\d+", stream_text(executed))


@pytest.mark.slow
def test_one_request_three_ways(executed):
    text = stream_text(executed)
    assert "serving bundled" in text
    assert "stream joined equals the non-streaming text: True" in text
    assert "same text as the engine alone, in process: True | same finish_reason: True" in text
    chunks = ast.literal_eval(re.search(r"\n\d+ chunks: (\[.*\])\n", text).group(1))
    reasons = ast.literal_eval(re.search(r"finish_reason per chunk: (\[.*\])\n", text).group(1))
    whole = ast.literal_eval(re.search(r"text: ('.*'|\".*\")\n", text).group(1))
    assert "".join(chunks) == whole and len(chunks) == len(reasons) > 1
    assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] in ("stop", "length")


@pytest.mark.slow
def test_the_raw_stream_is_server_sent_events(executed):
    text = stream_text(executed)
    assert "content-type: text/event-stream" in text
    raw = [ast.literal_eval(line) for line in text.splitlines() if line.startswith(("'data", "''"))]
    events = [line for line in raw if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])
    chat = [line for line in text.splitlines() if line.startswith("data: ")]
    assert '"role": "assistant"' in chat[0] and chat[-1] == "data: [DONE]"
    assert '"choices": []' in chat[-2] and '"usage": {"prompt_tokens"' in chat[-2]


@pytest.mark.slow
def test_bad_requests_are_4xx_and_the_server_goes_on(executed):
    text = stream_text(executed)
    statuses = [int(s) for s in re.findall(r"-> (\d{3}) ", text)]
    assert len(statuses) == 8 and all(400 <= s < 500 for s in statuses), statuses
    assert statuses.count(404) == 1
    assert "every answer a 4xx: True" in text
    assert "the official client raises BadRequestError with param 'n'" in text
    assert "and the server still answers:" in text


@pytest.mark.slow
def test_concurrent_streams_and_the_benchmark(executed):
    text = stream_text(executed)
    assert "8 concurrent streams: TTFT median" in text
    assert "each stream's text equals its prompt run alone: True" in text
    ratios = re.findall(r"^concurrency\s+(\d+): server / in-process", text, re.MULTILINE)
    assert [int(c) for c in ratios] == [1, 8, 32, 64]


# The chapter's benchmark prose against the committed JSON ----------------------------------
# Try it quotes the run in chapters/figures/s19_server.json (the notebook plots the same
# file). These checks keep the prose from drifting when the benchmark is re-recorded: every
# ratio, every millisecond figure and every load average the chapter writes must be the JSON's,
# rounded as written.

CHAPTER = ROOT / "chapters" / "s19-server.md"
BENCH_JSON = ROOT / "chapters" / "figures" / "s19_server.json"


def _paragraph(text: str, opening: str) -> str:
    start = text.index(opening)
    return text[start:text.index("\n\n", start)]


def _rounded(value: float, written: str) -> str:
    decimals = len(written.split(".")[1]) if "." in written else 0
    return f"{value:,.{decimals}f}"


def _loads(uptime: str) -> list[str]:
    return re.search(r"load average: ([\d.]+), ([\d.]+), ([\d.]+)", uptime).groups()


def test_the_chapter_quotes_the_committed_benchmark():
    import json
    bench = json.loads(BENCH_JSON.read_text())
    text = CHAPTER.read_text()
    prose = _paragraph(text, "The ratios, server over in process")
    caption = _paragraph(text, "The benchmark, `python benchmarks/bench_s19_server.py --out")
    levels = [r["concurrency"] for r in bench["ratios"]]
    ratios = {r["concurrency"]: r for r in bench["ratios"]}
    assert levels == bench["config"]["concurrency"]
    listed = ", ".join(map(str, levels[:-1])) + f" and {levels[-1]}"
    assert f"at {listed} requests in flight" in " ".join(prose.split())
    for key, label in (("ttft_p50", "median TTFT"), ("itl_p50", "median inter-token latency"),
                       ("output_tokens_per_s", "output tokens per second")):
        number = r"×\d+(?:\.\d+)?"
        found = re.search(re.escape(label) + rf"\s+((?:{number}(?:,\s+|\s+and\s+)?)+)", prose)
        assert found, label
        written = re.findall(r"×(\d+(?:\.\d+)?)", found.group(1))
        assert len(written) == len(levels), (label, written)
        assert written == [_rounded(ratios[c][key], w) for c, w in zip(levels, written)], label
    # Every decimal number the paragraph writes is one of the JSON's, rounded as written: a
    # ratio (median or one repeat's), a latency of a summary row or a run, a throughput, a
    # load average. The one exception is the sentence that quotes a reviewer's --quick run.
    values = [v for r in bench["ratios"] for k, v in r.items() if k != "concurrency"
              for v in (v if isinstance(v, list) else [v])]
    values += [row[metric][stat] for row in bench["summary"] + bench["runs"]
               for metric in ("ttft", "itl", "e2e")
               for stat in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")]
    values += [row["output_tokens_per_s"] for row in bench["summary"] + bench["runs"]]
    values += [float(x) for key in ("uptime_before", "uptime_after")
               for x in _loads(bench[key])]
    own = " ".join(sentence for sentence in re.split(r"(?<=\.)\s+", prose)
                   if "reviewer" not in sentence)
    written = re.findall(r"(?<![\w.])(\d[\d,]*\.\d+)", own)
    assert len(written) >= 20, written
    for w in written:
        assert any(_rounded(v, w) == w for v in values), f"{w} is not in the JSON"
    # The load averages: one-minute values before and after, as `uptime` recorded them.
    before, after = _loads(bench["uptime_before"])[0], _loads(bench["uptime_after"])[0]
    for where in (prose, caption):
        loads = re.findall(r"load average (?:of )?([\d.]+) before and ([\d.]+) after", where)
        assert loads == [(before, after)], where[:80]
    assert f"{bench['config']['requests']} corpus" in caption
    assert f"{bench['config']['max_tokens']} tokens each" in caption
