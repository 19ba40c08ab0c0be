"""S07, the roofline: this machine's limits, and the cost of a step from the model config.

What is here
    What the harness's numbers (`s07_measuring.py`) are judged against. `measure_bandwidth`
    and `measure_matmul_flops` measure this machine's memory bandwidth and matmul FLOP/s by a
    short, stated method (`measure_peaks` does both); `decode_step_cost` and `prefill_cost`
    count the FLOPs and bytes of a decode step and of a prefill from the model config with
    S03's cost functions (K/V reads included). A decode step at batch 1 does about 0.5 FLOP per
    float32 byte it reads, so its floor is `bytes moved / bandwidth` (`bandwidth_floor_s`); a
    prefill of hundreds of tokens reuses every weight hundreds of times and lands on the
    compute roof (`roofline_floor_s` takes the larger of the two times). `attach_floor` puts a
    run's decode steps against their floor, and `plot_roofline` draws where measured steps
    land. (The floor assumes the weights come from main memory: a model small enough to live
    in the CPU's caches, like the bundled one at 5.8 MB, is limited by per-operation overheads
    instead, and its ratio says so.)

What it does not handle
    Only CPU threads and one CUDA device; float32 matmuls for the compute roof (a bfloat16 or
    int8 roof is the same code with another dtype); no cache hierarchy (one bandwidth, main
    memory's); activations are not counted in a step's bytes (they are small next to the
    weights at batch 1, as S03 says).

Run it
    python code/s07_measuring.py          # prints this machine's roofs and both intensities

Tests
    tests/test_s07_roofline.py: FLOPs and bytes of a tiny config counted weight by weight,
    floors and the ridge on hand-made peaks, the median decode context of `attach_floor`, the
    measurements' methods and errors, the PNG's size.

References
    S. Williams, A. Waterman, D. Patterson, "Roofline: An Insightful Visual Performance Model
    for Multicore Architectures" (CACM 2009); J. McCalpin, "STREAM" (copy bandwidth counted as
    bytes read + bytes written); Pope et al., "Efficiently Scaling Transformer Inference"
    (2022) and Kaplan et al. (2020) for the FLOPs and bytes of a step (through S03's
    `flops_per_token` / `bytes_per_token`).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

import s03_transformer as s03

if TYPE_CHECKING:  # the harness imports nothing from here; only the type hint needs it
    from s07_measuring import BenchmarkRun


# ---------------------------------------------------------------------------------------------
# This machine's limits, measured
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MachinePeaks:
    """What this machine sustains, as measured by `measure_bandwidth` and
    `measure_matmul_flops`: bytes per second and FLOP per second, with the method stated."""

    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float
    bandwidth_method: str
    matmul_method: str

    @property
    def ridge_intensity(self) -> float:
        """FLOP per byte where the two roofs meet: below it a step is bandwidth-bound."""
        return self.matmul_flops_per_s / self.bandwidth_bytes_per_s


def _best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation are not the machine's speed
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu"
                      ) -> tuple[float, str]:
    """Memory bandwidth in bytes/s: copy a float32 tensor of `nbytes` into another, best of
    `repeats` (after one warm-up copy), counting nbytes read + nbytes written (STREAM's "copy").
    Uses torch's `copy_` with torch's current thread count. Returns (bytes/s, the method as a
    sentence). Raises ValueError for nbytes < 4 or repeats < 1.
    """
    import torch
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"need nbytes >= 4 and repeats >= 1 (got {nbytes}, {repeats})")
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = _best_time(lambda: dst.copy_(src), repeats, lambda: _sync(device))
    moved = 2 * src.numel() * 4
    method = (f"torch copy_ of a {moved // 2 / 2**20:.0f} MiB float32 tensor on {device}, "
              f"{torch.get_num_threads()} thread(s), best of {repeats}; bytes read + written")
    return moved / best, method


def measure_matmul_flops(n: int = 2048, repeats: int = 5, device: str = "cpu",
                         dtype: str = "float32") -> tuple[float, str]:
    """Matmul throughput in FLOP/s: an (n, n) @ (n, n) torch matmul of `dtype`, best of
    `repeats` after one warm-up, counted as 2 n^3 FLOPs (one multiply and one add per term).
    Returns (FLOP/s, the method as a sentence). Raises ValueError for n < 1 or repeats < 1."""
    import torch
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1 (got {n}, {repeats})")
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(torch_dtype)
    b = torch.randn(n, n, device=device).to(torch_dtype)
    best = _best_time(lambda: a @ b, repeats, lambda: _sync(device))
    method = (f"torch {dtype} matmul ({n} x {n}) @ ({n} x {n}) on {device}, "
              f"{torch.get_num_threads()} thread(s), best of {repeats}; 2 n^3 FLOPs")
    return 2 * n ** 3 / best, method


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def measure_peaks(device: str = "cpu", bandwidth_bytes: int = 256 * 2**20,
                  matmul_n: int = 2048, repeats: int = 5) -> MachinePeaks:
    """Both measurements of this machine (see `measure_bandwidth`, `measure_matmul_flops`)."""
    bw, bw_method = measure_bandwidth(bandwidth_bytes, repeats, device)
    flops, flops_method = measure_matmul_flops(matmul_n, repeats, device)
    return MachinePeaks(bw, flops, bw_method, flops_method)


# ---------------------------------------------------------------------------------------------
# The cost of a step, counted from the config
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes moved by one forward step; intensity is FLOP per byte."""

    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def decode_step_cost(config: s03.TransformerConfig, context_len: int, dtype_bytes: int = 4
                     ) -> StepCost:
    """One decode step at batch 1: one new token attending to S = context_len positions
    (itself included), with a KV cache. S03's `flops_per_token` and `bytes_per_token`: every
    weight read once (the LM head too), K and V of the S - 1 cached positions read and the
    new token's written, 2 FLOPs per weight plus 4 H D S per layer for attention.
    Raises ValueError for context_len < 1 or dtype_bytes < 1."""
    return StepCost(s03.flops_per_token(config, context_len),
                    s03.bytes_per_token(config, context_len, dtype_bytes))


def batched_decode_cost(config: s03.TransformerConfig, batch_size: int, context_len: int,
                        dtype_bytes: int = 4) -> StepCost:
    """One decode step of B = batch_size requests, each a new token attending to S =
    context_len positions. FLOPs: B times the batch-1 step's. Bytes: the batch-1 step's, plus,
    for each of the other B - 1 requests, what S03's `cost_breakdown` charges to the token
    itself and not to a weight: its embedding row (and GPT-2's position row) and, in every
    layer, the K and V of its S positions. Every weight is read once for the whole batch.
    Raises ValueError for batch_size < 1 (and `decode_step_cost`'s errors)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1 (got {batch_size!r})")
    one = decode_step_cost(config, context_len, dtype_bytes)
    rows = {r.part: r.bytes for r in s03.cost_breakdown(config, context_len, dtype_bytes)}
    attention = next(p.bytes for p in s03.layer_breakdown(config, context_len, dtype_bytes)
                     if p.part.startswith("attention"))
    per_request = (rows["embedding"] + rows.get("position embedding", 0)
                   + config.num_hidden_layers * attention)
    return StepCost(batch_size * one.flops, one.bytes + (batch_size - 1) * per_request)


def prefill_cost(config: s03.TransformerConfig, prompt_tokens: int, dtype_bytes: int = 4
                 ) -> StepCost:
    """The prefill of a prompt of T = prompt_tokens tokens in one step, LM head on the last
    position only (as S05's and S06's engines do).

    FLOPs: the T tokens' forward passes, token s attending to s positions (causal: the useful
    work, not masked-out pairs), i.e. sum over s = 1..T of S03's `flops_per_token(config, s)`,
    minus the LM head (2 C V) of the T - 1 rows whose logits are not computed.
    Bytes: every weight once and K/V of one position (S03's `bytes_per_token(config, 1)`),
    plus K and V written for the other T - 1 positions (2 L Hkv D each); activations and the
    extra embedding rows are not counted, as in S03. Raises ValueError for prompt_tokens < 1
    or dtype_bytes < 1.
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1 (got {prompt_tokens})")
    cfg = config
    attention_per_position = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    per_token = s03.flops_per_token(cfg, 1) - attention_per_position   # everything but attention
    flops = (prompt_tokens * per_token
             + attention_per_position * prompt_tokens * (prompt_tokens + 1) // 2
             - (prompt_tokens - 1) * 2 * cfg.hidden_size * cfg.vocab_size)
    kv_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    moved = (s03.bytes_per_token(cfg, 1, dtype_bytes)
             + (prompt_tokens - 1) * kv_per_position * dtype_bytes)
    return StepCost(flops, moved)


def bandwidth_floor_s(cost: StepCost, peaks: MachinePeaks) -> float:
    """Seconds a step needs at least to move its bytes: bytes / bandwidth."""
    return cost.bytes / peaks.bandwidth_bytes_per_s


def roofline_floor_s(cost: StepCost, peaks: MachinePeaks) -> float:
    """The roofline's lower bound on a step's time: the larger of bytes / bandwidth and
    FLOPs / matmul FLOP/s (whichever resource the step runs out of first)."""
    return max(cost.bytes / peaks.bandwidth_bytes_per_s, cost.flops / peaks.matmul_flops_per_s)


def attach_floor(run: BenchmarkRun, config: s03.TransformerConfig, peaks: MachinePeaks,
                 dtype_bytes: int = 4) -> None:
    """Fill run.decode_floor_s: the bandwidth floor of a decode step at the (low) median context
    length of the run's decode steps (step k of a request reads prompt + k tokens), so
    run.decode_vs_floor = ITL p50 / floor. Does nothing for a run without decode steps."""
    contexts = [r.prompt_tokens + k for r in run.requests for k in range(1, r.output_tokens)]
    if not contexts:
        return
    context = statistics.median_low(contexts)   # an actual step's context, not a midpoint
    run.decode_context_len = context
    run.decode_floor_s = bandwidth_floor_s(decode_step_cost(config, context, dtype_bytes), peaks)


# ---------------------------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------------------------

def plot_roofline(peaks: MachinePeaks, points: Sequence[tuple[str, StepCost, float]],
                  path: str | Path, title: str = "Roofline") -> Path:
    """Draw the roofline and where measured steps land; save it as a PNG at `path`.

    The roof: attainable FLOP/s = min(matmul FLOP/s, bandwidth x intensity), log-log. points:
    (label, the step's cost, its measured seconds); each is drawn at (cost.intensity,
    cost.flops / seconds), with a hollow marker on the roof above it (what the step could reach).
    Returns the path.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intensities = [c.intensity for _, c, _ in points] or [1.0]
    lo = min(min(intensities), peaks.ridge_intensity) / 4
    hi = max(max(intensities), peaks.ridge_intensity) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    roof = np.minimum(peaks.matmul_flops_per_s, peaks.bandwidth_bytes_per_s * x)
    fig, ax = plt.subplots(figsize=(10.5, 4.8))
    ax.loglog(x, roof, color="black", lw=2,
              label=f"roof: {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                    f"{peaks.matmul_flops_per_s / 1e9:.0f} GFLOP/s")
    ax.axvline(peaks.ridge_intensity, color="grey", ls=":", lw=1)
    for where, text, align in ((peaks.ridge_intensity / 1.3, "bandwidth-bound", "right"),
                               (peaks.ridge_intensity * 1.3, "compute-bound", "left")):
        ax.text(where, peaks.matmul_flops_per_s * 1.3, text, ha=align, va="bottom",
                fontsize=8, color="grey")
    measured = [c.flops / t for _, c, t in points]
    ax.set_ylim(min([roof.min(), *measured]) / 2, peaks.matmul_flops_per_s * 3)
    colors = plt.get_cmap("tab20").colors          # 20 distinct colours, one per point
    for i, (label, cost, seconds) in enumerate(points):
        color = colors[(2 * i) % 20 + (2 * i) // 20 % 2]   # dark shades first, then light
        attainable = min(peaks.matmul_flops_per_s,
                         peaks.bandwidth_bytes_per_s * cost.intensity)
        ax.scatter([cost.intensity], [cost.flops / seconds], color=color, zorder=3, label=label)
        ax.scatter([cost.intensity], [attainable], facecolors="none", edgecolors=color, zorder=3)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))   # beside: covers no point
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
