"""The "Check yourself" widget shuffles each question's choices and scores by identity.

A minimal page per quiz, opened from file:// (as a learner opens the site from disk), holds the
placeholder the ``{quiz}`` directive writes (site/ext/course_quiz.py: quiz_html) and loads
site/static/course.js; no site build is needed. Playwright drives Debian's Chromium.

- With a fixed seed (``?quiz-seed=N``) every question shows a permutation of its JSON choices,
  some questions differ from the JSON order, and the same seed gives the same order again.
- Picking the right choice scores right and a wrong one scores wrong, whatever the order; a
  learner who picks by position (the JSON index of the answer, counted on screen) scores only
  where the shuffle happened to leave the answer there. The feedback names the right choice.
- Labels and keyboard: every radio has its label, arrow keys move in the displayed order.
- No console errors. The quiz files are every course quiz plus the fixture quiz.
The validator's rule that nothing points at a choice by position is tested here too.
Browser tests skip when Playwright or /usr/bin/chromium is missing.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from site_testing import ROOT, fixture_quiz, site_module

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
QUIZZES = sorted((ROOT / "site" / "quizzes").glob("*.json"))
SEEDS = [1, 7, 2024]
browser_test = [pytest.mark.browser, pytest.mark.slow]


def all_quizzes() -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in QUIZZES] + [fixture_quiz()]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """file:// URL of a page per quiz (by chapter name)."""
    quiz_module = site_module("course_quiz")
    folder = tmp_path_factory.mktemp("quiz_pages")
    shutil.copy(ROOT / "site" / "static" / "course.js", folder / "course.js")
    urls = {}
    for quiz in all_quizzes():
        quiz_module.validate_quiz(quiz, quiz["chapter"])
        # The sections the explanations link back to, so each "Back to" link has a target.
        sections = "".join(f'<section id="{s}"><h2>{s}</h2></section>'
                           for s in sorted({q["section"] for q in quiz["questions"]}))
        page = folder / f"{quiz['chapter']}.html"
        page.write_text("<!doctype html><html><head><meta charset='utf-8'></head><body>"
                        f"{sections}{quiz_module.quiz_html(quiz, quiz['chapter'])}"
                        "<script src='course.js'></script></body></html>", encoding="utf-8")
        urls[quiz["chapter"]] = page.as_uri()
    return urls


@pytest.fixture(scope="module")
def browser():
    api = pytest.importorskip("playwright.sync_api",
                              reason="Playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    profile = tempfile.mkdtemp(prefix="quiz-chromium-")
    with api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM,
                                                       headless=True, args=ARGS)
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


