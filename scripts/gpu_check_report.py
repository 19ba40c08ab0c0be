"""scripts/gpu_check.sh's reports: what the machine has (versions.json) and what ran (summary.json).

    python scripts/gpu_check_report.py versions --json OUT/versions.json
    python scripts/gpu_check_report.py get OUT/versions.json cuda.available
    python scripts/gpu_check_report.py summary OUT --parts PARTS.tsv [--junit PYTEST.xml]

Only the standard library is imported at the top, so the summary is written even on a machine
whose torch is broken; `versions` imports torch (and triton, when there is a CUDA device) to
read the device, and reads every other package's version from its installed metadata without
importing it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# (distribution, module, what in the check needs it, what happens without it)
NEEDS = (
    ("torch", "torch", "everything", "nothing can be checked"),
    ("numpy", "numpy", "every chapter", "nothing can be checked"),
    ("transformers", "transformers",
     "the random models of every benchmark, HF's generate() as the peer, the tests' oracles",
     "the model benchmarks are skipped and the gpu test modules fail to collect"),
    ("safetensors", "safetensors", "S03's loader (every gpu test loads a tiny checkpoint)",
     "the gpu test modules fail to collect"),
    ("regex", "regex", "S02's tokenizer, imported by S03's loader",
     "the gpu test modules fail to collect"),
    ("tokenizers", "tokenizers", "S03's checkpoint tokenizer", "tests using it fail"),
    ("pytest", "pytest", "the gpu tests", "the pytest part is skipped"),
    ("hypothesis", "hypothesis", "the property-based tests (no gpu test)",
     "nothing in this check"),
    ("pytest-timeout", "pytest_timeout", "a time limit per gpu test",
     "a hung test is stopped by the part's budget instead"),
    ("triton", "triton", "nothing yet (the course's own kernels will)", "nothing skipped"),
    ("fastapi", "fastapi", "S19's server and its tests", "S19's tests skip (gpu ones too)"),
    ("uvicorn", "uvicorn", "S19's server", "S19's tests skip (gpu ones too)"),
    ("openai", "openai", "S19's client tests", "those tests skip"),
    ("httpx", "httpx", "S19's tests", "those tests skip"),
    ("matplotlib", "matplotlib", "figures and notebooks (no gpu test)", "nothing in this check"),
    ("nbformat", "nbformat", "the notebook tests (no gpu test)", "nothing in this check"),
    ("playwright", "playwright", "the browser tests (no gpu test)", "nothing in this check"),
)


def version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi() -> dict | None:
    """The driver's view of the GPUs (name, driver, memory), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError) as err:
        return {"error": str(err)}
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[:300]}
    return {"gpus": [line.strip() for line in out.stdout.splitlines() if line.strip()]}


def torch_device() -> dict:
    """torch's version, its CUDA build and the device it sees (the first one)."""
    try:
        import torch
    except Exception as err:          # a broken install raises more than ImportError
        return {"importable": False, "error": f"{type(err).__name__}: {err}", "available": False}
    info = {"importable": True, "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "available": bool(torch.cuda.is_available())}
    if info["available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), name=props.name,
                    memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())
        try:
            import triton
            info["triton_importable"] = triton.__version__
        except Exception as err:
            info["triton_importable"] = False
            info["triton_error"] = f"{type(err).__name__}: {err}"
    return info


def versions(path: Path) -> None:
    modules = {}
    for dist, module, needed_by, without in NEEDS:
        found = importlib.util.find_spec(module) is not None
        modules[module] = {"version": version_of(dist), "found": found}
    cuda = torch_device()
    data = {"python": sys.version.split()[0], "python_executable": sys.executable,
            "platform": platform.platform(), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "cuda": cuda, "nvidia_smi": nvidia_smi(),
            "modules": modules,
            "missing": [{"module": module, "needed_by": needed_by, "without_it": without}
                        for dist, module, needed_by, without in NEEDS
                        if not modules[module]["found"]]}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"python {data['python']} ({sys.executable}), "
          + ", ".join(f"{m} {v['version'] or '-'}" for m, v in modules.items()
                      if m in ("torch", "triton", "transformers", "numpy")))
    if cuda["available"]:
        print(f"device: {cuda['name']}, {cuda['memory_bytes'] / 2**30:.0f} GiB, compute "
              f"capability {cuda['capability']}, {cuda['multiprocessors']} SMs; torch "
              f"{cuda['torch']} built for CUDA {cuda['cuda_build']}")
    elif cuda["importable"]:
        print(f"torch {cuda['torch']} (CUDA build {cuda['cuda_build']}) sees no CUDA device")
    else:
        print(f"torch is not importable with {sys.executable}: {cuda['error']}")
    if data["nvidia_smi"]:
        print(f"nvidia-smi: {data['nvidia_smi']}")
    for item in data["missing"]:
        print(f"missing: {item['module']} (needed by {item['needed_by']}): {item['without_it']}")


