r"""S18, tensor parallelism's layers: S06's Qwen3 / Llama model split over N ranks.

What is new since S17
    Every step reads every weight once. Split each weight matrix N ways and give each rank one
    piece: each reads 1/N of the bytes, and the pieces' results are put back together by a
    sum over the ranks (an all-reduce) once per block. This is Megatron-LM's split (Shoeybi
    et al. 2019, section 3), written here for S06's layers:

    - `ColumnParallelLinear`: rank r holds rows r of W (out/N, in): its output is its slice of
      the features, no communication. The MLP's gate and up projections, and the fused q/k/v
      projection (split by heads: rank r's query heads and their key/value heads).
    - `RowParallelLinear`: rank r holds columns r of W (out, in/N) and reads the matching
      slice of its input, which is exactly what a column-parallel layer left it: its product
      is a partial sum of the full output, and one all-reduce makes the whole. The attention's
      output projection and the MLP's down projection. Bias added once, after the sum.
    - So a block costs two all-reduces of (T, C): one after attention, one after the MLP. The
      attention in between is per head, so each rank attends its own heads with its own keys
      and values: its share of the KV cache, Hkv/N heads (S12's pool, 1/N as wide).
    - GQA: key/value heads are split with their query heads when Hkv divides by N; when N is a
      multiple of Hkv each KV head is replicated on the N/Hkv ranks whose query heads use it
      (vLLM does the same); otherwise `check_tensor_parallel` refuses, naming the rule.
    - `VocabParallelEmbedding`: rank r holds the rows of vocabulary range r; a token outside
      it looks up zeros and the all-reduce adds the one rank that had it. `ParallelLMHead`:
      the same rows as the head (a tied head is the same tensor), each rank's logits for its
      range, gathered on rank 0 (the sampler's rank): (T, V).
    - `TPTransformer`: the model a rank holds, with S06's interface (`blocks`' `qkv` and
      `finish`, `embed_ids`, `head`, `config`: the rank's own, heads divided), so S12's and
      S17's runners run it unchanged on every rank. `load_shard` reads each tensor's slice
      straight from the checkpoint's safetensors files (memory-mapped: a rank reads only its
      bytes); `shard_model` splits an in-memory S06 model.
    - `Communicator`: what a layer calls to sum with the other ranks (all_reduce, gather),
      counting its all-reduces and their bytes. Here `ThreadCommunicator` (ranks as threads
      in one process: the tests, the notebook and the simulator's export run the real layers
      side by side without processes); code/s18_allreduce.py has the processes' ones
      (torch.distributed's, and a shared-memory all-reduce).

What it does not handle
    GPT-2's layout (its fused c_attn and Conv1D weights would need their own split rules);
    S14's quantized weights; padding a vocabulary that does not divide by N (vLLM pads it to a
    multiple of 64 N; here it is an error).

Run it
    python code/s18_tensor_parallel.py --tensor-parallel-size 2

Tests
    tests/test_s18_layers.py (shard shapes and bytes, logits of N ranks as threads against
    S06, the all-reduce count per layer, the refusals: sizes that do not split, checkpoints
    S03's loader refuses).

References
    Shoeybi et al., Megatron-LM (2019), section 3 and figure 3 (the MLP and attention splits);
    vLLM's vllm/model_executor/layers/linear.py (ColumnParallelLinear, MergedColumnParallel-
    Linear, QKVParallelLinear, RowParallelLinear) and vocab_parallel_embedding.py; gpt-fast's
    tp.py (the same split by rewriting a model's linears in place).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import s03_checkpoint
import s03_transformer as s03
import s06_torch as s06
from s01_generation_loop import ParameterError


# ---------------------------------------------------------------------------------------------
# The rules: which sizes divide, and who holds which slice
# ---------------------------------------------------------------------------------------------

def check_tensor_parallel(config: s03.TransformerConfig, world_size: int) -> None:
    """Raise ParameterError (parameter "tensor_parallel_size") unless this config splits N =
    world_size ways: N an integer >= 1; a Qwen3 / Llama layout; N divides the query heads,
    the MLP's intermediate size and the vocabulary; the key/value heads divide by N, or N by
    them (each KV head then replicated on N / Hkv ranks)."""
    def refuse(rule: str):
        raise ParameterError(f"tensor_parallel_size={world_size}: {rule}",
                             "tensor_parallel_size", world_size)

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ParameterError(f"tensor_parallel_size must be an integer >= 1 (got "
                             f"{world_size!r})", "tensor_parallel_size", world_size)
    if config.model_type == "gpt2":
        refuse("the split here is written for the Qwen3 / Llama layout, not GPT-2's")
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    if h % world_size:
        refuse(f"the {h} query heads must divide by the rank count")
    if hkv % world_size and world_size % hkv:
        refuse(f"the {hkv} key/value heads must divide by the rank count, or the rank count by "
               f"them (then each is replicated)")
    if config.intermediate_size % world_size:
        refuse(f"the MLP's intermediate size {config.intermediate_size} must divide by the "
               f"rank count")
    if config.vocab_size % world_size:
        refuse(f"the vocabulary ({config.vocab_size} tokens) must divide by the rank count")


def shard_range(size: int, rank: int, world_size: int) -> slice:
    """Rank r's contiguous 1/N of `size` (which divides by N): [r size/N, (r+1) size/N)."""
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def kv_head_range(config: s03.TransformerConfig, rank: int, world_size: int) -> slice:
    """The key/value heads rank r holds: its Hkv/N when N divides Hkv; else the one KV head
    its query heads use (ranks r N'..r N' + N' - 1 share head r // N', N' = N / Hkv)."""
    hkv = config.num_key_value_heads
    if hkv % world_size == 0:
        return shard_range(hkv, rank, world_size)
    head = rank // (world_size // hkv)
    return slice(head, head + 1)


