"""The built site in a real browser: Playwright driving Debian's Chromium (/usr/bin/chromium).

- Every page loads with no console error and no request leaving the machine (the site is served
  on 127.0.0.1; any other host fails the test, and is blocked so nothing waits on the network).
- Math is typeset by the site's own MathJax.
- The S01 simulator, stepped through its buttons, shows the tokens, text, stop reason and
  per-pass costs that `Engine.generate` produces for the same prompt, seed and temperature on
  the same V = 512 model (the engine is the oracle, run here in Python), and its top-k bars are
  numpy's softmax of the model's row.
- The quiz scores a right and a wrong answer and links each explanation back to its section;
  each question shows its own choices, shuffled (the shuffle itself: tests/test_quiz_browser.py).
- The S02 simulator cuts, merges and streams text as code/s02_tokenizer.py does, with and without
  allowed_special="all", and its stream ends where S02's Engine ends generating the same ids.
Screenshots of the S01 page and of the S02 simulator go to artifacts/ (git-ignored).

Skipped, with the reason, when Playwright or /usr/bin/chromium is missing (.ci/run installs
Debian's chromium; Playwright's own browser download does not work offline).
"""
from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.browser, pytest.mark.slow]

playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="Playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)
pytest.importorskip("sphinx", reason="the site needs sphinx")
pytest.importorskip("myst_nb", reason="the site needs myst-nb")

from site_testing import ROOT, built, fixture_quiz  # noqa: E402

ARTIFACTS = ROOT / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Sites:
    """The builds ("repo": the repository, "fixture": the placeholder chapter), each served over
    HTTP on 127.0.0.1 when first asked for. A failed build fails only the tests that use it."""

    def __init__(self):
        self.servers, self.roots = [], {}

    def __getitem__(self, name: str) -> tuple[str, Path]:
        if name not in self.roots:
            result, out = built(name)
            if result.returncode != 0:
                pytest.fail(f"strict build of {name} failed:\n{result.stderr}")
            handler = functools.partial(QuietHandler, directory=str(out))
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)
            self.roots[name] = (f"http://127.0.0.1:{server.server_address[1]}", out)
        return self.roots[name]

    def pages_with(self, marker: str) -> list[tuple[str, str]]:
        """(base URL, page) of built pages containing `marker`: the repository's first (when it
        builds), then the fixture's."""
        found = []
        for name in ("repo", "fixture"):
            if name == "repo" and built(name)[0].returncode != 0:
                continue
            base, out = self[name]
            found += [(base, rel) for rel in html_pages(out) if marker in (out / rel).read_text()]
        return found


@pytest.fixture(scope="module")
def sites():
    s = Sites()
    yield s
    for server in s.servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="course-chromium-")
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


class Watched:
    """A page with every console message, page error and request recorded."""

    def __init__(self, context, base: str):
        self.page = context.new_page()
        self.base_host = urlparse(base).netloc
        self.console, self.errors, self.requests, self.blocked = [], [], [], []
        self.page.on("console", lambda m: self.console.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.route("**/*", self._route)

    def _route(self, route):
        url = route.request.url
        parsed = urlparse(url)
        if parsed.scheme in ("data", "blob", "about") or parsed.netloc == self.base_host:
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def problems(self) -> list[str]:
        out = [f"console {kind}: {text}" for kind, text in self.console if kind == "error"]
        out += [f"page error: {e}" for e in self.errors]
        out += [f"request off the machine: {u}" for u in self.blocked]
        return out

    def close(self):
        self.page.close()


def html_pages(out: Path) -> list[str]:
    skip = {"genindex.html", "search.html"}
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.html")
                  if p.name not in skip and "_static" not in p.parts)


@pytest.mark.parametrize("which", ["repo", "fixture"])
def test_every_page_loads_offline_without_errors(sites, browser, which):
    base, out = sites[which]
    pages = html_pages(out) + ["search.html?q=token"]
    assert len(pages) >= 3
    failures = {}
    for rel in pages:
        watched = Watched(browser, base)
        watched.page.goto(f"{base}/{rel}", wait_until="load")
        if watched.page.locator("span.math, div.math").count():
            watched.page.wait_for_selector("mjx-container", timeout=15_000)
        watched.page.wait_for_timeout(150)
        if watched.problems():
            failures[rel] = watched.problems()
        watched.close()
    assert not failures, json.dumps(failures, indent=1)


