"""The course site builds strictly and offline, and its chapter-facing pieces keep their contract.

- The repository's site builds with warnings as errors (site/build.py); every chapter page and
  notebook is rendered (notebooks with outputs); the home page has the chapter map and the two
  set-up commands; no page references a script, style sheet, image or font off the site. The
  notebooks' outputs are those of the test run's one execution of each notebook, shared with
  the notebook tests and put into the site's execution cache (site_testing.seed_notebook_cache:
  each cell within the site's own time limit); the placeholder chapter's notebook is executed
  by the build itself.
- A placeholder chapter (tests/site_testing.py) exercises every feature a chapter uses:
  literalinclude from code/ (compared with the source file), dollar math, an SVG figure, the
  simulator and a quiz. A bad quiz anchor or an unknown simulator fails the build, with a message
  naming the rule.
- The quiz validator rejects each broken rule with a message that names it.
- The S01 simulator's data is the chapter's model exactly: the sparse table is rebuilt here and
  compared with `build_default(max_vocab=512)`'s float32 table bit for bit, the uniforms with
  numpy's generator, the reference traces with `Engine.generate`.
The browser side (pages load offline, the simulator equals the engine, the quiz scores) is in
tests/test_site_browser.py.
"""
from __future__ import annotations

import ast
import copy
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sphinx", reason="the site needs sphinx (see site/README.md for the pins)")
pytest.importorskip("myst_nb", reason="the site needs myst-nb (see site/README.md for the pins)")
pytest.importorskip("furo", reason="the site needs furo (see site/README.md for the pins)")
pytest.importorskip("mathjax", reason="the site needs django-static-mathjax (see site/README.md)")

from site_testing import ROOT, SECTIONS, built, fixture_quiz, make_fixture_tree, site_module  # noqa: E402

pytestmark = pytest.mark.slow  # a few Sphinx builds: about 20-40 s together


class Assets(HTMLParser):
    """Collects every URL a page would load by itself (not plain links)."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("script", "img", "iframe", "audio", "video", "source", "embed") and a.get("src"):
            self.urls.append(a["src"])
        if tag == "link" and a.get("href") and (a.get("rel") or "") not in ("canonical", "next",
                                                                             "prev", "index",
                                                                             "search"):
            self.urls.append(a["href"])
        if tag == "object" and a.get("data"):
            self.urls.append(a["data"])


def asset_urls(html: str) -> list[str]:
    parser = Assets()
    parser.feed(html)
    css_urls = re.findall(r"url\(\s*['\"]?([^'\")]+)", html)  # inline styles
    return parser.urls + css_urls


def is_remote(url: str) -> bool:
    return bool(re.match(r"^(https?:)?//", url.strip(), flags=re.I))


# --------------------------------------------------------------------------------------------
# The repository's site
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repo_site():
    result, out = built("repo")
    assert result.returncode == 0, f"strict build failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_every_chapter_and_notebook_is_a_page(repo_site):
    chapters = sorted(p.stem for p in (ROOT / "chapters").glob("s[0-9][0-9]-*.md"))
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("s[0-9][0-9]_*.ipynb"))
    assert chapters, "no chapter page in chapters/"
    for stem in chapters:
        assert (repo_site / "chapters" / f"{stem}.html").is_file(), stem
    for stem in notebooks:
        page = (repo_site / "notebooks" / f"{stem}.html").read_text()
        nb = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())
        n_code = sum(c["cell_type"] == "code" for c in nb["cells"])
        assert page.count('class="cell docutils container"') >= n_code, stem
        assert "cell_output" in page, f"notebook {stem} rendered without outputs"


CHAPTER_SECTIONS = SECTIONS + ["What's next"]  # every chapter page ends with "What's next"


def test_chapter_pages_follow_the_anatomy(repo_site):
    for md in sorted((ROOT / "chapters").glob("s[0-9][0-9]-*.md")):
        text = md.read_text()
        number = md.stem[1:3]
        assert re.match(rf"# S{number} · \S", text), f"{md.name}: title must be '# S{number} · <Title>'"
        heads = re.findall(r"^## (.+?)\s*$", text, flags=re.M)
        assert [h for h in heads if h in CHAPTER_SECTIONS] == CHAPTER_SECTIONS, \
            f"{md.name}: sections {heads}"
        assert heads[-1] == "What's next", f"{md.name}: '## What's next' must be the last section"
        # One key-terms line right under the title, before the intro and the first section.
        first = [line for line in text.split("\n## ", 1)[0].splitlines()[1:] if line.strip()]
        assert first and first[0].startswith("**Key terms:** "), \
            f"{md.name}: the line under the title must be '**Key terms:** a, b, ...'"
        terms = first[0].removeprefix("**Key terms:** ").rstrip(".").split(", ")
        assert 5 <= len(terms) <= 9 and all(t.strip() for t in terms), f"{md.name}: key terms {terms}"
        assert "```{simulator}" in text and "```{quiz}" in text, md.name


def test_home_page_has_chapter_map_and_setup_commands(repo_site):
    home = (repo_site / "site" / "index.html").read_text()
    text = visible_text(home)
    assert "make run" in text and "make test" in text
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d\d) \| \[([^\]]+)\]\(chapters/([a-z0-9-]+)\.md\)", readme, flags=re.M)
    assert rows, "README.md has no chapter rows"
    for number, title, stem in rows:
        assert title in text, title
        if (ROOT / "chapters" / f"{stem}.md").exists():
            assert f'href="../chapters/{stem}.html"' in home, stem
    for page in sorted((ROOT / "chapters").glob("s[0-9][0-9]-*.md")):  # listed in README or not
        assert f'href="../chapters/{page.stem}.html"' in home, page.stem
    redirect = (repo_site / "index.html").read_text()
    assert 'url=site/index.html' in redirect


def test_no_page_loads_anything_from_off_the_site(repo_site):
    pages = sorted(repo_site.rglob("*.html"))
    assert len(pages) >= 3
    for page in pages:
        remote = [u for u in asset_urls(page.read_text()) if is_remote(u)]
        assert not remote, f"{page.relative_to(repo_site)} loads {remote}"
    for css in repo_site.joinpath("_static").rglob("*.css"):
        remote = [u for u in re.findall(r"url\(\s*['\"]?([^'\")]+)", css.read_text()) if is_remote(u)]
        assert not remote, f"{css.name} loads {remote}"
        assert not re.search(r"@import\s+(url\()?\s*['\"]?(https?:)?//", css.read_text()), css.name


def test_math_is_served_by_the_site(repo_site):
    page = (repo_site / "chapters" / "s01-generation-loop.html").read_text()
    assert 'src="../_static/mathjax/tex-svg.js' in page
    assert (repo_site / "_static" / "mathjax" / "tex-svg.js").stat().st_size > 1_000_000


# --------------------------------------------------------------------------------------------
# The placeholder chapter
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixture_site():
    result, out = built("fixture")
    assert result.returncode == 0, f"strict build failed:\n{result.stdout}\n{result.stderr}"
    return out


def source_of(path: Path, name: str) -> str:
    """The lines of function `name` in a Python file, found with ast (the oracle for literalinclude)."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "\n".join(text.splitlines()[node.lineno - 1: node.end_lineno])
    raise LookupError(name)


