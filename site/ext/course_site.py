"""Sphinx extension for the course site: quizzes, simulators, the chapter map, local MathJax.

Directives (the chapter-facing API, see site/README.md):

    ```{quiz} s01-generation-loop
    ```
        Renders site/quizzes/s01-generation-loop.json (format and validator: course_quiz.py) as
        a "Check yourself" widget (site/static/course.js). The build fails when the file breaks
        the format or when a question's `section` is not an anchor on the page.

    ```{simulator} generation-loop
    ```
        A "Try it" simulator: site/simulators/generation-loop/simulator.js draws it, and
        site/simulators/generation-loop/export.py (`export() -> dict`) computes its data from
        code/ at build time. Adding a simulator for a later chapter is adding one such folder.

    ```{chapter-map}
    ```
        The chapter table of README.md ("## Chapters"), with links to the chapter pages and
        notebooks that exist, plus a row for every chapter page the README does not list yet
        (title from the page). It also builds the site navigation (hidden toctrees).

Math is typeset by MathJax 3 (SVG output, so no web fonts) copied into the build from the
`django-static-mathjax` package: nothing is fetched from a CDN when a page loads.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from course_quiz import QuizError, load_quiz, quiz_html

logger = logging.getLogger(__name__)

SITE_DIR = Path(__file__).resolve().parents[1]
SIMULATORS_DIR = SITE_DIR / "simulators"
MATHJAX_FILES = ("tex-svg.js", "input", "output", "ui", "a11y", "adaptors", "sre")


# ---------------------------------------------------------------------------------------------
# {quiz}
# ---------------------------------------------------------------------------------------------

class QuizDirective(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self):
        name = self.arguments[0]
        path = Path(self.env.srcdir) / "site" / "quizzes" / f"{name}.json"
        self.env.note_dependency(str(path))
        if not path.exists():
            raise self.error(f"quiz {name!r}: no file site/quizzes/{name}.json")
        try:
            quiz = load_quiz(path)
        except QuizError as err:
            raise self.error(str(err)) from None
        anchors = self.env.temp_data.setdefault("course_quiz_sections", [])
        anchors.extend((name, q["id"], q["section"]) for q in quiz["questions"])
        return [nodes.raw("", quiz_html(quiz, name), format="html")]


def check_quiz_sections(app: Sphinx, doctree: nodes.document) -> None:
    """After a page is read: every quiz question's section must be an anchor on that page."""
    wanted = app.env.temp_data.pop("course_quiz_sections", [])
    if not wanted:
        return
    ids = set()
    for node in doctree.findall(nodes.Element):
        ids.update(node.get("ids", []))
    for name, qid, section in wanted:
        if section not in ids:
            logger.warning(f"quiz {name!r}, question {qid!r}: section {section!r} is not an "
                           f"anchor on this page (known: {', '.join(sorted(ids))})",
                           location=app.env.docname, type="course", subtype="quiz")


# ---------------------------------------------------------------------------------------------
# {simulator}
# ---------------------------------------------------------------------------------------------

def simulator_names() -> list[str]:
    """Simulators that exist: folders of site/simulators with simulator.js and export.py."""
    return sorted(p.name for p in SIMULATORS_DIR.iterdir()
                  if (p / "simulator.js").is_file() and (p / "export.py").is_file())


class SimulatorDirective(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self):
        name = self.arguments[0]
        if name not in simulator_names():
            raise self.error(f"simulator {name!r}: no site/simulators/{name}/ with simulator.js "
                             f"and export.py (known: {', '.join(simulator_names())})")
        for part in ("simulator.js", "export.py"):
            self.env.note_dependency(str(SIMULATORS_DIR / name / part))
        sims = self.env.course_simulators.setdefault(self.env.docname, set())
        sims.add(name)
        html = (f'<div class="course-sim" data-sim="{name}">'
                '<p class="course-sim-loading">Loading the simulator (it needs JavaScript)…</p>'
                '</div>')
        return [nodes.raw("", html, format="html")]


