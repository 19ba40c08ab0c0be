"""Chapter S15's figures against what they are computed from.

Kinds of figure in chapters/s15-speculative.md:

- the worked example (one draft position, a four-token vocabulary): recomputed here with
  code/s15_rejection.py's `explain_step` and `acceptance_rate`, and by hand (the accept test,
  the residual, the inverse-CDF draw, the proof's count min(p, q) + P(reject) x residual = p);
- Leviathan et al.'s formulas at the chapter's values (Equation 1, Theorem 3.8, `optimal_k`,
  the 1 / (1 - alpha) bound), recomputed with the module and by hand;
- figures carried from earlier chapters (16.06 GB for Llama-3.1-8B in bfloat16, S07's batch of
  304 at an H100's ridge) and the arithmetic the chapter does with them;
- the quiz's numbers (site/quizzes/s15-speculative.json), recomputed;
- the excerpts: every literalinclude marker names text that is in the code file;
- measured figures, when the benchmark record chapters/figures/s15_speculative.json exists:
  each number the chapter quotes equals the record, rounded as the chapter writes it.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
CHAPTER = ROOT / "chapters" / "s15-speculative.md"
QUIZ = ROOT / "site" / "quizzes" / "s15-speculative.json"
RECORD = ROOT / "chapters" / "figures" / "s15_speculative.json"

import s15_rejection as rej  # noqa: E402

P = torch.tensor([0.5, 0.2, 0.2, 0.1])          # A, B, C, D
Q = torch.tensor([0.2, 0.6, 0.1, 0.1])
DRAFT = 1                                        # B
NAMES = "ABCD"


def text() -> str:
    return " ".join(CHAPTER.read_text().split())       # line breaks as spaces


def assert_in_chapter(*phrases: str) -> None:
    t = text()
    for phrase in phrases:
        assert phrase in t, f"the chapter should say {phrase!r}"


def vec(values) -> str:
    """(0.75, 0, 0.25, 0) as the chapter writes a distribution."""
    return "(" + ", ".join(f"{v:.3f}".rstrip("0").rstrip(".") for v in values) + ")"


# --- the worked example -----------------------------------------------------------------------

def test_the_worked_example_is_explain_steps():
    rejected = rej.explain_step(P, Q, DRAFT, 0.7, 0.8)
    kept = rej.explain_step(P, Q, DRAFT, 0.25, 0.8)
    assert not rejected["accepted"] and kept["accepted"] and kept["token"] == DRAFT
    p_x, q_x = rejected["p_x"], rejected["q_x"]
    res = rejected["residual"]
    assert_in_chapter(
        "p = (0.5, 0.2, 0.2, 0.1), the draft's q = (0.2, 0.6, 0.1, 0.1), and the draft proposed B",
        f"p(B) = {p_x:.1f} and q(B) = {q_x:.1f}, so B is accepted with probability "
        f"{p_x:.1f} / {q_x:.1f} = {rejected['accept_probability']:.3f}",
        f"0.7 × 0.6 = {0.7 * q_x:.2f} is not below 0.2, so B is rejected",
        f"max(p − q, 0) = {vec((P - Q).clamp(min=0).tolist())}, which normalises to {vec(res)}",
        f"A second uniform, 0.8, draws from it by the cumulative sum "
        f"{vec(torch.tensor(res).cumsum(0).tolist())}: the token is {NAMES[rejected['token']]}",
        f"Had the first uniform been 0.25, 0.25 × 0.6 = {0.25 * q_x:.2f} < 0.2 and B would "
        "have been kept")
    assert 0.7 * q_x >= p_x and 0.25 * q_x < p_x            # the code's test, u * q(x) < p(x)


def test_the_proof_counts_p_for_every_token():
    alpha = rej.acceptance_rate(P, Q)
    res = torch.tensor(rej.explain_step(P, Q, DRAFT, 0.7, 0.8)["residual"], dtype=torch.float64)
    emitted = torch.minimum(P, Q).double() + (1 - alpha) * res
    assert torch.allclose(emitted, P.double(), atol=1e-6)
    a, c = NAMES.index("A"), NAMES.index("C")
    assert_in_chapter(
        f"Here A comes out with probability {min(P[a], Q[a]):.1f} + {1 - alpha:.1f} × "
        f"{res[a]:.2f} = {emitted[a]:.1f}, which is p(A); C with {min(P[c], Q[c]):.1f} + "
        f"{1 - alpha:.1f} × {res[c]:.2f} = {emitted[c]:.1f}",
        f"The acceptance rate of this pair is α = Σ min(p, q) = {alpha:.1f}")


def test_the_one_hot_example_is_explain_steps():
    step = rej.explain_step(P, None, DRAFT, 0.7, 0.8)
    assert step["accept_probability"] == pytest.approx(float(P[DRAFT]))
    assert_in_chapter(f"B would be accepted with probability {step['accept_probability']:.1f} "
                      f"and the residual would be {vec(step['residual'])}")
    emitted = torch.tensor(step["residual"]) * (1 - P[DRAFT])
    emitted[DRAFT] += P[DRAFT]
    assert torch.allclose(emitted, P, atol=1e-6)               # "gives p again"


# --- the formulas -----------------------------------------------------------------------------

def test_the_formulas_at_the_chapters_values():
    alpha, k, c = 0.6, 4, 0.1
    tokens = rej.expected_tokens_per_step(alpha, k)
    assert tokens == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    best = rej.optimal_k(alpha, c)
    speedup = rej.expected_speedup(alpha, k, c)
    assert_in_chapter(f"With α = 0.6 and k = 4 that is {tokens:.2f} tokens per forward",
                      f"never more than 1 / (1 − α) = {1 / (1 - alpha):.1f}",
                      f"With α = 0.6 and c = 0.1, k = 4 gives {speedup:.2f}, "
                      f"and the best k is {best}, at {rej.expected_speedup(alpha, best, c):.2f}")
    assert rej.expected_speedup(alpha, k, c) == pytest.approx(tokens / (k * c + 1))


def test_figures_from_earlier_chapters_and_the_arithmetic_on_them():
    params = 8_030_261_248                                      # S12, S14
    assert_in_chapter(f"that is {2 * params / 1e9:.2f} GB per token (S14)")
    assert "304 at context 1" in " ".join((ROOT / "chapters" / "s07-measuring.md").read_text()
                                          .split()).replace("$B = 304$", "304")
    assert "ridge near 295 FLOP/byte" in " ".join(
        (ROOT / "chapters" / "s07-measuring.md").read_text().split())
    assert round(304 / 5) == 61
    assert_in_chapter("with k = 4 that is about 61 requests (304 / 5)",
                      "an H100's ridge point near 295 FLOP per byte")


def test_the_quizs_numbers_recompute():
    quiz = {q["id"]: q for q in json.loads(QUIZ.read_text())["questions"]}
    accept = quiz["q2-accept-probability"]
    assert accept["choices"][accept["answer"]].startswith(f"{min(1, 0.2 / 0.5):.1f}")
    tokens = quiz["q5-tokens-per-forward"]
    assert tokens["choices"][tokens["answer"]].startswith(
        f"{rej.expected_tokens_per_step(0.8, 3):.2f}")
    rollback = quiz["q7-rollback"]
    scheduled, accepted = 1 + 4, 1
    assert rollback["choices"][rollback["answer"]].startswith(
        f"By {scheduled - (4 - accepted)}")


# --- the excerpts -----------------------------------------------------------------------------

def test_every_excerpt_marker_is_in_its_code_file():
    md = CHAPTER.read_text()
    for m in re.finditer(r"```\{literalinclude\} (\S+)\n((?::\S+:.*\n)*)", md):
        source = (CHAPTER.parent / m.group(1)).resolve()
        code = source.read_text()
        for option, value in re.findall(r":(\S+):\s*(.*)", m.group(2)):
            if option in ("start-after", "end-before"):
                assert value in code, (m.group(1), option, value)
            if option == "pyobject":
                assert re.search(rf"(def|class) {value.split('.')[-1]}\b", code), value


# --- the measured figures: the committed record -----------------------------------------------

@pytest.fixture(scope="module")
def rec() -> dict:
    if not RECORD.exists():
        assert "TODO-FIGURE" in CHAPTER.read_text(), (
            "without the record the chapter must mark its measured figures TODO-FIGURE")
        pytest.skip("no benchmark record yet (python benchmarks/bench_s15_speculative.py --record)")
    return json.loads(RECORD.read_text())


def test_the_record_is_a_full_run(rec):
    assert not rec["config"]["quick"], "the committed record is a full run, not --quick"


# --- the figure -------------------------------------------------------------------------------

def test_the_figure_is_the_records_drawing_with_its_legends_off_the_data(rec):
    """chapters/figures/s15_speculative.png is scripts/s15_figure.py's drawing of the record,
    the chapter embeds it, and no legend covers a point or a label."""
    import subprocess
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "scripts"))
    from legend_check import covered_by_legends, describe
    import s15_figure
    assert s15_figure.DATA == RECORD
    found = covered_by_legends(s15_figure.build_figure(rec))
    assert not found, describe(found)
    assert "```{figure} figures/s15_speculative.png" in CHAPTER.read_text()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "s15_figure.py"), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the measured figures: each number the chapter quotes, from the record -------------------

def x(v: float) -> str:
    return f"{v:.2f}x"


def pct(v: float) -> str:
    return f"{v:.0%}"


def wall(rec, workload: str) -> dict:
    return rec["wallclock"]["workloads"][workload]["rows"]


def test_the_machine_and_the_model(rec):
    config = rec["config"]
    assert config["threads"] == 1 and config["logical_cores"] == 2
    assert config["engine_options"]["max_num_seqs"] == 1          # batch 1
    assert round(rec["load_average"]["start"][0], 1) == 1.0
    assert round(rec["load_average"]["end"][0], 1) == 1.0
    params = rec["wallclock"]["draft_model_on_bundled"]["parameters"]
    assert_in_chapter(f"torch {config['torch']}",
                      f"Its {params['target']:,} parameters are {params['target'] * 4 / 1e6:.2f} "
                      "MB in float32",
                      f"The draft has {params['draft'] / params['target']:.0%} of the target's "
                      "parameters")


def test_the_verify_cost(rec):
    rows = wall(rec, "corpus")
    step = rec["wallclock"]["workloads"]["corpus"]["plain_decode_step_s"]
    assert_in_chapter(f"cost {rows['ours draft']['verify_ratio']:.2f} (1-layer draft, k = "
                      f"{rows['ours draft']['k']}) to {rows['ours int4']['verify_ratio']:.2f} "
                      f"(int4 copy, k = {rows['ours int4']['k']}) plain steps of "
                      f"{step * 1e3:.2f} ms")
    ratios = [r["verify_ratio"] for w in ("corpus", "copy", "loop")
              for r in wall(rec, w).values() if "verify_ratio" in r]
    assert min(ratios) > 1.5                       # never the 1 the theorem assumes


def test_the_copy_shares(rec):
    shares = {w: part["copy_shares"] for w, part in rec["acceptance"]["workloads"].items()}
    assert all(s["in_prompt"] == 0 for s in shares.values())
    assert rec["wallclock"]["copy_heavy"]["workload"] == "loop"
    assert_in_chapter(f"{pct(0)} of its output 4-grams occur in the prompt, on every workload",
                      f"{pct(shares['corpus']['earlier_in_prompt_or_output'])} of its 4-grams on "
                      "short continuations of held-out text (corpus), "
                      f"{pct(shares['loop']['earlier_in_prompt_or_output'])} on "
                      f"{rec['config']['loop_tokens']}-token ones (loop)")


def test_the_ngram_story_and_hf(rec):
    loop, corpus = wall(rec, "loop"), wall(rec, "corpus")
    assert_in_chapter(f"our n-gram engine ran {x(loop['ours ngram']['speedup'])} faster than our "
                      f"plain engine, and Hugging Face's prompt lookup "
                      f"{x(loop['HF prompt lookup']['speedup'])} faster",
                      f"on corpus, {x(corpus['ours ngram']['speedup'])} and "
                      f"{x(corpus['HF prompt lookup']['speedup'])}")


def test_the_wall_clock_table(rec):
    for workload in ("corpus", "copy", "loop"):
        rows = wall(rec, workload)
        part = rec["wallclock"]["workloads"][workload]
        cells = [f"{rows['ours plain']['tokens_per_s']:.0f} tok/s"]
        cells += [x(rows[e]["speedup"]) for e in ("ours ngram", "ours draft", "ours int4")]
        cells += [f"{rows['HF plain']['tokens_per_s']:.0f} tok/s"]
        cells += [x(rows[e]["speedup"]) for e in ("HF assisted (draft)", "HF prompt lookup")]
        assert_in_chapter(f"| {workload}, {part['requests']} × {part['tokens_per_request']} "
                          f"tokens | " + " | ".join(cells) + " |")
        for row in rows.values():
            same = row["same_tokens_as_ours_plain"]
            assert same["identical_requests"] == same["requests"]   # "the same tokens"
    k = rec["wallclock"]["k"]
    assert (k["ngram"], k["draft"], k["int4"]) == (8, 2, 4)
    assert rec["wallclock"]["hf"]["prompt_lookup_num_tokens"] == 8
    assert rec["wallclock"]["repeats"] == 5
    assert_in_chapter("k: n-gram 8 (Hugging Face's `prompt_lookup_num_tokens` 8), 1-layer draft "
                      "2, int4 copy 4", "median of 5 alternating rounds")


def test_the_pass_lines(rec):
    for t in rec["wallclock"]["targets"]:
        line = (f"{'PASS' if t['pass'] else 'MISSED'}: {t['name']}: {x(t['speedup'])} vs "
                f"{x(t['against'])}")
        if "tolerance" in t:
            line += f" (within {t['tolerance']:.0%} counts as matching)"
        assert line in CHAPTER.read_text(), line


def test_the_draft_model_loses(rec):
    d = rec["wallclock"]["draft_model_on_bundled"]
    assert d["outcome"] == "loses" and d["workload"] == "corpus"
    verify = wall(rec, "corpus")["ours draft"]["verify_ratio"]
    k = rec["wallclock"]["k"]["draft"]
    cost = k * round(d["c"], 2) + round(verify, 2)
    assert cost == pytest.approx(d["step_cost_in_plain_steps"], abs=0.01)
    assert_in_chapter(f"The 1-layer draft model loses: {x(d['measured_speedup'])} on corpus",
                      f"measured α = {d['alpha_position_1']:.2f} (at draft position 1) and c = "
                      f"{d['c']:.2f} predicts {x(d['predicted_speedup'])}",
                      f"a step of k = {k} costs {k} × {d['c']:.2f} + {verify:.2f} = "
                      f"{d['step_cost_in_plain_steps']:.2f} plain steps and yields "
                      f"{d['tokens_per_forward']:.2f} tokens per forward, "
                      f"{x(d['tokens_per_forward'] / d['step_cost_in_plain_steps'])}")
    assert f"{x(d['tokens_per_forward'] / d['step_cost_in_plain_steps'])} predicted" in d["why"]


def test_the_int4_copies_and_the_random_model(rec):
    int4 = wall(rec, "corpus")["ours int4"]
    r = rec["random"]
    i4, i8 = r["rows"]["int4 draft"], r["rows"]["int8 draft"]
    assert not r["int4_acceptance_near_zero"]
    assert "int4's rounding flips often and int8's rarely" in r["note"]
    assert_in_chapter(
        f"accepted {int4['acceptance_rate']:.1%} of the time at k = {int4['k']}",
        f"({x(int4['speedup'])} on corpus): its draft step costs {int4['c']:.2f} target steps",
        f"with {r['parameters'] / 1e6:.1f}M parameters",
        f"(a plain step {r['plain_decode_step_s'] * 1e3:.1f} ms)",
        f"gets {x(i8['speedup'])} from its own int8 copy at k = {r['k']}, accepted "
        f"{pct(i8['alpha_position_1'])} at position 1 ({x(i8['predicted_speedup'])} predicted "
        f"by Theorem 3.8, {x(i8['predicted_speedup_measured_verify'])} with the measured verify "
        f"cost of {i8['verify_ratio']:.2f} plain steps), and {x(i4['speedup'])} from its int4 "
        f"copy, accepted {pct(i4['alpha_position_1'])}")


def test_equation_1_against_the_counts(rec):
    rows = {r["proposer"]: r for r in rec["acceptance"]["workloads"]["corpus"]["rows"]
            if r["k"] == 8}
    ng, dr = rows["ngram"], rows["draft"]
    a1, a2 = ng["acceptance_per_position"][:2]
    assert_in_chapter(f"{dr['tokens_per_verify']:.2f} tokens per verifying forward measured, "
                      f"{dr['predicted_tokens_per_forward']:.2f} predicted",
                      f"prompt lookup ({ng['tokens_per_verify']:.2f} measured, "
                      f"{ng['predicted_tokens_per_forward']:.2f} predicted)",
                      f"{pct(a1)} of the drafts at position 1 and {pct(a2)} at position 2 were "
                      f"accepted, so a run that reached position 2 went on {pct(a2 / a1)}")
    assert ng["tokens_per_verify"] > ng["predicted_tokens_per_forward"]


def test_the_earlier_run_is_not_the_record(rec):
    """The earlier run's numbers are quoted as such; the record's own comparison differs."""
    loop = wall(rec, "loop")
    assert_in_chapter("an earlier run of the same benchmark measured 1.74x against 1.89x on loop")
    assert x(loop["HF prompt lookup"]["speedup"]) != "1.89x"
