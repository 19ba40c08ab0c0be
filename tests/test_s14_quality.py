"""S14's quality evaluator (code/s14_quality.py) against independent oracles.

The split: S02's own tokenizer and S01's speech splitter, and the token count the training run
logged. Perplexity: transformers' AutoModelForCausalLM and torch's cross-entropy over the same
chunks and positions, computed here. KL, same-top-1 and every uncertainty: NumPy float64 from
HF's logits, written here in another form (logsumexp, sample standard deviations, the paired
differences, a delta-method gradient). Closed forms: a model against itself (KL 0, same top 1),
uniform logits (PPL = V). The positions llama.cpp scores are worked by hand: a chunk of T
tokens scores positions T//2 .. T-2, i.e. T - 1 - T//2 tokens (127 for T = 256).
"""
import copy
import json
import math

import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s02_tokenizer as s02
import s03_transformer as s03
from model_testing import V as TINY_V, build_tiny, hf_logits
from s01_generation_loop import ParameterError
from s06_torch import TorchTransformer
from s14_quality import QualityReport, evaluate, validation_token_ids

BUNDLED = s03.BUNDLED_MODEL_DIR
pytestmark = pytest.mark.skipif(
    not (BUNDLED / "model.safetensors").exists(),
    reason="bundled model not trained yet (scripts/train_bundled_model.py)")


@pytest.fixture(scope="module")
def bundled():
    return TorchTransformer.from_pretrained(BUNDLED, "cpu", torch.float32)


# --- the held-out split -----------------------------------------------------------------------

def test_split_is_every_tenth_speech_encoded_by_s02_and_has_the_logged_length():
    tokenizer = s02.BPETokenizer.load_hf(BUNDLED.parent / "tokenizer.json")
    expected: list[int] = []
    text = (BUNDLED.parent / "shakespeare.txt").read_text(encoding="utf-8")
    for i, speech in enumerate(s01.speeches(text)):
        if i % 10 == 9:
            expected.extend(tokenizer.encode_ordinary(speech))
            expected.append(tokenizer.eos_id)
    ids = validation_token_ids()
    assert ids.dtype == np.int64 and ids.tolist() == expected
    log = json.loads((BUNDLED / "training_log.json").read_text())
    assert ids.size == log["val_tokens"] == 63_066      # recorded by the training run itself
    assert ids[-1] == tokenizer.eos_id == 2047


# --- perplexity against transformers ----------------------------------------------------------

def test_ppl_equals_exp_mean_cross_entropy_of_transformers_on_the_same_positions(bundled):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    ids = validation_token_ids()
    chunks = torch.from_numpy(ids[:4 * 256].reshape(4, 256).copy())        # (B=4, T=256)
    with torch.no_grad():
        logits = hf(chunks).logits.double()                                # (4, 256, V)
    # llama.cpp: logits at positions 128..254 predict tokens 129..255
    nll = torch.nn.functional.cross_entropy(logits[:, 128:255].reshape(-1, logits.shape[-1]),
                                            chunks[:, 129:256].reshape(-1), reduction="none")
    report = evaluate(bundled, max_chunks=4)
    assert (report.context, report.num_chunks, report.num_tokens) == (256, 4, 4 * 127)
    assert report.ppl == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    assert report.mean_nll == pytest.approx(nll.mean().item(), rel=1e-5)
    assert report.ln_ppl == report.mean_nll
    se = nll.std().item() / math.sqrt(nll.numel())                         # sample std / sqrt(n)
    assert report.mean_nll_se == pytest.approx(se, rel=1e-4)
    assert report.ppl_se == pytest.approx(math.exp(nll.mean().item()) * se, rel=1e-4)
    assert report.mean_kld is None and report.same_top1 is None and report.delta_ppl is None


def test_a_shorter_context_scores_its_own_second_halves(bundled):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    ids = validation_token_ids()[1000:1000 + 3 * 51 + 20]                 # 3 chunks and a tail
    chunks = torch.from_numpy(ids[:3 * 51].reshape(3, 51).copy())
    with torch.no_grad():
        logits = hf(chunks).logits.double()
    # T = 51: positions 25..49 predict tokens 26..50, 25 per chunk
    nll = torch.nn.functional.cross_entropy(logits[:, 25:50].reshape(-1, logits.shape[-1]),
                                            chunks[:, 26:51].reshape(-1))
    report = evaluate(bundled, token_ids=ids, context=51)
    assert (report.num_chunks, report.num_tokens) == (3, 75)
    assert report.ppl == pytest.approx(math.exp(nll.item()), rel=1e-5)


