"""The GPU check (scripts/gpu_check.sh) on a machine without a GPU.

What a CPU can check: the script says there is no device, exits 0 and writes its summary;
every test marked `gpu` skips with its reason; the summary's bookkeeping (statuses, key figures,
pytest's outcomes); and benchmarks/gpu_bench.py's parts run end to end with --device cpu
--shape tiny, so a change to an engine's public API shows here and not first on a GPU. The
figures themselves, the CUDA paths and the budgets' fit are checked only by running the script
on a GPU (README.md, "The GPU check").
"""
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# The script's rule for the files that use the marker (its grep -E, here as a Python regex).
MARKER_LINE = re.compile(r"^[^#\"']*pytest\.mark\.gpu\b", re.MULTILINE)
PARTS = ("bandwidth", "pytest_gpu", "s06", "s08", "s09", "s12", "s14", "s15", "s16", "s17",
         "s18")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


report = load(ROOT / "scripts" / "gpu_check_report.py")


def gpu_test_files() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py")
                  if MARKER_LINE.search(p.read_text(encoding="utf-8")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: run the script")
def test_script_without_cuda_says_so_exits_0_and_writes_the_summary(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no CUDA device: nothing to check" in done.stdout
    assert "no CUDA device: nothing to check" in (out / "gpu_check.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "no_device" and summary["device"]["available"] is False
    assert summary["parts"]["versions"]["status"] == "ok"
    for part in PARTS:
        assert summary["parts"][part]["status"] == "skipped"
        assert summary["parts"][part]["reason"].startswith("no CUDA device")
    versions = json.loads((out / "versions.json").read_text())
    assert versions["python"] == platform.python_version()
    assert versions["cuda"]["torch"] == torch.__version__ and versions["cuda"]["available"] is False
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "summary.json",
                                                      "versions.json"]


def script_budgets() -> tuple[int, dict[str, int], dict[str, int]]:
    """(the default total, {part: budget} of the table in the script's header comment,
    {part: budget} of its run_part / bench calls)."""
    text = SCRIPT.read_text(encoding="utf-8")
    total = int(re.search(r"GPU_CHECK_BUDGET_S:-(\d+)", text).group(1))
    header = text[:text.index("\nset -u")]
    table = {name: int(budget) for name, budget in
             re.findall(r"^#   (\w+) +(\d+)   \S", header, re.MULTILINE)}
    calls = {name: int(budget) for name, budget in
             re.findall(r"^\s+(?:run_part|bench) (\w+) (\d+) ", text, re.MULTILINE)}
    return total, table, calls


def test_the_budgets_fit_the_default_total_and_the_header_says_them():
    """Every part gets its whole budget with the default total: the budgets add up to the
    total less the 10 s run_part keeps back for a KILL's grace (before S15's part they added
    up to 540 s against a total of 440 s, so the last parts were cut or skipped). The header's
    table is the calls', part by part, S15's included."""
    total, table, calls = script_budgets()
    assert table == calls
    assert set(calls) == {"versions", *PARTS}
    assert sum(calls.values()) + 10 == total == 480     # 8 minutes
    assert "default 480, so the whole check ends within 8 minutes" in SCRIPT.read_text()


def test_the_s15_part_uses_the_shape_of_s14s_benchmark():
    """gpu_bench's S15 random target is written out (no import of S14's benchmark); it must
    stay bench_s14_quantization's E2E_SHAPE, the 100.1M model S14's record measured."""
    bench = load(ROOT / "benchmarks" / "gpu_bench.py")
    source = (ROOT / "benchmarks" / "bench_s14_quantization.py").read_text(encoding="utf-8")
    block = source[source.index("E2E_SHAPE = dict("):]
    block = block[len("E2E_SHAPE = "):block.index("\n)\n") + 2]
    assert eval(block, {"dict": dict}) == bench.S15_RANDOM_SHAPE     # a literal dict(...)
    assert "s15" in bench.PARTS and bench.WORKLOADS["qwen3-0.6b"]["s15"]["tokens"] >= 32


def test_the_s18_part_runs_its_benchmarks_gpu_section_with_the_flags_it_takes():
    """The s18 part's command is benchmarks/bench_s18_tensor_parallel.py --sections gpu with
    the device's flags, --json and --budget-s (its budget less 10 s); the benchmark's own parser
    takes them (the CPU rehearsal's, GPU_CHECK_CPU=1; CUDA's too where torch finds a device),
    and every part keeps at least the 15 s below which run_part skips it."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert re.search(r'run_part s18 \d+ bench_s18\.json TERM "\$PYTHON" "\$\{S18_BENCH\[@\]\}" '
                     r'"\$\{s18_device\[@\]\}" \\\n\s+--json "\$OUTDIR/bench_s18\.json" '
                     r'--budget-s "@BUDGET_LESS_10@"\n', text)
    bench_line = re.search(r"^S18_BENCH=\((.*?)\)", text, re.MULTILINE).group(1).split()
    assert bench_line == ["benchmarks/bench_s18_tensor_parallel.py", "--sections", "gpu"]
    devices = re.findall(r"s18_device=\((.*?)\)", text)
    assert devices == ["--device cuda", "--device cpu --quick"]
    from bench_testing import import_benchmark   # the module test_s18_bench.py imports too
    bench = import_benchmark("bench_s18_tensor_parallel")
    budget = script_budgets()[2]["s18"] - 10
    for device in devices if torch.cuda.is_available() else devices[1:]:
        args = bench.parse_args([*bench_line[1:], *device.split(), "--json", "x.json",
                                 "--budget-s", str(budget)])
        assert args.sections == ["gpu"] and args.budget_s == budget
    assert min(script_budgets()[2].values()) >= 15


def test_script_refuses_a_missing_outdir_argument():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: scripts/gpu_check.sh OUTDIR" in done.stderr


@pytest.mark.slow   # pytest in a subprocess imports the S06 and S08 test modules: ~10 s
def test_every_gpu_test_skips_with_its_reason_without_cuda(tmp_path):
    files = gpu_test_files()
    assert {"test_s06_torch.py", "test_s08_static_batching.py", "test_s14_quantization.py",
            "test_s14_kv_cache.py", "test_s14_quality.py", "test_s15_rejection.py"
            } <= {p.name for p in files}
    junit = tmp_path / "gpu.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *map(str, files)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))   # no device, even on a GPU machine
    assert done.returncode == 0, done.stdout[-3000:]
    results = report.pytest_results(junit)
    assert results["counts"]["skipped"] == len(results["tests"]) > 0, results["counts"]
    for test in results["tests"]:
        assert test["message"] == "needs a CUDA device (none found)", test


def test_summary_reports_each_part_and_fails_on_a_timeout(tmp_path):
    (tmp_path / "bench_s06.json").write_text(json.dumps(
        {"status": "timeout", "key": {"ours_tokens_per_s": 100.0}, "cut": ["repeat 3: ..."]}))
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.t" name="a" time="0.5"/>'
        '<testcase classname="tests.t" name="b"><skipped message="needs fastapi"/></testcase>'
        '<testcase classname="tests.t" name="c"><failure message="assert 1 == 2"/></testcase>'
        '</testsuite></testsuites>')
    parts = tmp_path / "parts.tsv"
    parts.write_text("pytest_gpu\tfailed\texit status 1\t12\t150\t\n"
                     "s06\ttimeout\tstopped at its budget of 90 s\t90\t90\tbench_s06.json\n"
                     "s12\tskipped\tthe total budget (440 s) is spent\t0\t\tbench_s12.json\n")
    data = report.summary(tmp_path, parts, tmp_path / "pytest.xml", {"budget_s": 440.0})
    assert data == json.loads((tmp_path / "summary.json").read_text())
    assert data["status"] == "failed"
    s06 = data["parts"]["s06"]
    assert s06["status"] == "timeout" and s06["key"] == {"ours_tokens_per_s": 100.0}
    assert s06["cut"] == ["repeat 3: ..."] and s06["seconds"] == 90.0
    assert data["parts"]["s12"] == {"status": "skipped", "budget_s": None, "output":
                                    "bench_s12.json", "reason": "the total budget (440 s) is "
                                    "spent", "seconds": 0.0}
    tests = data["parts"]["pytest_gpu"]
    assert tests["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert [t["outcome"] for t in tests["tests"]] == ["passed", "skipped", "failed"]
    assert tests["tests"][2]["message"] == "assert 1 == 2"
    assert tests["reason"] == ("1 failed, 0 errors (collection errors included), 1 passed, "
                               "1 skipped; exit status 1")


def test_gpu_bench_help_needs_no_torch():
    done = subprocess.run([sys.executable, "-S", str(ROOT / "benchmarks" / "gpu_bench.py"),
                           "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "bandwidth,s06,s08,s09,s12,s14,s15" in done.stdout.replace(" ", "")


def test_gpu_bench_part_that_fails_writes_its_reason(tmp_path, capsys):
    bench = load(ROOT / "benchmarks" / "gpu_bench.py")
    out = tmp_path / "s06.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        assert bench.main(["s06", "--device", "cuda", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and "needs a CUDA device" in data["reason"]


@pytest.mark.slow   # five tiny models built and run: a few seconds
def test_gpu_bench_parts_run_end_to_end_on_the_cpu(tmp_path, capsys):
    bench = load(ROOT / "benchmarks" / "gpu_bench.py")
    common = ["--device", "cpu", "--shape", "tiny", "--bandwidth-json",
              str(tmp_path / "bandwidth.json")]
    for part in ("bandwidth", "s06", "s08", "s09", "s12", "s14", "s15"):
        out = tmp_path / f"{part}.json"
        assert bench.main([part, "--json", str(out), *common]) == 0, capsys.readouterr().out
        data = json.loads(out.read_text())
        assert data["status"] == "ok" and data["cut"] == [], data
        assert data["key"], f"{part}: no key figures"
        if part not in ("bandwidth", "s15"):
            assert data["copy_source"] == f"from {tmp_path / 'bandwidth.json'}"
            assert data["model"]["parameters"] > 0 and data["rows"]
    s06 = json.loads((tmp_path / "s06.json").read_text())
    assert s06["key"]["greedy_agreement"] == "all 4 equal"   # float32: ours == HF
    s12 = json.loads((tmp_path / "s12.json").read_text())
    assert [r["decode_steps"] for r in s12["rows"]] == [3, 3]
    s14 = json.loads((tmp_path / "s14.json").read_text())
    assert [r["weights"] for r in s14["rows"]] == ["float32", "int8", "int4 g32"]
    assert all(r["greedy_vs_float32"].startswith(("all 4", "first ")) for r in s14["rows"])
    assert [(tuple(r["shape"]), r["variant"]) for r in s14["gemv"]] == [
        (shape, v) for shape in ((128, 64), (256, 128))
        for v in ("float32", "int8", "int4 g32", "int4 g32 dequant+matmul")]
    assert s14["refused"] == {} and all(r["timed"] == "eager" for r in s14["gemv"])
    # the bytes a quantized step reads: the bf16 step's, each linear weight's full-precision
    # bytes replaced by what its kernel reads (by hand for int4 g32: K/2 code bytes per row
    # (repacked) and a bfloat16 scale and zero per 32 weights, so 4 + 1 bits per weight;
    # float32 weights are 32 bits)
    linear = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)      # TINY: qkv, o, gate_up, down
    steps = {r["weights"]: r["bytes_per_decode_step"] for r in s14["rows"]}
    assert steps["float32"] - steps["int4 g32"] == linear * (32 - 5) // 8
    s15 = json.loads((tmp_path / "s15.json").read_text())      # float32: speculation exact
    assert [(r["model"], r["engine"]) for r in s15["rows"]] == [
        (model, engine) for model in ("bundled", "random 0.1M")
        for engine in ("plain", "ngram k=2", "draft int4 g32 k=2")]
    assert all(r["greedy_vs_plain"] == "all 6 equal" for r in s15["rows"])
    assert s15["refused"] == {} and s15["key"]["bundled_draft_acceptance"] > 0
    assert [m["parameters"] for m in s15["models"]][0] > 1_000_000   # the bundled model


@pytest.mark.slow   # one tiny model built and run
def test_gpu_bench_s14_without_an_int4_kernel_says_why_and_measures_the_rest(tmp_path,
                                                                            monkeypatch):
    """Where torch has no int4 kernel for the device (CUDA before sm_80, or a build without
    tinygemm), S14 refuses int4's fused path (ParameterError naming "path"); the part records
    the refusal and measures the rest. Simulated here: the int4 kernel raises as torch does."""
    import s14_quantization as s14q
    bench = load(ROOT / "benchmarks" / "gpu_bench.py")
    run_kernel = s14q._run_kernel

    def no_int4(scheme, kernel, x, group_size):
        if scheme != "int8":
            raise RuntimeError("_weight_int4pack_mm: no kernel image for this device")
        return run_kernel(scheme, kernel, x, group_size)
    monkeypatch.setattr(s14q, "_run_kernel", no_int4)
    out = tmp_path / "s14.json"
    assert bench.main(["s14", "--json", str(out), "--device", "cpu", "--shape", "tiny"]) == 0
    data = json.loads(out.read_text())
    assert data["status"] == "ok"
    assert sorted(data["refused"]) == ["decode int4 g32", "gemv 128x64 int4 g32",
                                       "gemv 256x128 int4 g32"]
    assert "needs torch's int4 weight-only kernel" in data["refused"]["decode int4 g32"]
    assert [r["weights"] for r in data["rows"]] == ["float32", "int8"]
    assert data["key"]["refused"] == sorted(data["refused"])
