"""Every "Check yourself" quiz (site/quizzes/*.json) is well formed and points into its chapter.

The format is the one agreed for chapter pages (see site/quizzes/s01-generation-loop.json):

    {"chapter": "s01-generation-loop", "title": "...",
     "questions": [{"id", "question", "choices", "answer", "explanation", "section"}, ...]}

Rules checked here, without building the site: exactly those keys; at least 6 questions; unique
ids; plain-text questions and choices (no Markdown); at least 2 distinct, non-empty choices; an
`answer` that indexes `choices`; a non-empty explanation that names the section it points back
to; a `section` that is the anchor of a `##` heading of chapters/<chapter>.md; and the chapter
page embeds the quiz with a ```{quiz} <chapter>``` directive. Anchors are GitHub-style slugs,
as MyST makes them (`## Core idea` -> `core-idea`).
"""
from __future__ import annotations

import json
from collections import Counter
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUIZ_DIR = ROOT / "site" / "quizzes"
CHAPTER_DIR = ROOT / "chapters"
MIN_QUESTIONS = 6
QUESTION_KEYS = {"id", "question", "choices", "answer", "explanation", "section"}
MARKDOWN = re.compile(r"`|\*\*|__|\]\(|^#|^\s*[-*] ", re.MULTILINE)
QUIZ_DIRECTIVE = re.compile(r"^```\{quiz\}\s+(\S+)\s*$", re.MULTILINE)


def slugify(title: str) -> str:
    """GitHub-style heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def section_headings(markdown: str) -> dict[str, str]:
    """Map anchor -> title for every `##` heading outside fenced code blocks."""
    headings, fence = {}, None
    for line in markdown.splitlines():
        marker = re.match(r"^(`{3,}|~{3,})", line)
        if marker:
            if fence is None:
                fence = marker.group(1)
            elif line.startswith(fence) and not line[len(fence):].strip():
                fence = None
            continue
        if fence is None:
            m = re.match(r"^## (?!#)(.+?)\s*#*\s*$", line)
            if m:
                headings[slugify(m.group(1))] = m.group(1).strip()
    return headings


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"duplicate keys {dupes}")
    return dict(pairs)


def quiz_problems(path: Path, chapter_dir: Path = CHAPTER_DIR) -> list[str]:
    """Every rule the quiz file at `path` breaks, as readable messages (empty when it is fine)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys)
    except ValueError as err:
        return [f"not valid JSON: {err}"]
    if not isinstance(data, dict) or set(data) != {"chapter", "title", "questions"}:
        return ["top-level keys must be exactly chapter, title, questions"]
    problems = []
    chapter = data["chapter"]
    if chapter != path.stem:
        problems.append(f"chapter {chapter!r} must equal the file name {path.stem!r}")
    if not isinstance(data["title"], str) or not data["title"].strip():
        problems.append("title must be a non-empty string")
    page = chapter_dir / f"{chapter}.md"
    if not page.exists():
        return problems + [f"no chapter page {page.name} for this quiz"]
    markdown = page.read_text(encoding="utf-8")
    headings = section_headings(markdown)
    if chapter not in QUIZ_DIRECTIVE.findall(markdown):
        problems.append(f"{page.name} does not embed the quiz with a {{quiz}} {chapter} directive")
    questions = data["questions"]
    if not isinstance(questions, list) or len(questions) < MIN_QUESTIONS:
        return problems + [f"questions must be a list of at least {MIN_QUESTIONS}"]
    seen: set[str] = set()
    for i, q in enumerate(questions, start=1):
        at = f"question {i}"
        if not isinstance(q, dict) or set(q) != QUESTION_KEYS:
            problems.append(f"{at}: keys must be exactly {sorted(QUESTION_KEYS)}")
            continue
        if not isinstance(q["id"], str) or not q["id"].strip():
            problems.append(f"{at}: id must be a non-empty string")
        elif q["id"] in seen:
            problems.append(f"{at}: id {q['id']!r} is not unique")
        else:
            seen.add(q["id"])
        if not isinstance(q["question"], str) or not q["question"].strip():
            problems.append(f"{at}: question must be a non-empty string")
        elif MARKDOWN.search(q["question"]):
            problems.append(f"{at}: question must be plain text, without Markdown")
        choices = q["choices"]
        if (not isinstance(choices, list) or len(choices) < 2
                or not all(isinstance(c, str) and c.strip() for c in choices)):
            problems.append(f"{at}: choices must be a list of at least 2 non-empty strings")
        else:
            if len(set(choices)) != len(choices):
                problems.append(f"{at}: choices must be distinct")
            if any(MARKDOWN.search(c) for c in choices):
                problems.append(f"{at}: choices must be plain text, without Markdown")
            answer = q["answer"]
            if isinstance(answer, bool) or not isinstance(answer, int) \
                    or not 0 <= answer < len(choices):
                problems.append(f"{at}: answer must index choices, 0..{len(choices) - 1} "
                                f"(got {answer!r})")
        section = q["section"]
        if section not in headings:
            problems.append(f"{at}: section {section!r} is not a ## heading anchor of {page.name} "
                            f"(anchors: {sorted(headings)})")
        explanation = q["explanation"]
        if not isinstance(explanation, str) or not explanation.strip():
            problems.append(f"{at}: explanation must be a non-empty string")
        elif section in headings and headings[section].lower() not in explanation.lower():
            problems.append(f"{at}: explanation must name the section it points back to "
                            f"({headings[section]!r})")
    return problems


