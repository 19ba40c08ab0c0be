"""Data for the S07 "Try it" calculator: model configs, machine roofs, and the Python answers.

The page puts one decode step of a model config on a machine's roofline: its FLOPs and bytes at
a batch size, context length and dtype, its arithmetic intensity, whether it is bandwidth- or
compute-bound, the floor on its time (the ITL of every request in the batch) and tokens per
second, over a sweep of batch sizes, and the smallest batch whose step is compute-bound. The
JavaScript reimplements that arithmetic; everything it works from comes from here:

- configs, built by the course's own config functions: `s03_checkpoint.load_config` on the
  bundled model's config.json, `config_from_hf_dict` on the published config.json fields of
  Qwen/Qwen3-0.6B and meta-llama/Meta-Llama-3-8B (only the shape matters: no weights are read);
- roofs: the recorded CPU roofs of results/s07_engines.json (the roofs its floors use, and the
  same measurement after the runs) and of results/s07_engines_run2.json, each with its command,
  date and load; and datasheet roofs of two GPUs, labelled with their source;
- reference results for a grid of settings, computed with code/s07_roofline.py
  (`batched_decode_cost`, `bandwidth_floor_s`, `roofline_floor_s`, `MachinePeaks`), which the
  page recomputes when it loads and the browser test compares with the page.

Every FLOP and byte count here is an integer below 2**53 for every setting the page accepts
(checked below), so JavaScript's doubles hold them exactly and the page's arithmetic is the
same IEEE arithmetic as Python's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import s03_checkpoint as ckpt  # noqa: E402  (code/ is not a package)
import s03_transformer as s03  # noqa: E402
import s07_roofline as roof  # noqa: E402

MAX_BATCH = 65_536            # the largest batch the page accepts and searches for the ridge
SWEEP = [2 ** i for i in range(11)]  # batch sizes of the trade-off table: 1 ... 1,024
DTYPES = {"float32": 4, "bfloat16": 2}
EXACT = 2 ** 53               # doubles hold every integer below this exactly

# Published config.json fields (the shape only).
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "attention_bias": False, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0}
LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "tie_word_embeddings": False, "attention_bias": False,
              "mlp_bias": False, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0}

# Datasheet roofs (NVIDIA's H100 and H200 Tensor Core GPU datasheets, SXM form factor). The
# datasheets give BF16 Tensor Core throughput "with sparsity" (1,979 TFLOPS); dense matmul, what
# a decode step runs, is half of it, written 989 as the chapter does. FP32 is the non-tensor figure.
GPU_ROOFS = (
    ("h100-sxm", "H100 SXM (datasheet)", 3.35e12, {"bfloat16": 989e12, "float32": 67e12},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: GPU memory bandwidth 3.35 TB/s (HBM3), "
     "FP32 67 TFLOPS, BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense)"),
    ("h200-sxm", "H200 SXM (datasheet)", 4.8e12, {"bfloat16": 989e12, "float32": 67e12},
     "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: GPU memory bandwidth 4.8 TB/s (HBM3e), "
     "FP32 67 TFLOPS, BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense)"),
)
# (context, batch) pairs of the reference grid, for every config, machine and dtype it has.
GRID_CONTEXTS = (1, 28, 512, 4096)
GRID_BATCHES = (1, 8, 64, 1024)


def configs() -> list[dict]:
    """The models the page offers: id, label, where the shape comes from, and the config."""
    out = []
    for cid, label, source, cfg in (
            ("bundled", "bundled model (data/model)",
             "data/model/config.json, read by s03_checkpoint.load_config",
             ckpt.load_config(s03.BUNDLED_MODEL_DIR)),
            ("qwen3-0.6b", "Qwen3-0.6B shape",
             "Qwen/Qwen3-0.6B config.json fields, through s03_checkpoint.config_from_hf_dict",
             ckpt.config_from_hf_dict(QWEN3_0_6B)),
            ("llama-3-8b", "Llama-3-8B shape",
             "meta-llama/Meta-Llama-3-8B config.json fields, through "
             "s03_checkpoint.config_from_hf_dict", ckpt.config_from_hf_dict(LLAMA_3_8B))):
        if cfg.model_type not in ("qwen3", "llama"):
            raise ValueError(f"{cid}: the page counts Qwen3 / Llama shapes only")
        out.append({"id": cid, "label": label, "source": source, "config": cfg})
    return out


def _recorded(path: Path, label_prefix: str) -> list[dict]:
    run = json.loads(path.read_text())
    m = run["machine"]
    where = (f"{path.relative_to(ROOT)}, recorded by \"{run['command'].strip()}\", "
             f"written {run['created_utc']} on {m['cpu_model']} ({m['usable_cores']} usable cores, "
             f"torch {m['torch']}), load average {m['load_average_1min']:.2f} at the start, "
             f"{run['load_average_1min_after']:.2f} at the end")
    r = run["roofline"]
    out = [{"label": f"{label_prefix}: the roofs its floors use",
            "bandwidth": r["bandwidth_bytes_per_s"], "flops": {"float32": r["matmul_flops_per_s"]},
            "method": f"{r['bandwidth_method']} | {r['matmul_method']}", "source": where}]
    after = run["roofline_measurements"]["after, 2 thread(s)"]
    out.append({"label": f"{label_prefix}: measured again after the runs (2 threads)",
                "bandwidth": after["bandwidth_bytes_per_s"],
                "flops": {"float32": after["matmul_flops_per_s"]},
                "method": f"{after['bandwidth_method']} | {after['matmul_method']}",
                "source": where})
    return out


def machines() -> list[dict]:
    """Roofs: bandwidth in bytes/s and matmul FLOP/s per dtype (a dtype without a recorded roof
    is absent), with where each number comes from. The CPU's: the roofs each committed run's
    floors use, and for run 1 (the run the chapter quotes) the same measurement after its runs."""
    run1 = _recorded(ROOT / "results" / "s07_engines.json", "course CPU, run 1")
    run2 = _recorded(ROOT / "results" / "s07_engines_run2.json", "course CPU, run 2")
    out = [{"id": mid, "kind": "cpu", **m} for mid, m in
           (("cpu-run1", run1[0]), ("cpu-run1-after", run1[1]), ("cpu-run2", run2[0]))]
    for mid, label, bandwidth, flops, source in GPU_ROOFS:
        out.append({"id": mid, "kind": "gpu", "label": label, "bandwidth": bandwidth,
                    "flops": dict(flops), "method": "datasheet peak, not a measurement",
                    "source": source})
    return out


def peaks(machine: dict, dtype: str) -> roof.MachinePeaks:
    return roof.MachinePeaks(machine["bandwidth"], machine["flops"][dtype], machine["source"],
                             machine["method"])


def is_compute_bound(cost: roof.StepCost, p: roof.MachinePeaks) -> bool:
    """The step's FLOPs take at least as long as its bytes: the roofline floor is FLOPs / peak."""
    return cost.flops / p.matmul_flops_per_s >= cost.bytes / p.bandwidth_bytes_per_s


