"""Shared plumbing for the simulators' browser tests (tests/test_s*_simulator_browser.py).

Not a test module. Each browser test loads a simulator's exporter, writes a minimal page (course.js,
optionally course.css, the simulator's script and its exported data) and drives it in Debian's
Chromium with Playwright:

- `skip_without_browser()`: call at module level; skips the module when Playwright or Chromium
  is missing, else returns `playwright.sync_api`;
- `load_exporter(name, module_name)`: site/simulators/NAME/export.py, loaded as a module;
- `write_page(folder, name, data, css=True)`: writes the page into folder, returns index.html;
- `open_page(html_path, wait_selector, profile_prefix)`: a context manager yielding a Playwright
  page whose `.problems` collects console errors and uncaught page errors;
- `bundled_export(name, module_name, requires=())`: the exporter's data on the bundled model
  (skips without data/model or without a module in requires); `data_fixture(...)` and
  `page_fixture(name, wait_selector, profile_prefix)` make a test module's module-scoped `data`
  and `page` fixtures from it (`data = data_fixture(...)`, `page = page_fixture(...)`);
- `go_to(pg, prefix, step)`: moves a simulator built with CourseSim.stepControls(prefix) to step
  with its slider and waits until its label shows that step.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
SIMULATORS = ROOT / "site" / "simulators"
STATIC = ROOT / "site" / "static"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def skip_without_browser():
    """Skip the calling test module (at import) without Playwright or Chromium; return the
    `playwright.sync_api` module otherwise."""
    api = pytest.importorskip("playwright.sync_api",
                              reason="Playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)
    return api


def load_exporter(name: str, module_name: str | None = None):
    """site/simulators/NAME/export.py as a fresh module (named module_name)."""
    module_name = module_name or f"{name.replace('-', '_')}_sim_export_browser"
    spec = importlib.util.spec_from_file_location(module_name, SIMULATORS / name / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_page(folder: Path, name: str, data, css: bool = True) -> Path:
    """A minimal page for simulator NAME showing data; with css, course.css is linked too."""
    folder = Path(folder)
    shutil.copy(STATIC / "course.js", folder / "course.js")
    if css:
        shutil.copy(STATIC / "course.css", folder / "course.css")
    shutil.copy(SIMULATORS / name / "simulator.js", folder / "simulator.js")
    (folder / "data.js").write_text(
        f"CourseSim.setData('{name}', {json.dumps(data, allow_nan=False)});\n")
    link = "<link rel='stylesheet' href='course.css'>" if css else ""
    html = folder / "index.html"
    html.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'>{link}</head><body>"
        f"<div class='course-sim' data-sim='{name}'></div>"
        "<script src='course.js'></script><script src='simulator.js'></script>"
        "<script src='data.js'></script></body></html>")
    return html


@contextmanager
def open_page(html_path: Path, wait_selector: str, profile_prefix: str, query: str = ""):
    """Open html_path (plus an optional query string) in headless Chromium, wait for
    wait_selector, and yield the page; page.problems lists console errors and page errors."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix=profile_prefix)
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM,
                                                           headless=True, args=ARGS)
            try:
                pg = context.new_page()
                pg.problems = []
                pg.on("console",
                      lambda m: pg.problems.append(m.text) if m.type == "error" else None)
                pg.on("pageerror", lambda e: pg.problems.append(str(e)))
                pg.goto(Path(html_path).as_uri() + query)
                pg.wait_for_selector(wait_selector)
                yield pg
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def bundled_export(name: str, module_name: str, requires: tuple[str, ...] = ()):
    """site/simulators/NAME/export.py's export() on the bundled model; skips the calling test
    when data/model has no model or a module named in requires cannot be imported."""
    import s03_transformer as s03
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("data/model has no bundled model")
    for module in requires:
        pytest.importorskip(module)
    return load_exporter(name, module_name).export()


def data_fixture(name: str, module_name: str, requires: tuple[str, ...] = ()):
    """A module-scoped fixture `data`: bundled_export(name, module_name, requires)."""
    @pytest.fixture(scope="module", name="data")
    def data():
        return bundled_export(name, module_name, requires)
    return data


def page_fixture(name: str, wait_selector: str, profile_prefix: str):
    """A module-scoped fixture `page`: simulator NAME on a minimal page (write_page) of the
    module's `data` fixture, opened with open_page(html, wait_selector, profile_prefix)."""
    @pytest.fixture(scope="module", name="page")
    def page(data, tmp_path_factory):
        html = write_page(tmp_path_factory.mktemp(f"{name}_page"), name, data)
        with open_page(html, wait_selector, profile_prefix) as pg:
            yield pg
    return page


def go_to(pg, prefix: str, step: int, label: str = "step-label",
          ends_with: str | None = None) -> None:
    """Move the simulator's slider (.PREFIX-slider; fill fires "input") to step and wait until
    its label (.PREFIX-LABEL) starts with "step STEP of", or, with ends_with, ends with it."""
    pg.locator(f".{prefix}-slider").fill(str(step))
    shown = (f".endsWith({json.dumps(ends_with)})" if ends_with is not None
             else f".startsWith('step {step} of')")
    pg.wait_for_function(f"document.querySelector('.{prefix}-{label}').textContent{shown}")
