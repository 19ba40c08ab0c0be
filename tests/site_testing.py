"""Helpers shared by tests/test_site_build.py and tests/test_site_browser.py (not a test module).

- `site_module(name)`: import site/build.py or site/ext/*.py (site/ is not a package).
- `make_fixture_tree(dest)`: a small source tree with one placeholder chapter that uses every
  chapter-facing feature (literalinclude from code/, dollar math, an SVG figure, the simulator,
  a quiz, a notebook), so the site machinery is tested independently of the real chapters.
- `built(src, out)`: build a tree once per test session (both test modules share the result).
- `seed_notebook_cache(root)`: the repository's build renders the notebooks as the notebook tests
  executed them (tests/notebook_testing.py, once per run for all of them), put into the site's
  execution cache (jupyter-cache, the folder site/conf.py names), instead of running each one a
  second time; `make site` still executes them itself (the fixture build here does too).
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
_BUILDS: dict[tuple[str, str], object] = {}

SECTIONS = ["Motivation", "Core idea", "Mechanics", "Try it", "Build it", "In production",
            "Exercises", "Check yourself"]


def site_module(name: str):
    """Import site/<name>.py or site/ext/<name>.py once and return the module."""
    key = f"course_site_{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = SITE / f"{name}.py"
    if not path.exists():
        path = SITE / "ext" / f"{name}.py"
    if str(SITE / "ext") not in sys.path:
        sys.path.insert(0, str(SITE / "ext"))
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


FIXTURE_CHAPTER = """\
# S99 · A placeholder chapter

A page of the test fixture, not of the course.

## Motivation

Inline math $n^2$ and a display:

$$\\sum_{{n=1}}^{{N}} n = \\frac{{N(N+1)}}{{2}}$$

## Core idea

```{{figure}} figures/s99-box.svg
:alt: A box with the word box in it.

A hand-written SVG figure.
```

## Mechanics

```{{literalinclude}} ../code/s01_generation_loop.py
:pyobject: sample
:language: python
```

## Try it

```{{simulator}} {simulator}
```

A second simulator on the same page:

```{{simulator}} bpe-tokenizer
```

## Build it

See the [notebook](../notebooks/s99_fixture.ipynb).

## In production

Nothing here.

## Exercises

Nothing here.

## Check yourself

