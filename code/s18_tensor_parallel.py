r"""S18, tensor parallelism: one scheduler, the model split over N processes.

What is new since S17
    code/s18_layers.py splits S06's model over N ranks; this module runs the ranks as
    processes and drives them from S09's engine, the way nano-vllm and vLLM's multiprocessing
    executor do:

    - `TPExecutor` starts ranks 1 .. N-1 as spawned processes (or finds them started by
      `torchrun`), joins them in a torch.distributed process group (gloo on the CPU, NCCL on
      CUDA), and makes this process rank 0. The rendezvous is a TCPStore that rank 0 opens on
      a port the operating system picks on the loopback (so two runs never collide); under
      torchrun it is torchrun's (env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
    - Every rank holds a `Worker`: its share of the model (`load_shard`: its slice of every
      tensor, read from the checkpoint; or handed over for a model in memory), and a runner
      over its own paged KV pool, Hkv/N heads wide (S12's `PagedRunner`, or S17's
      `KernelRunner` with an attention backend).
    - Rank 0 runs the scheduler, the sampler and the output processing (S09's engine,
      unchanged). `TPRunner` is its runner: each step it puts the plan and the token ids the
      step reads into the store (`collective_rpc`), then runs its own share; the workers take
      the plan and run theirs. The forward's all-reduces are the ranks' meeting points, and
      the logits arrive on rank 0 only (the vocabulary-parallel head's gather).
    - Failure leaves nothing behind: a worker that raises writes its error (with its rank)
      to the store and exits; rank 0's next collective fails at once (the peer closed its
      connection), rank 0 reads the error, stops every rank and raises `WorkerError` naming
      the rank. An error or Ctrl-C on rank 0 stops every rank too. The process group and
      the workers go at `shutdown`, at exit, or when the last engine on the executor goes.
    - `build_engine(tensor_parallel_size=N)` builds any paged engine (S13's by default:
      prefix caching and chunked prefill keep working; S17's attention backends on every
      rank) on N ranks; `check_parallel` refuses what cannot run before any process starts.

What it does not handle
    S09's batch-invariant reference (each request alone every step: run it with N = 1); S16's
    static step, worker process and async scheduling's overlap (the step is synchronous);
    S14's quantized weights and S15's draft model (S15's n-gram drafts work: they live on rank
    0); ranks on several machines without torchrun; pipeline, sequence and expert parallelism
    (the chapter's In production). The chapter script, S08's shared main, loads the whole
    model in this process first for its config, device and dtype, and keeps it to the end:
    there rank 0 holds it beside its share (S19's server drops it once the ranks hold theirs;
    `build_engine(checkpoint=...)` itself reads slices only).

Run it
    python code/s18_tensor_parallel.py --tensor-parallel-size 2
    torchrun --standalone --nproc-per-node 2 code/s18_tensor_parallel.py --distributed-init env

Tests
    tests/test_s18_tensor_parallel.py (greedy tokens of N = 2 equal S05's and HF's alone,
    logits within the stated tolerance of N = 1, prefix caching, chunking and preemption under
    N = 2, no process left after shutdown, a worker's error, Ctrl-C; torchrun; the refusals).

References
    nano-vllm's ModelRunner (rank 0 writes each step's call to shared memory, the other ranks
    loop reading it); vLLM's MultiprocExecutor and `collective_rpc` (vllm/v1/executor/
    multiproc_executor.py) and its `tensor_parallel_size`; PyTorch's torch.distributed
    (TCPStore, init_process_group, gloo and NCCL) and torchrun's env:// variables.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import atexit
import dataclasses
import pickle
import signal
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

import s03_checkpoint
import s06_torch as s06
import s13_prefix_caching as s13
import s16_host
import s17_attention as s17
import s18_allreduce
import s18_layers
from s01_generation_loop import ParameterError
from s09_ragged import ModelRunnerOutput
from s12_engine import PagedKVCache, PagedRunner
from s16_worker import TokenWindow, WorkerError, token_window_args

DISTRIBUTED_BACKENDS = ("gloo", "nccl")    # torch.distributed's: CPU tensors, CUDA tensors
DISTRIBUTED_INITS = ("spawn", "env")      # start the ranks here, or find them (torchrun)
STORE_POLL_S = 3600.0                     # a worker's wait for the next call, then again


# ---------------------------------------------------------------------------------------------
# The rules, checked before any process starts
# ---------------------------------------------------------------------------------------------

def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:               # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size: N ranks. backend: "gloo" or "nccl" (None: NCCL on CUDA, gloo on
    the CPU). distributed_init: "spawn" (this process starts ranks 1 .. N-1) or "env" (they
    were started by torchrun; read RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). threads_per_rank:
    torch threads each rank uses. timeout_s: how long (1 to 1e9 s) a collective or the start
    may wait for a rank. disable_custom_all_reduce: use the backend's all-reduce even where the
    shared-memory one runs (vLLM's flag: spawned ranks on one x86 CPU; see
    s18_allreduce.ShmCommunicator).
    Raises ParameterError naming the field."""

    tensor_parallel_size: int = 1
    backend: str | None = None
    distributed_init: str = "spawn"
    threads_per_rank: int = 1
    timeout_s: float = 600.0
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "threads_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParameterError(f"{name} must be an integer >= 1 (got {value!r})", name,
                                     value)
        if self.backend is not None and self.backend not in DISTRIBUTED_BACKENDS:
            raise ParameterError(f"distributed_backend must be one of {DISTRIBUTED_BACKENDS} "
                                 f"(got {self.backend!r})", "distributed_backend", self.backend)
        if self.distributed_init not in DISTRIBUTED_INITS:
            raise ParameterError(f"distributed_init must be one of {DISTRIBUTED_INITS} (got "
                                 f"{self.distributed_init!r})", "distributed_init",
                                 self.distributed_init)
        # torch's store counts its timeout in whole milliseconds, and timedelta overflows
        # past about 1e14 s: from 1 s (no rank starts sooner) to 1e9 s (about 31 years)
        if (not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool)
                or not 1 <= self.timeout_s <= 1e9):
            raise ParameterError(f"timeout_s must be a number of seconds from 1 to 1e9 (got "
                                 f"{self.timeout_s!r})", "timeout_s", self.timeout_s)
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise ParameterError(f"disable_custom_all_reduce must be True or False (got "
                                 f"{self.disable_custom_all_reduce!r})",
                                 "disable_custom_all_reduce", self.disable_custom_all_reduce)


