"""The S06 "Try it" timeline in a real browser: it draws exactly the Python schedule.

A minimal page loads site/static/course.js, the simulator's script and the data that
site/simulators/host-device-timeline/export.py exports (counts and measured costs from the S06
engine on the bundled model). Playwright drives Debian's Chromium: for every exported reference
setting, and for the default settings of both model shapes, the controls are set as a learner
would, and every segment drawn on the host and device lanes (its data-start / data-end) and the
reported totals must equal `timeline` / `summary` in export.py within 1e-9 relative; the page
says it reproduced the reference schedules, and logs no console error. Skipped when Playwright,
Chromium or the bundled model is missing.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.browser, pytest.mark.slow]
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="Playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "site" / "simulators" / "host-device-timeline"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REL = 1e-9

spec = importlib.util.spec_from_file_location("s06_sim_export_browser", SIM / "export.py")
hd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hd)
if not (Path(hd.BUNDLED_MODEL_DIR) / "model.safetensors").exists():
    pytest.skip("the bundled model (data/model) is missing", allow_module_level=True)


@pytest.fixture(scope="module")
def data():
    return hd.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("s06_sim_page")
    shutil.copy(ROOT / "site" / "static" / "course.js", folder / "course.js")
    shutil.copy(SIM / "simulator.js", folder / "simulator.js")
    (folder / "data.js").write_text(
        f"CourseSim.setData('host-device-timeline', {json.dumps(data, allow_nan=False)});\n")
    (folder / "index.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'></head><body>"
        "<div class='course-sim' data-sim='host-device-timeline'></div>"
        "<script src='course.js'></script><script src='simulator.js'></script>"
        "<script src='data.js'></script></body></html>")
    profile = tempfile.mkdtemp(prefix="s06-chromium-")
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM,
                                                       headless=True, args=ARGS)
        pg = context.new_page()
        pg.problems = []
        pg.on("console", lambda m: pg.problems.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: pg.problems.append(str(e)))
        pg.goto((folder / "index.html").as_uri())
        pg.wait_for_selector(".hd-timeline")
        yield pg
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


DRAWN = """() => Array.from(document.querySelectorAll('.hd-seg')).map(r => [
  r.getAttribute('data-lane'), r.getAttribute('data-kind'), Number(r.getAttribute('data-step')),
  Number(r.getAttribute('data-start')), Number(r.getAttribute('data-end'))])"""
METRICS = """() => { const m = document.querySelector('.hd-metrics');
  return ['data-end', 'data-per-token', 'data-idle', 'data-wait'].map(a => Number(m.getAttribute(a))); }"""


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-300)


def set_controls(pg, setting: dict) -> None:
    pg.select_option(".hd-policy", setting["policy"])
    pg.select_option(".hd-steps", str(setting["steps"]))
    for selector, key in ((".hd-kernels", "model_launches"), (".hd-launch", "launch_us"),
                          (".hd-kernel", "kernel_us"), (".hd-post", "post_us"),
                          (".hd-host-sampler", "host_sampler_us")):
        pg.fill(selector, repr(setting[key]))


def assert_page_draws(pg, schedule: dict) -> None:
    drawn = pg.evaluate(DRAWN)
    host = [d for d in drawn if d[0] == "host"]
    device = [d for d in drawn if d[0] == "device"]
    assert len(host) == len(schedule["host"]) and len(device) == len(schedule["device"])
    for (_, kind, step, start, end), (k, s, b, e) in zip(host, schedule["host"]):
        assert (kind, step) == (k, s) and close(start, b) and close(end, e)
    for (_, kind, step, start, end), (s, b, e) in zip(device, schedule["device"]):
        assert (kind, step) == ("kernel", s) and close(start, b) and close(end, e)
    summary = hd.summary(schedule)
    shown = pg.evaluate(METRICS)
    expected = [summary["end"], summary["per_token"], summary["device_idle_fraction"],
                summary["host_wait"]]
    assert all(close(a, b) for a, b in zip(shown, expected)), (shown, expected)


def test_page_replays_the_reference_schedules_on_load(page, data):
    text = page.locator(".hd-check").inner_text()
    assert f"reproduces all {len(data['reference'])} reference schedules" in text
    assert page.problems == []


def test_controls_reproduce_every_reference_setting(page, data):
    for ref in data["reference"]:
        set_controls(page, ref["setting"])
        assert_page_draws(page, ref["schedule"])
    assert page.problems == []


@pytest.mark.parametrize("shape", ["bundled", "qwen3-0.6b"])
def test_each_model_shape_at_its_counted_launches(page, data, shape):
    page.select_option(".hd-shape", shape)
    page.select_option(".hd-policy", "step")
    page.select_option(".hd-steps", "3")
    page.fill(".hd-launch", repr(data["illustrative"]["launch_us"]))
    page.fill(".hd-post", repr(data["measured"]["post_us"]))
    assert page.input_value(".hd-kernels") == str(data["shapes"][shape]["model_launches"])
    for policy in hd.POLICIES:
        page.select_option(".hd-policy", policy)
        schedule = hd.timeline(policy, 3, data["shapes"][shape]["model_launches"],
                               data["counts"]["bfloat16"]["sampler"],
                               data["illustrative"]["launch_us"],
                               data["shapes"][shape]["roofline_kernel_us"],
                               data["measured"]["post_us"], float(page.input_value(".hd-host-sampler")))
        assert_page_draws(page, schedule)
    assert page.problems == []