def test_the_watch_catches_a_request_off_the_machine(sites, browser):
    # The offline check is only as good as its recorder: an image from another host must show up.
    base, _ = sites["fixture"]
    watched = Watched(browser, base)
    watched.page.goto(f"{base}/site/index.html")
    watched.page.evaluate("() => { const i = new Image(); i.src = 'https://example.org/x.png'; "
                          "document.body.appendChild(i); }")
    watched.page.wait_for_timeout(300)
    assert any("https://example.org/x.png" in p for p in watched.problems())
    watched.close()


# --------------------------------------------------------------------------------------------
# The S01 simulator against the engine
# --------------------------------------------------------------------------------------------

def simulator_pages(sites):
    """(base URL, page path) of every built page that embeds the generation-loop simulator."""
    return sites.pages_with('data-sim="generation-loop"')


@pytest.fixture(scope="module")
def engine_512():
    from s01_generation_loop import build_default
    return build_default(max_vocab=512)


CASES = [
    # prompt, max_tokens, temperature, seed, max_context
    ("Ham.\nTo be, or not to be", 40, 0.0, 42, 256),       # greedy: runs to the budget
    ("Ham.\nTo be, or not to be", 40, 0.8, 42, 256),       # the page's default: ends on eos
    ("QUEEN.\nGood night, sweet lord", 25, 1.3, 1, 256),   # a temperature no trace uses
    ("O, what a noble mind", 60, 0.55, 0, 14),             # context_full before the budget
    ("Thou  art\tZanzibar's   (fair) o'er-\nthe «sea»!", 30, 2.0, 3, 256),  # <unk>, odd spacing
    ("KING.\nMy lord", 12, 0.95, 2, 5),                    # prompt of exactly max_context
    ("\n", 20, 0.7, 0, 256),                               # a line break alone is one token
    # Gaps / 1e-300 overflow to -inf (weight 0): the max is subtracted before dividing, so this
    # is greedy with tied maxima sharing the draw, as in `sample`; dividing first gave NaN.
    ("O, what a noble mind", 20, 1e-300, 1, 256),
]


def stop_rule_that_fired(gen, max_tokens: int) -> str:
    """Which of S01's three rules ended a Completion, from what it holds: EOS is the only
    "stop"; "length" with the whole budget spent is max_tokens, else the context was full."""
    if gen.finish_reason == "stop":
        return "eos"
    return "max_tokens" if len(gen.token_ids) == max_tokens else "context_full"


def drive(page, prompt, max_tokens, temperature, seed, max_context):
    page.fill(".gl-prompt", prompt)
    page.fill(".gl-max-tokens", str(max_tokens))
    page.fill(".gl-max-context", str(max_context))
    page.select_option(".gl-seed", str(seed))
    page.fill(".gl-temperature", str(temperature))
    page.click(".gl-reset")
    steps = 0
    while page.locator(".gl-step").is_enabled():
        page.click(".gl-step")
        steps += 1
        assert steps <= max_context, "the simulator did not stop"
    return steps


def read_simulator(page) -> dict:
    return page.evaluate("""() => {
      const root = document.querySelector('.course-sim[data-sim="generation-loop"]');
      const q = (s) => root.querySelector(s);
      const all = (s) => Array.from(root.querySelectorAll(s));
      return {
        context: all(".gl-context .gl-tok").map(e => Number(e.dataset.id)),
        text: q(".gl-completion").hidden ? "" : q(".gl-completion").textContent,
        stop: q(".gl-stat-stopped-by").textContent,
        finish: q(".gl-stat-finish_reason").textContent,
        passes: Number(q(".gl-stat-passes").textContent),
        lens: all(".gl-cost-pass").map(e => Number(e.dataset.n)),
        uncached: all(".gl-cost-pass .gl-cost-uncached").map(e => Number(e.dataset.work)),
        cached: all(".gl-cost-pass .gl-cost-cached").map(e => Number(e.dataset.work)),
        totalUncached: q(".gl-total-uncached") ? q(".gl-total-uncached").textContent : null,
        totalCached: q(".gl-total-cached") ? q(".gl-total-cached").textContent : null,
        error: q(".gl-error").hidden ? null : q(".gl-error").textContent,
      };
    }""")


