"""The S18 tensor-parallel simulator in a real browser: offline, equal to the Python replay, the
all-reduces highlighted where they happen, and never showing a number that is not finite.

The page (site/simulators/tensor-parallel/simulator.js) gets the data of
site/simulators/tensor-parallel/export.py (code/s18_layers.py's ranks run as threads; its
numbers are held to S06's unsplit model and hand counts in tests/test_s18_simulator_data.py).
Playwright drives Debian's Chromium:

- on load the page recomputes every rank's products for N = 1, 2, 4 and finds them equal to the
  torch run (no banner, no console error, the count of numbers it compared is the count here),
  and it loaded nothing but its own files;
- for every N and every step, the matrices it shows are the ones that step is about (listed
  here by hand), each equal to `replay_world`'s (doubles, to 1e-12); the split step's shard
  table shows the shapes and bytes of the hand rules, and its note states the fractions that
  table shows (1/N of every matrix; k_proj and v_proj 1/Hkv when N > Hkv, each KV head on
  N/Hkv ranks; the norms whole); for N > 1 the communication line counts the all-reduces done
  so far (0, 0, 1, ... 3) with T C 4 bytes each, describes the course's all-reduce (publish,
  add in rank order; never a ring), and is highlighted exactly at the three all-reduces and the
  gather; at N = 1 it counts 0 all-reduces, 0 bytes, no gather (exercise 2's (0, 0)), says
  nothing is sent, and nothing is highlighted; the last step's gathered logits are S06's, by
  the relative measure of the load-time check (the largest |a - b| / (1 + |b|), recomputed
  here);
- the split diagram's labels never overlap each other or another matrix, at the text column's
  760 px and at 1600 px, for every N (bounding boxes in the page);
- the last step judges like the load-time check: a reference off by half the tolerance
  relative to 1 + |logit| (more than the tolerance in absolute terms) passes both, one off by
  three times it fails both (a second page, same browser);
- controls set to values they do not offer (N = 3, text), the slider past either end: the page
  stays on a valid setting and every number it shows or carries is finite; nothing overflows
  sideways at the text column's width.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import json
import math
import re

import pytest

from sim_browser import load_exporter, open_page, skip_without_browser, write_page

pytestmark = [pytest.mark.browser]
skip_without_browser()

tp = load_exporter("tensor-parallel", "s18_sim_export_browser")

# What each step shows: per-rank matrices and shared ones (by data-name), by hand.
SHOWS = {
    "split": (set(), set()),
    "embed": ({"embed"}, set()),
    "allreduce_embed": ({"embed"}, {"x"}),
    "qkv": ({"q", "k", "v"}, {"h_norm"}),
    "attention": ({"attn"}, set()),
    "o_proj": ({"o_partial"}, set()),
    "allreduce_attn": ({"o_partial"}, {"attn_sum", "h"}),
    "gate_up": ({"gate", "up", "act"}, {"m_norm"}),
    "down_proj": ({"down_partial"}, set()),
    "allreduce_mlp": ({"down_partial"}, {"mlp_sum", "out"}),
    "head": ({"logits_partial"}, {"final_norm"}),
    "gather": ({"logits_partial"}, {"logits"}),
}
ALL_REDUCES_SO_FAR = [0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3]
HOT = {"allreduce_embed", "allreduce_attn", "allreduce_mlp", "gather"}

SHOWN = """() => ({
  mats: Array.from(document.querySelectorAll('.tp-stage [data-values]')).map(e => ({
    name: e.dataset.name, rank: e.dataset.rank, head: e.dataset.head === undefined ? null :
      Number(e.dataset.head), values: JSON.parse(e.dataset.values)})),
  shards: Array.from(document.querySelectorAll('tr.tp-shard')).map(tr => ({
    rank: Number(tr.dataset.rank), name: tr.dataset.name, shape: JSON.parse(tr.dataset.shape),
    bytes: Number(tr.dataset.bytes)})),
  bytes: Array.from(document.querySelectorAll('.tp-bytes')).map(p => [Number(p.dataset.rank),
    Number(p.dataset.bytes)]),
  comm: Object.assign({}, document.querySelector('.tp-comm').dataset),
  hot: document.querySelector('.tp-comm').classList.contains('tp-hot'),
  hotSums: Array.from(document.querySelectorAll('.tp-sum.tp-hot')).map(e => e.dataset.name),
  ranks: document.querySelectorAll('.tp-rank').length,
  final: Object.assign({}, document.querySelector('.tp-final').dataset),
  label: document.querySelector('.tp-step-label').textContent,
  note: document.querySelector('.tp-note').textContent,
  commText: document.querySelector('.tp-comm').textContent,
  captions: Array.from(document.querySelectorAll(
    '.tp-stage .tp-mat-caption, .tp-stage .tp-sum-title')).map(e => e.textContent),
  text: document.querySelector('.tp-sim').innerText,
  world: document.querySelector('.tp-world').value})"""
SPLIT_BOXES = """() => Array.from(
    document.querySelectorAll('svg.tp-split text, svg.tp-split rect')).map(e => {
  const b = e.getBoundingClientRect();
  return {tag: e.tagName, cls: e.getAttribute('class'), text: e.textContent,
          name: e.closest('g').dataset.name, left: b.left, right: b.right, top: b.top,
          bottom: b.bottom};
})"""
NUMBERS = """() => {
  const sim = document.querySelector('.tp-sim');
  const attrs = [];
  sim.querySelectorAll('*').forEach(node => {
    for (const [k, v] of Object.entries(node.dataset || {})) attrs.push([k, v]);
  });
  return {text: sim.innerText, attrs: attrs,
          step: document.querySelector('.tp-step-label').textContent,
          fits: sim.scrollWidth <= sim.clientWidth + 1};
}"""


@pytest.fixture(scope="module")
def data():
    return json.loads(tp.text(tp.export()))


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("tensor_parallel_page"), "tensor-parallel", data)
    with open_page(html, ".tp-ranks", "s18-chromium-") as pg:
        yield pg


def flat(x) -> list[float]:
    return [y for item in x for y in flat(item)] if isinstance(x, list) else [x]


def equal(a, b, rel: float = 1e-12) -> bool:
    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(abs(x - y) <= rel * max(1.0, abs(x), abs(y))
                                      for x, y in zip(fa, fb))


def rel_diff(a, b) -> float:
    """The load-time check's measure: the largest |a - b| / (1 + |b|)."""
    return max(abs(x - y) / (1 + abs(y)) for x, y in zip(flat(a), flat(b)))