def rank_config(config: s03.TransformerConfig, world_size: int) -> s03.TransformerConfig:
    """The config of one rank's share: H/N query heads, its KV heads, intermediate/N; the
    hidden size, head size, vocabulary and positions are the model's (logits stay (T, V))."""
    check_tensor_parallel(config, world_size)
    return replace(config, num_attention_heads=config.num_attention_heads // world_size,
                   num_key_value_heads=max(config.num_key_value_heads // world_size, 1),
                   intermediate_size=config.intermediate_size // world_size)


@dataclass(frozen=True)
class ShardRule:
    """How one checkpoint tensor is split: dim, the dimension cut (None: every rank holds the
    whole tensor); unit, the rows per head (D) when the cut follows heads, else 1; kv, the cut
    follows the key/value heads (`kv_head_range`) rather than an even split."""

    dim: int | None
    unit: int = 1
    kv: bool = False

    def slice_of(self, shape: Sequence[int], config, rank: int, world_size: int
                 ) -> tuple[slice, ...]:
        """Rank r's index into a tensor of this full shape (a tuple of slices, one per dim)."""
        index = [slice(None)] * len(shape)
        if self.dim is not None:
            if self.kv:
                heads = kv_head_range(config, rank, world_size)
                part = slice(heads.start * self.unit, heads.stop * self.unit)
            else:
                part = shard_range(shape[self.dim], rank, world_size)
            index[self.dim] = part
        return tuple(index)


def shard_rule(name: str, config: s03.TransformerConfig) -> ShardRule:
    """The `ShardRule` of an HF tensor name of the Qwen3 / Llama layout."""
    d = config.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return ShardRule(0, d)                                   # column: query heads
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return ShardRule(0, d, kv=True)                          # column: their KV heads
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
        return ShardRule(0)                                      # column: intermediate
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return ShardRule(1)                                      # row: their inputs
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ShardRule(0)                                      # vocabulary ranges
    return ShardRule(None)    # norms, q/k norms, the row-parallel biases: whole on every rank


def shard_shapes(config: s03.TransformerConfig, rank: int, world_size: int
                 ) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor rank r holds, by HF name (the chapter's table)."""
    check_tensor_parallel(config, world_size)
    out = {}
    for name, shape in s03_checkpoint.expected_tensors(config).items():
        index = shard_rule(name, config).slice_of(shape, config, rank, world_size)
        out[name] = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
    return out


def shard_bytes(config: s03.TransformerConfig, world_size: int, dtype_bytes: int = 4
                ) -> list[int]:
    """Weight bytes each rank holds (a tied head counted once, as S06 holds it)."""
    return [dtype_bytes * sum(int(np.prod(s)) for s in shard_shapes(config, r, world_size).values())
            for r in range(world_size)]


def allreduce_plan(config: s03.TransformerConfig, num_tokens: int, world_size: int,
                   dtype_bytes: int = 4) -> dict:
    """The collectives of one step over num_tokens tokens (N > 1): all_reduce, the count (one
    for the embedding, two per layer); all_reduce_bytes, the bytes each carries (T C
    elements); gather, the logits gathered on rank 0 per sampled row (V/N per rank)."""
    return dict(all_reduce=1 + 2 * config.num_hidden_layers,
                all_reduce_bytes=num_tokens * config.hidden_size * dtype_bytes,
                gather_bytes_per_row=config.vocab_size // world_size * 4)


# ---------------------------------------------------------------------------------------------
# Communicators: what a rank calls to sum with the others
# ---------------------------------------------------------------------------------------------

class Communicator:
    """The two collectives the layers need, and a count of them (the tests' and chapter's).

    all_reduce(x): x (any shape) replaced by the sum of every rank's x, in place; returned.
    gather(x): x (T, n) from every rank; on rank 0 returns (T, N n), the ranks' in rank order,
    elsewhere None. num_all_reduce, all_reduce_bytes: the all-reduces done and the bytes of
    their inputs (on this rank)."""

    rank: int
    world_size: int

    def __init__(self):
        self.num_all_reduce = self.all_reduce_bytes = 0

    def count(self, x: torch.Tensor) -> None:
        self.num_all_reduce += 1
        self.all_reduce_bytes += x.numel() * x.element_size()

    def reset_counts(self) -> None:
        self.num_all_reduce = self.all_reduce_bytes = 0


class ThreadGroup:
    """N ranks as N threads of one process: the shared state of their `ThreadCommunicator`s.
    A rank that raises breaks the barrier, so the others raise too instead of waiting."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order (a copy each rank reads after all have written)."""
        self.slots[rank] = x
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()               # nobody writes the next round before all have read
        return parts


class ThreadCommunicator(Communicator):
    """Rank `rank` of a `ThreadGroup`. The all-reduce adds the ranks' tensors in rank order
    (every rank the same order, so all get the same bits); `trace`, when a list, receives
    (kind, rank, the inputs in rank order, the result) per collective: the simulator's data."""

    def __init__(self, group: ThreadGroup, rank: int, trace: list | None = None):
        super().__init__()
        self.group, self.rank, self.world_size, self.trace = group, rank, group.world_size, trace

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.count(x)
        parts = self.group.exchange(self.rank, x.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        if self.trace is not None and self.rank == 0:
            self.trace.append(("all_reduce", parts, total))
        return x.copy_(total)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.exchange(self.rank, x.clone())
        if self.rank != 0:
            return None
        if self.trace is not None:
            self.trace.append(("gather", parts, None))
        return torch.cat(parts, dim=-1)


def run_ranks(world_size: int, fn: Callable[[ThreadCommunicator], object],
              trace: list | None = None) -> list:
    """Call fn(comm) on world_size threads, one per rank, sharing a `ThreadGroup`; returns the
    ranks' results in rank order. The first rank's exception (by rank) is raised once all
    have stopped; the others see a broken barrier and stop too."""
    group = ThreadGroup(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def target(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(ThreadCommunicator(group, rank, trace))
        except BaseException as err:       # noqa: BLE001 (re-raised below, by rank)
            errors[rank] = err
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), name=f"s18-rank{r}")
               for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for err in errors:                     # a real error before a broken barrier it caused
        if err is not None and not isinstance(err, threading.BrokenBarrierError):
            raise err
    for err in errors:
        if err is not None:
            raise err
    return results


# ---------------------------------------------------------------------------------------------
# Megatron's layers
# ---------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: rank r's out/N output features, no communication.
    weight: (out/N, in) this rank's rows; bias: (out/N,) or None. x (T, in) -> (T, out/N)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias

    @staticmethod
    def shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Rank r's rows of a full (out, in) weight (or (out,) bias)."""
        return weight[shard_range(weight.shape[0], rank, world_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then + b: rank r holds columns r of W, (out, in/N), and
    reads x_r (T, in/N), its slice of the input (a column-parallel layer's output). One
    all-reduce of (T, out); the bias (out,), whole on every rank, added once after it."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Communicator):
        super().__init__()
        self.weight, self.bias, self.comm = weight, bias, comm

    @staticmethod
    def shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Rank r's columns of a full (out, in) weight."""
        return weight[:, shard_range(weight.shape[1], rank, world_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [lo, hi) of the (V, C) table: ids outside look up zeros, and one
    all-reduce of (T, C) adds the rank that had each id. ids int64 (T,) -> (T, C).
    Raises ValueError for an id outside [0, V) (every rank checks the same ids, so all raise
    before the all-reduce: none is left waiting)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, rank: int, world_size: int,
                 comm: Communicator):
        super().__init__()
        self.weight, self.vocab_size, self.comm = weight, vocab_size, comm
        part = shard_range(vocab_size, rank, world_size)
        self.lo, self.hi = part.start, part.stop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type == "cpu" and ids.numel():   # on CUDA a check would sync each step
            low, high = torch.aminmax(ids)                  # (S06 leaves it to the device too)
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"token id must be an integer in [0, V={self.vocab_size})")
        mine = (ids >= self.lo) & (ids < self.hi)
        x = F.embedding((ids - self.lo) * mine, self.weight)             # (T, C)
        return self.comm.all_reduce(x * mine[:, None].to(x.dtype))


class ParallelLMHead(nn.Module):
    """Logits for rank r's vocabulary range, x (T, C) -> (T, V/N) float32, gathered on rank 0
    into (T, V) (rank order is vocabulary order); None on the other ranks."""

    def __init__(self, weight: nn.Parameter, comm: Communicator):
        super().__init__()
        self.weight, self.comm = weight, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.comm.gather(F.linear(x, self.weight).float())


# ---------------------------------------------------------------------------------------------
# The model a rank holds
# ---------------------------------------------------------------------------------------------

class TPQwen3Block(nn.Module):
    """One rank's share of a Qwen3 / Llama layer. `local` is S06's own block built on this
    rank's weights with the rank's config (H/N query heads, its KV heads, I/N), so `qkv` is
    S06's code unchanged: q (H/N, T, D), k and v (Hkv/N, T, D). `finish` is S06's with the two
    row-parallel products summed over the ranks: the residual is added after each sum."""

    def __init__(self, local: s06.Qwen3Block, comm: Communicator):
        super().__init__()
        self.local, self.config, self.scale = local, local.config, local.scale
        self.o_proj = RowParallelLinear(local.o_proj, local.o_bias, comm)
        self.gate_up_proj = ColumnParallelLinear(local.gate_up_proj, local.gate_up_bias)
        self.down_proj = RowParallelLinear(local.down_proj, local.down_bias, comm)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.local.qkv(x, cos, sin)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x (T, C) whole on every rank; attn (H/N, T, D) this rank's heads. Returns (T, C)."""
        t_len = x.shape[0]
        h = x + self.o_proj(attn.transpose(0, 1).reshape(t_len, -1))          # all-reduce 1
        m = s06.rms_norm(h, self.local.post_attention_norm, self.config.norm_eps)
        gate, up = self.gate_up_proj(m).chunk(2, dim=-1)                    # (T, I/N) each
        return h + self.down_proj(F.silu(gate) * up)                        # all-reduce 2


class TPTransformer(s06.TorchTransformer):
    """Rank r of N's share of S06's `TorchTransformer` (Qwen3 / Llama): the same model, so the
    same class, holding a share. Its interface is S06's: config (the rank's: `rank_config`),
    device, dtype, attention_impl, blocks, cos, sin, embed_positions (None), vocab_size (V),
    `embed_ids` (vocabulary-parallel), `run` (S06's, inherited), `head` (logits on rank 0,
    None elsewhere); so S12's and S17's runners and S09's processor take it unchanged.
    full_config is the checkpoint's; comm the rank's communicator.

    state: the rank's tensors by HF name, already sliced (`load_shard`, `shard_state_dict`).
    Raises ParameterError (`check_tensor_parallel`) and S03's CheckpointError for a tensor
    missing or of the wrong shape."""

    def __init__(self, config: s03.TransformerConfig, state: Mapping[str, torch.Tensor],
                 comm: Communicator, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, attention: str = "manual"):
        nn.Module.__init__(self)         # S06's __init__ builds the whole model: not this
        if attention not in s06.ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {s06.ATTENTION_IMPLS} (got {attention!r})")
        self.full_config, self.comm = config, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.config = rank_config(config, self.world_size)
        self.device, self.dtype, self.attention_impl = torch.device(device), dtype, attention
        expected = shard_shapes(config, self.rank, self.world_size)
        for name, shape in expected.items():
            if name not in state:
                raise s03_checkpoint.MissingTensorError(f"rank {self.rank}: {name} is missing")
            if tuple(state[name].shape) != shape:
                raise s03_checkpoint.CheckpointError(
                    f"rank {self.rank}: {name} has shape {tuple(state[name].shape)}, its "
                    f"shard should be {shape}")
        w = {k: v.detach().float().cpu().numpy() for k, v in state.items()}
        param = lambda name: s06._param(w[name], self.device, dtype)    # noqa: E731
        self.embed_tokens = param("model.embed_tokens.weight")           # (V/N, C)
        self.embed_positions = None
        self.embedding = VocabParallelEmbedding(self.embed_tokens, config.vocab_size,
                                                self.rank, self.world_size, comm)
        self.blocks = nn.ModuleList(
            TPQwen3Block(s06.Qwen3Block(self.config, s03_checkpoint.strip_prefix(
                w, f"model.layers.{i}."), self.device, dtype), comm)
            for i in range(config.num_hidden_layers))
        self.final_norm = param("model.norm.weight")
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else param("lm_head.weight"))                     # (V/N, C)
        self.lm_head_parallel = ParallelLMHead(self.lm_head, comm)
        self.cos, self.sin = s06.rope_tables(config, self.device, dtype)

    @property
    def vocab_size(self) -> int:
        return self.full_config.vocab_size

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 (N,) -> (N, C), the whole embedding on every rank (one all-reduce)."""
        return self.embedding(ids)

    def head(self, x: torch.Tensor) -> torch.Tensor | None:
        """Final norm and the vocabulary-parallel head: (T, C) -> float32 (T, V) on rank 0."""
        return self.lm_head_parallel(s06.rms_norm(x, self.final_norm, self.config.norm_eps))

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """Every position of one sequence, no cache (S06's `run` then `head`): float32
        (T, V) on rank 0, None elsewhere. Raises ValueError as S06's `check_ids`."""
        return self.head(self.run(self.check_ids(token_ids), 0))

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (each tensor once; the RoPE tables not counted)."""
        seen = {id(p): p for p in self.parameters()}
        return sum(p.numel() * p.element_size() for p in seen.values())


# ---------------------------------------------------------------------------------------------
# Loading a rank's share
# ---------------------------------------------------------------------------------------------

def shard_state_dict(config: s03.TransformerConfig, read: Callable, rank: int,
                     world_size: int) -> dict[str, torch.Tensor]:
    """Rank r's tensors by HF name. read(name, index) returns the full tensor `name` indexed
    by `index` (a tuple of slices), reading no more than that slice when it can."""
    check_tensor_parallel(config, world_size)
    out = {}
    for name, shape in s03_checkpoint.expected_tensors(config).items():
        out[name] = read(name, shard_rule(name, config).slice_of(shape, config, rank, world_size))
    return out


def shard_model(model: s06.TorchTransformer, comm: Communicator) -> TPTransformer:
    """Rank comm.rank's share of an in-memory S06 model (its weights sliced; nothing loaded)."""
    check_tensor_parallel(model.config, comm.world_size)
    state = s06_state_dict(model)
    return TPTransformer(model.config, shard_state_dict(
        model.config, lambda name, index: state[name][index], comm.rank, comm.world_size),
        comm, model.device, model.dtype, model.attention_impl)


def s06_state_dict(model: s06.TorchTransformer) -> dict[str, torch.Tensor]:
    """An S06 Qwen3 / Llama model's weights under their HF names (its fused q/k/v and gate/up
    products split back into the checkpoint's tensors; views, no copy)."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.final_norm}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        parts = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        for n, s in parts.items():
            out[p + f"self_attn.{n}_proj.weight"] = block.qkv_proj[s]
            if block.qkv_bias is not None:
                out[p + f"self_attn.{n}_proj.bias"] = block.qkv_bias[s]
        out[p + "self_attn.o_proj.weight"] = block.o_proj
        if block.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = block.o_bias
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = block.q_norm
            out[p + "self_attn.k_norm.weight"] = block.k_norm
        gate, up = block.gate_up_proj.chunk(2, dim=0)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        if block.gate_up_bias is not None:
            gb, ub = block.gate_up_bias.chunk(2, dim=0)
            out[p + "mlp.gate_proj.bias"], out[p + "mlp.up_proj.bias"] = gb, ub
        out[p + "mlp.down_proj.weight"] = block.down_proj
        if block.down_bias is not None:
            out[p + "mlp.down_proj.bias"] = block.down_bias
        out[p + "input_layernorm.weight"] = block.input_norm
        out[p + "post_attention_layernorm.weight"] = block.post_attention_norm
    return {k: v.detach() for k, v in out.items()}


FLOAT_TAGS = ("F32", "F16", "BF16", "F64")     # safetensors' floating-point dtypes


class SafetensorsReader:
    """Reads slices of a checkpoint directory's tensors (model.safetensors, else the files
    model.safetensors.index.json names: S03's `load_state_dict` rules) through
    `safetensors.safe_open`: the file is memory-mapped and only the slice's bytes are read.
    `bytes_read` counts them. `check(config)` checks the headers only, as S03's
    `check_state_dict` checks the tensors. Raises S03's CheckpointError: no safetensors file,
    a bad index (not a JSON object with a weight_map of file names in the directory, a
    shard missing, a tensor in two shards), a file safetensors cannot open, a tensor no file
    holds."""

    def __init__(self, checkpoint_dir: str | Path):
        from safetensors import safe_open
        self.dir = Path(checkpoint_dir)
        index = self.dir / "model.safetensors.index.json"
        if (self.dir / "model.safetensors").exists():      # S03's order: the single file first
            files = ["model.safetensors"]
        elif index.exists():
            weight_map = s03_checkpoint.read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and f and Path(f).name == f and f not in (".", "..")
                    for f in weight_map.values()):
                raise s03_checkpoint.CheckpointError(
                    f"{index}: needs a \"weight_map\" object mapping each tensor name to a "
                    f"shard file in the checkpoint directory itself")
            files = sorted(set(weight_map.values()))
        else:
            raise s03_checkpoint.CheckpointError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self.handles, self.where = {}, {}
        for f in files:
            if not (self.dir / f).is_file():
                raise s03_checkpoint.CheckpointError(f"{self.dir}: shard {f} listed in "
                                                     f"model.safetensors.index.json is missing")
            try:
                self.handles[f] = safe_open(str(self.dir / f), framework="pt")
            except Exception as err:     # noqa: BLE001 (safetensors' own error type, one message)
                raise s03_checkpoint.CheckpointError(f"{self.dir / f}: not a readable "
                                                     f"safetensors file ({err})") from None
            for name in self.handles[f].keys():
                if name in self.where:
                    raise s03_checkpoint.CheckpointError(
                        f"{self.dir}: tensor {name!r} is stored in more than one shard ({f} "
                        f"and {self.where[name]})")
                self.where[name] = f
        self.bytes_read = 0

    def check(self, config: s03.TransformerConfig) -> None:
        """Every tensor the config needs is there, floating point, of the config's full shape
        (a longer one would be sliced silently), and no other (S03's rules; headers only).
        Raises S03's MissingTensorError and CheckpointError naming the tensor."""
        expected = s03_checkpoint.expected_tensors(config)
        missing = [name for name in expected if name not in self.where]
        if missing:
            raise s03_checkpoint.MissingTensorError(
                f"{self.dir}: missing {len(missing)} tensor(s) the config requires: "
                f"{', '.join(missing[:8])}")
        ignored = ("lm_head.weight",) if config.tie_word_embeddings else ()
        unexpected = sorted(n for n in self.where if n not in expected and n not in ignored
                            and not n.endswith(s03_checkpoint._IGNORED_SUFFIXES))
        if unexpected:
            raise s03_checkpoint.CheckpointError(
                f"{self.dir}: tensor(s) the {config.model_type} config does not account for: "
                f"{', '.join(unexpected[:8])}")
        for name, shape in expected.items():
            info = self.handles[self.where[name]].get_slice(name)
            if info.get_dtype() not in FLOAT_TAGS:
                raise s03_checkpoint.CheckpointError(
                    f"tensor {name} has dtype {info.get_dtype()}: model weights must be "
                    f"floating point ({', '.join(FLOAT_TAGS)})")
            if tuple(info.get_shape()) != shape:
                raise s03_checkpoint.CheckpointError(
                    f"tensor {name} has shape {list(info.get_shape())}, the config implies "
                    f"{list(shape)}")

    def __call__(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self.where:
            raise s03_checkpoint.MissingTensorError(f"{self.dir}: {name} is missing")
        part = self.handles[self.where[name]].get_slice(name)[index]
        self.bytes_read += part.numel() * part.element_size()
        return part


def load_shard(checkpoint_dir: str | Path, comm: Communicator, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, attention: str = "manual"
               ) -> TPTransformer:
    """Rank comm.rank's share of a checkpoint directory, each tensor read as its slice only
    (S03's config reader; safetensors' memory-mapped slices), after the headers are checked
    (`SafetensorsReader.check`). Raises S03's CheckpointError and ParameterError
    (`check_tensor_parallel`)."""
    config = s03_checkpoint.load_config(checkpoint_dir)
    check_tensor_parallel(config, comm.world_size)
    reader = SafetensorsReader(checkpoint_dir)
    reader.check(config)
    state = shard_state_dict(config, reader, comm.rank, comm.world_size)
    model = TPTransformer(config, state, comm, device, dtype, attention)
    model.bytes_read = reader.bytes_read
    return model