def compute_bound_batch(cfg: s03.TransformerConfig, context_len: int, dtype_bytes: int,
                        p: roof.MachinePeaks) -> int | None:
    """The smallest batch B <= MAX_BATCH whose decode step is compute-bound, by bisection (the
    FLOPs time minus the bytes time grows linearly with B), or None when B = MAX_BATCH is not."""
    def bound(b: int) -> bool:
        return is_compute_bound(roof.batched_decode_cost(cfg, b, context_len, dtype_bytes), p)
    if not bound(MAX_BATCH):
        return None
    lo, hi = 1, MAX_BATCH
    while lo < hi:
        mid = (lo + hi) // 2
        if bound(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def limit_intensity(cfg: s03.TransformerConfig, context_len: int, dtype_bytes: int) -> float:
    """FLOP/byte as B grows without bound: one request's FLOPs over the bytes it adds."""
    one = roof.batched_decode_cost(cfg, 1, context_len, dtype_bytes)
    two = roof.batched_decode_cost(cfg, 2, context_len, dtype_bytes)
    return one.flops / (two.bytes - one.bytes)


def step(cfg: s03.TransformerConfig, batch: int, context_len: int, dtype: str,
         p: roof.MachinePeaks) -> dict:
    """Everything the page shows for one setting, from code/s07_roofline.py."""
    cost = roof.batched_decode_cost(cfg, batch, context_len, DTYPES[dtype])
    floor = roof.roofline_floor_s(cost, p)
    return {"flops": cost.flops, "bytes": cost.bytes, "intensity": cost.intensity,
            "bytes_s": roof.bandwidth_floor_s(cost, p),
            "flops_s": cost.flops / p.matmul_flops_per_s, "floor_s": floor,
            "tokens_per_s": batch / floor,
            "bound": "compute" if is_compute_bound(cost, p) else "bandwidth"}


def _check_exact(models: list[dict]) -> None:
    for m in models:
        cfg = m["config"]
        for dtype_bytes in DTYPES.values():
            big = roof.batched_decode_cost(cfg, MAX_BATCH, cfg.max_position_embeddings, dtype_bytes)
            if max(big.flops, big.bytes) >= EXACT:
                raise ValueError(f"{m['id']}: counts reach 2**53, JavaScript would round them")


def config_fields(cfg: s03.TransformerConfig) -> dict:
    return {"model_type": cfg.model_type, "C": cfg.hidden_size, "I": cfg.intermediate_size,
            "L": cfg.num_hidden_layers, "H": cfg.num_attention_heads,
            "Hkv": cfg.num_key_value_heads, "D": cfg.head_dim, "V": cfg.vocab_size,
            "tied": cfg.tie_word_embeddings, "qk_norm": cfg.qk_norm,
            "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
            "max_context": cfg.max_position_embeddings}


def export() -> dict:
    models, roofs = configs(), machines()
    _check_exact(models)
    reference = []
    for m in models:
        cfg = m["config"]
        contexts = sorted({min(s, cfg.max_position_embeddings) for s in GRID_CONTEXTS})
        for machine in roofs:
            for dtype in DTYPES:
                if dtype not in machine["flops"]:
                    continue
                p = peaks(machine, dtype)
                for s in contexts:
                    setting = {"config": m["id"], "machine": machine["id"], "dtype": dtype,
                               "context": s}
                    reference.append({
                        **setting, "ridge": p.ridge_intensity,
                        "ridge_batch": compute_bound_batch(cfg, s, DTYPES[dtype], p),
                        "limit_intensity": limit_intensity(cfg, s, DTYPES[dtype]),
                        "steps": [{"batch": b, **step(cfg, b, s, dtype, p)} for b in GRID_BATCHES]})
    return {
        "source": "code/s07_roofline.py (batched_decode_cost, roofline_floor_s) and "
                  "code/s03_transformer.py (cost_breakdown), on results/s07_engines*.json",
        "max_batch": MAX_BATCH,
        "sweep": SWEEP,
        "dtypes": DTYPES,
        "configs": [{"id": m["id"], "label": m["label"], "source": m["source"],
                     "parameters": s03.parameter_count(m["config"]),
                     "fields": config_fields(m["config"])} for m in models],
        "machines": roofs,
        "defaults": {"config": "qwen3-0.6b", "machine": "cpu-run1", "dtype": "float32",
                     "context": 512, "batch": 1},
        "reference": reference,
    }


if __name__ == "__main__":  # print the size of what the page downloads
    print(f"{len(json.dumps(export(), separators=(',', ':'))):,} bytes")