def visible_text(html: str) -> str:
    import html as html_lib
    return html_lib.unescape(re.sub(r"<[^>]+>", "", html))


def test_literalinclude_quotes_code_verbatim(fixture_site):
    page = (fixture_site / "chapters" / "s99-fixture.html").read_text()
    block = re.search(r'<div class="highlight-python notranslate">(.*?)</pre>', page, flags=re.S)
    assert block, "no Python code block on the page"
    assert visible_text(block.group(1)).strip() == source_of(ROOT / "code" / "s01_generation_loop.py",
                                                             "sample").strip()


def test_fixture_page_math_figure_simulator_quiz(fixture_site):
    page = (fixture_site / "chapters" / "s99-fixture.html").read_text()
    assert r"\(n^2\)" in page and r"\frac{N(N+1)}{2}" in page
    assert re.search(r'<img[^>]+src="../_images/s99-box.svg"', page)
    assert (fixture_site / "_images" / "s99-box.svg").is_file()
    assert '<div class="course-sim" data-sim="generation-loop">' in page
    assert "_static/course/sim/generation-loop.js" in page
    assert "_static/course/sim/generation-loop.data.js" in page
    embedded = re.search(r'<script type="application/json" class="course-quiz-data">(.*?)</script>',
                         page, flags=re.S).group(1)
    assert json.loads(embedded) == fixture_quiz()  # "</script>" in a question was escaped
    for anchor in ("motivation", "core-idea", "check-yourself"):
        assert f'id="{anchor}"' in page
    home = (fixture_site / "site" / "index.html").read_text()
    assert "_static/course/sim/" not in home, "simulator scripts belong only on pages that use them"
    nb = (fixture_site / "notebooks" / "s99_fixture.html").read_text()
    assert "greedy pick: 1" in nb  # executed at build time: argmax of [0, 2, 1]


def build_tree(tmp_path, **kwargs):
    src = make_fixture_tree(tmp_path / "src", **kwargs)
    return site_module("build").build(src, tmp_path / "html")


