"""Top-p at the exact boundary against HF's TopPLogitsWarper: the sweep of issue 12.

    python scripts/top_p_sweep.py

Every ordered list of 3-4 probabilities in steps of 0.05 (each > 0, summing to 1) times top_p in
0.50..0.95: 11,400 cases; logits = log of the float32 probabilities, fed to ours and to HF.
Prints, for the rule before issue 12 (recomputed here) and for S04's NumPy and S06's torch
apply_top_p, in how many cases the kept multiset of probability levels differs from HF's (the
kept id sets also differ where probabilities tie: HF's sort keeps another of the tied ids), and
the two cases the issue names. tests/test_s04_top_p_boundary.py holds the same sweep.
"""
import itertools
import sys
from pathlib import Path

import numpy as np
import torch
from transformers.generation.logits_process import TopPLogitsWarper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
import s04_sampling as s04  # noqa: E402
import s06_sampler as s06  # noqa: E402


def old_rule(logits: np.ndarray, top_p: float) -> np.ndarray:
    """S04's rule before issue 12 (S06 ran it in torch): most likely first, drop a token
    once the float64 mass before it reaches top_p."""
    out = logits.copy()
    if top_p >= 1.0:
        return out
    order = np.argsort(-logits, kind="stable")
    probs = s04.softmax(logits)[order].astype(np.float64)
    drop = np.cumsum(probs) - probs >= top_p
    drop[0] = False
    out[order[drop]] = -np.inf
    return out


def hf(logits: np.ndarray, top_p: float) -> np.ndarray:
    return TopPLogitsWarper(top_p)(None, torch.from_numpy(logits.copy())[None])[0].numpy()


RULES = {
    "S04 NumPy before issue 12": old_rule,
    "S04 NumPy apply_top_p": s04.apply_top_p,
    "S06 torch apply_top_p": lambda l, t: s06.apply_top_p(torch.from_numpy(l.copy()), t).numpy(),
}


def kept_levels(logits: np.ndarray, filtered: np.ndarray) -> list[float]:
    return sorted(logits[np.isfinite(filtered)].tolist())


def main() -> None:
    rows = [np.log(np.array([k / 20 for k in parts], np.float32))
            for n in (3, 4) for parts in itertools.product(range(1, 20), repeat=n)
            if sum(parts) == 20]
    tops = [round(0.5 + 0.05 * k, 2) for k in range(10)]
    for name, rule in RULES.items():
        differ = sum(kept_levels(l, rule(l, t)) != kept_levels(l, hf(l, t))
                     for l in rows for t in tops)
        print(f"{name}: kept set differs from HF's in {differ} of {len(rows) * len(tops)} cases")
    for probs, top_p in (([0.1, 0.3, 0.6], 0.9), ([0.05, 0.6, 0.35], 0.6)):
        l = np.log(np.array(probs, np.float32))
        kept = {name: sorted(np.flatnonzero(np.isfinite(rule(l, top_p))).tolist())
                for name, rule in [("HF", hf), *RULES.items()]}
        print(f"{probs} top_p={top_p}: kept ids {kept}")


if __name__ == "__main__":
    main()