# --- KL divergence, same top, ratios ----------------------------------------------------------

def test_a_model_against_itself_has_zero_kl_and_same_top1_one(bundled):
    twin = TorchTransformer.from_pretrained(BUNDLED, "cpu", torch.float32)
    report = evaluate(twin, bundled, max_chunks=2)
    assert report.mean_kld == pytest.approx(0.0, abs=1e-12)
    assert report.same_top1 == 1.0 and report.same_top1_se == 0.0
    assert report.delta_ppl == pytest.approx(0.0, abs=1e-9)
    assert report.ln_ppl_ratio == pytest.approx(0.0, abs=1e-12)
    assert report.ref_ppl == pytest.approx(report.ppl, rel=1e-12)


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_every_statistic_against_a_perturbed_model_equals_numpy_float64(tmp_path):
    base_hf = build_tiny("qwen3_gqa_tied", tmp_path / "base")
    perturbed_hf = copy.deepcopy(base_hf)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for name, p in perturbed_hf.named_parameters():
            if name.endswith("mlp.down_proj.weight") or name.endswith("self_attn.v_proj.weight"):
                p.add_(0.15 * torch.randn(p.shape, generator=gen))
    perturbed_hf.save_pretrained(tmp_path / "perturbed")
    base = TorchTransformer.from_pretrained(tmp_path / "base")
    perturbed = TorchTransformer.from_pretrained(tmp_path / "perturbed")
    rng = np.random.default_rng(3)
    T, chunks = 32, 6
    ids = rng.integers(0, TINY_V, size=T * chunks + 9)                   # a tail is dropped
    report = evaluate(perturbed, base, token_ids=ids, context=T)

    a, b, kld, same = [], [], [], []
    for c in range(chunks):
        chunk = ids[c * T:(c + 1) * T].tolist()
        lq = _log_softmax64(hf_logits(perturbed_hf, chunk))[T // 2:T - 1]   # (15, V)
        lp = _log_softmax64(hf_logits(base_hf, chunk))[T // 2:T - 1]
        targets = np.array(chunk[T // 2 + 1:])
        a.append(-lq[np.arange(targets.size), targets])
        b.append(-lp[np.arange(targets.size), targets])
        kld.append((np.exp(lp) * (lp - lq)).sum(axis=-1))
        same.append(lq.argmax(axis=-1) == lp.argmax(axis=-1))
    a, b, kld, same = map(np.concatenate, (a, b, kld, same))
    n = a.size
    assert report.num_tokens == n == chunks * (T - 1 - T // 2)
    ppl_q, ppl_b = np.exp(a.mean()), np.exp(b.mean())
    assert report.ppl == pytest.approx(ppl_q, rel=1e-5)
    assert report.ref_ppl == pytest.approx(ppl_b, rel=1e-5)
    assert report.mean_kld == pytest.approx(kld.mean(), rel=1e-4)
    assert report.mean_kld > 0.01
    assert report.mean_kld_se == pytest.approx(kld.std(ddof=1) / math.sqrt(n), rel=1e-3)
    assert report.same_top1 == pytest.approx(same.mean(), abs=1e-12)
    assert 0 < report.same_top1 < 1
    p = same.mean()
    assert report.same_top1_se == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), rel=1e-9)
    # ln ratio and its error: the paired differences' mean and standard error
    d = a - b
    assert report.ln_ppl_ratio == pytest.approx(d.mean(), rel=1e-4, abs=1e-7)
    assert report.ln_ppl_ratio_se == pytest.approx(d.std(ddof=1) / math.sqrt(n), rel=1e-3)
    assert report.delta_ppl == pytest.approx(ppl_q - ppl_b, rel=1e-4, abs=1e-6)
    assert report.delta_ppl_pct == pytest.approx(100 * (ppl_q / ppl_b - 1), rel=1e-4, abs=1e-6)
    # PPL(Q) - PPL(base) by the delta method: gradient (ppl_q, -ppl_b) through the covariance
    # matrix of the two means
    sigma = np.cov(np.stack([a, b]), ddof=1) / n
    grad = np.array([ppl_q, -ppl_b])
    assert report.delta_ppl_se == pytest.approx(math.sqrt(grad @ sigma @ grad), rel=1e-3)
    assert report.ppl_se == pytest.approx(ppl_q * a.std(ddof=1) / math.sqrt(n), rel=1e-3)


def test_uniform_logits_have_perplexity_v():
    vocab = 2048
    uniform = lambda token_ids: np.zeros((len(token_ids), vocab), np.float32)   # noqa: E731
    ids = validation_token_ids()[:5 * 64]
    report = evaluate(uniform, uniform, token_ids=ids, context=64)
    assert report.ppl == pytest.approx(vocab, rel=1e-12)
    assert report.mean_nll == pytest.approx(math.log(vocab), rel=1e-12)
    assert report.mean_nll_se == pytest.approx(0.0, abs=1e-7)
    assert report.mean_kld == pytest.approx(0.0, abs=1e-12) and report.same_top1 == 1.0


def _fake_quantize(model, bits: int):
    """A copy with every linear weight of every block rounded per output channel to `bits`
    (symmetric, scale = absmax / (2^(bits-1) - 1)); the embedding / tied head stay fp32."""
    q = copy.deepcopy(model)
    qmax = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for block in q.blocks:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                w = getattr(block, name).numpy()
                scale = np.abs(w).max(axis=1, keepdims=True) / qmax                    # (out, 1)
                codes = np.clip(np.round(w / np.where(scale > 0, scale, 1)), -qmax, qmax)
                getattr(block, name).copy_(torch.from_numpy((codes * scale).astype(np.float32)))
    return q


def test_int8_rounding_costs_less_than_int4_rounding(bundled):
    int8 = evaluate(_fake_quantize(bundled, 8), bundled, max_chunks=6)
    int4 = evaluate(_fake_quantize(bundled, 4), bundled, max_chunks=6)
    assert 0 < int8.mean_kld < int4.mean_kld
    assert int8.same_top1 >= int4.same_top1
    assert abs(int8.ln_ppl_ratio) < abs(int4.ln_ppl_ratio)


def test_report_formats_llama_cpp_lines(bundled):
    text = evaluate(bundled, bundled, max_chunks=1).format()
    for label in ("Mean PPL(Q)", "Mean PPL(base)", "Mean ln(PPL(Q)/PPL(base))",
                  "Mean PPL(Q)-PPL(base)", "Mean    KLD", "Same top p"):
        assert label in text
    assert set(evaluate(bundled, max_chunks=1).to_dict()) == {
        f.name for f in QualityReport.__dataclass_fields__.values()}


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, parameter, words", [
    (dict(token_ids=[]), "token_ids", "non-empty 1-D"),
    (dict(token_ids=np.zeros((2, 300), np.int64)), "token_ids", "non-empty 1-D"),
    (dict(token_ids=[1.5] * 300), "token_ids", "integers"),
    (dict(token_ids=[2048] * 300), "token_ids", "[0, V=2048)"),
    (dict(token_ids=[-1] * 300), "token_ids", "[0, V=2048)"),
    (dict(token_ids=[5] * 255), "token_ids", "at least one chunk of context=256"),
    (dict(context=2), "context", "[3, max_position_embeddings=256]"),
    (dict(context=1), "context", "[3, max_position_embeddings=256]"),
    (dict(context=0), "context", "[3, max_position_embeddings=256]"),
    (dict(context=257), "context", "[3, max_position_embeddings=256]"),
    (dict(context=64.0), "context", "integer"),
    (dict(context=True), "context", "integer"),
    (dict(max_chunks=0), "max_chunks", ">= 1"),
    (dict(max_chunks=True), "max_chunks", ">= 1"),
])
def test_bad_arguments_raise_parameter_error_naming_the_parameter(bundled, kwargs, parameter,
                                                                  words):
    with pytest.raises(ParameterError, match=parameter) as err:
        evaluate(bundled, **kwargs)
    assert err.value.parameter == parameter and words in str(err.value)


def test_a_reference_with_another_vocabulary_is_refused(bundled, tmp_path):
    build_tiny("qwen3_gqa_tied", tmp_path)
    tiny = TorchTransformer.from_pretrained(tmp_path)
    with pytest.raises(ParameterError, match=r"reference must have the model's vocabulary "
                                             r"\(V=2048; the reference has V=97\)") as err:
        evaluate(bundled, tiny, context=64)
    assert err.value.parameter == "reference"
    # a callable declares no vocabulary: caught on the first chunk's logits
    other = lambda token_ids: np.zeros((len(token_ids), 100), np.float32)   # noqa: E731
    with pytest.raises(ParameterError, match="reference") as err:
        evaluate(bundled, other, max_chunks=1)
    assert err.value.parameter == "reference"


def test_logits_without_a_distribution_are_refused_naming_the_chunk(bundled):
    """NaN or +inf logits have no softmax (PPL came out nan); a row of only -inf neither. A
    single -inf logit is a token given probability 0, and stays allowed."""
    vocab, ids = 2048, validation_token_ids()[:3 * 64]

    def logits_with(value, column=None, chunk=1):
        def forward(token_ids):
            x = np.zeros((len(token_ids), vocab), np.float32)
            if forward.calls == chunk:                  # the chunk-th chunk only
                x[:, column if column is not None else slice(None)] = value
            forward.calls += 1
            return x
        forward.calls = 0
        return forward
    for value, column in ((math.nan, 7), (math.inf, 7), (-math.inf, None)):
        with pytest.raises(ParameterError, match=r"chunk 1 \(tokens 64\.\.127") as err:
            evaluate(logits_with(value, column), token_ids=ids, context=64)
        assert err.value.parameter == "model"
        with pytest.raises(ParameterError, match="chunk 1") as err:
            evaluate(bundled, logits_with(value, column), token_ids=ids, context=64)
        assert err.value.parameter == "reference"
    # -inf on a token never seen: uniform over V - 1 tokens, by hand PPL = V - 1
    never = int(np.setdiff1d(np.arange(vocab), ids)[0])
    report = evaluate(logits_with(-math.inf, never, chunk=0), token_ids=ids[:64], context=64)
    assert report.ppl == pytest.approx(vocab - 1, rel=1e-12)


def test_a_callable_whose_logits_miss_ids_of_the_text_is_refused(bundled):
    narrow = lambda token_ids: np.zeros((len(token_ids), 10), np.float32)   # noqa: E731
    ids = validation_token_ids()[:256]
    with pytest.raises(ParameterError, match=rf"V=10 tokens, but token_ids hold id "
                                             rf"{int(ids.max())}") as err:
        evaluate(narrow, token_ids=ids, context=128)
    assert err.value.parameter == "model"


def test_models_without_either_interface_or_a_window_are_refused(bundled):
    with pytest.raises(ParameterError) as err:
        evaluate(42)
    assert err.value.parameter == "model"
    with pytest.raises(ParameterError) as err:
        evaluate(bundled, "fp32")
    assert err.value.parameter == "reference"
    uniform = lambda token_ids: np.zeros((len(token_ids), 8), np.float32)   # noqa: E731
    with pytest.raises(ParameterError, match="context must be given") as err:
        evaluate(uniform, token_ids=[1, 2, 3, 4])
    assert err.value.parameter == "context"


def test_main_prints_the_fp32_report(capsys):
    from s14_quality import main
    main(["--max-chunks", "2", "--context", "128"])
    out = capsys.readouterr().out
    assert "2 chunks of 128 tokens, 126 tokens scored" in out and "Mean PPL(Q)" in out


def test_main_refuses_bad_flags_by_their_names(capsys):
    from s14_quality import main
    for argv, message in ((["--max-chunks", "0"], "--max-chunks must be an integer >= 1 (got 0)"),
                          (["--context", "2"], "--context must be an integer in [3, "
                                               "max_position_embeddings] (got 2)")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_models_against_the_cpu_fp32_reference(bundled):
    fp32 = evaluate(TorchTransformer.from_pretrained(BUNDLED, "cuda", torch.float32), bundled,
                    max_chunks=4)
    assert fp32.mean_kld < 1e-6 and fp32.same_top1 > 0.99
    assert fp32.ppl == pytest.approx(fp32.ref_ppl, rel=1e-4)
    bf16 = evaluate(TorchTransformer.from_pretrained(BUNDLED, "cuda", torch.bfloat16), bundled,
                    max_chunks=4)
    assert bf16.mean_kld > fp32.mean_kld and bf16.ref_ppl == pytest.approx(fp32.ref_ppl, rel=1e-12)


def test_s01_model_contract_s03_numpy_transformer_scores_like_s06(bundled):
    numpy_model = s03.Transformer.from_pretrained(BUNDLED)     # forward(ids) -> (T, V) NumPy
    report = evaluate(numpy_model, bundled, max_chunks=2)
    assert report.ppl == pytest.approx(report.ref_ppl, rel=1e-5)
    assert report.mean_kld < 1e-8 and report.same_top1 == 1.0