def open_quiz(browser, url: str, seed: int | None):
    page = browser.new_page()
    page.problems = []
    page.on("console", lambda m: page.problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.goto(url if seed is None else f"{url}?quiz-seed={seed}")
    page.wait_for_selector(".course-quiz-check")
    return page


def shown(page, quiz) -> dict[str, list[tuple[str, str]]]:
    """Per question id, the (radio value, label text) pairs in the order on screen."""
    return page.evaluate("""() => {
        const out = {};
        document.querySelectorAll('fieldset.course-quiz-question').forEach(fs => {
            out[fs.dataset.qid] = Array.from(fs.querySelectorAll('label.course-quiz-choice'))
                .map(l => [l.querySelector('input').value, l.textContent.trim()]);
        });
        return out;
    }""")


def score(page) -> str:
    return page.inner_text(".course-quiz-score")


@pytest.mark.parametrize("quiz", all_quizzes(), ids=lambda q: q["chapter"])
@pytest.mark.browser
@pytest.mark.slow
def test_each_order_is_a_permutation_and_some_are_shuffled(browser, pages, quiz):
    orders = {}
    for seed in SEEDS:
        page = open_quiz(browser, pages[quiz["chapter"]], seed)
        assert page.get_attribute(".course-quiz", "data-quiz-seed") == str(seed)
        displayed = shown(page, quiz)
        assert list(displayed) == [q["id"] for q in quiz["questions"]]
        for q in quiz["questions"]:
            values = [int(v) for v, _ in displayed[q["id"]]]
            assert sorted(values) == list(range(len(q["choices"]))), (seed, q["id"], values)
            # Each label shows the text of the choice whose JSON index is its radio's value.
            assert [text for _, text in displayed[q["id"]]] == [q["choices"][i] for i in values]
            orders[seed, q["id"]] = values
        moved = [q["id"] for q in quiz["questions"]
                 if orders[seed, q["id"]] != list(range(len(q["choices"])))]
        assert len(moved) >= len(quiz["questions"]) // 2, (seed, moved)
        # The same seed gives the same order on the next load.
        page.reload()
        page.wait_for_selector(".course-quiz-check")
        assert shown(page, quiz) == displayed
        assert not page.problems, page.problems
        page.close()
    # Different seeds give different orders for some question.
    assert any(orders[SEEDS[0], q["id"]] != orders[s, q["id"]]
               for s in SEEDS[1:] for q in quiz["questions"])


@pytest.mark.parametrize("quiz", all_quizzes(), ids=lambda q: q["chapter"])
@pytest.mark.browser
@pytest.mark.slow
def test_scoring_uses_the_choice_not_its_position(browser, pages, quiz):
    chapter, total = quiz["chapter"], len(quiz["questions"])
    for seed in SEEDS:
        page = open_quiz(browser, pages[chapter], seed)
        displayed = shown(page, quiz)
        # The right choice, found by its text wherever it is shown: full marks.
        for q in quiz["questions"]:
            page.locator(f'fieldset[data-qid="{q["id"]}"]').get_by_label(
                q["choices"][q["answer"]], exact=True).check()
        page.click(".course-quiz-check")
        assert score(page) == f"Score: {total} of {total}"
        assert page.locator("fieldset.is-right").count() == total
        # A wrong choice, for every question: nothing scores, and the feedback names the right
        # choice and carries the explanation and the link back.
        page.click(".course-quiz-reset")
        assert score(page) == ""
        for q in quiz["questions"]:
            wrong = next(text for value, text in displayed[q["id"]] if int(value) != q["answer"])
            page.locator(f'fieldset[data-qid="{q["id"]}"]').get_by_label(wrong, exact=True).check()
        page.click(".course-quiz-check")
        assert score(page) == f"Score: 0 of {total}"
        for q in quiz["questions"]:
            box = page.locator(f'fieldset[data-qid="{q["id"]}"]')
            assert "is-wrong" in box.get_attribute("class")
            feedback = box.locator(".course-quiz-feedback").inner_text()
            assert f"The answer is \u201c{q['choices'][q['answer']]}\u201d." in feedback
            assert q["explanation"] in feedback
            assert box.locator("a.course-quiz-back").get_attribute("href") == f"#{q['section']}"
        # Picking by position (the answer's JSON index, counted on screen) scores exactly the
        # questions where the shown choice at that place is the right one.
        page.click(".course-quiz-reset")
        expected = 0
        for q in quiz["questions"]:
            value, text = displayed[q["id"]][q["answer"]]
            expected += text == q["choices"][q["answer"]]
            page.locator(f'fieldset[data-qid="{q["id"]}"] input[type=radio]').nth(q["answer"]).check()
        page.click(".course-quiz-check")
        assert score(page) == f"Score: {expected} of {total}"
        assert not page.problems, page.problems
        page.close()


@pytest.mark.browser
@pytest.mark.slow
def test_labels_keyboard_and_a_random_seed(browser, pages):
    quiz = json.loads((ROOT / "site" / "quizzes" / "s03-transformer.json").read_text())
    chapter = quiz["chapter"]
    page = open_quiz(browser, pages[chapter], None)   # no seed: a random one, shown on the root
    assert re.fullmatch(r"\d+", page.get_attribute(".course-quiz", "data-quiz-seed"))
    displayed = shown(page, quiz)
    for q in quiz["questions"]:
        assert sorted(int(v) for v, _ in displayed[q["id"]]) == list(range(len(q["choices"])))
        for value, text in displayed[q["id"]]:
            radio = page.locator(f"#{chapter}-{q['id']}-{value}")
            assert radio.get_attribute("name") == f"{chapter}-{q['id']}"
            assert page.locator(f"label[for='{chapter}-{q['id']}-{value}']").inner_text().strip() \
                == text
        legend = page.locator(f'fieldset[data-qid="{q["id"]}"] legend').inner_text()
        assert legend.endswith(q["question"])
    # Arrow keys walk the radios in the order on screen.
    first = quiz["questions"][0]
    radios = page.locator(f'fieldset[data-qid="{first["id"]}"] input[type=radio]')
    radios.nth(0).focus()
    page.keyboard.press("Space")
    page.keyboard.press("ArrowDown")
    checked = page.locator(f'fieldset[data-qid="{first["id"]}"] input:checked')
    assert checked.get_attribute("value") == displayed[first["id"]][1][0]
    assert page.locator(".course-quiz-score").get_attribute("aria-live") == "polite"
    assert not page.problems, page.problems
    page.close()


@pytest.mark.parametrize("field, text", [
    ("choices", ["All of the above", "b"]),
    ("choices", ["a", "Neither of the others"]),
    ("explanation", "Option B is right. See Core idea."),
    ("explanation", "The first choice counts. See Core idea."),
    ("question", "Is answer C right?"),
])
def test_validator_refuses_what_points_at_a_position(field, text):
    quiz_module = site_module("course_quiz")
    quiz = fixture_quiz()
    quiz["questions"][2][field] = text
    if field == "choices":
        quiz["questions"][2]["answer"] = 0
    with pytest.raises(quiz_module.QuizError, match="points at a choice by its position"):
        quiz_module.validate_quiz(quiz, quiz["chapter"])
