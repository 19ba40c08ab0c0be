r"""S18, the all-reduce between processes: torch.distributed's, and one through shared memory.

What is new since S17
    code/s18_layers.py's layers sum over the ranks through a `Communicator`. Between
    processes there are two here:

    - `DistCommunicator`: torch.distributed's collectives on a process group (gloo on the
      CPU, NCCL on CUDA): the library's, which also works across machines.
    - `ShmCommunicator` over a `ShmArena`: the ranks of one x86 machine sum through shared
      memory, each publishing its message and a round number, every rank adding all N in rank
      order. On this course's CPU a gloo all-reduce of a few bytes costs about half a
      millisecond (two processes waking each other through sockets), more than a small
      model's whole decode step; this one costs about 20 us. vLLM's CPU backend and its CUDA
      custom all-reduce replace the library's for small messages for the same reason.

What it does not handle
    CPUs other than x86 (the ordering argument in `ShmCommunicator` needs x86's store order;
    code/s18_tensor_parallel.py falls back to gloo there), ranks on several machines
    (torch.distributed's), reductions other than a sum.

Run it
    python benchmarks/bench_s18_tensor_parallel.py --sections allreduce

Tests
    tests/test_s18_tensor_parallel.py (every engine test runs the shared-memory all-reduce;
    the gloo path with --disable-custom-all-reduce); the benchmark checks each size's sum.

References
    vLLM's CpuCommunicator and its shared-memory all-reduce (csrc/cpu/shm.cpp), its CUDA
    custom all-reduce (vllm/distributed/device_communicators/custom_all_reduce.py); Intel's
    x86 memory-ordering rules (SDM vol. 3A, 8.2.2); PyTorch's torch.distributed.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from s18_layers import Communicator


class DistCommunicator(Communicator):
    """Collectives through torch.distributed on `group` (None: the default group). Rank 0 of
    the group is the one that receives the gathered logits. At world size 1 the collectives
    are still called (each a no-op), so a one-GPU run exercises NCCL's calls."""

    def __init__(self, group=None):
        import torch.distributed as dist
        super().__init__()
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.count(x)
        self.dist.all_reduce(x, group=self.group)   # at world size 1 too: a smoke test of it
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dst = self.dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


class ShmArena:
    """Shared memory for `ShmCommunicator`s on one machine: data (2, N, capacity) float32, two
    rounds' worth of each rank's message (a round writes slot seq % 2, so a rank may write the
    next round while the others still read this one), and flags (N, 16) int64, each rank's
    latest round in its own 128-byte row (no two ranks' flags share a cache line). abort:
    flags[0, 8], set when the run is being stopped. Made before the ranks are spawned and
    handed to each (torch's multiprocessing shares the tensors, not copies)."""

    def __init__(self, world_size: int, capacity: int = 1 << 20):
        self.world_size, self.capacity = world_size, capacity
        self.data = torch.zeros(2, world_size, capacity, dtype=torch.float32).share_memory_()
        self.flags = torch.zeros(world_size, 16, dtype=torch.int64).share_memory_()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 4 + self.flags.numel() * 8

    def abort(self) -> None:
        self.flags[0, 8] = 1


class ShmCommunicator(Communicator):
    """An all-reduce through shared memory for ranks on one x86 machine (what vLLM's CPU
    backend and its CUDA custom all-reduce do instead of the library's for small messages).

    A round: every rank copies its message into its row of the arena, then publishes the
    round's number in its flag; it waits until every flag shows the round, then reads: the
    all-reduce sums the rows in rank order (every rank the same bits), the gather's rank 0
    concatenates them. Why this is safe on x86 (total store order): the writer's data stores
    become visible before its later flag store, and the reader's loads of the data are not
    moved before its earlier load of the flag, so a rank that sees a flag sees the data
    written before it (the flag is stored by a separate call after `copy_` returns, so no
    compiler moves it either). Why two slots: a rank writes round k + 2 into round k's slot
    only after it has seen every flag at k + 1, and a rank posts k + 1 only after it has read
    round k; so no one is two rounds ahead of a reader. Messages longer than the arena's
    capacity go in several rounds. The wait spins, then yields the core, then sleeps 50 us
    at a time; every few hundred checks it looks at `alive()` (False: a peer is gone), the
    arena's abort flag and timeout_s, and raises RuntimeError naming what it waited for.
    Tensors are summed in float32 and cast back."""

    def __init__(self, arena: ShmArena, rank: int, alive: Callable[[], bool] = lambda: True,
                 timeout_s: float = 600.0):
        super().__init__()
        self.arena, self.rank, self.world_size = arena, rank, arena.world_size
        self.alive, self.timeout_s = alive, timeout_s
        self.flags = arena.flags.numpy()          # a view: reading it costs no torch call
        self.round = int(self.flags[rank, 0])

    def _post_and_wait(self, flat: torch.Tensor) -> int:
        """One round: publish flat (at most capacity elements), wait for every rank's."""
        self.round += 1
        slot = self.round & 1
        self.arena.data[slot, self.rank, :flat.numel()].copy_(flat)
        self.flags[self.rank, 0] = self.round
        spins, start = 0, None
        for r in range(self.world_size):
            while self.flags[r, 0] < self.round:
                spins += 1
                if spins < 2000:
                    continue
                now = time.monotonic()
                start = now if start is None else start
                # yield the core to whoever we wait for; after a millisecond, sleep: more
                # ranks than free cores (a loaded machine) must not spin against each other
                time.sleep(0 if now - start < 1e-3 else 5e-5)
                if spins % 256 == 0:
                    if self.flags[0, 8]:
                        raise RuntimeError("the tensor-parallel run is stopping (abort)")
                    if not self.alive():
                        raise RuntimeError(f"rank {r} is gone: the all-reduce cannot finish")
                    if now - start > self.timeout_s:
                        raise RuntimeError(f"rank {r} did not reach all-reduce round "
                                           f"{self.round} in {self.timeout_s:.0f} s")
        return slot

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.count(x)
        flat = x.reshape(-1)
        out = flat if flat.dtype == torch.float32 else flat.float()
        for lo in range(0, flat.numel(), self.arena.capacity):
            part = out[lo:lo + self.arena.capacity]
            slot = self._post_and_wait(part)
            rows = self.arena.data[slot, :, :part.numel()]
            part.copy_(rows[0])
            for r in range(1, self.world_size):
                part.add_(rows[r])
        if out is not flat:
            flat.copy_(out)
        if x.data_ptr() != flat.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        flat = x.float().reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else None
        for lo in range(0, flat.numel(), self.arena.capacity):
            part = flat[lo:lo + self.arena.capacity]
            slot = self._post_and_wait(part)
            if parts is not None:
                for r in range(self.world_size):
                    parts[r][lo:lo + part.numel()].copy_(self.arena.data[slot, r, :part.numel()])
        if parts is None:
            return None
        return torch.cat([p.view_as(x) for p in parts], dim=-1)
