"""S14, quality: perplexity, KL divergence and same-top-1 of any model, as llama.cpp reports them.

What is new since S13
    A way to say how much a model transform (S14's quantization, an 8-bit KV cache) costs in
    quality, with one number per question and its uncertainty. `evaluate(model, reference)`
    runs both models over the same held-out text and reports what llama.cpp's perplexity tool
    (`llama-perplexity`, and its `--kl-divergence` mode) reports:
      - PPL = exp(mean NLL), the perplexity of `model`, with its standard error;
      - against a reference (the fp32 model): PPL(Q) - PPL(base), ln(PPL(Q)/PPL(base)) and
        the ratio in percent, each with an uncertainty that accounts for the two runs being
        correlated (the same tokens);
      - mean KL divergence KL(reference || model) per scored token, in nats;
      - "Same top p": the fraction of scored positions where both models' argmax agree.
    The held-out text is the bundled model's validation split (`validation_token_ids`): every
    10th speech of data/shakespeare.txt, encoded exactly as scripts/train_bundled_model.py
    encoded it (its own `encode_split` is imported and called, with its tokenizer and its
    default `--val-every 10`), so no token here was trained on.

How the text is scored (llama.cpp's `perplexity()` and `kl_divergence()`)
    The token stream is cut into n_chunk = N // context chunks of `context` tokens (the tail
    that does not fill a chunk is dropped); each chunk is run from position 0 with an empty
    cache, so chunks are independent. Only the second half of each chunk is scored: with
    first = context // 2, the logits at positions first .. context - 2 predict tokens
    first + 1 .. context - 1, i.e. context - 1 - first tokens per chunk (127 for the bundled
    model's 256-token window). llama.cpp does this so that every scored token has at least
    context / 2 tokens of history ("so the model always has some context to predict the
    token"); a token scored at position 3 measures the model's guess with almost nothing to
    go on, the same for every model, which dilutes the differences a transform makes. We
    follow llama.cpp rather than score every position, so our figures read like its tables.
    It means our PPL is not the training script's "final_val_perplexity" (64.8, every position
    of 257-token windows scored): a different estimator of the same kind of number.
    Two departures: no BOS is written over a chunk's first token (llama.cpp does that when the
    vocabulary's add_bos is set; the bundled tokenizer's add_bos_token is false and the model
    was trained on windows that start anywhere), and the reference's log-probabilities are
    computed exactly, in float64, on the fly, where llama.cpp stores them in a file as 16-bit
    codes and drops terms with log p < -16 from the KL sum.

Statistics (llama.cpp's `mean_and_uncertainty` and `covariance`)
    For per-token values x_1 .. x_n: mean = sum x / n, standard error
    sqrt((mean(x^2) - mean^2) / (n - 1)) (= the sample standard deviation / sqrt(n)). PPL's
    error is PPL * se(NLL) (error propagation through exp). For the ratio, the per-token NLLs of
    the two models are correlated, so se(ln ratio)^2 = se(a)^2 + se(b)^2 - 2 cov(a, b) / (n - 1)
    shrinks with the correlation (= the standard error of the paired differences a - b);
    se(PPL_Q - PPL_base) uses cov * PPL_Q * PPL_base. Same top: p, sqrt(p (1 - p) / (n - 1)).
    All sums are in float64, from float64 log-softmax of the models' float32 logits.

What it does not handle
    One chunk per forward pass (no batching of chunks: the bundled model runs the whole split
    in seconds), no strided windows (llama.cpp's --ppl-stride), no KLD percentiles or Δp
    statistics (llama.cpp prints them too). Models: anything with S06's `TorchTransformer`
    interface (`run(token_ids, start)` and `head(hidden)`; a quantized copy keeps it), or S01's
    model contract `model.forward(token_ids) -> logits (T, V)` (or a function doing that).
    Hugging Face models are used only as an oracle in the tests.

Run it
    python code/s14_quality.py                       # fp32 bundled model, whole split
    python code/s14_quality.py --max-chunks 8        # the first 8 chunks (1,016 tokens)

Tests
    tests/test_s14_quality.py: the split equals S02's tokenizer's encoding of every 10th speech
    and the training log's token count; PPL on the first chunks equals exp(mean cross-entropy)
    of transformers' AutoModelForCausalLM over the same positions; a model against itself has
    KL 0 and same-top-1 1; against a perturbed copy (tiny random Qwen3), every statistic and
    its uncertainty equals a NumPy float64 computation from HF logits; uniform logits give
    PPL = V; bad input raises ParameterError naming the parameter; a crude int8 per-channel
    rounding costs less than int4 rounding.

References
    llama.cpp tools/perplexity/perplexity.cpp (`perplexity`: chunks of n_ctx, `first =
    n_ctx/2`, "Final estimate: PPL = ... +/- ..."; `kl_divergence` and `mean_and_uncertainty`,
    `covariance`: "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "Mean KLD", "Same top p")
    and tools/perplexity/README.md (the uncertainties, KL divergence against the FP16 model);
    llama.cpp PR #6936 (J. Gaessler, 2024: the KLD and same-top statistics). Hugging Face,
    "Perplexity of fixed-length models" (transformers docs), which the llama.cpp code cites.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; N tokens in the split.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S06: tiny matmuls, threads cost more

import argparse
import dataclasses
import functools
import importlib.util
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

import s01_generation_loop as s01
from s01_generation_loop import ParameterError

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = ROOT / "scripts" / "train_bundled_model.py"
VAL_EVERY = 10   # scripts/train_bundled_model.py --val-every default: the split it trained with


# ---------------------------------------------------------------------------------------------
# The held-out data
# ---------------------------------------------------------------------------------------------

def _training_script():
    """scripts/train_bundled_model.py as a module (importing it trains nothing: its work is in
    `main`). Loaded by path, because scripts/ is not a package on sys.path."""
    spec = importlib.util.spec_from_file_location("train_bundled_model", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def _validation_ids() -> np.ndarray:
    from tokenizers import Tokenizer   # what the training script encoded with

    script = _training_script()
    tokenizer = Tokenizer.from_file(str(script.TOKENIZER))
    eos_id = tokenizer.token_to_id(script.EOS_TOKEN)
    _, val = script.encode_split(tokenizer, eos_id, VAL_EVERY)
    val.setflags(write=False)   # cached: shared by every caller
    return val


def validation_token_ids() -> np.ndarray:
    """The bundled model's held-out validation split: int64 (N,), N = 63,066 tokens.

    Every 10th speech of data/shakespeare.txt (blocks between blank lines), each encoded with
    the project tokenizer (data/tokenizer.json) and followed by <|endoftext|> (id 2047),
    concatenated in corpus order. Computed by scripts/train_bundled_model.py's own
    `encode_split` with its tokenizer and --val-every default, so it is exactly the split the
    model never trained on. Read-only (cached after the first call, about 1 s)."""
    return _validation_ids()


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QualityReport:
    """What `evaluate` measured, in llama.cpp's terms. Every `*_se` is a standard error (one
    sigma, llama.cpp's "±"); NaN when fewer than 2 tokens were scored.

    context: tokens per chunk; num_chunks: chunks run; num_tokens: tokens scored
        (num_chunks * (context - 1 - context // 2)).
    mean_nll, mean_nll_se: mean negative log-likelihood of the scored tokens, nats per token
        (= ln PPL, `ln_ppl`). ppl, ppl_se: exp(mean_nll), and ppl * mean_nll_se.
    elapsed_s: wall-clock seconds of the whole evaluation (both models, all chunks).
    Against a reference (None without one):
    ref_ppl, ref_ppl_se: the reference's PPL on the same tokens ("PPL(base)").
    delta_ppl, delta_ppl_se: PPL(Q) - PPL(base). delta_ppl_pct, delta_ppl_pct_se: 100 (PPL(Q) /
        PPL(base) - 1), in percent. ln_ppl_ratio, ln_ppl_ratio_se: ln(PPL(Q) / PPL(base)) =
        mean NLL(Q) - mean NLL(base).
    mean_kld, mean_kld_se: mean over scored positions of KL(reference || model) =
        sum_v p_ref(v) (ln p_ref(v) - ln p(v)), nats.
    same_top1, same_top1_se: fraction (0..1) of scored positions where the two argmaxes agree.
    """

    context: int
    num_chunks: int
    num_tokens: int
    mean_nll: float
    mean_nll_se: float
    ppl: float
    ppl_se: float
    elapsed_s: float
    ref_ppl: float | None = None
    ref_ppl_se: float | None = None
    delta_ppl: float | None = None
    delta_ppl_se: float | None = None
    delta_ppl_pct: float | None = None
    delta_ppl_pct_se: float | None = None
    ln_ppl_ratio: float | None = None
    ln_ppl_ratio_se: float | None = None
    mean_kld: float | None = None
    mean_kld_se: float | None = None
    same_top1: float | None = None
    same_top1_se: float | None = None

    @property
    def ln_ppl(self) -> float:
        """ln PPL, nats per token: the mean NLL itself."""
        return self.mean_nll

    def to_dict(self) -> dict:
        """The fields as a plain dict (JSON-ready: floats, ints and None)."""
        return dataclasses.asdict(self)

    def format(self) -> str:
        """llama.cpp's final statistics, in its words and order."""
        def row(label: str, value: float, se: float, percent: bool = False) -> str:
            if percent:
                return f"{label:30s}: {value:9.4f}% ± {se:9.4f}%"
            return f"{label:30s}: {value:10.6f} ± {se:10.6f}"

        lines = [f"{self.num_chunks} chunks of {self.context} tokens, {self.num_tokens:,} tokens "
                 f"scored (the second half of each chunk), {self.elapsed_s:.1f} s",
                 row("Mean NLL", self.mean_nll, self.mean_nll_se),
                 row("Mean PPL(Q)", self.ppl, self.ppl_se)]
        if self.ref_ppl is not None:
            lines += [row("Mean PPL(base)", self.ref_ppl, self.ref_ppl_se),
                      row("Mean ln(PPL(Q)/PPL(base))", self.ln_ppl_ratio, self.ln_ppl_ratio_se),
                      row("Mean PPL(Q)/PPL(base) - 1", self.delta_ppl_pct, self.delta_ppl_pct_se,
                          percent=True),
                      row("Mean PPL(Q)-PPL(base)", self.delta_ppl, self.delta_ppl_se),
                      row("Mean    KLD", self.mean_kld, self.mean_kld_se),
                      row("Same top p", 100 * self.same_top1, 100 * self.same_top1_se,
                          percent=True)]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Models: S06's interface, or S01's contract
# ---------------------------------------------------------------------------------------------

def _config_value(model, name: str) -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, name, None)
    return value if s01.is_int(value) else None


def _vocab_size(model) -> int | None:
    value = getattr(model, "vocab_size", None)
    return value if s01.is_int(value) else _config_value(model, "vocab_size")


def _logits_function(model, parameter: str) -> Callable[[np.ndarray, int], torch.Tensor]:
    """f(chunk_ids (T,) int64, first) -> float32 logits (T - 1 - first, V) of positions
    first .. T - 2, on the model's device. S06's interface runs the layers over the whole chunk
    and the LM head on the scored rows only; S01's contract (`model.forward(ids)`, or a plain
    function `model(ids)`) computes every row."""
    if callable(getattr(model, "run", None)) and callable(getattr(model, "head", None)):
        device = torch.device(getattr(model, "device", "cpu"))

        def run_head(ids: np.ndarray, first: int) -> torch.Tensor:
            hidden = model.run(torch.from_numpy(ids).to(device), 0)          # (T, C)
            return model.head(hidden[first:-1]).float()                       # (T-1-first, V)
        return run_head
    # S01's contract is a `forward` method (S03's NumPy Transformer); a bare function works too
    call = getattr(model, "forward", None) if callable(getattr(model, "forward", None)) else model
    if callable(call):
        def forward(ids: np.ndarray, first: int) -> torch.Tensor:
            logits = torch.as_tensor(np.asarray(call(ids.tolist())))          # (T, V)
            if logits.ndim != 2 or logits.shape[0] != ids.size:
                raise ParameterError(f"{parameter} must return logits of shape (T, V) for T "
                                     f"token ids (got {tuple(logits.shape)} for T={ids.size})",
                                     parameter)
            return logits[first:-1].float()
        return forward
    raise ParameterError(f"{parameter} must have S06's run(token_ids, start) and head(hidden), "
                         f"or S01's forward(token_ids) -> logits (T, V) (got "
                         f"{type(model).__name__})", parameter, model)


def _check_token_ids(token_ids, vocab: int | None) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.cpu().numpy()
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ParameterError(f"token_ids must be a non-empty 1-D sequence of token ids (got "
                             f"shape {ids.shape})", "token_ids")
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        raise ParameterError(f"token_ids must be integers (got dtype {ids.dtype})", "token_ids")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bound = "" if vocab is None else f", V={vocab}"
        raise ParameterError(f"token_ids must lie in [0{bound}) (got min {low}, max {high})",
                             "token_ids")
    return np.array(ids, dtype=np.int64)   # a private, writable copy (torch.from_numpy)


def _check_logits_width(logits: torch.Tensor, ids: np.ndarray, parameter: str, model) -> None:
    """The first chunk's logits must cover every id of the text (a callable declares no
    vocabulary: this is where a narrower one shows). Raises ParameterError (parameter)."""
    if int(ids.max()) >= logits.shape[-1]:
        raise ParameterError(f"{parameter} returns logits over V={logits.shape[-1]} tokens, but "
                             f"token_ids hold id {int(ids.max())}: its vocabulary must cover "
                             "every id of the text", parameter, model)


def _check_logits_values(logits: torch.Tensor, chunk: int, context: int, parameter: str,
                         model) -> None:
    """A chunk's logits must be real numbers or -inf (a token given probability 0), with at
    least one finite logit per row: NaN or +inf has no softmax, and would report PPL nan.
    Raises ParameterError (parameter) naming the chunk and its token range."""
    bad = torch.isnan(logits) | (logits == math.inf)
    empty = (logits == -math.inf).all(dim=-1)
    if bool(bad.any()) or bool(empty.any()):
        raise ParameterError(
            f"{parameter} returned logits with NaN or +inf, or a row of only -inf, in chunk "
            f"{chunk} (tokens {chunk * context}..{(chunk + 1) * context - 1} of token_ids): "
            "perplexity needs real logits (a -inf logit, probability 0, is fine)",
            parameter, model)


# ---------------------------------------------------------------------------------------------
# The statistics (llama.cpp's mean_and_uncertainty, covariance)
# ---------------------------------------------------------------------------------------------

def _mean_and_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error sqrt((E[x^2] - E[x]^2) / (n - 1)); NaN error for n < 2."""
    n = x.size
    mean = float(x.sum() / n)
    if n < 2:
        return mean, math.nan
    var = float((x * x).sum() / n) - mean * mean
    return mean, math.sqrt(max(var, 0.0) / (n - 1))


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """(E[ab] - E[a] E[b]) / (n - 1): the covariance of the two means."""
    n = a.size
    if n < 2:
        return math.nan
    return (float((a * b).sum() / n) - float(a.sum() / n) * float(b.sum() / n)) / (n - 1)


# ---------------------------------------------------------------------------------------------
# The evaluator
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def evaluate(model, reference=None, *, token_ids: Sequence[int] | np.ndarray | None = None,
             context: int | None = None, max_chunks: int | None = None) -> QualityReport:
    """Perplexity of `model` and, with a reference, its distance from it, llama.cpp's way.

    model, reference: a `TorchTransformer` (or anything with its `run(token_ids (T,) int64,
        start) -> hidden (T, C)` and `head(hidden) -> logits float32 (T, V)`, on any device,
        any dtype), or S01's model contract `model.forward(list of T ids) -> logits (T, V)`
        (S03's NumPy Transformer; NumPy or torch logits), or a function with that signature.
        The reference is usually the fp32 model the other was derived from.
    token_ids: the text, int (N,); default `validation_token_ids()` (the whole split).
    context: tokens per chunk, in [3, window]; default the window, the smaller
        `config.max_position_embeddings` of the two models (256 for the bundled model).
    max_chunks: score only the first max_chunks chunks (a fixed subset for tests); default all
        N // context.
    Returns a QualityReport (see there; llama.cpp's scoring is described in the module
    docstring: the second half of each chunk, context - 1 - context // 2 tokens per chunk).

    Raises ParameterError naming the parameter, before any model runs unless said: "model" or
    "reference" without either interface; "reference" whose vocabulary differs from the
    model's (also checked on the first chunk's logits when a callable declares none);
    "token_ids" empty, not 1-D integers, outside [0, V), or shorter than one chunk;
    "model" / "reference" whose logits hold NaN or +inf, or a row of only -inf (checked chunk
    by chunk as they come, the chunk named), or whose first chunk's logits are narrower than
    the largest id of the text (a callable that declares no vocabulary);
    "context" not an integer in [3, window] (2 would leave no token to score: the second half
    of a 2-token chunk is its last token, which has no successor in the chunk), or not given
    when neither model has a config with max_position_embeddings; "max_chunks" not an
    integer >= 1.
    """
    run_model = _logits_function(model, "model")
    run_reference = None if reference is None else _logits_function(reference, "reference")
    vocab = _vocab_size(model)
    if reference is not None:
        ref_vocab = _vocab_size(reference)
        if vocab is not None and ref_vocab is not None and vocab != ref_vocab:
            raise ParameterError(f"reference must have the model's vocabulary (V={vocab}; the "
                                 f"reference has V={ref_vocab})", "reference", reference)
        vocab = vocab if vocab is not None else ref_vocab
    windows = [w for w in (_config_value(model, "max_position_embeddings"),
                           None if reference is None
                           else _config_value(reference, "max_position_embeddings"))
               if w is not None]
    window = min(windows) if windows else None
    if context is None:
        if window is None:
            raise ParameterError("context must be given: neither model has a config with "
                                 "max_position_embeddings", "context")
        context = window
    if not s01.is_int(context) or not 3 <= context <= (window if window is not None else context):
        limit = "" if window is None else f", max_position_embeddings={window}"
        raise ParameterError(f"context must be an integer in [3{limit}] (got {context!r}): a "
                             "chunk's second half must hold a token with a successor",
                             "context", context)
    if max_chunks is not None and (not s01.is_int(max_chunks) or max_chunks < 1):
        raise ParameterError(f"max_chunks must be an integer >= 1 or None (got {max_chunks!r})",
                             "max_chunks", max_chunks)
    ids = _check_token_ids(validation_token_ids() if token_ids is None else token_ids, vocab)
    num_chunks = ids.size // context
    if num_chunks == 0:
        raise ParameterError(f"token_ids must hold at least one chunk of context={context} "
                             f"tokens (got {ids.size})", "token_ids")
    if max_chunks is not None:
        num_chunks = min(num_chunks, max_chunks)

    first = context // 2
    nll, nll_ref, kld, same = [], [], [], []
    start = time.perf_counter()
    for chunk in range(num_chunks):
        chunk_ids = ids[chunk * context:(chunk + 1) * context]             # (T,)
        targets = torch.from_numpy(chunk_ids[first + 1:])                  # (T - 1 - first,)
        logits = run_model(chunk_ids, first)                               # (n, V) float32
        if chunk == 0:
            _check_logits_width(logits, ids, "model", model)
        _check_logits_values(logits, chunk, context, "model", model)
        logprobs = torch.log_softmax(logits.double(), dim=-1).cpu()        # (n, V) float64
        nll.append(-logprobs.gather(1, targets[:, None])[:, 0].numpy())
        if run_reference is None:
            continue
        ref_logits = run_reference(chunk_ids, first)
        if ref_logits.shape[-1] != logits.shape[-1]:
            raise ParameterError(f"reference must have the model's vocabulary (the model's "
                                 f"logits have V={logits.shape[-1]}, the reference's "
                                 f"V={ref_logits.shape[-1]})", "reference", reference)
        _check_logits_values(ref_logits, chunk, context, "reference", reference)
        ref_logprobs = torch.log_softmax(ref_logits.double(), dim=-1).cpu()
        nll_ref.append(-ref_logprobs.gather(1, targets[:, None])[:, 0].numpy())
        ref_probs = ref_logprobs.exp()
        # p ln(p / q), with 0 ln 0 = 0 where the reference gives a token no probability
        terms = torch.where(ref_probs > 0, ref_probs * (ref_logprobs - logprobs), 0.0)
        kld.append(terms.sum(dim=-1).numpy())
        # argmax of the raw logits (lowest id on a tie), as llama.cpp's imax and S01's greedy
        same.append((logits.argmax(dim=-1).cpu() == ref_logits.argmax(dim=-1).cpu()).numpy())
    elapsed_s = time.perf_counter() - start

    a = np.concatenate(nll)
    mean_nll, mean_nll_se = _mean_and_se(a)
    ppl = math.exp(mean_nll)
    fields = dict(context=context, num_chunks=num_chunks, num_tokens=int(a.size),
                  mean_nll=mean_nll, mean_nll_se=mean_nll_se, ppl=ppl, ppl_se=ppl * mean_nll_se,
                  elapsed_s=elapsed_s)
    if run_reference is not None:
        b = np.concatenate(nll_ref)
        mean_ref, mean_ref_se = _mean_and_se(b)
        ref_ppl = math.exp(mean_ref)
        cov = _covariance(a, b)
        ln_ratio = mean_nll - mean_ref
        ln_ratio_se = math.sqrt(max(mean_nll_se ** 2 + mean_ref_se ** 2 - 2 * cov, 0.0))
        ratio = math.exp(ln_ratio)
        ref_ppl_se = ref_ppl * mean_ref_se
        mean_kld, mean_kld_se = _mean_and_se(np.concatenate(kld))
        top = float(np.concatenate(same).mean())
        n = a.size
        fields.update(
            ref_ppl=ref_ppl, ref_ppl_se=ref_ppl_se,
            delta_ppl=ppl - ref_ppl,
            delta_ppl_se=math.sqrt(max(fields["ppl_se"] ** 2 + ref_ppl_se ** 2
                                       - 2 * ppl * ref_ppl * cov, 0.0)),
            delta_ppl_pct=100 * (ratio - 1), delta_ppl_pct_se=100 * ratio * ln_ratio_se,
            ln_ppl_ratio=ln_ratio, ln_ppl_ratio_se=ln_ratio_se,
            mean_kld=mean_kld, mean_kld_se=mean_kld_se,
            same_top1=top, same_top1_se=math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else math.nan)
    return QualityReport(**fields)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    import s03_transformer as s03
    import s06_torch as s06
    import s08_cli

    parser = argparse.ArgumentParser(
        description="Chapter 14: perplexity of the fp32 model on the bundled model's held-out "
                    "validation speeches, scored as llama.cpp's perplexity tool does.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--max-chunks", type=int, default=None,
                        help="score only the first N chunks, N >= 1 (default: all of the split)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per chunk, 3 to the model's max_position_embeddings "
                             "(default: max_position_embeddings)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, 1 to the logical cores (%d) (default: "
                             "%%(default)s)" % (os.cpu_count() or 1))
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)
    if args.max_chunks is not None and args.max_chunks < 1:
        parser.error(f"--max-chunks must be an integer >= 1 (got {args.max_chunks})")
    if args.context is not None and args.context < 3:
        parser.error(f"--context must be an integer in [3, max_position_embeddings] (got "
                     f"{args.context})")
    torch.set_num_threads(args.threads)
    try:
        model = s06.TorchTransformer.from_pretrained(args.model, args.device, torch.float32)
        ids = validation_token_ids()
        report = evaluate(model, token_ids=ids, context=args.context, max_chunks=args.max_chunks)
    except ValueError as err:
        parser.error(str(err))
    print(f"{args.model}: float32 on {model.device}, {args.threads} thread(s); validation "
          f"split {ids.size:,} tokens")
    print(report.format())


if __name__ == "__main__":
    sys.exit(main())