def test_build_rejects_an_unknown_execution_mode():
    with pytest.raises(ValueError, match="execute must be 'cache', 'force' or 'off'"):
        site_module("build").build(ROOT, ROOT / "site" / "_build" / "unused", execute="always")


def test_quiz_section_must_be_an_anchor_on_the_page(tmp_path):
    quiz = fixture_quiz()
    quiz["questions"][2]["section"] = "no-such-section"
    result = build_tree(tmp_path, quiz=quiz)
    assert result.returncode != 0
    assert "section 'no-such-section' is not an anchor on this page" in result.stderr


def test_unknown_simulator_fails_the_build(tmp_path):
    result = build_tree(tmp_path, simulator="no-such-sim")
    assert result.returncode != 0
    assert "simulator 'no-such-sim': no site/simulators/no-such-sim/" in result.stderr


# --------------------------------------------------------------------------------------------
# The quiz format
# --------------------------------------------------------------------------------------------

def _set(path, value):
    def mutate(quiz):
        target = quiz
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _drop(path):
    def mutate(quiz):
        target = quiz
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


BAD_QUIZZES = [
    (_set(["extra"], 1), "top-level keys must be exactly chapter, title, questions"),
    (_set(["chapter"], "s98-other"), "must equal the file name 's99-fixture'"),
    (_set(["chapter"], "Chapter 1"), "chapter must look like 's01-generation-loop'"),
    (_set(["title"], " "), "title must be a non-empty string"),
    (lambda q: q["questions"].pop(), "questions must be a list of at least 6"),
    (_drop(["questions", 0, "section"]), "keys must be exactly"),
    (_set(["questions", 1, "id"], "q1"), "id 'q1' is used twice"),
    (_set(["questions", 0, "choices"], ["only"]), "choices must be a list of at least 2"),
    (_set(["questions", 0, "choices"], ["a", "a", "b"]), "choices must be distinct"),
    (_set(["questions", 0, "answer"], 4), "answer must be an index into choices, 0..3"),
    (_set(["questions", 0, "answer"], True), "answer must be an index into choices"),
    (_set(["questions", 0, "explanation"], ""), "explanation must be a non-empty string"),
    (_set(["questions", 0, "explanation"], "x" * 601), "explanation must be one to three sentences"),
    (_set(["questions", 0, "section"], "Core idea"), "section must be a section anchor"),
]


@pytest.mark.parametrize("mutate,message", BAD_QUIZZES, ids=[m for _, m in BAD_QUIZZES])
def test_quiz_validator_names_the_broken_rule(mutate, message):
    quiz_module = site_module("course_quiz")
    quiz = copy.deepcopy(fixture_quiz())
    mutate(quiz)
    with pytest.raises(quiz_module.QuizError, match=re.escape(message)):
        quiz_module.validate_quiz(quiz, "s99-fixture")


def test_quiz_validator_accepts_the_course_quizzes():
    quiz_module = site_module("course_quiz")
    quizzes = sorted((ROOT / "site" / "quizzes").glob("*.json"))
    assert quizzes
    for path in quizzes:
        assert quiz_module.load_quiz(path)["chapter"] == path.stem


def test_bad_json_is_a_quiz_error(tmp_path):
    quiz_module = site_module("course_quiz")
    path = tmp_path / "s99-fixture.json"
    path.write_text('{"chapter": ')
    with pytest.raises(quiz_module.QuizError, match="not valid JSON"):
        quiz_module.load_quiz(path)