def test_simulator_steps_match_the_engine(sites, browser, engine_512):
    from s01_generation_loop import Engine
    tokenizer, model = engine_512
    pages = simulator_pages(sites)
    assert pages, "no built page embeds the generation-loop simulator"
    for i, (base, rel) in enumerate(pages):
        watched = Watched(browser, base)
        page = watched.page
        page.goto(f"{base}/{rel}")
        page.wait_for_selector(".gl-step")
        # On load the page replays the engine's exported traces; 0 means it agreed with all.
        assert page.evaluate("document.querySelector('.course-sim').glSim.mismatches") == 0
        # Stepping is the slow part; the first page (the real S01 page once it exists) gets all
        # the cases, the others a short one.
        quick = [("KING.\nMy lord", 8, 0.9, 1, 256)]
        for prompt, max_tokens, temperature, seed, max_context in (CASES if i == 0 else quick):
            engine = Engine(model, tokenizer, max_context=max_context)
            gen = engine.generate(prompt, max_tokens, temperature=temperature, seed=seed)
            steps = drive(page, prompt, max_tokens, temperature, seed, max_context)
            got = read_simulator(page)
            case = f"{rel}: {prompt!r} T={temperature} seed={seed} ctx={max_context}"
            assert got["error"] is None, case
            assert steps == gen.stats.passes, case
            assert got["context"] == tokenizer.encode(prompt) + gen.token_ids, case
            assert got["text"] == gen.text, case
            assert got["stop"] == stop_rule_that_fired(gen, max_tokens), case
            assert got["finish"] == gen.finish_reason, case
            assert got["passes"] == gen.stats.passes, case
            assert got["lens"] == gen.stats.context_lens, case
            assert got["uncached"] == [n * n for n in gen.stats.context_lens], case
            assert got["cached"] == gen.stats.context_lens, case
            if gen.stats.passes:
                assert got["totalUncached"] == f"{gen.stats.attention_work_uncached:,}", case
                assert got["totalCached"] == f"{gen.stats.attention_work_cached:,}", case
        assert not watched.problems(), watched.problems()
        watched.close()


def test_run_button_ends_where_stepping_ends(sites, browser, engine_512):
    from s01_generation_loop import Engine
    tokenizer, model = engine_512
    base, rel = simulator_pages(sites)[0]
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector(".gl-run")
    page.fill(".gl-prompt", "O, what a noble mind")
    page.fill(".gl-temperature", "0.8")
    page.select_option(".gl-seed", "0")
    page.fill(".gl-max-tokens", "30")
    page.click(".gl-reset")
    page.click(".gl-run")
    page.wait_for_function("document.querySelector('.gl-stat-stopped-by').textContent !== '\u2014'",
                           timeout=20_000)
    gen = Engine(model, tokenizer, max_context=256).generate("O, what a noble mind", 30, 0.8, 0)
    got = read_simulator(page)
    assert got["context"] == tokenizer.encode("O, what a noble mind") + gen.token_ids
    assert got["stop"] == stop_rule_that_fired(gen, 30) and got["lens"] == gen.stats.context_lens
    assert not watched.problems(), watched.problems()
    watched.close()


def test_simulator_rejects_a_prompt_longer_than_the_context(sites, browser):
    base, rel = simulator_pages(sites)[0]
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector(".gl-step")
    page.fill(".gl-prompt", "Ham.\nTo be, or not to be")
    page.fill(".gl-max-context", "4")
    page.click(".gl-reset")
    # Engine.check_request's message, word for word.
    assert page.inner_text(".gl-error") == ("prompt is 10 tokens but max_context is 4; shorten the "
                                            "prompt (it is never truncated silently)")
    assert page.locator(".gl-step").is_disabled()
    watched.close()


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt must be a non-empty string or a non-empty list of token ids (got '')"),
    # Whitespace other than a line break encodes to no token: Engine.check_request's message.
    ("  \t ", "prompt must contain at least one token (the tokenizer encodes it to none)"),
])
def test_simulator_rejects_a_prompt_without_tokens(sites, browser, engine_512, prompt, message):
    from s01_generation_loop import Engine
    tokenizer, model = engine_512
    with pytest.raises(ValueError) as python_error:    # the engine is the oracle of the text
        Engine(model, tokenizer, max_context=256).generate(prompt, 5)
    assert str(python_error.value) == message
    base, rel = simulator_pages(sites)[0]
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector(".gl-step")
    page.fill(".gl-prompt", prompt)
    page.click(".gl-reset")
    assert page.inner_text(".gl-error") == message
    assert page.locator(".gl-step").is_disabled()
    watched.close()