QUIZZES = sorted(QUIZ_DIR.glob("*.json"))


def test_there_is_a_quiz_for_chapter_one():
    assert QUIZ_DIR / "s01-generation-loop.json" in QUIZZES


@pytest.mark.parametrize("path", QUIZZES, ids=[p.stem for p in QUIZZES])
def test_quiz_is_well_formed_and_points_into_its_chapter(path):
    problems = quiz_problems(path)
    assert problems == [], f"{path.name}:\n  " + "\n  ".join(problems)


def test_every_quiz_directive_has_a_quiz_file():
    for page in sorted(CHAPTER_DIR.glob("*.md")):
        for name in QUIZ_DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            assert (QUIZ_DIR / f"{name}.json").exists(), f"{page.name} embeds missing quiz {name!r}"


# The checker itself must catch what it claims to catch (otherwise the tests above prove nothing).

def test_slugs_and_headings_follow_myst():
    page = "# S01 · Title\n## Core idea\n```text\n## not a heading\n```\n## In production\n### Sub\n"
    assert section_headings(page) == {"core-idea": "Core idea", "in-production": "In production"}
    assert slugify("Try it") == "try-it" and slugify("What's next?") == "whats-next"


def _good_quiz():
    question = {"id": "q", "question": "Which?", "choices": ["a", "b"], "answer": 1,
                "explanation": "Because. See Core idea.", "section": "core-idea"}
    return {"chapter": "s99-demo", "title": "Check yourself: demo",
            "questions": [dict(question, id=f"q{i}") for i in range(MIN_QUESTIONS)]}


def _write(tmp_path, quiz, page="# S99 · Demo\n## Core idea\n## Check yourself\n```{quiz} s99-demo\n```\n"):
    (tmp_path / "chapters").mkdir(exist_ok=True)
    (tmp_path / "chapters" / "s99-demo.md").write_text(page)
    path = tmp_path / "s99-demo.json"
    path.write_text(json.dumps(quiz) if not isinstance(quiz, str) else quiz)
    return quiz_problems(path, tmp_path / "chapters")


def test_checker_accepts_a_good_quiz(tmp_path):
    assert _write(tmp_path, _good_quiz()) == []


@pytest.mark.parametrize("breakage, message", [
    (lambda q: q["questions"].pop(), "at least 6"),
    (lambda q: q["questions"][1].update(id="q0"), "not unique"),
    (lambda q: q["questions"][0].update(answer=2), r"answer must index choices, 0\.\.1"),
    (lambda q: q["questions"][0].update(answer=True), "answer must index choices"),
    (lambda q: q["questions"][0].update(choices=["a", "a"]), "distinct"),
    (lambda q: q["questions"][0].update(section="mechanics"), "'mechanics' is not a ## heading"),
    (lambda q: q["questions"][0].update(explanation="Because."), "must name the section"),
    (lambda q: q["questions"][0].update(question="What does `x` do?"), "plain text"),
    (lambda q: q["questions"][0].pop("section"), "keys must be exactly"),
    (lambda q: q.update(chapter="s98-other"), "must equal the file name"),
])
def test_checker_rejects_each_broken_rule(tmp_path, breakage, message):
    quiz = _good_quiz()
    breakage(quiz)
    problems = _write(tmp_path, quiz)
    assert any(re.search(message, p) for p in problems), problems


def test_checker_rejects_duplicate_keys_and_a_page_without_the_directive(tmp_path):
    assert "duplicate keys" in _write(tmp_path, '{"chapter": "a", "chapter": "b"}')[0]
    problems = _write(tmp_path, _good_quiz(), page="# S99\n## Core idea\n")
    assert any("does not embed the quiz" in p for p in problems)


def test_answer_positions_and_lengths_are_no_giveaway():
    # A quiz whose answer is mostly B, or mostly the longest choice, can be passed without
    # reading the chapter (it once was: B in 41 of 62, the longest in 43).
    questions = [q for path in QUIZZES
                 for q in json.loads(path.read_text(encoding="utf-8"))["questions"]]
    positions = Counter(q["answer"] for q in questions)
    assert len(questions) >= 40
    for position in range(4):
        share = positions[position] / len(questions)
        assert 0.15 <= share <= 0.35, f"answer {position} is right in {share:.0%} of questions"
    longest = sum(len(q["choices"][q["answer"]]) == max(map(len, q["choices"])) for q in questions)
    assert longest / len(questions) <= 0.3, f"the right answer is the longest in {longest}"
    for path in QUIZZES:   # each quiz on its own: no position holds half its answers
        answers = Counter(q["answer"] for q in json.loads(path.read_text())["questions"])
        assert max(answers.values()) <= 0.5 * sum(answers.values()), path.name