# --------------------------------------------------------------------------------------------
# The S01 simulator's data
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim_data():
    spec_path = ROOT / "site" / "simulators" / "generation-loop" / "export.py"
    import importlib.util
    spec = importlib.util.spec_from_file_location("gl_export_test", spec_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Through JSON, as the page gets it.
    return json.loads(json.dumps(module.export(), allow_nan=False)), module


def test_exported_table_is_the_models_table_bit_for_bit(sim_data):
    from s01_generation_loop import build_default
    data, module = sim_data
    tokenizer, model = build_default(max_vocab=module.MAX_VOCAB)
    assert data["vocab"] == tokenizer.id_to_token
    V = len(data["vocab"])
    table = np.empty((V, V), dtype=np.float32)
    for r, row in enumerate(data["rows"]):
        # What the page does: Math.fround(Number(text)) == float32(float(text)).
        table[r] = np.float32(float(row["d"]))
        table[r, row["ninf"]] = -np.inf
        for value, cols in row["v"]:
            table[r, cols] = np.float32(float(value))
    assert np.array_equal(table, model.logits_table)
    assert table.dtype == model.logits_table.dtype == np.float32


def test_exported_uniforms_are_numpys(sim_data):
    data, module = sim_data
    for seed in data["seeds"]:
        expected = np.random.default_rng(seed).random(module.UNIFORMS_PER_SEED)
        assert np.array_equal(np.array(data["uniforms"][str(seed)]), expected)
    assert module.UNIFORMS_PER_SEED >= data["max_context"] - 1  # one draw per possible pass


def test_exported_traces_are_the_engines(sim_data):
    from s01_generation_loop import Engine, build_default
    data, module = sim_data
    tokenizer, model = build_default(max_vocab=module.MAX_VOCAB)
    engine = Engine(model, tokenizer, max_context=data["max_context"])
    assert len(data["traces"]) >= 4
    reasons = set()
    for t in data["traces"]:
        gen = engine.generate(t["prompt"], t["max_tokens"], t["temperature"], t["seed"])
        assert t["token_ids"] == gen.token_ids and t["text"] == gen.text
        assert t["context_lens"] == gen.stats.context_lens
        assert t["finish_reason"] == gen.finish_reason
        reasons.add((gen.finish_reason, len(gen.token_ids) == t["max_tokens"]))
    assert {("stop", False), ("length", True)} <= reasons   # an EOS stop and a budget stop


def test_float32_text_round_trips():
    from site_testing import SITE
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gl_export_f32", SITE / "simulators" / "generation-loop" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(2000).astype(np.float32) * 10,
                             np.array([np.finfo(np.float32).tiny, -np.finfo(np.float32).max,
                                       np.float32(-16.118095)], dtype=np.float32)])
    for x in values:
        assert np.float32(float(module.float32_text(x))) == x
    with pytest.raises(ValueError, match="only finite values"):
        module.float32_text(np.float32(-np.inf))


def test_chapter_map_reads_readme_rows_and_refuses_a_malformed_one(tmp_path):
    course_site = site_module("course_site")
    readme = tmp_path / "README.md"
    readme.write_text("# X\n\n## Chapters\n\n| # | Chapter | Code | What you build |\n|---|---|---|---|\n"
                      "| 01 | [The loop](chapters/s01-the-loop.md) | [`code/s01_the_loop.py`](code/s01_the_loop.py)"
                      " | A loop |\n\n## Next\n| 02 | not a chapter table |\n")
    assert course_site.readme_chapters(readme) == [
        {"number": "01", "title": "The loop", "stem": "s01-the-loop",
         "code": "code/s01_the_loop.py", "summary": "A loop"}]
    readme.write_text("## Chapters\n\n| 02 | Tokenization | code/s02.py | BPE |\n")
    with pytest.raises(ValueError, match="chapter row not in the form"):
        course_site.readme_chapters(readme)
    readme.write_text("## Other\n")
    with pytest.raises(ValueError, match="no '## Chapters' section"):
        course_site.readme_chapters(readme)


def test_notebook_cache_key_follows_results_but_not_scratch(tmp_path):
    # The site's notebooks plot results/: a changed result must re-run them (once a bench run
    # with --replace-results left them stale); a scratch run must not.
    import ast
    from site_testing import SITE
    tree = ast.parse((SITE / "conf.py").read_text())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_code_hash")
    namespace: dict = {}
    module = ast.fix_missing_locations(ast.Module([ast.Import([ast.alias("hashlib")]), func], []))
    exec(compile(module, "conf", "exec"), namespace)
    code_hash = namespace["_code_hash"]
    for folder in ("code", "data", "results", "results/scratch"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "results" / "s07.json").write_text("{}")
    before = code_hash(tmp_path)
    (tmp_path / "results" / "scratch" / "s07.json").write_text("{}")
    assert code_hash(tmp_path) == before
    (tmp_path / "results" / "s07.json").write_text('{"x": 1}')
    assert code_hash(tmp_path) != before


def test_the_build_shows_its_progress_as_it_goes(tmp_path):
    """`make site` runs for minutes when notebooks execute: each page read and written and each
    notebook executed is reported as a line while the build runs, and warnings still fail it."""
    src = make_fixture_tree(tmp_path / "src", simulator="no-such-sim")
    lines: list[str] = []
    result = site_module("build").build(src, tmp_path / "html", progress=lines.append)
    assert any("reading sources" in line and "s99" in line for line in lines), lines
    assert any("s99_fixture.ipynb" in line and "notebook" in line for line in lines), lines
    assert not any(line.startswith("myst") for line in lines)
    assert set(lines) <= set(result.stdout.splitlines())
    assert result.returncode != 0
    assert "simulator 'no-such-sim': no site/simulators/no-such-sim/" in result.stderr
