"""The "Check yourself" quiz file format, and its validator.

A quiz lives in site/quizzes/<chapter>.json, e.g. site/quizzes/s01-generation-loop.json:

    {"chapter": "s01-generation-loop",
     "title": "Check yourself: the generation loop",
     "questions": [
        {"id": "q1", "question": "plain text", "choices": ["a", "b", "c", "d"], "answer": 2,
         "explanation": "why, in one to three sentences", "section": "core-idea"}]}

`answer` is an index into `choices`; `section` is the anchor (slugified `##` title) of the
section of the chapter page that the explanation points back to. The site build checks that the
anchor exists on the page that embeds the quiz (see course_site.py); this module checks the file
on its own, so it also runs without Sphinx (tests/test_site_build.py).

`choices` are listed in any order: the widget (renderQuiz in site/static/course.js) shows each
question's choices shuffled, in an order fixed per page load by a seed (the page's `quiz-seed`
query parameter, or a random one), and scores by a choice's JSON index, never by its position.
So no question, choice or explanation may point at a position ("the first choice", "option B",
"all of the above"). `quiz_html` is the placeholder the page carries; tests/test_quiz_browser.py
renders it in Chromium.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

MIN_QUESTIONS = 6
CHAPTER_RE = re.compile(r"^s\d\d-[a-z0-9]+(?:-[a-z0-9]+)*$")
ANCHOR_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
ID_RE = re.compile(r"^[A-Za-z0-9_-]+$")
# Words that point at a choice by its place, which the shuffled widget does not keep.
POSITIONAL_RE = re.compile(
    r"\b(?:all|none|both|neither) of the (?:above|below|others)\b"
    r"|\b(?:choice|option|answer)s? \(?(?-i:[A-D])\)?(?![\w'])"
    r"|\b(?:first|second|third|fourth|last|top|bottom) (?:choice|option|answer)\b",
    re.IGNORECASE)


class QuizError(ValueError):
    """A quiz file breaks a rule of the format; the message names the file, the question and the rule."""


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise QuizError(f"{where}: {what} must be a non-empty string")
    return value


def validate_quiz(data, name: str) -> dict:
    """Check one parsed quiz against the format; return it unchanged.

    name: the quiz's name (its file stem), which must equal data["chapter"].
    Raises QuizError (a ValueError) naming the broken rule: unknown or missing keys, fewer than
    MIN_QUESTIONS questions, duplicate ids, fewer than 2 or duplicate choices, an answer that is
    not an index into choices, an explanation longer than three sentences' worth (600 chars), a
    question, choice or explanation that points at a choice by its position (the widget
    shuffles them: POSITIONAL_RE), or a section that is not an anchor slug.
    """
    where = f"quiz {name!r}"
    if not isinstance(data, dict):
        raise QuizError(f"{where}: the file must hold a JSON object")
    keys = set(data)
    if keys != {"chapter", "title", "questions"}:
        raise QuizError(f"{where}: top-level keys must be exactly chapter, title, questions "
                        f"(got {sorted(keys)})")
    chapter = _text(data["chapter"], where, "chapter")
    if not CHAPTER_RE.match(chapter):
        raise QuizError(f"{where}: chapter must look like 's01-generation-loop' (got {chapter!r})")
    if chapter != name:
        raise QuizError(f"{where}: chapter {chapter!r} must equal the file name {name!r}")
    _text(data["title"], where, "title")
    questions = data["questions"]
    if not isinstance(questions, list) or len(questions) < MIN_QUESTIONS:
        raise QuizError(f"{where}: questions must be a list of at least {MIN_QUESTIONS}")
    seen = set()
    for i, q in enumerate(questions):
        at = f"{where}, question {i + 1}"
        if not isinstance(q, dict):
            raise QuizError(f"{at}: each question must be a JSON object")
        qkeys = set(q)
        expected = {"id", "question", "choices", "answer", "explanation", "section"}
        if qkeys != expected:
            raise QuizError(f"{at}: keys must be exactly {sorted(expected)} (got {sorted(qkeys)})")
        qid = _text(q["id"], at, "id")
        if not ID_RE.match(qid):
            raise QuizError(f"{at}: id must be letters, digits, '_' or '-' (got {qid!r})")
        if qid in seen:
            raise QuizError(f"{at}: id {qid!r} is used twice; ids must be unique")
        seen.add(qid)
        _text(q["question"], at, "question")
        choices = q["choices"]
        if not isinstance(choices, list) or len(choices) < 2:
            raise QuizError(f"{at}: choices must be a list of at least 2 strings")
        for c in choices:
            _text(c, at, "each choice")
        if len(set(choices)) != len(choices):
            raise QuizError(f"{at}: choices must be distinct")
        answer = q["answer"]
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise QuizError(f"{at}: answer must be an index into choices, 0..{len(choices) - 1} "
                            f"(got {answer!r})")
        explanation = _text(q["explanation"], at, "explanation")
        if len(explanation) > 600:
            raise QuizError(f"{at}: explanation must be one to three sentences (600 characters at "
                            f"most, got {len(explanation)})")
        for what, text in [("question", q["question"]), ("explanation", explanation)] + \
                [("choice", c) for c in choices]:
            m = POSITIONAL_RE.search(text)
            if m:
                raise QuizError(f"{at}: the {what} points at a choice by its position "
                                f"({m.group(0)!r}); choices are shown shuffled, so name the "
                                "choice instead")
        section = _text(q["section"], at, "section")
        if not ANCHOR_RE.match(section):
            raise QuizError(f"{at}: section must be a section anchor such as 'core-idea' "
                            f"(got {section!r})")
    return data


def quiz_html(quiz: dict, name: str) -> str:
    """The HTML the ```{quiz} NAME``` directive puts on a page for a validated quiz: a
    <div class="course-quiz"> holding the quiz JSON in a <script type="application/json"> (read
    by course.js's renderQuiz) and a line shown when JavaScript is off."""
    # "</" inside a <script> element would end it early; JSON allows "<\/" for "</".
    payload = json.dumps(quiz, ensure_ascii=False).replace("</", "<\\/")
    return (f'<div class="course-quiz" data-quiz="{name}">'
            f'<script type="application/json" class="course-quiz-data">{payload}</script>'
            '<p class="course-quiz-nojs">The quiz needs JavaScript.</p></div>')


def load_quiz(path: Path) -> dict:
    """Read and validate site/quizzes/<name>.json. Raises QuizError for bad JSON or a bad quiz,
    FileNotFoundError when the file does not exist."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise QuizError(f"quiz {path.stem!r}: not valid JSON ({err})") from None
    return validate_quiz(data, path.stem)