def get(path: Path, dotted: str) -> None:
    """Print one field of a JSON file (a.b.c), JSON-encoded for lists and objects; nothing
    and exit status 1 when the file or field is not there."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        for name in dotted.split("."):
            value = value[name]
    except (OSError, ValueError, KeyError, TypeError):
        sys.exit(1)
    print(json.dumps(value) if isinstance(value, (dict, list)) else value)


def pytest_results(junit: Path) -> dict:
    """Counts and every test's outcome from pytest's JUnit XML (collection errors included)."""
    root = ET.parse(junit).getroot()
    tests, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (node.get("message") or node.text or "").strip()[:500]
                break
        counts[outcome] += 1
        tests.append({"test": f"{case.get('classname', '')}::{case.get('name', '')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0),
                      **({"message": message} if message else {})})
    return {"counts": counts, "tests": tests}


def summary(outdir: Path, parts_tsv: Path, junit: Path | None, extra: dict) -> dict:
    """summary.json: per part its status (ok / failed / skipped / timeout), reason, seconds,
    budget and key figures (the part's JSON "key"); the device; the overall status."""
    parts = {}
    if parts_tsv.exists():
        for line in parts_tsv.read_text(encoding="utf-8").splitlines():
            name, status, reason, seconds, budget, output = (line.split("\t") + [""] * 6)[:6]
            part = {"status": status, "reason": reason or None,
                    "seconds": float(seconds) if seconds else None,
                    "budget_s": float(budget) if budget else None,
                    "output": output or None}
            if output and output.endswith(".json") and (outdir / output).exists():
                try:
                    data = json.loads((outdir / output).read_text(encoding="utf-8"))
                except ValueError as err:
                    data = {"reason": f"unreadable JSON: {err}"}
                part["key"] = data.get("key") or {}
                if data.get("cut"):
                    part["cut"] = data["cut"]
                if part["reason"] is None and data.get("reason"):
                    part["reason"] = data["reason"]
            parts[name] = part
    if junit is not None and junit.exists() and "pytest_gpu" in parts:
        tests = parts["pytest_gpu"]
        try:
            tests.update(pytest_results(junit))
        except ET.ParseError as err:
            tests["junit_error"] = str(err)
        counts = tests.get("counts")
        if counts and tests["status"] == "failed":   # the counts say more than pytest's status
            tests["reason"] = (f"{counts['failed']} failed, {counts['error']} errors "
                               f"(collection errors included), {counts['passed']} passed, "
                               f"{counts['skipped']} skipped; {tests['reason']}")
    device = None
    versions_json = outdir / "versions.json"
    if versions_json.exists():
        try:
            device = json.loads(versions_json.read_text(encoding="utf-8")).get("cuda")
        except ValueError:
            pass
    statuses = [p["status"] for p in parts.values()]
    data = {"script": "scripts/gpu_check.sh",
            "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **extra, "device": device, "parts": parts}
    if "status" not in data:
        data["status"] = ("failed" if any(s in ("failed", "timeout") for s in statuses)
                          else "running" if "running" in statuses else "ok")
    tmp = outdir / "summary.json.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, outdir / "summary.json")
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("versions", help="write versions.json (imports torch)")
    p.add_argument("--json", type=Path, required=True)
    p = sub.add_parser("get", help="print one field of a JSON file")
    p.add_argument("path", type=Path)
    p.add_argument("field")
    p = sub.add_parser("summary", help="write OUTDIR/summary.json")
    p.add_argument("outdir", type=Path)
    p.add_argument("--parts", type=Path, required=True,
                   help="tab-separated: part, status, reason, seconds, budget, output file")
    p.add_argument("--junit", type=Path, default=None, help="pytest's JUnit XML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a top-level field (status=no_device, reason=..., budget_s=...)")
    args = parser.parse_args(argv)
    if args.command == "versions":
        versions(args.json)
    elif args.command == "get":
        get(args.path, args.field)
    else:
        extra = {}
        for item in args.set:
            key, _, value = item.partition("=")
            extra[key] = float(value) if key.endswith("_s") and value else value
        data = summary(args.outdir, args.parts, args.junit, extra)
        print(f"summary: {data['status']}: " + ", ".join(
            f"{name} {p['status']}" for name, p in data["parts"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
