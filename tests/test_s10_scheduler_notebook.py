"""The S10 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it builds S10's engine with
`s10_scheduler.build_engine`, reads its steps from S09's tracer (never an `engine.trace`), and
defines none of the scheduler's or the engine's code; both plots are there (throughput / TTFT /
end-to-end latency against the KV capacity with the preemption counts, and p99 latency by
priority class) and no legend covers data (tests/legend_check.py); the step table shows a
preemption and the resume, the resumed request's recomputed tokens equal its prompt length
(counted here with the tokenizer) plus the tokens it had made (counted from the trace); every
request's tokens are the same with and without preemption; the sweep measured every capacity
under both policies, made every token, freed all KV, preempted nobody at the largest capacity
and somebody at the smallest; the markdown states the prompt and output ranges and the longest
context the requests really have (printed by the notebook). Timings are printed, never asserted.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s10_scheduler.ipynb"
CAPACITIES = [2048, 512, 256, 160, 128, 96]          # the notebook's sweep, written here


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engine_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s10_scheduler import build_engine" in source
    assert "from s09_trace import trace" in source and ".trace" not in source
    for name in ("LLMEngine", "Scheduler", "SchedulerOutput", "TokenKVPool", "StepRecord",
                 "schedule", "update_from_output", "format_schedule_table"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert f"CAPACITIES = {CAPACITIES}" in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 2
    assert figures_checked(executed) >= 2
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_one_preemption_step_by_step(executed):
    import s03_transformer as s03
    import s06_torch as s06
    from s08_cli import corpus_prompts

    text = stream_text(executed)
    assert "same tokens with and without preemption: True" in text
    m = re.search(r"request (\d+) is preempted in step (\d+): it had made (\d+) tokens", text)
    assert m, text[:2000]
    victim, step, made = m.group(1), int(m.group(2)), int(m.group(3))
    _, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    prompt = len(tokenizer.encode(corpus_prompts(tokenizer, 8, 0, 256)[int(victim)]))
    back = re.search(rf"resumed request {victim} recomputes (\d+) tokens", text)
    assert back and int(back.group(1)) == prompt + made
    # The printed schedule table has the preemption in its step and the resume later.
    table = {int(line.split()[0]): line for line in text.splitlines()
             if re.match(r"^\s+\d+\s+\d+/\d+ ", line)}
    assert victim in table[step].split()[-3:-1] or f" {victim} " in table[step]
    assert any(f"{victim}({prompt + made})" in line for s, line in table.items() if s > step)


@pytest.mark.slow
def test_the_sweep_measured_every_capacity_under_both_policies(executed):
    text = stream_text(executed)
    rows = re.findall(r"^\s*(fcfs|priority) kv\s+(\d+):\s+\d+ tok/s,\s+(\d+) steps,\s+(\d+) "
                      r"preemptions", text, re.MULTILINE)
    for policy in ("fcfs", "priority"):
        mine = [(int(c), int(p)) for pol, c, _, p in rows if pol == policy]
        assert [c for c, _ in mine] == CAPACITIES
        assert mine[0][1] == 0 and mine[-1][1] > 0
    assert "every run made every token: True" in text
    assert "KV free at the end of every run: True" in text
    assert re.search(r"priority: priority 0 p50\s+[\d.]+ p99\s+[\d.]+; priority 1", text)


@pytest.mark.slow
def test_the_workload_prose_states_the_ranges_the_requests_have(executed):
    """The markdown gives the realised prompt and output ranges and the longest context, as
    the code cell prints them from the requests (not the ranges the lengths were drawn from)."""
    text = stream_text(executed)
    m = re.search(r"prompts (\d+) to (\d+) tokens, outputs (\d+) to (\d+) tokens \((\d+) in "
                  r"all\), longest prompt \+ output (\d+) tokens", text)
    assert m, text[:2000]
    p_lo, p_hi, o_lo, o_hi, total, longest = m.groups()
    prose = " ".join("".join(c.source) for c in executed.cells if c.cell_type == "markdown")
    prose = re.sub(r"\s+", " ", prose)
    assert f"prompts of {p_lo} to {p_hi} tokens" in prose
    assert f"outputs of {o_lo} to {o_hi} tokens" in prose
    assert f"{total} tokens in all" in prose
    assert f"longest prompt plus its output ({longest} tokens)" in prose
    assert int(longest) < min(CAPACITIES)           # nobody is ended by the capacity
