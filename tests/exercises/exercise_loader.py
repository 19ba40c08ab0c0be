"""Exercise tests run against one implementation of each exercise module.

EXERCISES_IMPL=solutions (the default, used by `make test` and CI) grades the reference solutions
in exercises/solutions/; EXERCISES_IMPL=learner (set by exercises/grade.py) grades the learner's
copy in exercises/. EXERCISES_DIR (set by grade.py --exercises-dir) names another exercises
folder, laid out the same way. Each test carries `@pytest.mark.points(n)`: its weight in the score.
"""
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_exercise(name: str):
    """Import exercises/<name>.py or exercises/solutions/<name>.py, as EXERCISES_IMPL says
    (exercises/ is $EXERCISES_DIR when that is set)."""
    impl = os.environ.get("EXERCISES_IMPL", "solutions")
    if impl not in ("solutions", "learner"):
        raise ValueError(f"EXERCISES_IMPL must be 'solutions' or 'learner' (got {impl!r})")
    exercises = Path(os.environ.get("EXERCISES_DIR") or ROOT / "exercises")
    folder = exercises / ("solutions" if impl == "solutions" else "")
    path = folder / f"{name}.py"
    code_dir = str(ROOT / "code")
    if code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    spec = importlib.util.spec_from_file_location(f"exercise_{impl}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