def softmax(row: np.ndarray, temperature: float) -> np.ndarray:
    z = row.astype(np.float64) / temperature
    w = np.exp(z - z.max())
    return w / w.sum()


def test_distribution_bars_are_the_softmax_of_the_row(sites, browser, engine_512):
    tokenizer, model = engine_512
    base, rel = simulator_pages(sites)[0]
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector(".gl-step")
    page.fill(".gl-prompt", "QUEEN.\nGood night, sweet lord")
    page.click(".gl-reset")
    last = tokenizer.encode("QUEEN.\nGood night, sweet lord")[-1]
    for temperature in (0.3, 1.0, 1.7):
        page.fill(".gl-temperature", str(temperature))
        bars = page.evaluate("""() => Array.from(document.querySelectorAll('.gl-bar-row'))
                                .map(e => [Number(e.dataset.id), Number(e.dataset.p)])""")
        p = softmax(model.logits_table[last], temperature)
        order = sorted(range(len(p)), key=lambda i: (-p[i], i))[:10]
        assert [b[0] for b in bars] == order
        np.testing.assert_allclose([b[1] for b in bars], p[order], rtol=1e-12)
    watched.close()


def test_screenshots_of_the_s01_page(sites, browser):
    base, out = sites["repo"]
    rel = "chapters/s01-generation-loop.html"
    if not (out / rel).exists():
        pytest.skip("chapters/s01-generation-loop.md is not written yet")
    ARTIFACTS.mkdir(exist_ok=True)
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector("mjx-container")
    page.screenshot(path=str(ARTIFACTS / "site-s01-page.png"), full_page=True)
    if page.locator(".course-sim").count():
        page.fill(".gl-temperature", "0.8")
        page.select_option(".gl-seed", "42")
        page.click(".gl-reset")
        for _ in range(18):
            page.click(".gl-step")
        page.locator(".course-sim").screenshot(path=str(ARTIFACTS / "site-s01-simulator.png"))
    if page.locator(".course-quiz").count():
        page.locator(".course-quiz input[type=radio]").first.check()
        page.click(".course-quiz-check")
        page.locator(".course-quiz").screenshot(path=str(ARTIFACTS / "site-s01-quiz.png"))
    assert not watched.problems(), watched.problems()
    watched.close()
    assert (ARTIFACTS / "site-s01-page.png").stat().st_size > 10_000


# --------------------------------------------------------------------------------------------
# The quiz
# --------------------------------------------------------------------------------------------

def quiz_pages(sites):
    found = []
    for base, rel in sites.pages_with('class="course-quiz-data"'):
        out = sites["fixture"][1] if base == sites["fixture"][0] else sites["repo"][1]
        m = re.search(r'<script type="application/json" class="course-quiz-data">(.*?)</script>',
                      (out / rel).read_text(), flags=re.S)
        found.append((base, rel, json.loads(m.group(1))))
    return found