def show(pg, world_size: int, step: int) -> dict:
    pg.select_option(".tp-world", value=str(world_size))
    pg.locator(".tp-slider").fill(str(step))
    return pg.evaluate(SHOWN)


def test_the_page_loads_offline_and_reproduces_the_run(page, data):
    assert page.locator(".tp-banner").is_hidden()
    c = data["config"]
    t_len, hidden, vocab = len(data["token_ids"]), c["hidden_size"], c["vocab_size"]
    compared = 0
    for world in data["worlds"]:
        for rank in world["ranks"]:
            compared += sum(len(flat(rank[k])) for k in (
                "embed_partial", "q", "k", "v", "attn", "o_partial", "gate", "up", "act",
                "down_partial", "logits_partial"))
        compared += 5 * t_len * hidden + 2 * t_len * vocab    # 3 sums, h, out; logits twice
    text = page.locator(".tp-check").inner_text()
    assert f"for N = 1, 2, 4 ({compared} numbers)" in text, text
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.reload()                                  # every request of a load, recorded
    page.wait_for_selector(".tp-ranks")
    assert len(requests) >= 4 and all(r.startswith("file://") for r in requests), requests
    assert page.locator(".tp-banner").is_hidden()
    first = page.evaluate(SHOWN)                       # the defaults: N = 2, the split
    assert first["world"] == "2" and first["label"].startswith("step 0 of 11: the split")
    assert first["ranks"] == 2 and first["mats"] == []
    assert page.problems == []


