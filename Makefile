# Two commands do all the set-up themselves (see README.md):
#   make run    create .venv from requirements.txt on first use, then run chapter 1
#   make test   same set-up, then the whole test suite
# Other targets: make grade (score your exercises), make chapter N=02 (run another chapter),
#                make site (build the course site into site/_build/html).

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)

.PHONY: run test grade chapter site venv clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11'"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

run: venv
	$(PY) code/s01_generation_loop.py

# A chapter may have sibling modules (code/s03_checkpoint.py): the one named like its page runs.
chapter: venv
	@test -n "$(N)" && ls code/s$(N)_*.py >/dev/null 2>&1 || { echo "usage: make chapter N=01 (two digits; chapters: $$(ls code | sed -n 's/^s\([0-9][0-9]\)_.*/\1/p' | uniq | tr '\n' ' '))"; exit 2; }
	@script=code/$$(basename chapters/s$(N)-*.md .md | tr - _).py; echo "$(PY) $$script"; $(PY) $$script

# One pytest process per core (pytest-xdist), each test file whole in one of them, so a
# file's module fixtures are built once; `pytest` alone runs everything in one process.
test: venv
	$(PY) -m pytest -n auto --dist loadfile

grade: venv
	$(PY) exercises/grade.py

site: venv
	$(PY) site/build.py

clean:
	rm -rf $(VENV) .pytest_cache site/_build
