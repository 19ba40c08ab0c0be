"""S18 exercises, reference solutions: shard a weight for column or row parallelism (and the
fused q/k/v weight by heads, with GQA), count the all-reduces of a step and the bytes each
carries, and decide with a cost model when tensor parallelism pays.

Try the stubs in exercises/s18_tensor_parallel.py first; grade these with
`python exercises/grade.py --solutions s18`.

Sources followed: Shoeybi et al., Megatron-LM (2019), section 3 and figure 3 (the column and
row splits of the MLP and of attention by heads, two all-reduces per layer); vLLM's
QKVParallelLinear for the rule of GQA's key/value heads when the rank count exceeds them (each
replicated on N / Hkv ranks); the cost model is the chapter's: a decode step bound by reading
the weights, plus the all-reduces' latency (as in gpt-fast's and vLLM's discussions of when
tensor parallelism helps a small batch).
"""
from __future__ import annotations

import torch

import s18_layers


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (got {world_size!r})")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0 .. {world_size - 1} (got {rank!r})")


def _part(size: int, rank: int, world_size: int, what: str) -> slice:
    """Rank r's contiguous 1/N of `size` things."""
    if size % world_size:
        raise ValueError(f"{what} ({size}) must divide by world_size {world_size}")
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


# Exercise 1: shard a weight ------------------------------------------------------------------

def shard_weight(weight: torch.Tensor, rank: int, world_size: int, kind: str) -> torch.Tensor:
    """Column: a slice of dim 0 (the output features, and a bias's entries with them); row: a
    slice of dim 1 (the input features)."""
    _check_rank(rank, world_size)
    if kind == "column":
        return weight[_part(weight.shape[0], rank, world_size, "the output features")]
    if kind == "row":
        if weight.dim() != 2:
            raise ValueError(f"a row-parallel shard cuts a 2-D (out, in) weight (got shape "
                             f"{tuple(weight.shape)}); a row-parallel bias is not split")
        return weight[:, _part(weight.shape[1], rank, world_size, "the input features")]
    raise ValueError(f"kind must be 'column' or 'row' (got {kind!r})")


def shard_qkv(q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor, rank: int,
              world_size: int, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> torch.Tensor:
    """The query heads split evenly; the key/value heads split with them when Hkv divides by
    N, else the one head the rank's query heads use (a whole head: its D rows attend
    together). Heads are D rows each, so a head range is a row range times D."""
    _check_rank(rank, world_size)
    h, hkv, d = num_heads, num_kv_heads, head_dim
    if h % hkv:
        raise ValueError(f"the {h} query heads must divide by the {hkv} key/value heads (GQA)")
    if hkv % world_size and world_size % hkv:
        raise ValueError(f"the {hkv} key/value heads must divide by world_size {world_size}, "
                         f"or world_size by them (each then replicated)")
    if q_w.shape[0] != h * d or k_w.shape[0] != hkv * d or v_w.shape[0] != hkv * d:
        raise ValueError(f"q, k, v must have H D = {h * d}, Hkv D = {hkv * d} rows (got "
                         f"{q_w.shape[0]}, {k_w.shape[0]}, {v_w.shape[0]})")
    heads = _part(h, rank, world_size, "the query heads")
    if hkv % world_size == 0:
        kv = _part(hkv, rank, world_size, "the key/value heads")
    else:
        head = rank // (world_size // hkv)           # N / Hkv consecutive ranks share it
        kv = slice(head, head + 1)
    rows = lambda s: slice(s.start * d, s.stop * d)  # noqa: E731  (heads -> rows)
    return torch.cat([q_w[rows(heads)], k_w[rows(kv)], v_w[rows(kv)]], dim=0)


# Exercise 2: the all-reduces of a step -------------------------------------------------------

def allreduce_per_step(config, num_tokens: int, world_size: int, dtype_bytes: int = 4
                       ) -> tuple[int, int]:
    """One for the embedding, two per layer (after o_proj and after down_proj); each sums the
    (T, C) hidden states."""
    s18_layers.check_tensor_parallel(config, world_size)
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer >= 1 (got {num_tokens!r})")
    if world_size == 1:
        return 0, 0
    return 1 + 2 * config.num_hidden_layers, num_tokens * config.hidden_size * dtype_bytes


# Exercise 3: when tensor parallelism pays ----------------------------------------------------

def tp_step_time(weight_bytes: float, bandwidth: float, num_allreduce: int,
                 allreduce_latency: float, world_size: int) -> float:
    """Every rank reads its 1/N at once; the all-reduces come one after the other (each waits
    for the layer before it)."""
    if weight_bytes < 0:
        raise ValueError(f"weight_bytes must be >= 0 (got {weight_bytes})")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes per second (got {bandwidth})")
    if num_allreduce < 0 or allreduce_latency < 0:
        raise ValueError(f"num_allreduce and allreduce_latency must be >= 0 (got "
                         f"{num_allreduce}, {allreduce_latency})")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (got {world_size!r})")
    read_s = weight_bytes / (world_size * bandwidth)
    return read_s if world_size == 1 else read_s + num_allreduce * allreduce_latency


def tp_pays(weight_bytes: float, bandwidth: float, num_allreduce: int,
            allreduce_latency: float, world_size: int) -> bool:
    """Strictly faster than one rank in the same model."""
    split = tp_step_time(weight_bytes, bandwidth, num_allreduce, allreduce_latency, world_size)
    alone = tp_step_time(weight_bytes, bandwidth, num_allreduce, allreduce_latency, 1)
    return world_size > 1 and split < alone
