"""Chapter S19's split of the server's time against its committed record.

The Deep dive "where the server's time goes, measured" quotes the run committed as
chapters/figures/s19_split.json (`python benchmarks/bench_s19_split.py --json ...`). These
checks keep the prose from drifting when the benchmark is re-recorded: every cell of the
table is the record's median row, per generated token, derived as the benchmark's own report
derives it and rounded as written; every other decimal in the dropdown is one of the record's
figures (a median or one repeat's), and the load averages are the record's `uptime` lines.
The quiz item on the split quotes the same figures.
"""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "s19-server.md"
RECORD = ROOT / "chapters" / "figures" / "s19_split.json"
QUIZ = ROOT / "site" / "quizzes" / "s19-server.json"
OPENING = "````{dropdown} Deep dive: where the server's time goes, measured"


def _dropdown() -> str:
    text = CHAPTER.read_text()
    start = text.index(OPENING)
    return text[start:text.index("\n````", start + len(OPENING))]


def _per_token(row: dict) -> dict[str, tuple[float, ...]]:
    """The table's rows, label -> values, as bench_s19_split.report derives them."""
    local, served, rep = row["in_process"], row["server"], row["replay"]
    per, sper, rper = (1e3 / local["tokens"], 1e3 / served["tokens"], 1e3 / rep["tokens"])

    def both(key):
        return local[key] * per, served[key] * sper
    rest = served["event_loop_cpu_s"] - rep["sse_encode_s"] - rep["parse_request_s"]
    return {
        "wall, in process / server": both("wall_s"),
        "engine step, in process / server": both("step_s"),
        "of which the model call": both("model_s"),
        "engine thread between steps (waiting, or its own other work), in process / server":
            both("between_s"),
        "engine thread CPU, in process / server": both("thread_cpu_s"),
        "server's event loop thread CPU": (served["event_loop_cpu_s"] * sper,),
        "of which `parse_request` (replayed)": (rep["parse_request_s"] * rper,),
        "of which the chunks' JSON and SSE (replayed)": (rep["sse_encode_s"] * rper,),
        "the rest: uvicorn's HTTP, Starlette, FastAPI, asyncio": (rest * sper,),
        "detokenize and stop rules (replayed; with 4 stop strings)":
            (rep["postprocess_s"] * rper, rep["postprocess_4_stops_s"] * rper),
        "the load generator's CPU (httpx, SSE parsing)": (served["client_cpu_s"] * sper,),
    }


def _rounded(value: float, written: str) -> str:
    decimals = len(written.split(".")[1]) if "." in written else 0
    return f"{value:.{decimals}f}"


def _loads(uptime: str) -> tuple[str, ...]:
    return re.search(r"load average: ([\d.]+), ([\d.]+), ([\d.]+)", uptime).groups()


def test_the_record_is_the_chapters_run():
    record = json.loads(RECORD.read_text())
    config = record["config"]
    assert config["threads"] == 1 and config["device"] == "cpu" and config["repeats"] == 3
    assert [s["concurrency"] for s in record["summary"]] == [8, 64]
    assert len(record["rows"]) == config["repeats"] * len(record["summary"])
    text = " ".join(_dropdown().split())
    assert f"the same {config['requests']} corpus prompts" in text
    assert f"{config['max_tokens']} tokens each" in text
    assert "--json chapters/figures/s19_split.json" in text


def test_the_table_is_the_records_median_rows():
    record = json.loads(RECORD.read_text())
    columns = [_per_token(row) for row in record["summary"]]
    header = [f"{s['concurrency']} in flight" for s in record["summary"]]
    lines = [line for line in _dropdown().splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [""] + header
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [cells[0] for cells in body] == list(columns[0])
    for label, *cells in body:
        for column, cell in zip(columns, cells, strict=True):
            written = re.findall(r"\d+\.\d+", cell)
            assert written == [_rounded(v, w) for v, w in zip(column[label], written,
                                                               strict=True)], (label, cell)


def test_every_other_figure_and_the_load_are_the_records():
    record = json.loads(RECORD.read_text())
    prose = "\n".join(line for line in _dropdown().splitlines()[1:]
                      if not line.startswith("|"))
    values = [v for row in record["summary"] + record["rows"]
              for pair in _per_token(row).values() for v in pair]
    values += [row[way]["tokens_per_s"] for row in record["summary"]
               for way in ("in_process", "server")]
    values += [float(x) for key in ("uptime_before", "uptime_after")
               for x in _loads(record[key])]
    written = re.findall(r"(?<![\w.])(\d+\.\d+)", prose)
    assert len(written) >= 10, written
    for w in written:
        assert any(_rounded(v, w) == w for v in values), f"{w} is not in the record"
    flat = " ".join(prose.split())
    for s in record["summary"]:     # the throughputs, tokens per second, both ways
        tps = [f"{s[way]['tokens_per_s']:.0f}" for way in ("in_process", "server")]
        assert f"{tps[0]} against {tps[1]}" in flat
    before, after = _loads(record["uptime_before"])[0], _loads(record["uptime_after"])[0]
    assert re.findall(r"load average ([\d.]+) before and ([\d.]+) after", flat) == [
        (before, after)]


def test_the_quiz_item_quotes_the_record():
    record = json.loads(RECORD.read_text())
    eight = _per_token(next(s for s in record["summary"] if s["concurrency"] == 8))
    item = next(q for q in json.loads(QUIZ.read_text())["questions"] if q["id"] == "q8-split")
    text = item["explanation"]
    detok, detok_4 = eight["detokenize and stop rules (replayed; with 4 stop strings)"]
    loop, = eight["server's event loop thread CPU"]
    rest, = eight["the rest: uvicorn's HTTP, Starlette, FastAPI, asyncio"]
    client, = eight["the load generator's CPU (httpx, SSE parsing)"]
    for value in (detok, detok_4, loop, rest, client):
        assert f"{value:.3f} ms" in text or f"{value:.3f} of it" in text \
            or f"({value:.3f} with" in text, (value, text)
    before, after = _loads(record["uptime_before"])[0], _loads(record["uptime_after"])[0]
    assert f"load average {before} before and {after} after" in text
    right = item["choices"][item["answer"]]
    assert f"about {loop:.2f} ms" in right and f"About {detok:.2f} ms" in right
