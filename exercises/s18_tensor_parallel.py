"""S18 exercises: shard a weight for column or row parallelism (and the fused q/k/v weight by
heads, with GQA), count the all-reduces of a step and the bytes each carries, and decide with a
cost model when tensor parallelism pays.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s18

The chapter's code is code/s18_layers.py (`ColumnParallelLinear` and `RowParallelLinear` with
their `shard`, `shard_range`, `kv_head_range`, `check_tensor_parallel`, `shard_shapes`,
`shard_model`, the communicators and `run_ranks`, which runs N ranks as threads of one process)
and code/s18_tensor_parallel.py (the multi-process executor). The graded tests run your shards
through the chapter's real layers, N ranks side by side with `run_ranks`, and compare the sum
with the unsplit product (`F.linear`, and attention computed whole with torch's
`scaled_dot_product_attention`); compare your shards with the tensors the chapter's
`TPTransformer` holds for the bundled model; count the all-reduces a real sharded forward does
(the communicator's `num_all_reduce` and `all_reduce_bytes`); and check your cost model on cases
worked by hand in the tests (and on the chapter's recorded runs once they exist). Reference
solutions are in exercises/solutions/ -- try first, peek later.

Vocabulary (the chapter's): N ranks (world_size), rank r in 0 .. N-1; a weight W is (out, in),
as torch's `F.linear(x, W)` = x W^T takes it. Column parallelism gives rank r a contiguous 1/N
of W's output features (rows of W: (out/N, in)); row parallelism gives it 1/N of the input
features (columns of W: (out, in/N)), and the ranks' partial products are summed by an
all-reduce. H query heads, Hkv key/value heads, D head dim, C hidden size, L layers, T tokens in
a step, V vocabulary.
"""
from __future__ import annotations

import torch


# Exercise 1: shard a weight (4 points) -------------------------------------------------------
# Megatron's MLP: the first GEMM split by columns (each rank its slice of the intermediate
# features, no communication: the activation is elementwise), the second by rows (each rank
# reads exactly the slice the first left it; one all-reduce sums the partial outputs).

def shard_weight(weight: torch.Tensor, rank: int, world_size: int, kind: str) -> torch.Tensor:
    """Rank `rank`'s shard of a full weight, for column or row parallelism.

    weight: (out, in), any dtype; for kind "column" also a bias (out,), which is split like
    the rows it belongs to. kind: "column" (rank r's rows [r out/N, (r+1) out/N): its output
    features) or "row" (rank r's columns [r in/N, (r+1) in/N): its input features; a row-
    parallel bias is never split, it is added once after the sum). Returns a tensor holding
    the shard's values (a view is fine).
    Example: W (6, 4), N = 2: "column" rank 1 -> W[3:6] (3, 4); "row" rank 0 -> W[:, 0:2]
    (6, 2). Stacking the column shards in rank order gives W back; so does concatenating the
    row shards along dim 1.
    Raises ValueError for another kind, a world_size < 1, a rank outside 0 .. N-1, a size that
    does not divide by N, and "row" on a tensor that is not 2-D.
    The tests compare you with the chapter's `ColumnParallelLinear.shard` and
    `RowParallelLinear.shard`, run an MLP through the real layers on your shards (N ranks as
    threads) against the unsplit one, and compare with the weights the chapter's
    `TPTransformer` holds for the bundled model (its o_proj and down_proj: row; gate_proj,
    up_proj and the embedding's vocabulary rows: column).
    Hint: `shard_range` in code/s18_layers.py is the slice arithmetic, if you want it.
    """
    raise NotImplementedError("exercise 1a")