```{{quiz}} s99-fixture
```
"""

FIXTURE_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="120" height="60" '
               'viewBox="0 0 120 60"><rect x="5" y="5" width="110" height="50" fill="#dbeafe" '
               'stroke="#2563eb"/><text x="60" y="36" text-anchor="middle" font-size="14">box'
               '</text></svg>\n')


def fixture_quiz() -> dict:
    """Six questions whose right answers are 0, 1, 2, 3, 0, 1, one per section in order."""
    anchors = ["motivation", "core-idea", "mechanics", "try-it", "build-it", "in-production"]
    return {"chapter": "s99-fixture", "title": "Check yourself: the fixture",
            "questions": [{"id": f"q{i + 1}", "question": f"Question {i + 1}: is </script> safe?",
                           "choices": ["zero", "one", "two", "three"], "answer": i % 4,
                           "explanation": f"Reason {i + 1}, see the section {anchor}.",
                           "section": anchor} for i, anchor in enumerate(anchors)]}


def fixture_notebook() -> dict:
    """A two-cell notebook that imports from code/ the way course notebooks do."""
    src = ("import sys\nfrom pathlib import Path\nroot = Path.cwd()\n"
           "while not (root / 'code').is_dir():\n    root = root.parent\n"
           "sys.path.insert(0, str(root / 'code'))\n"
           "from s01_generation_loop import sample\nimport numpy as np\n"
           "print('greedy pick:', sample(np.array([0.0, 2.0, 1.0]), 0.0, np.random.default_rng(0)))")
    cell = {"cell_type": "code", "execution_count": None, "id": "code-1", "metadata": {}, "outputs": [],
            "source": src}
    return {"cells": [{"cell_type": "markdown", "id": "title", "metadata": {},
                       "source": "# S99 notebook"}, cell],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                        "language": "python"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def make_fixture_tree(dest: Path, quiz: dict | None = None, simulator: str = "generation-loop") -> Path:
    """Write the placeholder source tree into dest (code/ is a link to the real code/)."""
    dest = Path(dest)
    (dest / "chapters" / "figures").mkdir(parents=True, exist_ok=True)
    (dest / "site" / "quizzes").mkdir(parents=True, exist_ok=True)
    (dest / "notebooks").mkdir(parents=True, exist_ok=True)
    if not (dest / "code").exists():
        (dest / "code").symlink_to(ROOT / "code", target_is_directory=True)
    (dest / "README.md").write_text((ROOT / "README.md").read_text())
    (dest / "site" / "index.md").write_text((SITE / "index.md").read_text())
    (dest / "site" / "course-map.md").write_text("# Course map\n\nThe fixture has no chapters of the plan.\n")
    (dest / "chapters" / "s99-fixture.md").write_text(FIXTURE_CHAPTER.format(simulator=simulator))
    (dest / "chapters" / "figures" / "s99-box.svg").write_text(FIXTURE_SVG)
    (dest / "site" / "quizzes" / "s99-fixture.json").write_text(
        json.dumps(quiz if quiz is not None else fixture_quiz(), indent=1))
    (dest / "notebooks" / "s99_fixture.ipynb").write_text(json.dumps(fixture_notebook(), indent=1))
    return dest


def built(name: str, src: Path | None = None, out: Path | None = None):
    """Build once per session and return (CompletedProcess, output folder).

    name "repo" builds the repository (site/_build/html); name "fixture" builds the placeholder
    tree in a temporary folder.
    """
    if name in _BUILDS:
        return _BUILDS[name]
    build = site_module("build")
    if name == "repo":
        out = build.DEFAULT_OUT
        result = shared_build(build, ROOT, out, before=lambda: seed_notebook_cache(ROOT))
    elif name == "fixture":
        tmp = Path(tempfile.mkdtemp(prefix="course-site-fixture-"))
        src, out = make_fixture_tree(tmp / "src"), tmp / "html"
        result = build.build(src, out)
    _BUILDS[name] = (result, Path(out))
    return _BUILDS[name]


def shared_build(build, src: Path, out: Path, before=lambda: None) -> subprocess.CompletedProcess:
    """`before()` then `build.build(src, out)`, once per test run even when pytest-xdist runs
    test modules in several processes: the first process to get the lock builds and records the
    result; the others wait on the lock and read it (the folder and the notebooks' execution
    cache are shared, so two builds at once would write over each other)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:                      # one process: nothing to share
        before()
        return build.build(src, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = out.parent / f".{out.name}-test-build.json"
    with open(out.parent / f".{out.name}-test-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            saved = json.loads(record.read_text())
            if saved["run"] == run:
                return subprocess.CompletedProcess(saved["args"], saved["returncode"],
                                                   saved["stdout"], saved["stderr"])
        before()
        result = build.build(src, out)
        record.write_text(json.dumps(dict(run=run, args=[str(a) for a in result.args],
                                          returncode=result.returncode,
                                          stdout=result.stdout, stderr=result.stderr)))
        return result


def seed_notebook_cache(root: Path) -> None:
    """Put every notebook of root/notebooks/ that the site's execution cache lacks into it,
    executed by tests/notebook_testing.py (once per test run, shared with the notebook tests;
    started here in reverse order, so that another process running them from the first meets
    this one in the middle). The build then renders their outputs as it would after executing
    them itself (jupyter-cache matches a notebook by its code cells and kernelspec).

    Raises nbclient's CellExecutionError when a cell fails, and AssertionError when a cell ran
    longer than the site's own per-cell limit (site/conf.py nb_execution_timeout), either of
    which would fail the site's build.
    """
    from datetime import datetime

    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    from notebook_testing import execute_all

    conf = site_module("conf")
    cache = get_cache(conf._cache_path(root))
    limit = conf.nb_execution_timeout
    missing = []
    for path in sorted((root / "notebooks").glob("*.ipynb"), reverse=True):
        try:
            cache.match_cache_notebook(nbformat.read(path, as_version=4))
        except KeyError:
            missing.append(path)
    for path, ran in execute_all(missing, timeout=limit).items():
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        ran_code = [c for c in ran.cells if c.cell_type == "code"]
        assert [c.source for c in code] == [c.source for c in ran_code], path.name
        seconds = 0.0
        for index, (cell, done) in enumerate(zip(code, ran_code)):
            times = done.metadata.get("execution", {})
            start, end = times.get("iopub.status.busy"), times.get("shell.execute_reply")
            took = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
            assert took <= limit, (f"{path.name}: code cell {index} ran {took:.0f} s, over the "
                                   f"site's limit of {limit} s per cell (site/conf.py)")
            seconds += took
            # Outputs only: the cell's own metadata stays, as jupyter-cache hashes it.
            cell.outputs, cell.execution_count = done.outputs, done.execution_count
        for key in ("language_info", "widgets"):
            if key in ran.metadata:
                nb.metadata[key] = ran.metadata[key]
        cache.cache_notebook_bundle(CacheBundleIn(nb, str(path),
                                                  data={"execution_seconds": seconds}),
                                    check_validity=True, overwrite=True)
