"""exercises/grade.py: each chapter's points stand alone (issue 13).

Each case copies exercises/ into a temporary folder, changes the copy, and grades it through the
grader's own command line (`--exercises-dir`, `--results`) in a subprocess, as a learner runs it.
The oracle for a chapter's points is the `@pytest.mark.points(n)` weights in its test file.
"""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # each case runs the grader: a few seconds

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "exercises"


def points_of(chapter: str) -> int:
    """Sum of the points weights written in tests/exercises/test_ex_<chapter>.py."""
    (test_file,) = TESTS.glob(f"test_ex_{chapter}_*.py")
    total = 0
    for node in ast.parse(test_file.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            marks = [d for d in node.decorator_list
                     if isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.points"]
            total += marks[0].args[0].value if marks else 1
    return total


def grade(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    results = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / "exercises" / "grade.py"),
                           "--exercises-dir", str(tmp_path / "exercises"),
                           "--results", str(results), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(results.read_text())


def by_chapter(results: dict, chapter: str) -> list[dict]:
    return [t for t in results["tests"] if t["name"].startswith(f"test_ex_{chapter}_")]


def test_a_syntax_error_scores_0_of_its_own_chapter_and_the_others_still_count(tmp_path):
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    broken = tmp_path / "exercises" / "solutions" / "s07_measuring.py"
    lines = broken.read_text().count("\n")
    broken.write_text(broken.read_text() + "\ndef broken(:\n    pass\n")

    done, results = grade(tmp_path, "--solutions", "s01", "s07")

    s01, s07 = by_chapter(results, "s01"), by_chapter(results, "s07")
    assert s01 and all(t["status"] == "passed" for t in s01)
    assert sum(t["score"] for t in s01) == sum(t["max_score"] for t in s01) == points_of("s01")
    # The broken chapter keeps its weight in max_score and scores none of it.
    assert s07 and all(t["status"] == "failed" and t["score"] == 0 for t in s07)
    assert sum(t["max_score"] for t in s07) == points_of("s07")
    assert results["score"] == points_of("s01")
    assert results["max_score"] == points_of("s01") + points_of("s07")
    message = f"SyntaxError: invalid syntax (s07_measuring.py, line {lines + 2})"
    assert all(t["output"].startswith(message) for t in s07)
    # The table: per-chapter subtotals, and the error in one line, not a traceback.
    out = done.stdout
    assert "s01_generation_loop" in out and f"{points_of('s01')}/{points_of('s01')}" in out
    assert f"s07_measuring.py does not load: {message}" in out
    assert "TOTAL" in out and f"{points_of('s01')}/{points_of('s01') + points_of('s07')}" in out
    assert "Traceback" not in out and "\nE " not in out and "Interrupted" not in out


def test_a_failing_test_shows_one_line_and_verbose_the_traceback(tmp_path):
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")   # the learner's stubs

    done, results = grade(tmp_path, "s01")
    assert results["score"] == 0 and results["max_score"] == points_of("s01")
    row = next(line for line in done.stdout.splitlines()
               if "test_apply_stop_strings_earliest_and_tie" in line)
    assert row.split() == ["test_apply_stop_strings_earliest_and_tie", "0/1",
                           "NotImplementedError:", "exercise", "1a"]
    assert "\nE " not in done.stdout and "raise NotImplementedError" not in done.stdout

    verbose, _ = grade(tmp_path, "-v", "s01")
    assert 'raise NotImplementedError("exercise 1a")' in verbose.stdout


def test_an_exercises_dir_that_does_not_exist_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "exercises" / "grade.py"),
                           "--exercises-dir", str(tmp_path / "nope"), "s01"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--exercises-dir: no such directory" in done.stderr


# --- a solution that hangs or ends the process: the grader still finishes (issue 27) --------

def run_grader(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The grader's command line on tmp_path/exercises, whatever its exit status."""
    results = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / "exercises" / "grade.py"),
                           "--exercises-dir", str(tmp_path / "exercises"),
                           "--results", str(results), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert results.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(results.read_text())


def break_fit_growth(tmp_path: Path, body: str) -> None:
    """The copied reference solution of S01 with `body` as the first statement of
    fit_growth (test_fit_growth_recovers_power_laws, S01's sixth test, calls it)."""
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    path = tmp_path / "exercises" / "solutions" / "s01_generation_loop.py"
    source = path.read_text()
    head = next(line for line in source.splitlines() if line.startswith("def fit_growth("))
    path.write_text(source.replace(head + "\n", f"{head}\n    {body}\n", 1))


def check_s01_stopped_at_fit_growth(results: dict, reason: str) -> None:
    """S01's tests before fit_growth's keep their points; it and the test after it score 0
    with the reason; S04 is graded in full."""
    s01, s04 = by_chapter(results, "s01"), by_chapter(results, "s04")
    stopped = {"test_fit_growth_recovers_power_laws", "test_time_passes_measures_each_length"}
    for t in s01:
        if t["name"].split("::")[-1] in stopped:
            assert t["status"] == "failed" and t["score"] == 0
            assert t["output"].startswith(reason), t["output"][:200]
        else:
            assert t["status"] == "passed" and t["score"] == t["max_score"], t["name"]
    assert sum(t["max_score"] for t in s01) == points_of("s01")
    assert all(t["status"] == "passed" for t in s04)
    assert sum(t["score"] for t in s04) == points_of("s04")


def test_a_solution_that_hangs_times_out_and_the_other_chapters_still_count(tmp_path):
    break_fit_growth(tmp_path, "while True: pass")
    # The limit is waited out in full: short, yet several times the 2-5 s the chapter's worker
    # took to start and pass the five tests before fit_growth (load 2.4 on 2 cores).
    done, results = run_grader(tmp_path, "--solutions", "--timeout", "20", "s01", "s04")
    reason = "timed out after 20 s in test test_fit_growth_recovers_power_laws"
    check_s01_stopped_at_fit_growth(results, reason)
    assert f"grading stopped: {reason}" in done.stdout and "TOTAL" in done.stdout
    assert done.returncode == 1 and "grading did not complete for s01" in done.stderr


@pytest.mark.parametrize("where", ["test", "module"])
def test_a_solution_that_ends_the_process_is_named_and_the_others_still_count(tmp_path, where):
    if where == "test":             # os._exit(3) in the sixth test: five keep their points
        break_fit_growth(tmp_path, "import os; os._exit(3)")
        reason = ("the grading process exited with status 3 before its tests finished "
                  "(in test test_fit_growth_recovers_power_laws)")
    else:                           # os._exit(0) while the tests load: nothing ran
        shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
        path = tmp_path / "exercises" / "solutions" / "s01_generation_loop.py"
        path.write_text(path.read_text() + "\nimport os\nos._exit(0)\n")
        reason = ("the grading process exited with status 0 before its tests finished "
                  "(while loading the tests)")
    done, results = run_grader(tmp_path, "--solutions", "s01", "s04")
    if where == "test":
        check_s01_stopped_at_fit_growth(results, reason)
    else:
        s01 = by_chapter(results, "s01")
        assert all(t["score"] == 0 and t["output"].startswith(reason) for t in s01)
        assert sum(t["max_score"] for t in s01) == points_of("s01")
        assert results["score"] == points_of("s04")
    assert f"grading stopped: {reason}" in done.stdout
    assert done.returncode == 1


def test_sys_exit_while_the_exercise_loads_is_named(tmp_path):
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    path = tmp_path / "exercises" / "solutions" / "s01_generation_loop.py"
    lines = path.read_text().count("\n")
    path.write_text(path.read_text() + "\nimport sys\nsys.exit(0)\n")
    done, results = grade(tmp_path, "--solutions", "s01", "s04")   # graded: status 0
    message = f"SystemExit: 0 (s01_generation_loop.py, line {lines + 3})"
    assert f"s01_generation_loop.py does not load: {message}" in done.stdout
    assert all(t["output"].startswith(message) for t in by_chapter(results, "s01"))
    assert results["score"] == points_of("s04")
    assert "INTERNALERROR" not in done.stdout + done.stderr


def test_timeout_must_be_positive(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "exercises" / "grade.py"),
                           "--timeout", "0", "s01"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--timeout must be a number of seconds > 0" in done.stderr