def test_every_step_shows_the_replay(page, data):
    c = data["config"]
    t_len, hidden, d = len(data["token_ids"]), c["hidden_size"], c["head_dim"]
    stages = [s["id"] for s in data["stages"]]
    assert stages == list(SHOWS)
    for world in data["worlds"]:
        n = world["world_size"]
        replay = tp.replay_world(data, world)
        shared = {"x": replay["x"], "h_norm": replay["ranks"][0]["h_norm"],
                  "attn_sum": replay["attn_sum"], "h": replay["h"], "m_norm": replay["m_norm"],
                  "mlp_sum": replay["mlp_sum"], "out": replay["out"],
                  "final_norm": replay["final_norm"], "logits": replay["logits"]}
        for step, stage in enumerate(stages):
            got = show(page, n, step)
            assert got["world"] == str(n) and got["ranks"] == n
            comms = data["stages"][step]["kind"] in ("all_reduce", "gather")
            assert got["label"] == (f"step {step} of 11: {data['stages'][step]['title']}"
                                    + (" (none at N = 1)" if n == 1 and comms else ""))
            assert not re.search(r"\bring\b", got["text"], re.I), (n, stage)   # not a ring
            per_rank, common = SHOWS[stage]
            seen_rank, seen_shared = set(), set()
            for mat in got["mats"]:
                name = mat["name"]
                if mat["rank"] == "":
                    assert equal(mat["values"], shared[name]), (n, stage, name)
                    seen_shared.add(name)
                    continue
                r = int(mat["rank"])
                mine = replay["ranks"][r]
                if name.endswith("-head"):                        # one head of a group
                    base = name[:-5]
                    first = world["ranks"][r]["kv_heads" if base in ("k", "v") else "q_heads"][0]
                    assert equal(mat["values"], mine[base][mat["head"] - first]), (n, stage, r)
                    continue
                assert equal(mat["values"], mine[name]), (n, stage, r, name)
                seen_rank.add((r, name))
            assert seen_rank == {(r, x) for r in range(n) for x in per_rank}, (n, stage)
            assert seen_shared == common, (n, stage)
            # the communication so far, by hand; highlighted only where ranks communicate; one
            # rank communicates nothing
            so_far = ALL_REDUCES_SO_FAR[step] if n > 1 else 0
            hot = stage in HOT and n > 1
            assert int(got["comm"]["allReduces"]) == so_far
            assert int(got["comm"]["bytes"]) == so_far * t_len * hidden * 4
            assert int(got["comm"]["gathers"]) == (stage == "gather" and n > 1)
            assert got["hot"] == hot and got["comm"]["hot"] == str(hot).lower()
            assert got["hotSums"] == ({"allreduce_embed": ["x"], "allreduce_attn": ["attn_sum"],
                                       "allreduce_mlp": ["mlp_sum"], "gather": ["logits"]}
                                      .get(stage, []) if n > 1 else [])
            if n == 1:
                assert "So far: nothing sent (0 all-reduces, 0 bytes, no gather)" in got["commText"]
                for text in [got["note"], got["commText"]] + got["captions"]:
                    for word in ("sends", "publishes", "gathered logits", "\u03a3 over ranks"):
                        assert word not in text, (stage, word, text)
                if comms:
                    assert got["commText"].startswith("No communication"), got["commText"]
                    assert "nothing" in got["note"].lower(), got["note"]
            else:
                assert (f"So far: {so_far} of 3 all-reduces (each rank's partials in them: "
                        f"{so_far * t_len * hidden * 4} bytes), {int(stage == 'gather')} of 1 "
                        "gather.") in got["commText"]
                if stage in HOT - {"gather"}:
                    assert (f"each rank publishes its {t_len * hidden * 4}-byte partial"
                            in got["commText"]), got["commText"]
                    assert (f"every rank adds all {n} partials in rank order"
                            in got["commText"]), got["commText"]
            if stage == "split":                      # the shard table, by the hand rules
                h_r, kv_r = c["num_attention_heads"] // n, max(c["num_key_value_heads"] // n, 1)
                i_r, v_r = c["intermediate_size"] // n, c["vocab_size"] // n
                want = {"model.embed_tokens.weight": [v_r, hidden],
                        "model.layers.0.self_attn.q_proj.weight": [h_r * d, hidden],
                        "model.layers.0.self_attn.k_proj.weight": [kv_r * d, hidden],
                        "model.layers.0.self_attn.v_proj.weight": [kv_r * d, hidden],
                        "model.layers.0.self_attn.o_proj.weight": [hidden, h_r * d],
                        "model.layers.0.mlp.gate_proj.weight": [i_r, hidden],
                        "model.layers.0.mlp.up_proj.weight": [i_r, hidden],
                        "model.layers.0.mlp.down_proj.weight": [hidden, i_r]}
                assert len(got["shards"]) == n * len(want)
                for row in got["shards"]:
                    assert row["shape"] == want[row["name"]]
                    assert row["bytes"] == 4 * math.prod(row["shape"])
                norms = 2 * hidden + 2 * d + hidden
                held = 4 * (sum(math.prod(s) for s in want.values()) + norms)
                assert got["bytes"] == [[r, held] for r in range(n)]
                # the note's fractions are the table's: 1/N of every matrix, except k/v (1/Hkv)
                # when N > Hkv, and the norms (not in the table: whole)
                hkv, note = c["num_key_value_heads"], got["note"]
                full = {k: math.prod(v) for k, v in data["full_shapes"].items()}
                for row in got["shards"]:
                    kv = row["name"].endswith(("k_proj.weight", "v_proj.weight"))
                    part = 1 / hkv if kv and n > hkv else 1 / n
                    assert math.prod(row["shape"]) == full[row["name"]] * part, row
                if n == 1:
                    assert note.startswith("One rank holds every weight"), note
                elif n > hkv:
                    for words in (f"Each of the {n} ranks holds 1/{n} of every matrix except "
                                  "k_proj and v_proj, and the norms",
                                  f"replicated on {n}/{hkv} = {n // hkv} ranks",
                                  f"a rank holds 1/{hkv} of k_proj and v_proj",
                                  "held whole by every rank"):
                        assert words in note, (words, note)
                else:
                    assert f"Each of the {n} ranks holds 1/{n} of every matrix:" in note, note
                    assert "except k_proj" not in note and "held whole by every rank" in note, note
            if stage == "gather":
                assert got["final"]["finished"] == "true" and got["final"]["ok"] == "true"
                out = json.loads(got["final"]["out"])
                assert equal(out, replay["logits"])
                want = rel_diff(out, data["reference_logits"])    # the load check's measure
                assert equal(float(got["final"]["diff"]), want) and want <= data["tolerance"]
            else:
                assert got["final"]["finished"] == "false" and "diff" not in got["final"]
                assert "ok" not in got["final"]
    assert page.locator(".tp-banner").is_hidden()
    assert page.problems == []


