"""The course map says what exists and what is planned, and no chapter points past it.

site/course-map.md lists every chapter of the plan with a status. A chapter page in chapters/ must
be on the map as "written" (linked), a "planned" chapter must have no page and no code module, and
README.md's chapter table lists exactly the written ones. Each chapter's "What's next" may name a
chapter that has no page only in a sentence that says it is planned, so the promise stays true as
chapters land.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "site" / "course-map.md"
PAGES = {p.name[1:3]: p for p in (ROOT / "chapters").glob("s[0-9][0-9]-*.md")}
ROW = re.compile(r"^\|\s*(\d\d)\s*\|\s*(.+?)\s*\|\s*(written|planned)\s*\|\s*(.+?)\s*\|\s*$")


def map_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in MAP.read_text().splitlines():
        if m := ROW.match(line):
            number, chapter, status, _ = m.groups()
            assert number not in rows, f"chapter {number} twice on the map"
            rows[number] = (chapter, status)
    return rows


def test_the_map_lists_every_chapter_of_the_plan_once():
    assert sorted(map_rows()) == [f"{n:02d}" for n in range(1, 21)]


def test_every_written_chapter_is_on_the_map_linked_and_every_planned_one_has_no_page():
    for number, (chapter, status) in map_rows().items():
        if number in PAGES:
            assert status == "written", f"S{number} has a page but the map says {status}"
            assert f"</chapters/{PAGES[number].stem}>" in chapter, f"S{number}'s map row has no link"
        else:
            assert status == "planned", f"S{number} is marked written but has no page"
            assert not list((ROOT / "code").glob(f"s{number}_*.py")), f"S{number} has code"


def test_the_readme_table_lists_exactly_the_written_chapters():
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"^## Chapters\s*$(.*?)(?=^## )", readme, flags=re.M | re.S).group(1)
    listed = set(re.findall(r"^\|\s*(\d\d)\s*\|", table, flags=re.M))
    assert listed == set(PAGES)


def whats_next(text: str) -> str:
    match = re.search(r"^## What's next\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    return match.group(1) if match else ""


@pytest.mark.parametrize("page", sorted(PAGES.values()), ids=lambda p: p.stem)
def test_whats_next_names_an_unwritten_chapter_only_as_planned(page):
    section = whats_next(page.read_text())
    assert section.strip(), f"{page.name} has no What's next"
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(section.split()))
    for sentence in sentences:
        for number in re.findall(r"\bS(\d\d)\b", sentence):
            if number not in PAGES:
                assert "planned" in sentence.lower(), (
                    f"{page.name}: What's next names S{number}, which has no page, "
                    f"without saying it is planned: {sentence!r}")
