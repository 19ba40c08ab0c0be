"""S17, the paged attention kernel for the CPU: code/s17_paged_attention.c built at first use
and called through ctypes.

What is new
    S12 reads a request's keys by gathering its blocks into a copy, every layer of every step.
    `paged_attention` calls a C function that walks the block tables itself and reads the pool
    in place, one block at a time with the online softmax (code/s17_paged_attention.c; the
    algorithm is `s17_flash.paged_attention`'s). One call per layer covers the whole ragged
    batch, decodes and prompt chunks together, so the runner has no per-request loop either.

    Building: `load()` compiles the C file once with the C compiler ($CC, else gcc, cc,
    clang) into a shared library in a cache directory ($COURSE_CACHE_DIR, else
    $XDG_CACHE_HOME/llm-course, else ~/.cache/llm-course), named by a hash of the source and
    the flags, so a changed source is rebuilt and two processes building at once do not clash
    (each writes its own file and renames it into place). About a second with gcc; OpenMP is
    used when the compiler has it (the work units run on torch.get_num_threads() threads).
    ctypes releases the GIL during the call.

What it does not handle
    float32 only (the course's CPU dtype; a bfloat16 kernel would convert each block); the
    pool must be contiguous (S12's is); S14's 8-bit pool is not read (build with the gather
    backend). Speculative decoding's draft rows need nothing new: to the kernel they are a
    request's new tokens like a prompt chunk's.

Run it
    python code/s17_attention.py --attention-backend paged

Tests
    tests/test_s17_cpu.py: against torch's SDPA over S12's gather (shuffled blocks, partial last
    blocks, GQA, chunks after cached keys, one-token requests), poisoned outputs, strided q and
    out, threads; bad input named by rule.

References
    Kwon et al., PagedAttention (SOSP 2023); Dao et al., FlashAttention (2022); Python's ctypes
    documentation (a foreign function releases the GIL while it runs).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

import s01_generation_loop as s01

ParameterError = s01.ParameterError

SOURCE = Path(__file__).with_name("s17_paged_attention.c")
CC_NAMES = ("gcc", "cc", "clang")
# -O3 and -march=native: vector instructions of this machine (the library is built where it
# runs). The four math flags let the compiler vectorise the dot products' sums (reassociation)
# without -ffast-math (which assumes no value is infinite, and with gcc 12 makes a shared
# library switch the whole process to flush-to-zero when it is loaded).
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
MAX_HEAD_DIM = 1024          # the kernel keeps G x D floats per work unit on the stack
MAX_BLOCK_SIZE = 1024        # and G x block_size scores
MAX_STACK_BYTES = 256 * 1024  # G (2 D + block_size + 2) floats: well inside a thread's stack

_library = None


def find_cc() -> str | None:
    """The C compiler: $CC if set, else the first of gcc, cc, clang on PATH (None: none)."""
    names = [os.environ["CC"]] if os.environ.get("CC") else list(CC_NAMES)
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def host_cpu() -> str:
    """This machine's CPU as the build key sees it (the library is built with -march=native,
    so a cache directory shared with another CPU must not hand it this one's build): the
    architecture, and on Linux the model name and instruction-set flags of /proc/cpuinfo."""
    text = platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return text
    for prefix in ("model name", "flags", "Features"):
        text += next((" " + line for line in lines if line.startswith(prefix)), "")
    return text


def cache_dir() -> Path:
    """Where built libraries go: $COURSE_CACHE_DIR, else $XDG_CACHE_HOME/llm-course, else
    ~/.cache/llm-course."""
    if os.environ.get("COURSE_CACHE_DIR"):
        return Path(os.environ["COURSE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-course"


def build(cc: str, out_dir: Path) -> Path:
    """Compile SOURCE into out_dir (with OpenMP if cc accepts -fopenmp, else without) and
    return the library's path; an existing library of the same source and flags is reused.
    Raises ParameterError with the compiler's message if it fails."""
    source = SOURCE.read_bytes()
    out_dir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for extra in (("-fopenmp",), ()):
        flags = CFLAGS + extra
        key = hashlib.sha256(source + " ".join((cc,) + flags + (host_cpu(),)).encode()
                             ).hexdigest()[:16]
        target = out_dir / f"s17_paged_attention-{key}.so"
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        result = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"],
                                capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(tmp, target)     # atomic: a concurrent build never sees half a file
            return target
        os.unlink(tmp)
        last_error = result.stderr.strip()[-2000:]
    raise ParameterError(f"the paged CPU kernel did not compile with {cc}:\n{last_error}",
                         "attention_backend")


