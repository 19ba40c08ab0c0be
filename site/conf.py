"""Sphinx configuration of the course site. Build it with `python site/build.py` (see site/README.md).

The source root is the repository root, so chapter pages (chapters/*.md) can quote code/ with
literalinclude and notebooks (notebooks/*.ipynb) sit where learners open them; only the home page,
the course map, the chapters and the notebooks are read (include_patterns below).
"""
import hashlib
import os
import shutil
import sys
from pathlib import Path

SITE = Path(__file__).resolve().parent
sys.path.insert(0, str(SITE / "ext"))

project = "LLM inference, from the loop to the engine"
author = "the course authors"
copyright = "the course authors; corpus: public-domain works (see data/SOURCE.md)"
language = "en"

root_doc = "site/index"
include_patterns = ["site/index.md", "site/course-map.md", "chapters/*.md", "notebooks/*.ipynb"]
# Pruned before include_patterns is applied, so Sphinx never walks these trees.
exclude_patterns = [".venv", ".git", "site/_build", "**/.ipynb_checkpoints", "data", "tests",
                    "exercises", "benchmarks", "scripts", "artifacts", "build"]

extensions = ["myst_nb", "sphinx.ext.mathjax", "sphinx_design", "course_site"]

# --- MyST -------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3          # [text](#core-idea) links to a `##` heading by its slug
myst_dmath_double_inline = True

# --- notebooks --------------------------------------------------------------------------------
# Executed once and cached (jupyter-cache). The cache is keyed by the notebook's code cells, not
# by the code they import, so the cache folder is named after a hash of code/, data/ and results/: change
# the engine and every notebook runs again; change nothing and the build reuses the outputs.
def _code_hash(root: Path) -> str:
    # Notebook outputs depend on the code, the data and the recorded results they plot
    # (results/scratch/ is a benchmark's scratch output, read by no notebook).
    digest = hashlib.sha256()
    for folder in ("code", "data", "results"):
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts \
                    and path.relative_to(root).parts[:2] != ("results", "scratch"):
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cache_path(root: Path) -> str:
    caches = SITE / "_build" / ".jupyter_cache"
    current = caches / _code_hash(root)
    if caches.is_dir():  # outputs of older code are never used again
        for old in caches.iterdir():
            if old != current and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return str(current)


nb_execution_mode = os.environ.get("COURSE_NB_EXECUTION", "cache")
nb_execution_cache_path = _cache_path(SITE.parent)
nb_execution_timeout = 120
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# Widgets cannot run without a kernel, and the default widget scripts come from a CDN: keep them
# out. Widget outputs then render as nothing; the page's interactive part is the simulator.
nb_ipywidgets_js = {}

# --- HTML -------------------------------------------------------------------------------------
html_theme = "furo"
html_title = "LLM inference, from the loop to the engine"
html_static_path = ["static"]
html_extra_path = ["extra"]       # index.html at the site root, redirecting to the home page
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {"navigation_with_keys": True}
pygments_style = "friendly"
pygments_dark_style = "monokai"

# MathJax 3 from the site itself (copied into _static/mathjax by course_site), SVG output: no fonts.
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {"tex": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]},
                   "options": {"enableMenu": False}}

