"""Build the course site: `python site/build.py` -> site/_build/html (open site/_build/html/index.html).

Strict: every Sphinx warning is an error (-W), all of them are reported (--keep-going), and the
environment is always rebuilt from scratch (-E), so a warning in a page that did not change is
never hidden by an incremental build. Notebooks run once and are cached, keyed by a hash of code/
and data/ (see site/conf.py), so a rebuild that changed only prose takes seconds.

It prints Sphinx's progress as it goes (each page read and written, each notebook executed, with
its time), so a build that executes every notebook for minutes shows where it is.

Options: --out DIR (default site/_build/html), --src DIR (the source root; default the repository
root; the tests point it at a fixture tree), --execute {cache,force,off} (notebook execution).
Exit status: 0 on a clean build, non-zero on any warning or error.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

SITE = Path(__file__).resolve().parent
ROOT = SITE.parent
DEFAULT_OUT = SITE / "_build" / "html"
# ipykernel >= 7 logs this on every kernel start unless the kernel manager provisions CurveZMQ
# keys (jupyter_client's KernelManager.transport_encryption), and myst-nb's executor gives no
# way to configure its kernel manager. The kernel runs on this machine only; the one line is
# dropped from the build's output (tests/notebook_testing.py encrypts instead).
KERNEL_TCP_WARNING = "WARNING | Kernel is running over TCP without encryption."
# MyST's and MyST-NB's one-line dumps of their whole configuration: kept in stdout, not shown.
CONFIG_DUMPS = ("myst v", "myst-nb v")


def sphinx_command(src: Path, out: Path, quiet: bool = True) -> list[str]:
    """The sphinx-build command line the site is built with (-q: warnings and errors only)."""
    return [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-E",
            *(["-q"] if quiet else []),
            "-c", str(SITE), "-d", str(out.parent / (out.name + ".doctrees")), str(src), str(out)]


def build(src: Path = ROOT, out: Path = DEFAULT_OUT, execute: str = "cache",
          progress: Callable[[str], None] | None = None) -> subprocess.CompletedProcess:
    """Run the strict build in a child process and return it (stdout and stderr captured).

    execute: "cache" (run notebooks when code/, data/ or their cells changed), "force" (always
    run them) or "off" (render the outputs stored in the .ipynb files). Raises ValueError for
    another value. progress: called with each line of Sphinx's progress output (stdout) as it
    comes (MyST's configuration dumps left out); without it Sphinx runs quiet and stdout holds nothing but errors' context.
    """
    if execute not in ("cache", "force", "off"):
        raise ValueError(f"execute must be 'cache', 'force' or 'off' (got {execute!r})")
    env = dict(os.environ, COURSE_NB_EXECUTION=execute, PYTHONHASHSEED="0")
    command = sphinx_command(Path(src), Path(out), quiet=progress is None)
    if progress is None:
        result = subprocess.run(command, cwd=str(src), env=env, capture_output=True, text=True)
        result.stderr = drop_kernel_tcp_warning(result.stderr)
        return result
    with subprocess.Popen(command, cwd=str(src), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, bufsize=1) as child:
        errors: list[str] = []
        reader = threading.Thread(target=lambda: errors.extend(child.stderr), daemon=True)
        reader.start()
        lines = []
        for line in child.stdout:
            lines.append(line)
            if not line.startswith(CONFIG_DUMPS):
                progress(line.rstrip("\n"))
        reader.join()
        returncode = child.wait()
    return subprocess.CompletedProcess(command, returncode, "".join(lines),
                                       drop_kernel_tcp_warning("".join(errors)))


def drop_kernel_tcp_warning(text: str) -> str:
    """`text` without the lines of ipykernel's KERNEL_TCP_WARNING (every other line kept)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if KERNEL_TCP_WARNING not in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the course site (strict, offline).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--src", type=Path, default=ROOT, help="source root (repository root)")
    parser.add_argument("--execute", choices=["cache", "force", "off"], default="cache",
                        help="notebook execution (default: cache)")
    args = parser.parse_args(argv)
    result = build(args.src.resolve(), args.out.resolve(), args.execute,
                   progress=lambda line: print(line, flush=True))
    sys.stderr.write(result.stderr)
    if result.returncode == 0:
        print(f"built {args.out.resolve() / 'index.html'}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