def load() -> ctypes.CDLL:
    """The kernel's library, built on first use (see the module docstring). Raises
    ParameterError ("attention_backend") when no C compiler is found."""
    global _library
    if _library is None:
        cc = find_cc()
        if cc is None:
            raise ParameterError("the paged attention backend on the CPU is a C kernel built at "
                                 "first use: it needs a C compiler (gcc, cc or clang on PATH, "
                                 "or $CC); install one, or use attention_backend='gather'",
                                 "attention_backend")
        lib = ctypes.CDLL(str(build(cc, cache_dir())))
        fn = lib.paged_attention_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                       ctypes.c_float, ptr, i64, i64, ctypes.c_int]
        fn.restype = None
        _library = lib
    return _library


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ParameterError unless the pool is what the kernel reads: two contiguous float32
    CPU tensors of one shape (num_blocks, block_size, Hkv, D), sizes within the kernel's."""
    if k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ParameterError("the paged C kernel runs on the CPU; on CUDA use "
                             "attention_backend='triton'", "device")
    if k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise ParameterError(f"the paged C kernel reads float32 only (got {k_cache.dtype} and "
                             f"{v_cache.dtype}): use attention_backend='gather' for other "
                             f"dtypes", "dtype")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ParameterError("k_cache and v_cache must be one shape (num_blocks, block_size, "
                             "Hkv, D)", "k_cache")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ParameterError("the paged C kernel reads a contiguous pool", "k_cache")
    if k_cache.shape[1] > MAX_BLOCK_SIZE:
        raise ParameterError(f"block_size must be at most {MAX_BLOCK_SIZE} for the paged C "
                             f"kernel (got {k_cache.shape[1]})", "block_size")
    if k_cache.shape[3] > MAX_HEAD_DIM:
        raise ParameterError(f"head_dim must be at most {MAX_HEAD_DIM} for the paged C kernel "
                             f"(got {k_cache.shape[3]})", "head_dim")


