"""The S07 benchmark's command line (benchmarks/bench_s07_engines.py): where it writes, and
every bad argument as a usage error before anything runs.

Oracles: git itself (`git check-ignore`: the default output is a path git ignores, so a run
never changes the committed results) and the stated rules of each flag. The benchmark itself
is not run here (minutes); `parse_args` checks everything it can before a model is built.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import s07_measuring as s07

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_s07_engines",
                                                  ROOT / "benchmarks" / "bench_s07_engines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_s07_engines"] = module
    spec.loader.exec_module(module)
    return module


def test_default_output_is_git_ignored_scratch(bench):
    args = bench.parse_args(["--skip-qwen"])       # the chapter's suggested command
    assert args.out == bench.SCRATCH_JSON == ROOT / "results" / "scratch" / "s07_engines.json"
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", str(args.out)], cwd=ROOT)
        assert ignored.returncode == 0, "results/scratch/ must be ignored by git"
    else:   # a copy without git: the rule itself must be there
        assert "results/scratch/" in (ROOT / ".gitignore").read_text().split()
    assert [name for name, _, _ in args.plan] == ["bundled"]
    assert [w.name for w in args.workloads["bundled"]] == ["chat-short", "chat", "long", "mixed"]


def test_replace_results_and_out_choose_the_file(bench, tmp_path):
    assert bench.parse_args(["--replace-results"]).out == ROOT / "results" / "s07_engines.json"
    assert bench.parse_args(["--out", str(tmp_path / "mine.json")]).out == tmp_path / "mine.json"


def usage_error(bench, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "--threads must be an integer in [1, "),
    (["--threads", "100000"], "--threads must be an integer in [1, "),
    (["--requests", "100000000"], f"--requests must be an integer in [1, {s07.MAX_REQUESTS}]"),
    (["--qwen-requests", "0"], "--qwen-requests must be an integer in [1, "),
    (["--short-tokens", "0"], "--short-tokens must be an integer >= 1"),
    (["--qwen-tokens", "-3"], "--qwen-tokens must be an integer >= 1"),
    (["--profile-steps", "-1"], "--profile-steps must be an integer >= 0"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--attentions", "flash"], "--attentions must list some of"),
    (["--device", "tpu"], "--device"),
    (["--out", "x.json", "--replace-results"], "not allowed with argument"),
])
def test_bad_arguments_are_usage_errors(bench, argv, message, capsys):
    assert message in usage_error(bench, argv, capsys)


def test_out_must_be_a_writable_file(bench, tmp_path, capsys):
    assert f"--out: {tmp_path} is a directory" in usage_error(bench, ["--out", str(tmp_path)],
                                                              capsys)
    blocker = tmp_path / "f"
    blocker.write_text("")
    assert "is a file, not a directory" in usage_error(
        bench, ["--out", str(blocker / "r.json")], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_device_is_a_usage_error(bench, capsys):
    assert "--device cuda: no CUDA device" in usage_error(bench, ["--device", "cuda"], capsys)


def test_threads_bound_is_the_core_count(bench, capsys):
    cores = os.cpu_count()
    assert bench.parse_args(["--threads", str(cores), "--skip-qwen"]).threads == cores
    assert f"[1, {cores}] (got {cores + 1})" in usage_error(
        bench, ["--threads", str(cores + 1)], capsys)


def test_json_paths_that_only_fail_when_written_are_refused_before_the_run(tmp_path):
    # Found by trying it: a dangling link, /proc (writable by mode, not in fact) and a name
    # too long for the file system passed the check and failed after the whole run.
    from s07_measuring import check_output_file
    link = tmp_path / "dangling.json"
    link.symlink_to(tmp_path / "missing" / "x.json")
    with pytest.raises(ValueError, match="it is a link to .*, which does not exist"):
        check_output_file(link)
    with pytest.raises(ValueError, match="cannot write /proc/x.json"):
        check_output_file("/proc/x.json")
    with pytest.raises(ValueError, match="File name too long"):
        check_output_file(tmp_path / ("a" * 300 + ".json"))
    ok = tmp_path / "ok.json"
    assert check_output_file(ok) == ok and not ok.exists()   # the probe leaves nothing behind