def init_env(app: Sphinx, env) -> None:
    if not hasattr(env, "course_simulators"):
        env.course_simulators = {}


def purge_doc(app: Sphinx, env, docname: str) -> None:
    getattr(env, "course_simulators", {}).pop(docname, None)


def merge_info(app: Sphinx, env, docnames, other) -> None:
    init_env(app, env)
    for docname in docnames:
        if docname in getattr(other, "course_simulators", {}):
            env.course_simulators[docname] = other.course_simulators[docname]


def add_page_assets(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Only pages with a simulator load its script and its data."""
    for name in sorted(getattr(app.env, "course_simulators", {}).get(pagename, ())):
        app.builder.add_js_file(f"course/sim/{name}.js")
        app.builder.add_js_file(f"course/sim/{name}.data.js")


def load_exporter(name: str):
    spec = importlib.util.spec_from_file_location(f"course_sim_export_{name.replace('-', '_')}",
                                                  SIMULATORS_DIR / name / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_simulators(app: Sphinx, env) -> list[str]:
    """Export each used simulator's data from code/ and copy its script into _static/course/sim.

    Runs after reading and before pages are written, so the `?v=` checksums in the pages are
    those of the files they load (a browser never keeps stale data under an unchanged URL).
    """
    if app.builder.format != "html":
        return []
    used = sorted(set().union(*getattr(app.env, "course_simulators", {}).values()))
    out = Path(app.outdir) / "_static" / "course" / "sim"
    out.mkdir(parents=True, exist_ok=True)
    for name in used:
        data = load_exporter(name).export()
        text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        (out / f"{name}.data.js").write_text(
            f"/* Exported at build time by site/simulators/{name}/export.py. */\n"
            f"CourseSim.setData({json.dumps(name)}, {text});\n", encoding="utf-8")
        shutil.copyfile(SIMULATORS_DIR / name / "simulator.js", out / f"{name}.js")
        logger.info(f"simulator {name}: {len(text):,} bytes of data")
    return []


# ---------------------------------------------------------------------------------------------
# MathJax, served by the site itself
# ---------------------------------------------------------------------------------------------

def mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax package: MathJax 3.2.2 as static files
    return Path(mathjax.__file__).resolve().parent / "static" / "mathjax" / "es5"


def copy_mathjax(app: Sphinx, env) -> list[str]:
    if app.builder.format != "html":
        return []
    src = mathjax_source()
    dst = Path(app.outdir) / "_static" / "mathjax"
    stamp = dst / ".copied-from"
    if stamp.exists() and stamp.read_text() == str(src):
        return []
    for part in MATHJAX_FILES:
        source = src / part
        if source.is_dir():
            shutil.copytree(source, dst / part, dirs_exist_ok=True)
        else:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dst / part)
    shutil.copyfile(src.parent / "LICENSE", dst / "LICENSE")
    stamp.write_text(str(src))
    return []


# ---------------------------------------------------------------------------------------------
# {chapter-map}
# ---------------------------------------------------------------------------------------------

ROW_RE = re.compile(r"^\|\s*(\d\d)\s*\|\s*\[([^\]]+)\]\(chapters/([a-z0-9-]+)\.md\)\s*\|"
                    r"\s*\[`(code/[^`]+)`\]\([^)]*\)\s*\|\s*(.+?)\s*\|\s*$")


def readme_chapters(readme: Path) -> list[dict]:
    """Rows of README.md's chapter table: number, title, chapter stem, code path, summary.

    Raises ValueError when the README has no "## Chapters" table rows in the expected form
    (| 01 | [Title](chapters/s01-x.md) | [`code/s01_x.py`](code/s01_x.py) | summary |).
    """
    text = readme.read_text(encoding="utf-8")
    match = re.search(r"^## Chapters\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if not match:
        raise ValueError(f"{readme}: no '## Chapters' section for the chapter map")
    rows = []
    for line in match.group(1).splitlines():
        if not re.match(r"^\|\s*\d", line):
            continue  # header, separator or prose
        m = ROW_RE.match(line)
        if not m:  # a chapter row the map cannot read is an error, never a silent gap
            raise ValueError(f"{readme}: chapter row not in the form | 01 | [Title](chapters/s01-x.md)"
                             f" | [`code/s01_x.py`](code/s01_x.py) | summary |: {line.strip()}")
        rows.append(m.groups())
    if not rows:
        raise ValueError(f"{readme}: the '## Chapters' section has no table row of the form "
                         "| 01 | [Title](chapters/s01-x.md) | [`code/s01_x.py`](...) | summary |")
    return [{"number": n, "title": t, "stem": s, "code": c, "summary": w} for n, t, s, c, w in rows]


class ChapterMapDirective(SphinxDirective):
    has_content = False

    def run(self):
        readme = Path(self.env.srcdir) / "README.md"
        self.env.note_dependency(str(readme))
        try:
            rows = readme_chapters(readme)
        except ValueError as err:
            raise self.error(str(err)) from None
        found = self.env.found_docs
        # Chapter pages the README does not list yet still get a row: the title from the page's
        # "# SNN · Title" line, the code module when it exists.
        listed = {row["stem"] for row in rows}
        srcdir = Path(self.env.srcdir)
        for doc in sorted(d for d in found if d.startswith("chapters/s")):
            stem = doc.split("/", 1)[1]
            if stem in listed:
                continue
            page = (srcdir / doc).with_suffix(".md")
            first = page.read_text(encoding="utf-8").lstrip().splitlines()[0] if page.exists() else ""
            title = re.sub(r"^#\s*S\d\d\s*·\s*", "", first).strip() or stem
            module = sorted((srcdir / "code").glob(stem.replace("-", "_") + ".py"))
            rows.append({"number": stem[1:3], "title": title, "stem": stem,
                         "code": f"code/{module[0].name}" if module else None, "summary": "—"})
        rows.sort(key=lambda r: r["number"])
        lines = ["| # | Chapter | Notebook | Code | What you build |", "|---|---|---|---|---|"]
        for row in rows:
            doc = f"chapters/{row['stem']}"
            chapter = (f"{{doc}}`{row['title']} </{doc}>`" if doc in found
                       else f"{row['title']} (being written)")
            notebook = "notebooks/" + row["stem"].replace("-", "_")
            nb = f"{{doc}}`notebook </{notebook}>`" if notebook in found else "—"
            code = (f"{{download}}`{Path(row['code']).name} </{row['code']}>`" if row["code"]
                    and (srcdir / row["code"]).exists() else "—")
            lines.append(f"| {row['number']} | {chapter} | {nb} | {code} | {row['summary']} |")
        # The site navigation: every chapter page and notebook that exists, in order. (A glob
        # toctree would warn, and so fail the strict build, while a folder is still empty.)
        for caption, folder in (("Chapters", "chapters/"), ("Notebooks", "notebooks/")):
            docs = sorted(d for d in found if d.startswith(folder))
            if docs:
                lines += ["", "```{toctree}", f":caption: {caption}", ":hidden:", ""]
                lines += [f"/{d}" for d in docs] + ["```"]
        container = nodes.container(classes=["course-chapter-map"])
        self.state.nested_parse(StringList(lines, source=str(readme)), self.content_offset,
                                container)
        return [container]


def setup(app: Sphinx) -> dict:
    app.add_directive("quiz", QuizDirective)
    app.add_directive("simulator", SimulatorDirective)
    app.add_directive("chapter-map", ChapterMapDirective)
    app.connect("env-before-read-docs", lambda app, env, docnames: init_env(app, env))
    app.connect("env-purge-doc", purge_doc)
    app.connect("env-merge-info", merge_info)
    app.connect("doctree-read", check_quiz_sections)
    app.connect("html-page-context", add_page_assets)
    app.connect("env-updated", write_simulators)
    app.connect("env-updated", copy_mathjax)
    app.add_css_file("course.css")
    app.add_js_file("course.js")
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