def check_group(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Raise ParameterError ("num_heads") unless the query heads are a multiple of the KV heads
    and one work unit's state, G (2 head_dim + block_size + 2) floats with G = num_heads /
    num_kv_heads, fits MAX_STACK_BYTES (the kernel keeps it on the thread's stack)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ParameterError(f"the query heads ({num_heads}) must be a multiple of the KV "
                             f"heads ({num_kv_heads})", "num_heads")
    group = num_heads // num_kv_heads
    if 4 * group * (2 * head_dim + block_size + 2) > MAX_STACK_BYTES:
        raise ParameterError(f"{group} query heads per KV head with head_dim {head_dim} and "
                             f"block_size {block_size} need more than the paged C kernel's "
                             f"{MAX_STACK_BYTES} bytes of state per work unit", "num_heads")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    *, check: bool = True) -> torch.Tensor:
    """The C kernel: attention of a ragged batch against one layer's paged pool, in place.

    q: float32 (N, H, D), unit stride along D (any strides otherwise: the runner's (H, N, D)
    tensor transposed is passed as is); k_cache, v_cache: contiguous float32 (num_blocks,
    block_size, Hkv, D); query_start_loc: int64 (B + 1,); seq_lens: int64 (B,), each request's
    context after this step (>= its query count); block_tables: int64 (B, M), unit stride
    along M, covering every request's positions. out: float32 (N, H, D) to write (unit stride
    along D), or None for a new one. Returns out. check: validate shapes, dtypes and the
    offsets (host syncs of a few small tensors; the runner validates its batch once and passes
    False). Raises ParameterError naming the rule.
    """
    if check:
        check_pool(k_cache, v_cache)
        for name, t in (("q", q), ("out", out)):
            if t is not None and (t.dim() != 3 or t.dtype != torch.float32
                                  or t.device.type != "cpu" or t.stride(2) != 1):
                raise ParameterError(f"{name} must be a float32 CPU tensor (N, H, D) with unit "
                                     f"stride along D", name)
        if out is not None and out.shape != q.shape:
            raise ParameterError(f"out must have q's shape {tuple(q.shape)} (got "
                                 f"{tuple(out.shape)})", "out")
        n_heads, head_dim = q.shape[1:]
        if head_dim != k_cache.shape[3]:
            raise ParameterError(f"q's head_dim {head_dim} is not the pool's "
                                 f"{k_cache.shape[3]}", "head_dim")
        check_group(n_heads, k_cache.shape[2], head_dim, k_cache.shape[1])
        for name, t, ndim in (("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1),
                              ("block_tables", block_tables, 2)):
            if (t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != ndim
                    or t.stride(-1) != 1):
                raise ParameterError(f"{name} must be a {ndim}-d int64 CPU tensor, unit stride "
                                     f"along its last dimension", name)
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        if (len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != q.shape[0]
                or any(e < a for a, e in zip(starts, starts[1:]))):
            raise ParameterError("query_start_loc must be B + 1 offsets from 0 to N, never "
                                 "decreasing", "query_start_loc")
        width = block_tables.shape[1] * k_cache.shape[1]
        if len(block_tables) != len(lens) or any(
                s < e - a or s > width for s, a, e in zip(lens, starts, starts[1:])):
            raise ParameterError("each seq_len must be at least its request's query count and "
                                 "fit its block table", "seq_lens")
        if block_tables.numel() and not (0 <= int(block_tables.min())
                                         and int(block_tables.max()) < k_cache.shape[0]):
            raise ParameterError("a block table names a block outside the pool", "block_tables")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    num_blocks, block_size, n_kv, head_dim = k_cache.shape
    load().paged_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(),
        seq_lens.data_ptr(), len(seq_lens), q.shape[1], n_kv, head_dim, block_size,
        float(scale), out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    return out


class PoolKernel:
    """The kernel bound to one engine's pool, for the runner's per-layer calls.

    k_pool, v_pool: a `PagedKVCache`'s k and v, contiguous float32 (L, num_blocks, block_size,
    Hkv, D); num_heads: the model's query heads. The pool never moves, so each layer's
    addresses are taken once; `set_step(query_start_loc, seq_lens, block_tables)` takes a
    step's index tensors (int64 on the CPU, unit stride along the last dimension; kept alive
    here) once per step; `attend(layer, q, scale, out)` is then one ctypes call with q and
    out (N, H, D) views of any strides with D contiguous. At a batch of one, a decode step's
    attention is mostly this Python side, not arithmetic, which is why it is this thin.
    Raises ParameterError as `check_pool` and `check_group` do.
    """

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int):
        check_pool(k_pool[0], v_pool[0])
        _, _, block_size, num_kv_heads, head_dim = k_pool.shape
        check_group(num_heads, num_kv_heads, head_dim, block_size)
        self.fn = load().paged_attention_f32
        self.sizes = (num_heads, num_kv_heads, head_dim, block_size)
        self.layers = [(k_pool[i].data_ptr(), v_pool[i].data_ptr())
                       for i in range(k_pool.shape[0])]
        self.step: tuple = ()

    def set_step(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
        for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                        ("block_tables", block_tables)):
            if t.dtype != torch.int64 or t.device.type != "cpu" or t.stride(-1) != 1:
                raise ParameterError(f"{name} must be an int64 CPU tensor, unit stride along "
                                     f"its last dimension", name)
        self.step = (query_start_loc, seq_lens, block_tables,     # alive while in use
                     block_tables.data_ptr(), block_tables.stride(0),
                     query_start_loc.data_ptr(), seq_lens.data_ptr(), len(seq_lens))

    def attend(self, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        assert q.stride(2) == 1 and out.stride(2) == 1 and self.step, "see the docstring"
        table, table_stride, starts, lens, num_seqs = self.step[3:]
        num_heads, num_kv_heads, head_dim, block_size = self.sizes
        k_ptr, v_ptr = self.layers[layer]
        self.fn(q.data_ptr(), q.stride(0), q.stride(1), k_ptr, v_ptr, table, table_stride,
                starts, lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                float(scale), out.data_ptr(), out.stride(0), out.stride(1),
                torch.get_num_threads())