def test_quiz_scores_a_right_and_a_wrong_answer(sites, browser):
    pages = quiz_pages(sites)
    assert any(q == fixture_quiz() for _, _, q in pages), "the fixture quiz was not rendered"
    for base, rel, quiz in pages:
        watched = Watched(browser, base)
        page = watched.page
        page.goto(f"{base}/{rel}")
        page.wait_for_selector(".course-quiz-check")
        for q in quiz["questions"]:   # shown in a shuffled order, but exactly its own choices
            labels = page.locator(f'fieldset[data-qid="{q["id"]}"] label.course-quiz-choice')
            assert sorted(s.strip() for s in labels.all_inner_texts()) == sorted(q["choices"])
        first, second = quiz["questions"][0], quiz["questions"][1]
        wrong = (second["answer"] + 1) % len(second["choices"])
        page.check(f"#{quiz['chapter']}-{first['id']}-{first['answer']}")
        page.check(f"#{quiz['chapter']}-{second['id']}-{wrong}")
        page.click(".course-quiz-check")
        total = len(quiz["questions"])
        assert page.inner_text(".course-quiz-score") == f"Score: 1 of {total}"
        right_box = page.locator(f'fieldset[data-qid="{first["id"]}"]')
        wrong_box = page.locator(f'fieldset[data-qid="{second["id"]}"]')
        assert "is-right" in right_box.get_attribute("class")
        assert "is-wrong" in wrong_box.get_attribute("class")
        assert second["choices"][second["answer"]] in wrong_box.inner_text()
        for q in (first, second):
            box = page.locator(f'fieldset[data-qid="{q["id"]}"]')
            assert q["explanation"] in box.inner_text()
            link = box.locator("a.course-quiz-back")
            assert link.get_attribute("href") == f"#{q['section']}"
            assert page.locator(f"[id='{q['section']}']").count() == 1
        # Every question answered right scores full marks; "Start again" clears.
        page.click(".course-quiz-reset")
        assert page.inner_text(".course-quiz-score") == ""
        for q in quiz["questions"]:
            page.check(f"#{quiz['chapter']}-{q['id']}-{q['answer']}")
        page.click(".course-quiz-check")
        assert page.inner_text(".course-quiz-score") == f"Score: {total} of {total}"
        assert not watched.problems(), watched.problems()
        watched.close()


# --------------------------------------------------------------------------------------------
# The S02 simulator (bpe-tokenizer) against the chapter's tokenizer
# --------------------------------------------------------------------------------------------

def pages_with(sites, sim: str):
    return sites.pages_with(f'data-sim="{sim}"')


@pytest.fixture(scope="module")
def bpe():
    from s02_tokenizer import TOKENIZER_PATH, BPETokenizer
    return BPETokenizer.load_hf(TOKENIZER_PATH)


BPE_TEXTS = [
    "To be, or not to be: that is the question.",
    "naïve café 😀 12345678",
    "Ham.\n  Good night, sweet prince!\n\n\n   ",
    "She'LL say \"we've\" 'S ſ's <|endoftext|> x<|endoftext|>y",
    "Здравствуй, мир! 你好，世界。 مرحبا e\u0301 ½ Ⅻ ²",
    "\ufeffbom \u0085nel\u00a0nbsp \x1cfs\ttab\nend",  # (a textarea turns \r\n into \n)
    "👩‍👩‍👧 🇫🇷 a\u200db",
]


def bpe_rows(tokenizer, ids: list[int], stops: list[str]) -> list[list]:
    """The streaming view's rows, computed with the chapter's classes (the oracle): fed in the
    order S02's `Engine.postprocess` feeds them (an EOS id is not fed and ends the request; after
    a completed stop string nothing is fed, not even the flushes). The engine itself checks the
    visible consequences in `engine_run`."""
    from s02_tokenizer import StopStringMatcher, StreamingDetokenizer
    detok, matcher, rows = StreamingDetokenizer(tokenizer), StopStringMatcher(stops), []
    for token_id in ids:
        fed = token_id != tokenizer.eos_id
        delta = detok.feed(token_id) if fed else ""
        shown = matcher.feed(delta) if fed else ""
        rows.append([token_id, tokenizer.decode([token_id]), fed, delta, shown, matcher.held,
                     matcher.stopped])
        if not fed or matcher.stopped:
            break
    if not matcher.stopped:
        tail = detok.flush()
        shown = matcher.feed(tail)
        rows.append([None, "", True, tail, shown, matcher.held, matcher.stopped])
        rows.append([None, "", True, "", matcher.flush(), "", matcher.stopped])
    return rows


class ScriptedModel:
    """A model whose greedy choice after the prompt is `script[0]`, then `script[1]`, ...: makes
    S02's Engine generate given ids, so its stop rules and text are the oracle for the stream."""

    def __init__(self, script: list[int], prompt_len: int, vocab_size: int):
        self.script, self.prompt_len, self.vocab_size = script, prompt_len, vocab_size

    def forward(self, token_ids):
        logits = np.zeros((len(token_ids), self.vocab_size))          # (T, V)
        logits[-1, self.script[len(token_ids) - self.prompt_len]] = 1.0
        return logits