def assert_all_finite(pg) -> None:
    got = pg.evaluate(NUMBERS)
    for word in ("NaN", "Infinity", "undefined"):
        assert word not in got["text"], word
    for key, value in got["attrs"]:
        for x in value.replace("[", " ").replace("]", " ").replace(",", " ").split():
            try:
                number = float(x)
            except ValueError:
                continue
            assert math.isfinite(number), (key, value)
    step, last = (int(x) for x in got["step"].split(":")[0].split()[1::2])
    assert 0 <= step <= last
    assert got["fits"], "the simulator overflows the text column sideways"


def test_bad_and_extreme_controls_show_only_finite_numbers(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for n in (1, 2, 4):
            for fill in ("-5", "3", "6", "11", "1000"):
                page.select_option(".tp-world", value=str(n))
                page.locator(".tp-slider").fill(fill)
                assert_all_finite(page)
        for value in ("3", "abc", "-1"):              # values no option offers: the default N
            page.evaluate("""(value) => {
                const s = document.querySelector('.tp-world');
                const o = document.createElement('option');
                o.value = value;
                o.textContent = 'bad';
                s.appendChild(o);
                s.value = value;
                s.dispatchEvent(new Event('change'));
            }""", value)
            assert page.locator(".tp-world").input_value() == "2", value
            assert page.evaluate(SHOWN)["ranks"] == 2
            assert_all_finite(page)
        page.click(".tp-reset")
        assert page.evaluate(SHOWN)["label"].startswith("step 0 of 11")
        assert_all_finite(page)
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.locator(".tp-banner").is_hidden()
    assert page.problems == []


def overlap(a: dict, b: dict) -> bool:
    """The two boxes share more than an edge (half a pixel of slack)."""
    return (min(a["right"], b["right"]) - max(a["left"], b["left"]) > 0.5
            and min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > 0.5)


def test_the_split_diagrams_labels_never_overlap(page, data):
    try:
        for width in (760, 1600):
            page.set_viewport_size({"width": width, "height": 1400})
            for n in (1, 2, 4):
                show(page, n, 0)
                boxes = page.evaluate(SPLIT_BOXES)
                texts = [b for b in boxes if b["tag"] == "text"]
                labels = [b for b in texts if b["cls"] == "tp-split-label"]
                assert [b["text"] for b in labels] == [
                    name.split(".")[-2] if "layers" in name else "embed_tokens"
                    for name in data["full_shapes"] if not name.endswith("norm.weight")]
                assert all(b["right"] - b["left"] > 10 for b in texts)         # rendered
                for i, a in enumerate(texts):
                    for b in texts[i + 1:]:
                        assert not overlap(a, b), (width, n, a, b)
                    for r in boxes:                   # nor a text over another matrix
                        if r["tag"] == "rect" and r["name"] != a["name"]:
                            assert not overlap(a, r), (width, n, a, r)
                assert_all_finite(page)
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []


def test_the_last_step_judges_like_the_load_check(page, data, tmp_path):
    """A reference moved by k tol (1 + |b|) at its largest logit: equal at k = 0.5 (though the
    absolute difference exceeds tol), different at k = 3, both at load and on the last step."""
    tol, ref = data["tolerance"], data["reference_logits"]
    t, v = max(((t, v) for t in range(len(ref)) for v in range(len(ref[0]))),
               key=lambda tv: abs(ref[tv[0]][tv[1]]))
    assert abs(ref[t][v]) > 1                          # so relative and absolute disagree
    last = len(data["stages"]) - 1
    try:
        for k, ok in ((0.5, True), (3.0, False)):
            moved = json.loads(json.dumps(data))
            moved["reference_logits"][t][v] += k * tol * (1 + abs(ref[t][v]))
            (tmp_path / str(k)).mkdir()
            html = write_page(tmp_path / str(k), "tensor-parallel", moved)
            page.problems.clear()
            page.goto(html.as_uri())
            page.wait_for_selector(".tp-ranks")
            assert page.locator(".tp-banner").is_hidden() == ok
            got = show(page, 2, last)
            out = json.loads(got["final"]["out"])
            assert abs(out[t][v] - moved["reference_logits"][t][v]) > tol    # absolute: out
            assert got["final"]["ok"] == str(ok).lower()
            verdict = "\u2713 equal" if ok else "\u2717 differs"
            assert verdict in page.locator(".tp-final").inner_text()
            assert equal(float(got["final"]["diff"]), rel_diff(out, moved["reference_logits"]))
            if ok:
                assert page.problems == []
            else:
                assert page.problems and "the logits against S06's" in page.problems[0]
    finally:
        (tmp_path / "home").mkdir(exist_ok=True)
        page.goto(write_page(tmp_path / "home", "tensor-parallel", data).as_uri())
        page.wait_for_selector(".tp-ranks")
        page.problems.clear()
