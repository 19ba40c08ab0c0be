"""What the benchmark tests share: a benchmark script imported as a module (benchmarks/ is not
a package), its usage errors caught before any work starts, one --quick run into a scratch
file that must leave the committed record alone, and, for the chapter-figures tests, the
record keys a chapter's `<!-- record: ... -->` markers name."""
from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_benchmark(name: str):
    """benchmarks/<name>.py as a module, imported once per process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def usage_error(bench, argv, capsys, monkeypatch) -> str:
    """The message of the usage error (exit 2) bench.main(argv) raises before it sets torch's
    threads (a tripwire: getting that far fails the test)."""
    import torch

    def tripwire(n):
        raise AssertionError(f"{argv}: got past the argument checks")
    monkeypatch.setattr(torch, "set_num_threads", tripwire)
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def quick_run(bench, out: Path, record: Path, *extra: str) -> tuple[dict, object, str]:
    """bench.main(["--quick", "--json", out, *extra]) with its printout captured: (the JSON
    it wrote, what main returned, the printout). Asserts the committed record was not
    touched (a trial run never overwrites it)."""
    before = record.stat().st_mtime_ns if record.exists() else None
    text = io.StringIO()
    with redirect_stdout(text):
        returned = bench.main(["--quick", "--json", str(out), *extra])
    after = record.stat().st_mtime_ns if record.exists() else None
    assert before == after, "--quick must not touch the committed record"
    return json.loads(out.read_text()), returned, text.getvalue()


def record_markers(chapter_text: str) -> list[str]:
    """Every `<!-- record: key, key -->` marker of a chapter, its text between the colon and
    the closing `-->` (the chapters mark each paragraph that quotes a benchmark record)."""
    return re.findall(r"<!-- record: (.*?) -->", chapter_text)


def resolve(record: dict, key: str) -> list:
    """The values a marker's key names: dots and ["k"] index dicts, [*] every value."""
    nodes = [record]
    for part in re.findall(r'\["([^"]*)"\]|\[(\*)\]|([^.\[\]]+)', key):
        name = part[0] or part[1] or part[2]
        nxt = []
        for node in nodes:
            assert isinstance(node, dict), (key, name)
            if name == "*":
                nxt += list(node.values())
            else:
                assert name in node, f"the record has no {key!r} ({name!r} missing)"
                nxt.append(node[name])
        nodes = nxt
    return nodes