def engine_run(tokenizer, ids: list[int], stops: list[str]):
    """S02's Engine generating exactly `ids` (greedy, max_tokens = len(ids)) with `stops`."""
    from s02_tokenizer import Engine
    prompt = "Ham."
    n = len(tokenizer.encode(prompt))
    engine = Engine(ScriptedModel(ids, n, tokenizer.vocab_size), tokenizer,
                    max_context=n + len(ids) + 1)
    stream = engine.stream(prompt, max_tokens=len(ids), temperature=0.0, stop=stops)
    outputs = list(stream)
    return outputs, stream.result


def check_special_pieces(tokenizer, text: str, pieces: list[str]) -> None:
    """Pre-tokens under allowed_special="all", judged by the tokenizer's own output (it has no
    function returning them): they cover the text; each special token is one piece, its id
    alone; every run of other pieces is `pre_tokenize` of that run's text; and encoding piece
    by piece gives `encode(text, allowed_special="all")`."""
    specials = tokenizer.special_tokens
    assert "".join(pieces) == text, text
    assert sum(p in specials for p in pieces) == sum(text.count(s) for s in specials), pieces
    run: list[str] = []
    for p in pieces + [None]:
        if p is None or p in specials:
            assert run == tokenizer.pre_tokenize("".join(run)), (text, run)
            run = []
            if p is not None:
                assert tokenizer.encode(p, allowed_special="all") == [specials[p]]
        else:
            run.append(p)
    assert [i for p in pieces for i in tokenizer.encode(p, allowed_special="all")] \
        == tokenizer.encode(text, allowed_special="all"), text


def test_bpe_simulator_cuts_text_like_the_tokenizer(sites, browser, bpe):
    pages = pages_with(sites, "bpe-tokenizer")
    assert pages, "no built page embeds the bpe-tokenizer simulator"
    base, rel = pages[0]
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector(".bpe-text")
    assert page.evaluate("document.querySelector('.bpe-sim').parentNode.bpeSim.mismatches") == 0
    for text in BPE_TEXTS:
        page.fill(".bpe-text", text)
        for allowed in (False, True):
            page.set_checked(".bpe-special", allowed)
            got = page.evaluate("""() => ({
              ids: Array.from(document.querySelectorAll('.bpe-tokens .bpe-token'))
                     .map(e => Number(e.dataset.id)),
              pieces: Array.from(document.querySelectorAll('.bpe-piece')).map(e => e.dataset.piece)})""")
            want = bpe.encode(text, allowed_special="all") if allowed else bpe.encode_ordinary(text)
            assert got["ids"] == want, (text, allowed)
            if not allowed:
                assert got["pieces"] == bpe.pre_tokenize(text), text
            else:
                check_special_pieces(bpe, text, got["pieces"])
    # A special token is one piece, with no merges to show.
    page.fill(".bpe-text", "Good night<|endoftext|>sweet")
    page.set_checked(".bpe-special", True)
    assert page.locator(".bpe-piece-special").count() == 1
    page.click(".bpe-piece-special")
    assert page.locator(".bpe-step[data-parts]").count() == 0
    assert str(bpe.eos_id) in page.inner_text(".bpe-merges")
    page.set_checked(".bpe-special", False)
    assert page.locator(".bpe-piece-special").count() == 0
    # Merge steps of a few pre-tokens, picked by clicking them.
    page.fill(".bpe-text", "naïve café 😀 12345678 questioning")
    for piece in (" questioning", "naïve", " 😀", "123"):
        page.click(f".bpe-piece[data-piece='{piece}']")
        steps = page.evaluate("""() => Array.from(document.querySelectorAll('.bpe-step[data-parts]'))
                                 .map(e => JSON.parse(e.dataset.parts))""")
        assert steps == [[list(part) for part in step] for step in bpe.merge_steps(piece)], piece
    assert not watched.problems(), watched.problems()
    watched.close()


