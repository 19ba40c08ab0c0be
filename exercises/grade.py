"""Grade your exercises: runs the exercise tests against YOUR copy in exercises/, prints a score
table and writes an autograder results file in Gradescope's JSON format.

    python exercises/grade.py            # every chapter
    python exercises/grade.py s01        # one chapter
    python exercises/grade.py --solutions s01   # grade the reference solutions instead
    python exercises/grade.py --results out.json
    python exercises/grade.py -v s01     # pytest's own output, full tracebacks included

Each chapter is graded on its own (one pytest run per tests/exercises/test_ex_<chapter>.py, in
a worker process the grader watches), so its points stand alone: an exercise file that does not
even import (a syntax error, a typo at module level) scores 0 of its own chapter's points, with
the error named in one line, and the other chapters still count. A chapter whose run goes past
the time limit (`--timeout`, seconds per chapter: an endless loop) or whose process ends early
(`os._exit`) keeps the points of the tests that finished and scores 0 for the others, with the
reason in one line ("timed out after 300 s in test ..."); the grader then exits with status 1.
The table shows, per failing test, the one-line message of what failed (the assertion, or the
exception); `-v` shows pytest's output as well.

The results file follows Gradescope's autograder specification (results.json with `score`,
`max_score`, `tests` entries of name/score/max_score/status/output).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "exercises"
MESSAGE_CHARS = 160   # one table line: test name, points, message
TIMEOUT_S = 300       # per chapter; each chapter's tests take seconds


def declared_points(test_file: Path) -> dict[str, float]:
    """{test name: points} read from the source of `test_file` (its `@pytest.mark.points(n)`
    decorators, 1 without one), without importing it: the points a chapter is worth even when
    its exercise file does not import."""
    points = {}
    for node in ast.parse(test_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            points[node.name] = 1
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.points"
                        and dec.args and isinstance(dec.args[0], ast.Constant)):
                    points[node.name] = dec.args[0].value
    return points


def one_line(text: str) -> str:
    """The last `E   ...` line of a pytest failure text (the exception and its message), with
    the last file:line it names when that is an exercise file (a SyntaxError's place)."""
    # pytest's `E` lines; an exception pytest did not expect (sys.exit in an exercise file,
    # while the tests load) comes as INTERNALERROR lines instead
    errors = [line.removeprefix("INTERNALERROR>")[1:].strip() for line in text.splitlines()
              if line.startswith(("E ", "INTERNALERROR> "))]
    message = next((e for e in reversed(errors) if re.match(r"\w+(Error|Exception|Exit)\b", e)),
                   errors[-1] if errors else (text.strip().splitlines() or ["failed"])[-1])
    places = re.findall(r'File "([^"]+)", line (\d+)|^(\S+\.py):(\d+):', text, re.M)
    if places:
        path, line = next((a or c, b or d) for a, b, c, d in reversed(places))
        if "exercises" in Path(path).parts[-2:] or "solutions" in Path(path).parts[-2:]:
            message += f" ({Path(path).name}, line {line})"
    return message


def crash_line(report) -> str:
    """One line for a failed test: an assert's own message, or else the failing statement and
    pytest's explanation of it squashed onto a line, or the exception and its message."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None or not crash.message.strip():
        return one_line(report.longreprtext)
    lines = [line.strip() for line in crash.message.strip().splitlines() if line.strip()]
    if not re.match(r"(AssertionError: )?assert\b", lines[0]):
        return lines[0]  # `assert x, "message"`, or another exception: its first line says it
    # A bare assert: the statement (the line before pytest's `E` lines) and what it compared.
    text = report.longreprtext.splitlines()
    first_e = next((i for i, line in enumerate(text) if line.startswith("E ")), len(text))
    statement = text[first_e - 1].strip() if first_e > 0 else ""
    explained = " ".join([lines[0]] + [x for x in lines[1:3] if not x.startswith("+")])
    explained = explained.removeprefix("AssertionError: ")
    where = f"{Path(crash.path).name}:{crash.lineno}"
    return f"{where}: {statement} -- {explained}" if statement.startswith("assert") \
        else f"{where}: {explained}"


class PointsCollector:
    """A pytest plugin that records each test's outcome and its @pytest.mark.points weight.
    With a `progress` file, it writes there, as JSON, the test running now and the entries of
    the tests that finished, at each start and finish: what the grader still knows when the
    run is killed (a timeout) or its process ends early."""

    def __init__(self, progress: Path | None = None):
        self.results: dict[str, dict] = {}
        self.collect_error: str | None = None
        self.progress, self.current, self.finished = progress, None, []

    def write_progress(self) -> None:
        if self.progress is not None:
            state = {"current": self.current, "finished": {
                nodeid: self.results[nodeid] for nodeid in self.finished
                if nodeid in self.results}}
            tmp = self.progress.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.progress)

    def pytest_runtest_logstart(self, nodeid, location):
        self.current = nodeid
        self.write_progress()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.finished.append(nodeid)
        self.current = None
        self.write_progress()

    def pytest_runtest_logreport(self, report):
        points = dict(report.user_properties).get("points", 1)
        entry = self.results.setdefault(report.nodeid, {"points": points, "passed": True,
                                                        "output": "", "message": ""})
        if report.failed or (report.when == "call" and report.skipped):
            entry["passed"] = False
            if report.skipped:  # longrepr is (path, line, reason)
                entry["message"] = entry["message"] or f"skipped: {report.longrepr[2]}"
            else:
                message = crash_line(report)
                if report.when != "call":  # a fixture failed, or teardown did
                    message += f" (in {report.when})"
                entry["message"] = entry["message"] or message
            entry["output"] = (entry["output"] + "\n" + report.longreprtext).strip()[-1500:]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        marker = item.get_closest_marker("points")
        item.user_properties.append(("points", marker.args[0] if marker else 1))
        yield

    def pytest_collectreport(self, report):
        if report.failed:  # the module did not even import
            self.collect_error = report.longreprtext


def grade_file(test_file: Path, verbose: bool, progress: Path | None = None
               ) -> tuple[list[dict], str | None]:
    """Run one chapter's exercise tests in this process; return (one entry per test, the load
    error or None). An entry: name, points, passed, message (one line), output (the
    traceback's last part). progress: see `PointsCollector`."""
    collector = PointsCollector(progress)
    for name in [m for m in sys.modules if m.startswith("test_ex_")]:
        del sys.modules[name]  # a second call in one process imports the tests afresh
    options = ["-p", "no:cacheprovider", "--no-header", "-o", "addopts=", "--strict-markers",
               *(["-v"] if verbose else ["-q", "--tb=short", "-rN"]), str(test_file)]
    captured = io.StringIO()
    with contextlib.ExitStack() as stack:
        if not verbose:
            stack.enter_context(contextlib.redirect_stdout(captured))
            stack.enter_context(contextlib.redirect_stderr(captured))
        code = pytest.main(options, plugins=[collector])
    internal = one_line(captured.getvalue()) if code == pytest.ExitCode.INTERNAL_ERROR else ""
    if code == pytest.ExitCode.USAGE_ERROR or (   # not an exception in the exercise code
            internal and not re.search(r"\(\S+\.py, line \d+\)$", internal)):
        print(captured.getvalue(), file=sys.stderr)  # pytest itself failed: show why
    entries = [{"name": nodeid.split("/")[-1], **r} for nodeid, r in collector.results.items()]
    error = None
    if collector.collect_error is not None or code not in (0, 1):
        error = one_line(collector.collect_error or captured.getvalue() or f"pytest exit {code}")
    if error is not None or not entries:
        # Nothing (or not everything) ran: every declared test scores 0 of its points.
        error = error or "no test ran"
        text = collector.collect_error or captured.getvalue()
        ran = {e["name"] for e in entries}
        for name, points in declared_points(test_file).items():
            if f"{test_file.name}::{name}" not in ran:
                entries.append({"name": f"{test_file.name}::{name}", "points": points,
                                "passed": False, "message": error, "output": text[-1500:]})
    return entries, error


def unfinished(test_file: Path, finished: list[dict], reason: str) -> list[dict]:
    """The entries of a chapter whose run stopped early: those of the tests that finished,
    then every other declared test, failed with the reason."""
    done = {e["name"] for e in finished}
    return finished + [{"name": f"{test_file.name}::{name}", "points": points,
                        "passed": False, "message": reason, "output": ""}
                       for name, points in declared_points(test_file).items()
                       if f"{test_file.name}::{name}" not in done]


def run_chapters(files: list[Path], verbose: bool, timeout: float
                 ) -> list[tuple[list[dict], str | None, bool]]:
    """Grade the chapters in order in a worker process (`worker`: `grade_file` for each, its
    imports shared as in one process), each chapter killed past `timeout` seconds. A worker
    that is killed or ends early is replaced by a new one for the chapters after. Returns,
    per chapter, (entries, error or None, complete): complete is False when its run timed
    out or the worker ended before its tests did; then the tests that finished keep their
    results and the others score 0, the error saying why in one line."""
    results: dict[Path, tuple] = {}
    remaining = list(files)
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        def path(test_file: Path, kind: str) -> Path:
            return Path(tmp) / f"{test_file.stem}.{kind}.json"

        while remaining:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                       "--worker", tmp, *(["-v"] if verbose else []),
                                       *map(str, remaining)], cwd=ROOT)
            current, since, status = None, 0.0, None
            while status is None:
                status = proc.poll()
                now = next((f for f in remaining if not path(f, "report").exists()), None)
                if now is None:             # every chapter reported
                    current = None
                    break
                if now != current:          # a chapter's clock starts when it is next
                    current, since = now, time.monotonic()
                if status is None and time.monotonic() - since > timeout:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.05)
            else:
                current = next((f for f in remaining if not path(f, "report").exists()), None)
            for test_file in remaining:
                if path(test_file, "report").exists():
                    report = json.loads(path(test_file, "report").read_text())
                    results[test_file] = (report["entries"], report["error"], True)
            if proc.poll() is None:
                proc.wait()
            if current is None:
                break
            why = (f"timed out after {timeout:g} s" if status is None else
                   f"the grading process exited with status {status}")
            results[current] = stopped_chapter(current, path(current, "progress"), why,
                                               timed_out=status is None)
            remaining = remaining[remaining.index(current) + 1:]
    return [results[f] for f in files]