def check_parallel(config, parallel: ParallelConfig, device: torch.device) -> str:
    """Every rule a run of N ranks must keep, before a process starts; returns the backend.
    Raises ParameterError: N that does not divide the heads, the MLP or the vocabulary
    (`check_tensor_parallel`); NCCL without CUDA, or fewer GPUs than ranks; gloo with CUDA
    tensors; on the CPU, more ranks x threads than the cores this process may use (ranks
    that share a core take turns, and every all-reduce waits for the slowest)."""
    s18_layers.check_tensor_parallel(config, parallel.tensor_parallel_size)
    n = parallel.tensor_parallel_size
    backend = parallel.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ParameterError("distributed_backend='nccl' needs CUDA, and torch finds none: "
                                 "use 'gloo' on the CPU", "distributed_backend", backend)
        if device.type != "cuda":
            raise ParameterError("NCCL reduces CUDA tensors: use device 'cuda' with it, or "
                                 "'gloo' on the CPU", "distributed_backend", backend)
        if parallel.distributed_init == "spawn" and torch.cuda.device_count() < n:
            raise ParameterError(f"tensor_parallel_size={n} needs one GPU per rank, and torch "
                                 f"finds {torch.cuda.device_count()}", "tensor_parallel_size", n)
    elif device.type != "cpu":
        raise ParameterError("gloo here runs the ranks on the CPU: use 'nccl' with CUDA",
                             "distributed_backend", backend)
    elif parallel.distributed_init == "spawn":
        cores = usable_cores()
        if n * parallel.threads_per_rank > cores:
            raise ParameterError(
                f"tensor_parallel_size={n} x threads_per_rank={parallel.threads_per_rank} "
                f"needs {n * parallel.threads_per_rank} cores; this process may use {cores}",
                "tensor_parallel_size", n)
    return backend


# ---------------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunnerSpec:
    """What a rank needs to build its runner, the same on every rank: the pool's num_blocks,
    block_size and max_seq_len; S09's attention ("masked" / "loop"); S17's backend."""

    num_blocks: int
    block_size: int
    max_seq_len: int
    attention: str
    attention_backend: str = "gather"
    num_splits: int = 1


def make_runner(model, spec: RunnerSpec):
    """S12's `PagedRunner` over a pool for this model (on a rank: its KV heads), with S17's
    attention backend when not "gather"."""
    cache = PagedKVCache.for_model(model, spec.num_blocks, spec.block_size, spec.max_seq_len)
    runner = PagedRunner(model, cache, False, spec.attention)
    if spec.attention_backend != "gather":
        runner = s17.KernelRunner(runner, s17.make_backend(
            spec.attention_backend, cache, model.config.num_attention_heads, spec.num_splits))
    return runner


class Worker:
    """One rank: its communicator, its share of the model, its runner. The methods are what
    `collective_rpc` calls on every rank at once (vLLM's worker: load_model, a runner with its
    KV cache, execute_model)."""

    def __init__(self, comm: s18_layers.Communicator, device: torch.device, dtype: torch.dtype,
                 attention_impl: str):
        self.comm, self.device, self.dtype = comm, device, dtype
        self.attention_impl = attention_impl
        self.model = self.runner = None

    def load_model(self, source) -> int:
        """source: a checkpoint directory (each rank reads its slices) or a list, by rank, of
        (config, this rank's state dict) for a model handed over in memory. Returns the
        rank's weight bytes."""
        if isinstance(source, (str, Path)):
            self.model = s18_layers.load_shard(source, self.comm, self.device, self.dtype,
                                               self.attention_impl)
        else:
            config, state = source
            self.model = s18_layers.TPTransformer(config, state, self.comm, self.device,
                                                  self.dtype, self.attention_impl)
        return self.model.weight_bytes()

    def init_runner(self, spec: RunnerSpec, runner=None) -> None:
        """A runner over a new pool (rank 0 passes the engine's own, already built)."""
        self.runner = None                       # the old pool goes before the new one
        self.runner = make_runner(self.model, spec) if runner is None else runner

    def execute_model(self, plan, requests: Mapping, windows: bool = False
                      ) -> ModelRunnerOutput:
        """The step on this rank: its logits on rank 0, None on the others. windows: requests
        holds, per request id, S16's `token_window_args` (what a worker is sent: only the
        ids the step reads), made into `TokenWindow`s here."""
        if windows:
            requests = {rid: TokenWindow(*t) for rid, t in requests.items()}
        return self.runner.execute_model(plan, requests)


def _open_store(parallel: ParallelConfig, rank: int, world_size: int, host: str, port: int):
    """The rendezvous store: on rank 0 of a spawned run a new one on an OS-picked port of the
    loopback; otherwise a client of it (under torchrun, of torchrun's agent's when it hosts
    one, as torch's env:// does)."""
    import torch.distributed as dist
    timeout = timedelta(seconds=parallel.timeout_s)
    if parallel.distributed_init == "spawn":
        return dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                             wait_for_workers=False)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(host, port, world_size, is_master=(rank == 0 and not agent),
                         timeout=timeout, wait_for_workers=False)


def shm_supported() -> bool:
    """This CPU runs the shared-memory all-reduce: x86 (its ordering argument needs x86's
    store order; see s18_allreduce.ShmCommunicator)."""
    import platform
    return platform.machine().lower() in ("x86_64", "amd64")