def shard_qkv(q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor, rank: int,
              world_size: int, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> torch.Tensor:
    """Rank `rank`'s fused q/k/v weight: its query heads, then their key heads, then their
    value heads, concatenated along dim 0 (S06's fused `qkv_proj` layout, on the rank's heads).

    q_w: (H D, C) (or a bias (H D,)), head h in rows h D .. (h+1) D - 1; k_w, v_w:
    (Hkv D, C) (or biases (Hkv D,)). Rank r holds query heads [r H/N, (r+1) H/N). Under GQA
    query head h uses key/value head h // (H / Hkv); the rank holds the key/value heads its
    query heads use:
    - when Hkv divides by N: heads [r Hkv/N, (r+1) Hkv/N) (split like the query heads);
    - when N is a multiple of Hkv: one key/value head, r // (N / Hkv), replicated on the
      N / Hkv ranks that share it (a head cannot be cut in half: its D features attend
      together).
    Returns ((H/N) D + 2 Hkv_r D, C) (or 1-D for biases), Hkv_r the key/value heads rank r
    holds (Hkv/N, or 1 when replicated).
    Example: H = 4, Hkv = 2, D = 32, N = 4: rank 1 holds query head 1 and key/value head 0:
    q rows 32..63, k rows 0..31, v rows 0..31 -> (96, C).
    Raises ValueError when H does not divide by N, when neither Hkv divides by N nor N by Hkv,
    when H does not divide by Hkv, for a rank outside 0 .. N-1, and when the weights' first
    dims are not H D and Hkv D.
    The tests compare you with the fused q/k/v weight (and bias) the chapter's `TPTransformer`
    holds on each rank, and run attention through the real layers on your shards (N ranks as
    threads, each attending its own heads) against the whole attention.
    """
    raise NotImplementedError("exercise 1b")


# Exercise 2: the all-reduces of a step (3 points) --------------------------------------------
# A sharded forward communicates only where a row-parallel product (or the vocabulary-parallel
# embedding) leaves partial sums. Count them the way the chapter does.

def allreduce_per_step(config, num_tokens: int, world_size: int, dtype_bytes: int = 4
                       ) -> tuple[int, int]:
    """(count, bytes each): the all-reduces one forward step of num_tokens tokens does on a
    rank of a world_size-way split model, and the bytes of each all-reduce's input tensor.

    config: an S03 `TransformerConfig` (Qwen3 / Llama layout): num_hidden_layers L,
    hidden_size C. num_tokens: T >= 1, every token of the step (prefill chunks and decodes
    together: the all-reduces act on the hidden states of all of them). dtype_bytes: the
    activations' element size (4: float32; 2: bfloat16). Which products leave partial sums:
    the vocabulary-parallel embedding (a token's row lives on one rank, the others look up
    zeros), and in each layer the attention's output projection and the MLP's down projection
    (both row-parallel). The logits gathered on the sampler's rank are a gather, not an
    all-reduce: do not count them. At N = 1 nothing is summed: (0, 0).
    Example: the bundled model (L = 6, C = 128), T = 5, N = 2, float32: (13, 2560).
    Raises ValueError when the config does not split world_size ways (the chapter's
    `check_tensor_parallel` says why) and for num_tokens < 1.
    The tests compare you with what the communicator counts in a real sharded forward
    (`run_ranks` + `shard_model`, `num_all_reduce` and `all_reduce_bytes`) on the bundled
    model and a random one, and with hand cases.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: when tensor parallelism pays (3 points) -----------------------------------------
# A decode step reads every weight once; split N ways, each rank reads 1/N of them, in
# parallel. What it pays for that is the all-reduces, whose latency does not shrink with N.

def tp_step_time(weight_bytes: float, bandwidth: float, num_allreduce: int,
                 allreduce_latency: float, world_size: int) -> float:
    """Seconds of one step in the simple cost model: the time to read the weights, split N
    ways, plus the all-reduces, one after the other.

    weight_bytes: the whole model's weight bytes (bytes); bandwidth: the bytes per second one
    rank reads its weights at (a GPU's memory bandwidth; each rank has its own); num_allreduce:
    the all-reduces of a step (`allreduce_per_step`); allreduce_latency: seconds each takes;
    world_size: N >= 1. Each rank reads weight_bytes / N at `bandwidth`, all at once; at N = 1
    there is nothing to all-reduce (the latency does not count).
    Example: 2 GB of weights at 1 TB/s, 10 all-reduces of 50 us: N = 1 -> 2 ms; N = 2 ->
    1 ms + 0.5 ms = 1.5 ms.
    Raises ValueError for weight_bytes < 0, bandwidth <= 0, num_allreduce < 0,
    allreduce_latency < 0 and world_size < 1.
    The tests check cases worked by hand.
    """
    raise NotImplementedError("exercise 3a")


def tp_pays(weight_bytes: float, bandwidth: float, num_allreduce: int,
            allreduce_latency: float, world_size: int) -> bool:
    """True when the step at world_size ranks is strictly faster than on one rank, in the cost
    model of `tp_step_time` (arguments as there). N = 1 never pays (it is the baseline);
    a tie does not pay. Raises ValueError as `tp_step_time`.
    Example: as above, 1.5 ms < 2 ms: True; with all-reduces of 150 us, 1 ms + 1.5 ms = 2.5 ms:
    False.
    The tests check cases worked by hand, and hold you against the chapter's recorded runs
    (chapters/figures/s18_tensor_parallel.json, when it exists): where TP = 2 was measured
    faster than TP = 1, your model must allow it.
    """
    raise NotImplementedError("exercise 3b")
