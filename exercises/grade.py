"""Grade your exercises: runs the exercise tests against YOUR copy in exercises/, prints a score
table and writes an autograder results file in Gradescope's JSON format.

    python exercises/grade.py            # every chapter
    python exercises/grade.py s01        # one chapter
    python exercises/grade.py --solutions s01   # grade the reference solutions instead
    python exercises/grade.py --results out.json

The results file follows Gradescope's autograder specification (results.json with `score`,
`max_score`, `tests` entries of name/score/max_score/status/output).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "exercises"


class PointsCollector:
    """A pytest plugin that records each test's outcome and its @pytest.mark.points weight."""

    def __init__(self):
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        points = dict(report.user_properties).get("points", 1)
        entry = self.results.setdefault(report.nodeid, {"points": points, "passed": True, "output": ""})
        if report.failed or (report.when == "call" and report.skipped):
            entry["passed"] = False
            entry["output"] = (entry["output"] + "\n" + report.longreprtext).strip()[-1500:]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        marker = item.get_closest_marker("points")
        item.user_properties.append(("points", marker.args[0] if marker else 1))
        yield

    def pytest_collectreport(self, report):
        if report.failed:  # the module did not even import
            self.results[report.nodeid] = {"points": 0, "passed": False,
                                           "output": report.longreprtext[-1500:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Grade the course exercises.")
    parser.add_argument("chapters", nargs="*", help="chapter stems, e.g. s01 (default: all)")
    parser.add_argument("--solutions", action="store_true", help="grade the reference solutions")
    parser.add_argument("--results", type=Path, default=ROOT / "results.json",
                        help="where to write the Gradescope results file")
    args = parser.parse_args(argv)

    files = sorted(TESTS.glob("test_ex_*.py"))
    if args.chapters:
        files = [f for f in files if any(f.name.startswith(f"test_ex_{c}") for c in args.chapters)]
        if not files:
            parser.error(f"no exercise tests for {args.chapters}; "
                         f"known: {[f.name[8:11] for f in sorted(TESTS.glob('test_ex_*.py'))]}")
    os.environ["EXERCISES_IMPL"] = "solutions" if args.solutions else "learner"
    collector = PointsCollector()
    pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "-rN", "--tb=short",
                 "-o", "addopts=", *map(str, files)], plugins=[collector])

    rows, tests, score, max_score = [], [], 0.0, 0.0
    for nodeid, r in collector.results.items():
        got = r["points"] if r["passed"] else 0
        score += got
        max_score += r["points"]
        name = nodeid.split("/")[-1]
        rows.append((name, got, r["points"]))
        tests.append({"name": name, "score": got, "max_score": r["points"],
                      "status": "passed" if r["passed"] else "failed", "output": r["output"]})
    width = max([len(n) for n, _, _ in rows] + [10])
    print(f"\n{'exercise test':<{width}}  points")
    for name, got, pts in rows:
        print(f"{name:<{width}}  {got:g}/{pts:g}")
    print(f"{'TOTAL':<{width}}  {score:g}/{max_score:g}")
    results = {"score": score, "max_score": max_score, "tests": tests,
               "output": f"{score:g} of {max_score:g} points"}
    args.results.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