def custom_all_reduce(parallel: ParallelConfig, device: torch.device) -> bool:
    """Whether the ranks sum through shared memory (`ShmCommunicator`): spawned ranks (one
    machine) on an x86 CPU, N > 1, unless disabled."""
    return (parallel.tensor_parallel_size > 1 and parallel.distributed_init == "spawn"
            and device.type == "cpu" and not parallel.disable_custom_all_reduce
            and shm_supported())


def _init_group(parallel: ParallelConfig, backend: str, store, rank: int, world_size: int,
                arena=None, alive: Callable[[], bool] = lambda: True):
    """Join the process group (gloo or NCCL) and, for NCCL, a gloo group beside it for the
    barriers; returns (the layers' communicator: shared memory when an arena is given, else
    the device group's; the CPU group)."""
    import torch.distributed as dist
    timeout = timedelta(seconds=parallel.timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore("s18/pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    if arena is not None:
        return s18_allreduce.ShmCommunicator(arena, rank, alive, parallel.timeout_s), cpu_group
    return s18_allreduce.DistCommunicator(), cpu_group


def _device_of(device: torch.device, rank: int, distributed_init: str) -> torch.device:
    """A rank's device: on CUDA, spawned rank r takes GPU (the given index, default 0) + r;
    under torchrun, LOCAL_RANK (its GPU on its machine)."""
    if device.type != "cuda":
        return device
    if distributed_init == "env":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return torch.device("cuda", (device.index or 0) + rank)


def run_worker(rank: int, world_size: int, parallel: ParallelConfig, backend: str, host: str,
               port: int, device: str, dtype: torch.dtype, attention_impl: str, source,
               arena=None) -> int:
    """Rank `rank` (>= 1): join the group, then run each call rank 0 puts in the store until
    told to stop, or rank 0 is gone. A call that raises: the error and traceback go to the
    store under this rank, and the process exits (its peers' collectives fail at once).
    Returns the exit code (0 stopped by rank 0, 1 failed)."""
    import torch.distributed as dist
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is rank 0's to handle
    torch.set_num_threads(parallel.threads_per_rank)
    if host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")    # gloo's sockets on the loopback
    store = None
    try:
        store = _open_store(parallel, rank, world_size, host, port)
        torch_device = _device_of(torch.device(device), rank, parallel.distributed_init)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        store.set(f"s18/alive/{rank}", b"1")       # next: joining the group (rank 0 waits)
        parent = os.getppid()                      # rank 0, for a spawned rank
        comm, cpu_group = _init_group(parallel, backend, store, rank, world_size, arena,
                                      lambda: os.getppid() == parent)
        worker = Worker(comm, torch_device, dtype, attention_impl)
        if source is not None:                     # spawned: load now (torchrun: when called)
            worker.load_model(source)
            dist.barrier(group=cpu_group)
        number = 0
        while True:
            number += 1
            key = f"s18/call/{number}"
            while True:
                try:
                    store.wait([key], timedelta(seconds=STORE_POLL_S))
                    break
                except dist.DistStoreError as err:
                    if "timeout" not in str(err).lower():
                        return 0                   # the store is gone: rank 0 has stopped
            method, args = pickle.loads(store.get(key))
            if method == "shutdown":
                break
            getattr(worker, method)(*args)
            if method != "execute_model":          # its forward's collectives are the meeting
                dist.barrier(group=cpu_group)
        dist.destroy_process_group()
        return 0
    except BaseException as err:                   # noqa: BLE001 (reported, then exit)
        if store is not None:
            try:
                store.set(f"s18/error/{rank}", pickle.dumps((repr(err), traceback.format_exc())))
            except Exception:                      # noqa: BLE001 (the store is gone too)
                pass
        return 1


def _spawned_worker(*args) -> None:
    code = run_worker(*args)
    sys.stdout.flush()
    os._exit(code)        # no interpreter teardown racing the group's sockets


# ---------------------------------------------------------------------------------------------
# Rank 0: the executor
# ---------------------------------------------------------------------------------------------

# The executor of this process, if any (one process group per process), held weakly: an
# engine's own executor goes, ranks and all, when the engine is collected.
_ACTIVE: list[weakref.ref] = []


class TPExecutor:
    """Ranks 0 .. N-1 of one model; this process is rank 0 (see the module docstring).

    source: a checkpoint directory (every rank reads only its slices) or an S06
    `TorchTransformer` in memory (rank 0 slices it; each worker gets its shard through shared
    memory when spawned). device: "cpu" or "cuda" (rank r on cuda:r); device and dtype default
    to an in-memory model's own. parallel: a `ParallelConfig` (this process, rank 0, runs
    threads_per_rank torch threads until the executor shuts down). `collective_rpc(method,
    *args)` calls a `Worker` method on every rank and returns rank 0's result;
    `attach(engine)` gives a built engine (rank 0's) to the ranks; `shutdown()` stops them,
    idempotent, also at exit. Raises ParameterError for what `check_parallel` refuses, for
    arguments of the wrong type or value and for a second live executor in this process;
    S03's CheckpointError for a checkpoint whose headers break S03's rules
    (`SafetensorsReader.check`), all before any process starts; WorkerError
    when a rank fails to start or fails in a call (naming it; every rank is then stopped)."""

    def __init__(self, source, parallel: ParallelConfig = ParallelConfig(2),
                 device: str | None = None, dtype: str | torch.dtype | None = None,
                 attention: str = "manual"):
        import torch.distributed as dist
        if not isinstance(parallel, ParallelConfig):
            raise ParameterError(f"parallel must be a ParallelConfig (got {parallel!r})",
                                 "parallel")
        if (not isinstance(source, (str, Path, s06.TorchTransformer))
                or isinstance(source, s18_layers.TPTransformer)):
            raise ParameterError(f"source must be a checkpoint directory (or hub id) or a "
                                 f"whole S06 TorchTransformer (got {type(source).__name__})",
                                 "source")
        if attention not in s06.ATTENTION_IMPLS:
            raise ParameterError(f"attention must be one of {s06.ATTENTION_IMPLS} (got "
                                 f"{attention!r})", "attention")
        if isinstance(source, s06.TorchTransformer):   # by default, the model's own
            device = str(source.device) if device is None else device
            dtype = source.dtype if dtype is None else dtype
        if isinstance(dtype, torch.dtype):
            names = [k for k, v in s06.DTYPES.items() if v == dtype]
            if not names:
                raise ParameterError(f"dtype must be one of torch.{', torch.'.join(s06.DTYPES)}"
                                     f" (got {dtype})", "dtype")
            dtype = names[0]
        torch_device, torch_dtype = s06.resolve_device_dtype(device, dtype)
        if isinstance(source, s06.TorchTransformer):
            config = source.config
        else:
            source = s03_checkpoint.resolve_checkpoint(source)
            config = s03_checkpoint.load_config(source)
        backend = check_parallel(config, parallel, torch_device)
        if not isinstance(source, s06.TorchTransformer):   # headers only: refused here, not
            s18_layers.SafetensorsReader(source).check(config)   # by every rank once spawned
        if any(ref() is not None for ref in _ACTIVE) or dist.is_initialized():
            raise ParameterError("one tensor-parallel executor per process (it owns the "
                                 "process group): shut the other down first",
                                 "tensor_parallel_size")
        self.parallel, self.backend, self.config = parallel, backend, config
        self.world_size = n = parallel.tensor_parallel_size
        self.processes: list = []
        self.store = self.arena = None
        self._unset_ifname = False
        self._number = 0
        self._dead: str | None = None
        self._engine_runner = lambda: None       # a weak reference to the attached runner
        if parallel.distributed_init == "env":
            env = {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                       "MASTER_PORT")}
            if not env["MASTER_ADDR"] or not all(env[k].isdigit() for k in
                                                 ("RANK", "WORLD_SIZE", "MASTER_PORT")):
                raise ParameterError(f"distributed_init='env' reads torchrun's variables, and "
                                     f"they are not all set ({env}): start it with torchrun",
                                     "distributed_init")
            if int(env["RANK"]) != 0 or int(env["WORLD_SIZE"]) != n:
                raise ParameterError(f"distributed_init='env' builds the executor on rank 0 "
                                     f"of {n} (RANK={env['RANK']}, WORLD_SIZE="
                                     f"{env['WORLD_SIZE']}): the other ranks run run_worker",
                                     "distributed_init")
            host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        else:
            host, port = "127.0.0.1", 0
            if "GLOO_SOCKET_IFNAME" not in os.environ:    # gloo on the loopback; unset again
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"   # at shutdown
                self._unset_ifname = True
        _ACTIVE.append(weakref.ref(self))
        self._threads_before = torch.get_num_threads()   # rank 0 is this process: restored
        torch.set_num_threads(parallel.threads_per_rank)  # at shutdown
        self._finalizer = weakref.finalize(self, _stop_ranks, self.__dict__)
        atexit.register(self._finalizer)
        try:
            self.store = _open_store(parallel, 0, n, host, port)
            shards = None
            if isinstance(source, s06.TorchTransformer):   # each rank's slices, made here
                full = s18_layers.s06_state_dict(source)
                shards = [(config, s18_layers.shard_state_dict(
                    config, lambda name, index: full[name][index].clone(), r, n))
                    for r in range(n)]
                for _, state in shards[1:]:
                    for tensor in state.values():
                        tensor.share_memory_()
            worker_source = str(source) if shards is None else shards
            if parallel.distributed_init == "env" and shards is not None:
                raise ParameterError("under torchrun every rank reads its shard from a "
                                     "checkpoint directory: pass its path", "distributed_init")
            self.arena = (s18_allreduce.ShmArena(n) if custom_all_reduce(parallel, torch_device)
                          else None)
            if parallel.distributed_init == "spawn" and n > 1:
                self._spawn(host, self.store.port, torch_device, torch_dtype, attention,
                            worker_source)
            torch_device = _device_of(torch_device, 0, parallel.distributed_init)
            if torch_device.type == "cuda":
                torch.cuda.set_device(torch_device)
            self._wait_alive()
            comm, self.cpu_group = _init_group(parallel, backend, self.store, 0, n, self.arena,
                                               self._workers_alive_check())
            self.worker = Worker(comm, torch_device, torch_dtype, attention)
            if parallel.distributed_init == "env":   # torchrun's ranks wait for their call
                self.weight_bytes = self.collective_rpc("load_model", worker_source)
            else:
                self.weight_bytes = self.worker.load_model(
                    source if shards is None else shards[0])
                if n > 1:
                    dist.barrier(group=self.cpu_group)
        except BaseException as err:
            self._fail(err)

    @property
    def model(self) -> s18_layers.TPTransformer:
        """Rank 0's share of the model."""
        return self.worker.model

    def _spawn(self, host, port, device, dtype, attention, source) -> None:
        import torch.multiprocessing as mp
        context = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            process = context.Process(
                target=_spawned_worker, name=f"s18-rank{rank}", daemon=True,
                args=(rank, self.world_size, self.parallel, self.backend, host, port,
                      str(device), dtype, attention,
                      source if isinstance(source, str) else source[rank], self.arena))
            process.start()
            self.processes.append(process)

    def _workers_alive_check(self) -> Callable[[], bool]:
        """The spawned ranks' liveness as a function that does not hold the executor (the
        finalizer keeps what it holds: a reference back would keep the executor forever)."""
        processes = self.processes
        return lambda: all(process.is_alive() for process in processes)

    def _wait_alive(self) -> None:
        """Wait until every spawned rank has reached the store (or report one that died)."""
        deadline = time.monotonic() + self.parallel.timeout_s
        for rank, process in enumerate(self.processes, start=1):
            while not self.store.check([f"s18/alive/{rank}"]):
                if not process.is_alive():
                    raise WorkerError(f"rank {rank} did not start (exit code "
                                      f"{process.exitcode})" + self._errors_text())
                if time.monotonic() > deadline:
                    raise WorkerError(f"rank {rank} did not start in timeout_s="
                                      f"{self.parallel.timeout_s:g} s")
                time.sleep(0.01)

    def collective_rpc(self, method: str, *args, local_args: tuple | None = None):
        """Call Worker.method on every rank (rank 0 with local_args when given: the real
        requests where the workers get their token windows); returns rank 0's result. Every
        call ends where all ranks meet (the forward's collectives, or a barrier), so no call
        overtakes the one before it. Raises WorkerError (every rank stopped) on a failure."""
        import torch.distributed as dist
        if self._dead is not None:
            raise WorkerError(f"the tensor-parallel executor has stopped ({self._dead}): "
                              "build a new engine")
        try:
            self._number += 1
            if self.world_size > 1:
                self.store.set(f"s18/call/{self._number}", pickle.dumps((method, args)))
                if self._number > 1:
                    self.store.delete_key(f"s18/call/{self._number - 1}")
            result = getattr(self.worker, method)(*(args if local_args is None else local_args))
            if method != "execute_model" and self.world_size > 1:
                dist.barrier(group=self.cpu_group)
            return result
        except BaseException as err:
            self._fail(err)

    def _errors_text(self) -> str:
        """The errors the workers wrote to the store, as text (empty when none)."""
        if self.store is None:
            return ""
        lines = []
        for rank in range(1, self.world_size):
            key = f"s18/error/{rank}"
            try:
                if self.store.check([key]):
                    what, trace = pickle.loads(self.store.get(key))
                    lines.append(f"\nrank {rank} raised {what}\n{trace}")
            except Exception:                       # noqa: BLE001 (store gone: nothing to add)
                pass
        return "".join(lines)

    def _fail(self, err: BaseException):
        """Stop every rank and raise: the worker's error when one wrote it (naming its rank;
        a worker writes it before it exits, and rank 0 notices the exit, so it is there),
        else err itself (rank 0's own, Ctrl-C included)."""
        text = self._errors_text()
        dead = [f"rank {r} exit code {p.exitcode}" for r, p in     # gone before we stop them
                enumerate(self.processes, start=1) if p.exitcode not in (None, 0)]
        if self.arena is not None:
            self.arena.abort()
        for process in self.processes:              # out of step now: stop them at once
            if process.is_alive():
                process.kill()
        self._dead = (text.strip().splitlines()[0] if text else
                      ", ".join(dead) if dead else f"rank 0: {err!r}")
        self.shutdown()
        if text:
            raise WorkerError(f"a tensor-parallel rank failed:{text}") from err
        if isinstance(err, (KeyboardInterrupt, ParameterError, WorkerError)):
            raise err
        if dead:
            raise WorkerError(f"a tensor-parallel rank is gone ({', '.join(dead)}): "
                              f"{err}") from err
        raise err

    def attach(self, engine):
        """Give a built paged engine (rank 0's share; S12-S17's builders) to every rank:
        each builds the same runner over its own pool, and the engine's runner becomes a
        `TPRunner`. The engine attached before it stops working. Returns the engine."""
        inner = engine.runner
        if isinstance(inner, TPRunner):
            raise ParameterError("this engine already runs on a tensor-parallel executor: "
                                 "attach each engine once (build_engine(..., executor=...) "
                                 "does)", "engine")
        kernel = isinstance(inner, s17.KernelRunner)
        paged = inner.inner if kernel else inner
        if not isinstance(paged, PagedRunner) or paged.model is not self.model:
            raise ParameterError("a tensor-parallel engine is built from the executor's model "
                                 "by S12-S17's paged builders", "tensor_parallel_size")
        if paged.batch_invariant:
            raise ParameterError("the batch-invariant reference runs each request alone every "
                                 "step: use tensor_parallel_size=1 for it",
                                 "tensor_parallel_size")
        cache = paged.cache
        spec = RunnerSpec(cache.num_blocks, cache.block_size, cache.max_seq_len,
                          paged.attention, inner.backend.name if kernel else "gather",
                          getattr(inner.backend, "num_splits", 1) if kernel else 1)
        previous = self._engine_runner()
        if previous is not None:
            previous.retired = True
        self.collective_rpc("init_runner", spec, local_args=(spec, inner))
        engine.runner = runner = TPRunner(self, inner)
        self._engine_runner = weakref.ref(runner)
        return engine

    def execute_model(self, plan, requests: Mapping) -> ModelRunnerOutput:
        """One step on every rank: the workers get the token ids the step reads, rank 0 the
        engine's requests; returns rank 0's output (the logits of the sampling rows)."""
        tokens = token_window_args(plan, requests) if self.world_size > 1 else None
        return self.collective_rpc("execute_model", plan, tokens, True,
                                   local_args=(plan, requests))

    def describe(self) -> str:
        """The ranks in words (the chapter script's and S19's start-up line): "2 ranks (gloo,
        all-reduce by shared memory), weights per rank 2.8 MiB of 5.5 MiB"."""
        full = s18_layers.shard_bytes(self.config, 1, self.model.dtype.itemsize)[0]
        summed = "shared memory" if self.arena is not None else self.backend
        return (f"{self.world_size} ranks ({self.backend}, all-reduce by {summed}), weights "
                f"per rank {self.weight_bytes / 2**20:.1f} MiB of {full / 2**20:.1f} MiB")

    @property
    def comm(self) -> s18_layers.Communicator:
        """Rank 0's communicator: its counts of all-reduces and bytes (every rank does the
        same collectives)."""
        return self.worker.comm

    def shutdown(self) -> None:
        """Stop every rank (a spawned one that does not stop in 10 s is killed) and leave the
        process group. Idempotent."""
        self._finalizer()


def _stop_ranks(state: dict) -> None:
    import torch.distributed as dist
    store, processes = state.get("store"), state.get("processes", [])
    if store is not None and state.get("_dead") is None:
        try:
            store.set(f"s18/call/{state['_number'] + 1}", pickle.dumps(("shutdown", ())))
        except Exception:                           # noqa: BLE001 (store already closed)
            pass
    state["_dead"] = state.get("_dead") or "shut down"
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:                           # noqa: BLE001 (a failed group)
            pass
    state["store"] = None
    if state.pop("_unset_ifname", False):
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    if state.get("_threads_before"):
        torch.set_num_threads(state.pop("_threads_before"))
    _ACTIVE[:] = [ref for ref in _ACTIVE
                  if ref() is not None and ref().__dict__ is not state]


class TPRunner:
    """Rank 0's runner in a tensor-parallel engine: `execute_model` runs the step on every
    rank through the executor; model, cache, vocab_size, batch_invariant and attention are
    rank 0's runner's (its share: the pool holds its KV heads). `shutdown` stops the executor
    when the engine's builder made it (not one passed in: its maker stops it)."""

    def __init__(self, executor: TPExecutor, inner):
        self.executor, self.inner = executor, inner
        self.retired, self.owns_executor = False, False

    model = property(lambda self: self.inner.model)
    cache = property(lambda self: self.inner.cache)
    vocab_size = property(lambda self: self.inner.vocab_size)
    batch_invariant = property(lambda self: self.inner.batch_invariant)
    attention = property(lambda self: self.inner.attention)
    tensor_parallel_size = property(lambda self: self.executor.world_size)

    def execute_model(self, plan, requests: Mapping) -> ModelRunnerOutput:
        if self.retired:
            raise WorkerError("a newer engine was attached to this tensor-parallel executor; "
                              "this one no longer runs")
        return self.executor.execute_model(plan, requests)

    def shutdown(self) -> None:
        if self.owns_executor:
            self.executor.shutdown()


def _check_same_config(model: s06.TorchTransformer, config, parameter: str) -> None:
    """ParameterError unless the ranks' config (an executor's or a checkpoint's) is model's:
    the engine is built on the ranks' model, so another would run in its place silently."""
    if model.config != config:
        differ = [f"{f.name} {getattr(config, f.name)!r}, model's {getattr(model.config, f.name)!r}"
                  for f in dataclasses.fields(config)
                  if getattr(config, f.name) != getattr(model.config, f.name)]
        raise ParameterError(f"{parameter} holds another model than `model` ("
                             f"{'; '.join(differ[:3])}): build both from the same checkpoint",
                             parameter)


def _check_same_weights(model: s06.TorchTransformer, executor: TPExecutor,
                        parameter: str) -> None:
    """ParameterError unless the executor's rank 0 holds model's weights in model's dtype
    (compared: the first rows of its embedding slice; two checkpoints of one config differ
    there)."""
    share = executor.model
    if share.dtype != model.dtype:
        raise ParameterError(f"{parameter}: the ranks hold {share.dtype} weights, model "
                             f"{model.dtype}: build both in one dtype", parameter)
    rows = min(16, share.embed_tokens.shape[0])
    if not torch.equal(share.embed_tokens[:rows].cpu(), model.embed_tokens[:rows].cpu()):
        raise ParameterError(f"{parameter} holds other weights than `model` (their embeddings "
                             f"differ): build both from the same checkpoint", parameter)


def build_engine(model: s06.TorchTransformer, tokenizer, *, tensor_parallel_size: int = 1,
                 checkpoint: str | Path | None = None, executor: TPExecutor | None = None,
                 distributed_backend: str | None = None, threads_per_rank: int = 1,
                 disable_custom_all_reduce: bool = False,
                 attention_backend: str = "gather", num_splits: int = 1,
                 builder: Callable = s13.build_engine, **options):
    """The engine `builder` makes (S13's by default; any of S12-S15's paged builders) with
    S17's attention backend, its model split over tensor_parallel_size ranks.

    N = 1 and no executor: S17's `build_engine` exactly (one process). Otherwise the model
    runs on a `TPExecutor`: executor when given (its ranks keep their shards and are reused:
    each engine built on it gets new pools; its maker shuts it down), else a new one that the
    engine owns (`s16_host.shutdown_engine` or exit stops it), whose ranks read their shards
    from checkpoint (a directory or hub id; None: model's weights, sliced here and handed
    over through shared memory). distributed_backend, threads_per_rank,
    disable_custom_all_reduce: `ParallelConfig`'s (checked at N = 1 too; with executor, they
    and checkpoint are its own: given otherwise, refused). options: the builder's. Raises
    ParameterError naming the rule (`ParallelConfig`'s and `check_parallel`'s, batch_invariant,
    N different from the executor's, model not the one the ranks hold) before any process
    starts, S03's CheckpointError (`TPExecutor`), and WorkerError when a rank fails."""
    parallel = ParallelConfig(tensor_parallel_size, distributed_backend, "spawn",
                              threads_per_rank,
                              disable_custom_all_reduce=disable_custom_all_reduce)
    if executor is not None and not isinstance(executor, TPExecutor):
        raise ParameterError(f"executor must be a TPExecutor (got {type(executor).__name__})",
                             "executor")
    if isinstance(model, s18_layers.TPTransformer):   # alone, its collectives wait forever
        raise ParameterError("model is one rank's share (a TPTransformer): pass the whole S06 "
                             "model (and executor=, to reuse the executor's ranks)", "model")
    if executor is None and tensor_parallel_size == 1:
        return s17.build_engine(model, tokenizer, attention_backend=attention_backend,
                                num_splits=num_splits, builder=builder, **options)
    if not isinstance(model, s06.TorchTransformer):
        raise ParameterError(f"model must be an S06 TorchTransformer (got "
                             f"{type(model).__name__})", "model")
    if options.get("batch_invariant"):
        raise ParameterError("the batch-invariant reference runs each request alone every "
                             "step: use tensor_parallel_size=1 for it", "batch_invariant")
    for name, off in (("quantize", (None,)), ("kv_cache_dtype", ("auto",)),
                      ("draft_model", (None,)), ("speculative", (None, "ngram"))):
        if options.get(name, off[0]) not in off:     # rank 0 would change alone
            raise ParameterError(f"{name}={options[name]!r} changes rank 0's model or pool "
                                 f"only (S14's quantization, S15's draft model are not split "
                                 f"over ranks): use tensor_parallel_size=1 for it", name)
    owned = executor is None
    if owned:
        if checkpoint is not None:
            _check_same_config(model, s03_checkpoint.load_config(
                s03_checkpoint.resolve_checkpoint(checkpoint)), "checkpoint")
        executor = TPExecutor(model if checkpoint is None else checkpoint, parallel,
                              str(model.device), model.dtype, model.attention_impl)
    else:
        if tensor_parallel_size not in (1, executor.world_size):
            raise ParameterError(f"tensor_parallel_size={tensor_parallel_size}, and the "
                                 f"executor runs {executor.world_size} ranks",
                                 "tensor_parallel_size")
        for name, given in (("checkpoint", checkpoint is not None),
                            ("distributed_backend", distributed_backend not in
                             (None, executor.backend)),
                            ("threads_per_rank", threads_per_rank not in
                             (1, executor.parallel.threads_per_rank)),
                            ("disable_custom_all_reduce", disable_custom_all_reduce
                             and executor.arena is not None)):
            if given:       # it would be ignored: the executor's ranks are set up already
                raise ParameterError(f"{name} sets up a new executor's ranks; the executor "
                                     f"given was set up without it: drop it, or make the "
                                     f"executor with it", name)
        _check_same_config(model, executor.config, "executor")
    try:
        _check_same_weights(model, executor, "checkpoint" if owned else "executor")
        engine = s17.build_engine(executor.model, tokenizer, attention_backend=attention_backend,
                                  num_splits=num_splits, builder=builder, **options)
        executor.attach(engine)
    except BaseException:
        if owned:
            executor.shutdown()
        raise
    engine.runner.owns_executor = owned
    return engine


# ---------------------------------------------------------------------------------------------
# The chapter script
# ---------------------------------------------------------------------------------------------

def add_parallel_arguments(parser) -> None:
    """--tensor-parallel-size (vLLM's flag), --distributed-backend, --threads-per-rank (this
    script and S19's server); --distributed-init for the script."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many ranks (processes) (default: "
                             "%(default)s: one process, no split)")
    parser.add_argument("--distributed-backend", choices=DISTRIBUTED_BACKENDS, default=None,
                        help="torch.distributed's backend (default: nccl on CUDA, gloo on the "
                             "CPU)")
    parser.add_argument("--threads-per-rank", type=int, default=1,
                        help="torch threads each rank uses, rank 0 (this process) included, "
                             "with --tensor-parallel-size > 1 (default: %(default)s)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="sum through torch.distributed's backend even where the ranks "
                             "could sum through shared memory (spawned ranks on one x86 CPU)")


def check_parallel_arguments(parser, args) -> None:
    """Usage errors before any model loads or process starts, each naming its flag."""
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be >= 1 (got {args.tensor_parallel_size})")
    if args.threads_per_rank < 1:
        parser.error(f"--threads-per-rank must be >= 1 (got {args.threads_per_rank})")
    if getattr(args, "distributed_init", "spawn") == "env":
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if not os.environ.get(name) or (name != "MASTER_ADDR"
                                                   and not os.environ[name].isdigit())]
        if missing:
            parser.error(f"--distributed-init env reads torchrun's RANK, WORLD_SIZE, "
                         f"MASTER_ADDR and MASTER_PORT, and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set (or not a number): "
                         f"start it with torchrun --nproc-per-node N (or drop "
                         f"the flag)")
        world = int(os.environ["WORLD_SIZE"])
        if args.tensor_parallel_size not in (1, world):
            parser.error(f"--tensor-parallel-size {args.tensor_parallel_size}: torchrun "
                         f"started {world} ranks (WORLD_SIZE); drop the flag or make them "
                         f"equal")
        args.tensor_parallel_size = world             # the ranks torchrun started
    elif args.tensor_parallel_size == 1:
        for flag, given in (("--distributed-backend", args.distributed_backend is not None),
                            ("--threads-per-rank", args.threads_per_rank > 1),
                            ("--disable-custom-all-reduce", args.disable_custom_all_reduce)):
            if given:       # it would be ignored: one process, no ranks to set up
                parser.error(f"{flag} sets up the ranks of --tensor-parallel-size N > 1; "
                             "with one process it does nothing: drop it")
        return
    if getattr(args, "threads", 1) not in (1, args.threads_per_rank):
        parser.error(f"--threads {args.threads}: with --tensor-parallel-size every rank, this "
                     f"process included, runs --threads-per-rank torch threads: use that flag")
    if getattr(args, "batch_invariant", False):
        parser.error("--batch-invariant runs each request alone every step: use it with "
                     "--tensor-parallel-size 1")
    if getattr(args, "executor_backend", "uni") == "mp" or getattr(args, "async_scheduling",
                                                                    False):
        parser.error("--tensor-parallel-size runs its own ranks, step by step: use it without "
                     "--executor-backend mp and --async-scheduling")
    if getattr(args, "compile", False) or getattr(args, "cuda_graphs", False):
        parser.error("--compile and --cuda-graphs run S16's static step, which is not split "
                     "over ranks: use them with --tensor-parallel-size 1")
    if getattr(args, "kv_cache_dtype", "auto") != "auto" or getattr(args, "quantize", None):
        parser.error("--quantize and --kv-cache-dtype (S14's quantized weights and 8-bit KV "
                     "pool) are not split over ranks: use them with --tensor-parallel-size 1")
    if getattr(args, "speculative", None) == "draft" or getattr(args, "draft_model", None):
        parser.error("--speculative draft (S15's draft model) is not split over ranks: use "
                     "--speculative ngram with --tensor-parallel-size")
    try:
        device = s06.resolve_device_dtype(args.device)[0]
        model = getattr(args, "model", None) or s06.s03.BUNDLED_MODEL_DIR
        config = s03_checkpoint.load_config(s03_checkpoint.resolve_checkpoint(model))
        parallel = ParallelConfig(args.tensor_parallel_size, args.distributed_backend,
                                  getattr(args, "distributed_init", "spawn"),
                                  args.threads_per_rank)
        check_parallel(config, parallel, device)
    except ParameterError as err:
        flag = f"--{err.parameter.replace('_', '-')}: " if err.parameter else ""
        parser.error(f"{flag}{err}")
    except ValueError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import s08_cli
    import s09_trace
    import s12_engine as s12

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--distributed-init", choices=DISTRIBUTED_INITS, default="spawn")
    known, _ = pre.parse_known_args(argv)
    rank = os.environ.get("RANK", "0")
    if known.distributed_init == "env" and rank.isdigit() and int(rank) != 0:
        return _torchrun_worker(argv, int(rank))
    holder: dict = {}

    def add_arguments(parser) -> None:
        add_parallel_arguments(parser)
        parser.add_argument("--distributed-init", choices=DISTRIBUTED_INITS, default="spawn",
                            help="'spawn': this process starts the other ranks; 'env': they "
                                 "were started by torchrun (default: %(default)s)")
        s17.add_attention_arguments(parser)
        s12.add_paged_arguments(
            parser, "KV blocks in each rank's pool, block 0 (the null block) included "
                    "(default: max-num-seqs x the context's blocks + 1)")

    def check(parser, args) -> None:
        s12.check_paged_arguments(parser, args)
        s17.check_attention_arguments(parser, args)
        check_parallel_arguments(parser, args)

    def options(args) -> dict:
        opts = dict(s12.paged_options(args), enable_kv_cache_events=False,
                    attention_backend=args.attention_backend, num_splits=args.num_splits,
                    tensor_parallel_size=args.tensor_parallel_size,
                    checkpoint=s03_checkpoint.resolve_checkpoint(args.model),
                    distributed_backend=args.distributed_backend,
                    threads_per_rank=args.threads_per_rank,
                    disable_custom_all_reduce=args.disable_custom_all_reduce)
        if args.distributed_init == "env":
            parallel = ParallelConfig(int(os.environ.get("WORLD_SIZE", "1")),
                                      args.distributed_backend, "env", args.threads_per_rank)
            holder["executor"] = TPExecutor(opts.pop("checkpoint"), parallel, args.device,
                                            args.dtype)    # its ranks read the checkpoint
            opts["executor"] = holder["executor"]
        return opts

    def describe(engine, tracers) -> str:
        runner = engine.runner
        cache = runner.cache
        if isinstance(runner, TPRunner):
            kv = runner.model.config.num_key_value_heads
            split = (f"{runner.executor.describe()}, each rank's pool "
                     f"{cache.nbytes / 2**20:.1f} MiB ({kv} KV head{'s' * (kv != 1)})")
        else:
            split = "1 rank (no split)"
        return (f"tensor parallel: {split}; KV pool of {cache.num_blocks} blocks of "
                f"{cache.block_size}")

    def build(*args, **kwargs):
        holder["engine"] = build_engine(*args, **kwargs)
        return holder["engine"]

    try:
        s08_cli.chapter_main(s08_cli.Chapter(
            "Chapter 18: tensor parallelism: the model split over N processes "
            "(torch.distributed), one scheduler on rank 0 driving them.",
            build, add_arguments=add_arguments, options=options,
            tracers=lambda engine: [s09_trace.StepTracer()], describe=describe,
            table=lambda run, tracers: s09_trace.format_occupancy_table(tracers[0].records),
            check=check), argv)
    finally:
        if "engine" in holder:
            s16_host.shutdown_engine(holder["engine"])   # the ranks it started (torchrun's: below)
        if "executor" in holder:
            holder["executor"].shutdown()


def _torchrun_worker(argv, rank: int) -> int:
    """A rank torchrun started other than 0: join rank 0 and serve its calls. A flag that
    breaks a rule: its error in one line and exit code 2, no traceback (rank 0 checks the
    same flags and prints the usage error, unless torchrun stops it first)."""
    import argparse
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--model", default=str(s06.s03.BUNDLED_MODEL_DIR))
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--distributed-backend", default=None)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    try:
        args, _ = parser.parse_known_args(argv)
        device, dtype = s06.resolve_device_dtype(args.device, args.dtype)
        world = int(os.environ["WORLD_SIZE"])
        parallel = ParallelConfig(world, args.distributed_backend, "env", args.threads_per_rank)
        config = s03_checkpoint.load_config(s03_checkpoint.resolve_checkpoint(args.model))
        backend = check_parallel(config, parallel, device)
    except (argparse.ArgumentError, ValueError) as err:   # ParameterError, CheckpointError
        print(f"{Path(sys.argv[0]).name}: rank {rank}: error: {err}", file=sys.stderr)
        return 2
    return run_worker(rank, world, parallel, backend, os.environ["MASTER_ADDR"],
                      int(os.environ["MASTER_PORT"]), str(device), dtype, "manual", None)


if __name__ == "__main__":
    sys.exit(main())