def test_bpe_simulator_streams_like_the_detokenizer(sites, browser, bpe):
    base, rel = pages_with(sites, "bpe-tokenizer")[0]
    watched = Watched(browser, base)
    page = watched.page
    page.goto(f"{base}/{rel}")
    page.wait_for_selector(".bpe-text")
    # Stop strings are typed into one-line inputs, where a line break is written "\\n".
    eot = "<|endoftext|>"
    cases = [  # text, stop strings as typed, allowed_special ticked
        ("naïve café 😀 12345678", ["café", ""], False), ("naïve café 😀 12345678", ["😀", "78"], False),
        ("Ham.\n  Good night, sweet prince!\n\n", ["\\n\\n", "sweet"], False),
        ("Ham.\n  Good night, sweet prince!\n\n", ["t\\n", "x\\ty"], False),
        ("abc 👩‍👩‍👧 done", ["xyz", ""], False), ("To be, or not to be", ["be", "o"], False),
        ("abc 😀", ["😀", ""], False),    # completes on the last id: no flush follows
        # allowed_special: the EOS id is one streamed id, not fed, and ends the request ...
        (f"Good night{eot}sweet prince", ["prince", ""], True),
        (f"café 😀{eot} more", ["", ""], True),
        (f"a 😀{eot}", ["😀", ""], True),   # ... unless a stop string ended it first
        # ... unticked, the same text is ordinary text, fed piece by piece.
        (f"Good night{eot}sweet prince", ["prince", ""], False),
        (f"{eot}{eot}x", ["", ""], True),
    ]
    for text, (stop1, stop2), allowed in cases:
        page.fill(".bpe-text", text)
        page.fill(".bpe-stop1", stop1)
        page.fill(".bpe-stop2", stop2)
        page.set_checked(".bpe-special", allowed)
        page.click(".bpe-feed")                  # one id, then the rest
        assert page.locator("tr.bpe-row").count() == 1
        if page.locator(".bpe-feed").is_enabled():   # not ended yet: nothing is marked unfed
            assert page.locator("tr.bpe-row-unfed").count() == 0
        if page.locator(".bpe-feed-all").is_enabled():
            page.click(".bpe-feed-all")
        got = page.evaluate("""() => ({
            rows: Array.from(document.querySelectorAll('tr.bpe-row')).map(e => {
              const r = JSON.parse(e.dataset.row);
              return [r.id, r.naive, r.fed, r.delta, r.shown, r.held, r.stopped]; }),
            unfed: Array.from(document.querySelectorAll('tr.bpe-row-unfed'))
                     .map(e => Number(e.dataset.id)),
            note: document.querySelector('.bpe-stream-note').textContent})""")
        stops = [s.replace("\\n", "\n").replace("\\t", "\t") for s in (stop1, stop2) if s]
        ids = bpe.encode(text, allowed_special="all" if allowed else ())
        want = bpe_rows(bpe, ids, stops)
        case = (text, stops, allowed)
        assert got["rows"] == want, case
        # The engine, generating these ids, is the judge of what is fed, shown and why it ends.
        outputs, result = engine_run(bpe, ids, stops)
        fed_ids = [r[0] for r in got["rows"] if r[0] is not None]
        assert fed_ids == result.token_ids, case
        assert got["unfed"] == ids[len(result.token_ids):], case
        shown = page.inner_text(".bpe-shown")
        assert shown == result.text == "".join(o.text_delta for o in outputs), case
        per_id = [r[4] for r in got["rows"] if r[0] is not None]
        flushed = "".join(r[4] for r in got["rows"] if r[0] is None)
        assert per_id[:-1] + [per_id[-1] + flushed] == [o.text_delta for o in outputs], case
        assert f'finish_reason "{result.finish_reason}"' in got["note"], (case, got["note"])
        if isinstance(result.stop_reason, str):
            reason = json.dumps(result.stop_reason, ensure_ascii=False)
            assert f"stop_reason {reason}" in got["note"], (case, got["note"])
        assert page.locator(".bpe-feed").is_disabled()
    # A picture of the end of a stream: the stop string cut, the ids after it greyed, not fed.
    page.fill(".bpe-text", f"Good night, sweet prince{eot} and more")
    page.fill(".bpe-stop1", "sweet")
    page.fill(".bpe-stop2", "")
    page.set_checked(".bpe-special", True)
    page.click(".bpe-feed-all")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator(".bpe-sim").screenshot(path=str(ARTIFACTS / "site-s02-simulator.png"))
    page.set_checked(".bpe-special", False)
    assert not watched.problems(), watched.problems()
    watched.close()