def stopped_chapter(test_file: Path, progress: Path, why: str, timed_out: bool
                    ) -> tuple[list[dict], str, bool]:
    """(entries, reason, False) for a chapter whose run stopped: the tests that finished keep
    their results (the worker's progress file), the others score 0 with the reason, which
    names the test that was running when it is known."""
    state = json.loads(progress.read_text()) if progress.exists() else {}
    finished = [{"name": nodeid.split("/")[-1], **r}
                for nodeid, r in state.get("finished", {}).items()]
    current = state.get("current")
    where = (f"in test {current.split('::')[-1]}" if current else
             "while loading the tests" if not finished else "after its last test")
    reason = f"{why} {where}" if timed_out else f"{why} before its tests finished ({where})"
    return unfinished(test_file, finished, reason), reason, False


def worker(report_dir: Path, files: list[Path], verbose: bool) -> int:
    """`run_chapters`' worker: grade each chapter in this process, writing its progress and
    then its entries into report_dir."""
    for test_file in files:
        if not verbose:
            print(f"grading {test_file.stem[len('test_ex_'):]} ...", flush=True)
        entries, error = grade_file(test_file, verbose,
                                    report_dir / f"{test_file.stem}.progress.json")
        (report_dir / f"{test_file.stem}.report.json").write_text(
            json.dumps({"entries": entries, "error": error}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Grade the course exercises: each chapter's tests on its own, a table of "
                    "points per test and per chapter, and a Gradescope results file.")
    parser.add_argument("chapters", nargs="*", help="chapter stems, e.g. s01 (default: all)")
    parser.add_argument("--solutions", action="store_true",
                        help="grade the reference solutions (EXERCISES/solutions/) instead of "
                             "your copy")
    parser.add_argument("--exercises-dir", type=Path, default=ROOT / "exercises",
                        metavar="EXERCISES",
                        help="folder holding the exercise files, solutions/ inside it "
                             "(default: exercises/)")
    parser.add_argument("--results", type=Path, default=ROOT / "results.json",
                        help="where to write the Gradescope results file (default: results.json)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show pytest's own output, full tracebacks included")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="SECONDS",
                        help="time limit for each chapter's tests; past it the chapter's "
                             "unfinished tests score 0 (default: %(default)g)")
    # `run_chapters`' worker process: --worker REPORT_DIR TEST_FILE...
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, [Path(f) for f in args.chapters], args.verbose)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a number of seconds > 0 (got {args.timeout:g})")

    files = sorted(TESTS.glob("test_ex_*.py"))
    if args.chapters:
        files = [f for f in files if any(f.name.startswith(f"test_ex_{c}") for c in args.chapters)]
        if not files:
            parser.error(f"no exercise tests for {args.chapters}; "
                         f"known: {[f.name[8:11] for f in sorted(TESTS.glob('test_ex_*.py'))]}")
    if not args.exercises_dir.is_dir():
        parser.error(f"--exercises-dir: no such directory: {args.exercises_dir}")
    os.environ["EXERCISES_IMPL"] = "solutions" if args.solutions else "learner"
    os.environ["EXERCISES_DIR"] = str(args.exercises_dir.resolve())

    chapters, tests, score, max_score, stopped = [], [], 0.0, 0.0, []
    for test_file, (entries, error, complete) in zip(
            files, run_chapters(files, args.verbose, args.timeout)):
        chapter = test_file.stem[len("test_ex_"):]
        if not complete:
            stopped.append(chapter)
        got = sum(e["points"] for e in entries if e["passed"])
        out_of = sum(e["points"] for e in entries)
        chapters.append((chapter, got, out_of, error, complete, entries))
        score, max_score = score + got, max_score + out_of
        for e in entries:
            tests.append({"name": e["name"], "score": e["points"] if e["passed"] else 0,
                          "max_score": e["points"],
                          "status": "passed" if e["passed"] else "failed",
                          "output": (e["message"] + "\n\n" + e["output"]).strip()
                          if not e["passed"] else e["output"]})

    width = max([len(e["name"].split("::")[-1]) + 2 for *_, entries in chapters
                 for e in entries] + [24])
    print(f"\n{'exercise test':<{width}}  points")
    for chapter, got, out_of, error, complete, entries in chapters:
        note = (f"  {chapter}.py does not load: {error}" if error and complete else
                f"  grading stopped: {error}" if error else "")
        print(f"{chapter:<{width}}  {got:g}/{out_of:g}{note}")
        if error and (complete or not got):
            continue  # one line for the chapter: every test failed the same way
        for e in entries:
            got_e = e["points"] if e["passed"] else 0
            message = "" if e["passed"] else "  " + e["message"][:MESSAGE_CHARS]
            print(f"  {e['name'].split('::')[-1]:<{width - 2}}  {got_e:g}/{e['points']:g}{message}")
    print(f"{'TOTAL':<{width}}  {score:g}/{max_score:g}")
    if not args.verbose and any(not e["passed"] for *_, entries in chapters for e in entries):
        print("(one line per failure; python exercises/grade.py -v CHAPTER shows the tracebacks)")
    results = {"score": score, "max_score": max_score, "tests": tests,
               "output": f"{score:g} of {max_score:g} points; " + ", ".join(
                   f"{c} {g:g}/{m:g}" for c, g, m, *_ in chapters)}
    args.results.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.results}")
    if stopped:
        print(f"grading did not complete for {', '.join(stopped)}: their unfinished tests "
              "score 0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
