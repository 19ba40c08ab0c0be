"""S17, attention kernels in Triton: a varlen flash-attention forward, a paged decode kernel
that walks the block table itself (with its split-K variant) and the KV write through the
slot mapping.

What is new since code/s17_flash.py
    The same algorithms, written as GPU kernels: one program per tile of work, loads and stores
    through pointers, the running softmax state kept in registers.

    - `flash_attn_varlen`: causal grouped-query attention over a ragged batch laid end to end
      (`cu_seqlens_q`, `cu_seqlens_k`), the diagonal aligned bottom-right so a chunk of new
      queries after cached keys is one call. One program per (query tile, request, query head);
      it streams the request's key tiles through FlashAttention-2's online softmax (running max
      m, running sum l, output acc rescaled, divided by l once at the end) and stops at the
      last tile the diagonal reaches. Optionally the log-sum-exp of each row.
    - `paged_decode_attention`: one query per request against the KV pool read in place. One
      program per (request, KV head): the G = H / Hkv query heads of that KV head go together,
      so every key and value is loaded once for all of them. For each tile of key positions
      the kernel reads the block table (position p lives at block table[p // block_size],
      offset p % block_size) and loads the keys from there: no gathered copy.
      `num_splits` > 1 is flash decoding (split-K): each request's blocks are cut into
      num_splits contiguous ranges, a program per (request, KV head, range) writes a partial
      output and its log-sum-exp, and a second kernel merges them
      (`paged_decode_partials` returns the partials). With one request and a long context
      this turns Hkv programs into Hkv x num_splits, enough to fill a GPU.
    - `reshape_and_cache` (vLLM's name): the step's keys and values written to their slots
      (slot = block id x block_size + offset); a negative slot is padding and skipped.

    On a machine without CUDA, importing this module sets TRITON_INTERPRET=1 (unless the
    environment says otherwise) before Triton is imported: the kernels then run in Triton's
    interpreter, NumPy on the host, one program after another. Correct, slow by design, for
    tests only. Triton reads the variable when `triton.jit` decorates a function, that is when
    this module is imported, and for triton.language's own helpers (tl.max, tl.sum, ...) when
    triton is first imported in the process, which may be earlier (import torch._dynamo
    imports triton): the variable has to be set before anything imports triton, or the
    interpreted kernels cannot call those helpers. `check_triton` notices and says so.

What it does not handle
    Forward only; no sliding window, ALiBi, softcapping or dropout; no FP8 KV. bfloat16
    attention runs compiled on a GPU only: the interpreter's tl.dot multiplies bfloat16 bit
    patterns (triton-lang/triton#11584), so there it is refused with a clear error. Values inside
    index tensors (block ids, slots, seq_lens within the table) are checked on host tensors,
    where it is free; on a GPU that check would cost a device-to-host sync per call, so there
    the caller (the KV manager) guarantees them, as in vLLM. No autotuning: the tile sizes are
    arguments.

Run it
    pytest tests/test_s17_triton.py            # the interpreter on a CPU, compiled on a GPU
    The chapter's runner uses it as the `triton` attention backend; benchmarks/ times it on a
    GPU only (the interpreter is for correctness, never timed).

Tests
    tests/test_s17_triton.py: each kernel against torch's scaled_dot_product_attention (per
    request, with the bottom-right mask built by hand) and against gather + SDPA over the pool;
    tail tiles, GQA, empty and one-token requests, shuffled blocks, split-K's merge, poisoned
    outputs, the slot writes, the errors. GPU-marked tests run the compiled kernels at real
    shapes.

References
    Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"
    (NeurIPS 2022); Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning" (2023), Algorithm 1; Dao, Haziza, Massa and Sizov, "Flash-Decoding for
    long-context inference" (PyTorch blog, 2023); Kwon et al., "Efficient Memory Management
    for Large Language Model Serving with PagedAttention" (SOSP 2023); Tillet et al., "Triton"
    (MAPL 2019). vLLM's names: `reshape_and_cache`, `slot_mapping`, `block_tables`,
    `seq_lens`, `cu_seqlens_q`.
"""
import os

import torch

# Before Triton is imported: without CUDA, Triton can only interpret the kernels on the host.
# setdefault, so an explicit TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from s01_generation_loop import ParameterError  # noqa: E402

try:
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
except ImportError:                       # the CPU torch wheel does not bring Triton
    TRITON_AVAILABLE = False

    class _NoTriton:
        """Just enough for the kernel definitions below to be read; every public function
        refuses to run through `check_triton`."""
        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()

__all__ = [
    "TRITON_AVAILABLE", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIM_MAX", "SUPPORTED_BLOCK_SIZE_MAX",
    "MIN_TILE", "interpreted", "check_triton", "check_pool_supported", "flash_attn_varlen",
    "paged_decode_attention",
    "paged_decode_partials", "reshape_and_cache",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIM_MAX = 256       # a (tile, head_dim) block of q, k, v and acc in registers
SUPPORTED_BLOCK_SIZE_MAX = 256     # vLLM's largest block size on GPUs
MIN_TILE = 16                      # tl.dot needs at least 16 rows and columns on tensor cores


# ---------------------------------------------------------------------------------------------
# Where the kernels run
# ---------------------------------------------------------------------------------------------

def interpreted() -> bool:
    """True when TRITON_INTERPRET is set to a true value now ("1", "true", "on", "yes", read
    as Triton reads it)."""
    if not TRITON_AVAILABLE:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:                                        # Triton before 3.4
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_triton(device) -> None:
    """Raise ParameterError("attention_backend") when the Triton kernels cannot run on device
    (a torch.device or its name): Triton is missing; the device is neither the CPU nor a
    CUDA/ROCm GPU; the device is the CPU and the interpreter is off; the device is a GPU and
    the interpreter is on; triton was first imported under another TRITON_INTERPRET than this
    module (Triton reads the variable when a function is decorated: its own library's helpers
    when triton is first imported, these kernels when this module is); or the variable changed
    after this module was imported."""
    device = torch.device(device)
    if not TRITON_AVAILABLE:
        raise ParameterError(
            "the triton attention backend needs Triton: pip install triton (the CPU torch "
            "wheel does not bring it), or pick another attention backend", "attention_backend")
    if device.type not in ("cpu", "cuda"):
        raise ParameterError(f"the Triton kernels run on CUDA (or ROCm) GPUs, or on the CPU in "
                             f"Triton's interpreter, not on {device.type}", "attention_backend")
    if device.type == "cpu" and not interpreted():
        raise ParameterError(
            "Triton kernels on the CPU run only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before Python starts (slow, for correctness only)",
            "attention_backend")
    if device.type != "cpu" and interpreted():
        raise ParameterError(
            f"TRITON_INTERPRET is on, so the kernels would be interpreted on the host (every "
            f"tensor copied there and back per launch), not compiled for {device.type}: unset "
            f"it before Python starts", "attention_backend")
    if _LIBRARY_INTERPRETED != _KERNELS_INTERPRETED:
        raise ParameterError(
            f"triton was imported before TRITON_INTERPRET was "
            f"{'set' if _KERNELS_INTERPRETED else 'unset'} (import torch._dynamo, or "
            f"torch.compile, imports it): its own helpers (tl.zeros, tl.max, tl.sum, tl.cdiv) "
            f"were built {'to compile' if _KERNELS_INTERPRETED else 'for the interpreter'} and "
            f"the kernels {'for the interpreter' if _KERNELS_INTERPRETED else 'to compile'}, "
            f"which cannot call them. Set TRITON_INTERPRET before anything imports triton: in "
            f"the environment, or first thing in the entry script (for the tests, "
            f"tests/conftest.py)", "attention_backend")
    if interpreted() != _KERNELS_INTERPRETED:
        raise ParameterError(
            f"TRITON_INTERPRET changed after s17_triton was imported: the kernels were built "
            f"{'for the interpreter' if _KERNELS_INTERPRETED else 'to compile'}; Triton reads "
            f"the variable when a kernel is decorated, so set it before Python starts",
            "attention_backend")


# ---------------------------------------------------------------------------------------------
# Kernel 1: varlen causal flash attention (FlashAttention-2's forward)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _flash_attn_varlen_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, scale,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
        stride_on, stride_oh, stride_ln,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr):
    tile, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, k_start = tl.load(cu_q_ptr + b).to(tl.int64), tl.load(cu_k_ptr + b).to(tl.int64)
    T = tl.load(cu_q_ptr + b + 1) - q_start          # new tokens (int64 offsets: no overflow)
    S = tl.load(cu_k_ptr + b + 1) - k_start          # its keys, cached + new (S >= T)
    if tile * BLOCK_M >= T:                          # the grid is sized for the longest request
        return
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)       # query rows of this tile, within the request
    d = tl.arange(0, BLOCK_D)                        # head_dim padded to a power of two
    q_mask = (i < T)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qn + h * stride_qh + d[None, :],
                mask=q_mask, other=0.0)                                      # (BLOCK_M, BLOCK_D)
    k_base = k_ptr + k_start * stride_kn + (h // GROUP) * stride_kh          # GQA: shared head
    v_base = v_ptr + k_start * stride_vn + (h // GROUP) * stride_vh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)    # running max of each row's scores
    l = tl.zeros([BLOCK_M], tl.float32)                  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)       # running sum of exp(score - m) v
    # Bottom-right causal: row i sees key j iff j <= S - T + i. Key tiles past the tile's last
    # row's diagonal are never loaded.
    k_end = tl.minimum(S, S - T + (tile + 1) * BLOCK_M)
    for n0 in range(0, k_end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (j < S)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + j[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
        # "ieee": float32 inputs are not rounded to TF32 (float16 / bfloat16 are unaffected)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale           # (BLOCK_M, BLOCK_N)
        # Key 0 is visible to every row, so every row's max is finite after the first tile.
        s = tl.where((j[None, :] <= S - T + i[:, None]) & (j < S)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)                   # rescales what was summed under the old max
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + j[:, None] * stride_vn + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    out = acc / l[:, None]                          # FlashAttention-2: normalise once, here
    tl.store(o_ptr + (q_start + i)[:, None] * stride_on + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_mask)
    if WRITE_LSE:
        tl.store(lse_ptr + (q_start + i) * stride_ln + h, m + tl.log(l), mask=i < T)


# ---------------------------------------------------------------------------------------------
# Kernel 2: paged decode attention, one split of a request's blocks per program
# ---------------------------------------------------------------------------------------------

@triton.jit
def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, o_ptr, lse_ptr, scale,
        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # This program's contiguous run of whole blocks, as key positions [start, end).
    blocks_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE), NUM_SPLITS)
    start = split * blocks_per_split * BLOCK_SIZE
    end = tl.minimum(seq_len, start + blocks_per_split * BLOCK_SIZE)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)    # group padded to >= 16 rows for tl.dot
    heads = kv_head * GROUP + g                            # the query heads of this KV head
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)                                      # (BLOCK_G, BLOCK_D)
    table = block_tables_ptr + b * stride_tb
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for p0 in range(start, end, BLOCK_N):
        pos = p0 + tl.arange(0, BLOCK_N)                   # key positions of this tile
        ok = pos < end
        # Position p sits at offset p % BLOCK_SIZE of block table[p // BLOCK_SIZE] (int64:
        # block id x block stride can pass 2**31 in a large pool).
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        addr = (block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None]
        kv_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + addr + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale           # (BLOCK_G, BLOCK_N)
        s = tl.where(ok[None, :], s, float("-inf"))     # position p0 < end: a finite max per row
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + addr + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    # An empty range (seq_len 0, or a split past the last block): output 0, lse -inf, no NaN.
    l_safe = tl.where(l > 0, l, 1.0)
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
             (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=q_mask)
    if WRITE_LSE:
        lse = tl.where(l > 0, m + tl.log(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)


# ---------------------------------------------------------------------------------------------
# Kernel 3: split-K's merge (the log-sum-exp rule)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _merge_splits_kernel(
        part_o_ptr, part_lse_ptr, o_ptr,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s < NUM_SPLITS,
                  other=float("-inf"))                                       # (BLOCK_S,)
    part = tl.load(part_o_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :],
                   other=0.0).to(tl.float32)                                 # (BLOCK_S, BLOCK_D)
    # out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s): each partial output
    # is normalised over its own keys, and exp(lse_s) is that range's softmax denominator.
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)   # all splits empty: weights 0
    w = tl.exp(lse - lse_max)                                    # an empty split weighs 0
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# Kernel 4: the KV write through the slot mapping
# ---------------------------------------------------------------------------------------------

@triton.jit
def _reshape_and_cache_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kn, stride_kh, stride_vn, stride_vh, stride_cb, stride_cs, stride_ch,
        NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    n = tl.program_id(0)                                   # one token, all its KV heads
    slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
    if slot < 0:                                           # a padding token: nothing to write
        return
    h, d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    # slot = block id x BLOCK_SIZE + offset in the block
    addr = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            + h[:, None] * stride_ch + d[None, :])
    k = tl.load(k_ptr + n * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + n * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + addr, k, mask=mask)
    tl.store(v_cache_ptr + addr, v, mask=mask)


# The kernels were decorated with whatever TRITON_INTERPRET said when this module was imported;
# triton.language's own jit helpers that they call (tl.zeros, tl.max, tl.sum, tl.cdiv) with what
# it said when triton was first imported in this process, possibly earlier (import torch._dynamo
# imports triton). check_triton refuses to launch unless the three agree.
_KERNELS_INTERPRETED = TRITON_AVAILABLE and type(_flash_attn_varlen_kernel).__name__ == (
    "InterpretedFunction")
_LIBRARY_INTERPRETED = TRITON_AVAILABLE and type(tl.zeros).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------------
# Validation shared by the wrappers
# ---------------------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _check_dtype(dot: bool, **tensors: torch.Tensor) -> torch.dtype:
    """The tensors' one dtype. dot: the kernel multiplies them with tl.dot."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    for name, dtype in dtypes.items():
        if dtype not in SUPPORTED_DTYPES:
            raise ParameterError(f"{name} has dtype {dtype}; the kernels take float32, float16 "
                                 f"or bfloat16", "dtype", dtype)
    if len(set(dtypes.values())) > 1:
        raise ParameterError(f"the tensors must share one dtype, got {dtypes}", "dtype", dtypes)
    dtype = next(iter(dtypes.values()))
    if dot and dtype == torch.bfloat16 and interpreted():
        # The interpreter keeps bfloat16 as its uint16 bits and its tl.dot multiplies those
        # (values near 1e10; triton-lang/triton#11584, "not supported yet").
        raise ParameterError("Triton's interpreter cannot multiply bfloat16 with tl.dot: use "
                             "float32 or float16 on the CPU (bfloat16 runs compiled on a GPU)",
                             "dtype", dtype)
    return dtype


def _check_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ParameterError(f"the tensors must be on one device, got {devices}", "device",
                             devices)
    device = next(iter(devices.values()))
    check_triton(device)
    return device


def _check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != ndim:
        raise ParameterError(f"{name} must be a {ndim}-d int32 or int64 tensor, got "
                             f"{t.dtype} of shape {tuple(t.shape)}", name)
    if t.numel() > 1 and t.stride(-1) != 1:     # the kernels step along the last dim by 1
        raise ParameterError(f"{name} must have unit stride along its last dimension (got "
                             f"strides {t.stride()}): pass {name}.contiguous()", name)


def _check_head_dim(d: int) -> int:
    """The head dim padded to the power of two the kernels' tiles use (at least MIN_TILE)."""
    if not 1 <= d <= SUPPORTED_HEAD_DIM_MAX:
        raise ParameterError(f"head_dim must be between 1 and {SUPPORTED_HEAD_DIM_MAX}, got {d}",
                             "head_dim", d)
    return max(MIN_TILE, _pow2(d))


def _check_heads(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ParameterError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})", "num_heads", num_heads)
    return num_heads // num_kv_heads


def _check_tile(name: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < MIN_TILE or n & (n - 1):
        raise ParameterError(f"{name} must be a power of two >= {MIN_TILE} (tl.dot's smallest "
                             f"tile), got {n!r}", name, n)


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int,
                head_dim: int) -> int:
    """The block size of a (num_blocks, block_size, Hkv, D) pair of caches."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ParameterError(f"k_cache and v_cache must both be (num_blocks, block_size, Hkv, "
                             f"D), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}",
                             "k_cache")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ParameterError(f"the pool holds (Hkv, D) = {tuple(k_cache.shape[2:])}, the "
                             f"tokens ({num_kv_heads}, {head_dim})", "k_cache")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ParameterError(f"k_cache and v_cache must have one layout, contiguous along D "
                             f"(a view such as pool.k[layer] is fine), got strides "
                             f"{k_cache.stride()} and {v_cache.stride()}", "k_cache")
    block_size = k_cache.shape[1]
    if not 1 <= block_size <= SUPPORTED_BLOCK_SIZE_MAX or block_size & (block_size - 1):
        raise ParameterError(f"block_size (k_cache.shape[1]) must be a power of two between 1 "
                             f"and {SUPPORTED_BLOCK_SIZE_MAX}, got {block_size}", "block_size",
                             block_size)
    return block_size


def check_pool_supported(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
    """Raise ParameterError naming the rule unless the kernels can read this pool (one layer's,
    (num_blocks, block_size, Hkv, D)) for a model of num_heads query heads: its dtype, head
    dim, block size, head grouping and layout. An engine checks this once, when it is built,
    so no step fails on it later."""
    _check_dtype(True, k_cache=k_cache, v_cache=v_cache)
    _check_head_dim(k_cache.shape[-1])
    _check_heads(num_heads, k_cache.shape[-2])
    _check_pool(k_cache, v_cache, k_cache.shape[-2], k_cache.shape[-1])


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()   # the kernels step along D by 1


def _check_out(out: torch.Tensor | None, shape: tuple, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ParameterError(f"out must be {dtype} of shape {tuple(shape)} on {device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}", "out")
    if out.stride(-1) != 1:
        raise ParameterError("out must be contiguous along D", "out")
    return out


# ---------------------------------------------------------------------------------------------
# Kernel 1's wrapper
# ---------------------------------------------------------------------------------------------

def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float, *,
                      block_m: int = 16, block_n: int = 16, return_lse: bool = False,
                      max_seqlen_q: int | None = None, out: torch.Tensor | None = None):
    """Causal grouped-query attention of a ragged batch in one launch.

    q: (N_q, H, D), the new tokens of B requests end to end; k, v: (N_k, Hkv, D), each
    request's keys and values (cached + new) end to end; float32, float16 or bfloat16, one
    dtype (scores and sums accumulate in float32). cu_seqlens_q, cu_seqlens_k: int32 or int64
    (B + 1,), on q's device: request b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]
    - 1 (T_b of them), its keys rows cu_seqlens_k[b] .. (S_b >= T_b). Causal, bottom-right:
    query i of request b sees key j iff j <= S_b - T_b + i. scale multiplies q.k (usually
    D ** -0.5). block_m, block_n: the query and key tile (powers of two >= 16). max_seqlen_q:
    at least the largest T_b, if the caller knows it (the grid is sized from it; on a GPU it
    saves reading cu_seqlens to the host; on the CPU they are read and checked anyway). out:
    a preallocated (N_q, H, D) output in q's dtype.

    Returns out (N_q, H, D) in q's dtype, and with return_lse also lse float32 (N_q, H), the
    natural log of sum_j exp(scale q.k_j) over the keys each row sees. A request with T_b = 0
    writes nothing.

    Raises ParameterError naming the parameter for: dtypes ("dtype"; bfloat16 too under the
    interpreter), devices ("device"), head_dim over SUPPORTED_HEAD_DIM_MAX ("head_dim"), H not
    a multiple of Hkv ("num_heads"), bad tiles ("block_m", "block_n"), shapes ("q",
    "cu_seqlens_q", "cu_seqlens_k", "out"), and, when cu_seqlens are read on the host (host
    tensors, or max_seqlen_q not given), a request with S_b < T_b ("cu_seqlens_k"). Follows
    FlashAttention-2's forward (Dao 2023, Algorithm 1) with FlashAttention's varlen interface.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ParameterError(f"q must be (N_q, H, D) and k, v (N_k, Hkv, D) with one D, got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}", "q")
    device = _check_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    dtype = _check_dtype(True, q=q, k=k, v=v)
    n_q, num_heads, head_dim = q.shape
    block_d = _check_head_dim(head_dim)
    group = _check_heads(num_heads, k.shape[1])
    _check_tile("block_m", block_m)
    _check_tile("block_n", block_n)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1)
    _check_index("cu_seqlens_k", cu_seqlens_k, 1)
    if len(cu_seqlens_q) != len(cu_seqlens_k) or len(cu_seqlens_q) < 1:
        raise ParameterError(f"cu_seqlens_q and cu_seqlens_k must both be (B + 1,), got "
                             f"{len(cu_seqlens_q)} and {len(cu_seqlens_k)}", "cu_seqlens_q")
    num_reqs = len(cu_seqlens_q) - 1
    if max_seqlen_q is None or device.type == "cpu":
        max_seqlen_q = _check_cu_seqlens(cu_seqlens_q.tolist(), cu_seqlens_k.tolist(),
                                         n_q, k.shape[0])
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out = _check_out(out, (n_q, num_heads, head_dim), dtype, device)
    lse = torch.empty((n_q, num_heads) if return_lse else (1, 1), dtype=torch.float32,
                      device=device)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_reqs, num_heads)
    if num_reqs and max_seqlen_q:
        _flash_attn_varlen_kernel[grid](
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            WRITE_LSE=return_lse)
    return (out, lse) if return_lse else out


def _check_cu_seqlens(cu_q: list[int], cu_k: list[int], n_q: int, n_k: int) -> int:
    """The largest T_b, after checking the offsets on the host."""
    for name, cu, n in (("cu_seqlens_q", cu_q, n_q), ("cu_seqlens_k", cu_k, n_k)):
        if cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
            raise ParameterError(f"{name} must start at 0, never decrease and end at {n} (the "
                                 f"number of rows), got {cu}", name)
    t = [b - a for a, b in zip(cu_q, cu_q[1:])]
    s = [b - a for a, b in zip(cu_k, cu_k[1:])]
    for b, (t_b, s_b) in enumerate(zip(t, s)):
        if s_b < t_b:
            raise ParameterError(f"cu_seqlens_k gives request {b} {s_b} keys for {t_b} new "
                                 f"tokens: its keys must include its new tokens (S_b >= T_b)",
                                 "cu_seqlens_k")
    return max(t, default=0)


# ---------------------------------------------------------------------------------------------
# Kernels 2 and 3's wrappers
# ---------------------------------------------------------------------------------------------

def _check_decode(q, k_cache, v_cache, block_tables, seq_lens, num_splits, block_n):
    """Validate a paged decode call; return (device, group, block_size, block_d)."""
    if q.dim() != 3:
        raise ParameterError(f"q must be (B, H, D), one query per request, got "
                             f"{tuple(q.shape)}", "q")
    device = _check_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                           seq_lens=seq_lens)
    _check_dtype(True, q=q, k_cache=k_cache, v_cache=v_cache)
    num_reqs, num_heads, head_dim = q.shape
    block_d = _check_head_dim(head_dim)
    if k_cache.dim() != 4:
        raise ParameterError(f"k_cache must be (num_blocks, block_size, Hkv, D), got "
                             f"{tuple(k_cache.shape)}", "k_cache")
    group = _check_heads(num_heads, k_cache.shape[2])
    block_size = _check_pool(k_cache, v_cache, k_cache.shape[2], head_dim)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ParameterError(f"num_splits must be an int >= 1, got {num_splits!r}",
                             "num_splits", num_splits)
    _check_tile("block_n", block_n)
    _check_index("block_tables", block_tables, 2)
    _check_index("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != num_reqs or seq_lens.shape[0] != num_reqs:
        raise ParameterError(f"block_tables (B, M) and seq_lens (B,) need B = {num_reqs} rows, "
                             f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}",
                             "block_tables")
    if device.type == "cpu" and num_reqs:       # free on the host; a sync on a GPU
        capacity = block_tables.shape[1] * block_size
        if int(seq_lens.min()) < 0 or int(seq_lens.max()) > capacity:
            raise ParameterError(f"seq_lens must be between 0 and the table's capacity "
                                 f"{capacity}, got {seq_lens.tolist()}", "seq_lens")
        if block_tables.numel() and not (0 <= int(block_tables.min())
                                         and int(block_tables.max()) < k_cache.shape[0]):
            raise ParameterError(f"block_tables must hold block ids below num_blocks "
                                 f"{k_cache.shape[0]}", "block_tables")
    return device, group, block_size, block_d


def _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse, num_splits,
                   group, block_size, block_d, block_n, write_lse):
    """Kernel 2 over (B, Hkv, num_splits). out is (B, H, D) when num_splits is 1 and lse is
    not wanted, else (B, H, splits, D) with lse (B, H, splits)."""
    num_reqs, num_heads, head_dim = q.shape
    stride_os = out.stride(2) if out.dim() == 4 else 0
    grid = (num_reqs, num_heads // group, num_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, lse, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), stride_os, lse.stride(0),
        lse.stride(1),
        GROUP=group, BLOCK_G=max(MIN_TILE, _pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, WRITE_LSE=write_lse)


def default_block_n(q: torch.Tensor) -> int:
    """Key positions per decode tile: 64, or 32 when a row of keys takes more than 512 bytes
    (head_dim 256 in float32): a 64-row tile of keys and one of values, double-buffered by
    Triton's pipelining, would pass the 228 KB of shared memory an H100 SM has."""
    return 64 if q.shape[-1] * q.element_size() <= 512 else 32


def paged_decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                          num_splits: int = 2, block_n: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K's first pass alone: for each request, KV head's query heads and split, the
    attention over that split's keys and its log-sum-exp.

    Arguments as `paged_decode_attention`. Split s of request b covers its blocks
    s * n .. (s + 1) * n - 1 with n = cdiv(cdiv(seq_len_b, block_size), num_splits).
    Returns partial_out float32 (B, H, num_splits, D), normalised over the split's own keys
    (0 for an empty split), and partial_lse float32 (B, H, num_splits), log sum exp(scale q.k)
    over them (-inf for an empty split). Flash-Decoding (Dao, Haziza, Massa, Sizov 2023).
    """
    block_n = default_block_n(q) if block_n is None else block_n
    device, group, block_size, block_d = _check_decode(q, k_cache, v_cache, block_tables,
                                                       seq_lens, num_splits, block_n)
    num_reqs, num_heads, head_dim = q.shape
    q = _unit_stride(q)
    part_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=device)
    part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=device)
    if num_reqs:
        _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, part_out, part_lse,
                       num_splits, group, block_size, block_d, block_n, write_lse=True)
    return part_out, part_lse


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           num_splits: int = 1, block_n: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention, reading the KV pool in place through the block tables.

    q: (B, H, D), the one new query of each request. k_cache, v_cache: one layer's pool,
    (num_blocks, block_size, Hkv, D), any strides with D contiguous, the same for both
    (pool.k[layer] and pool.v[layer] of S12's (L, num_blocks, block_size, Hkv, D) pool are
    fine); q's dtype (float32, float16, bfloat16). block_tables: int32/int64 (B, M), request
    b's block ids in order (entries past its context are not read); seq_lens: int32/int64
    (B,), request b's context length S_b (keys 0 .. S_b - 1, the new token's included: write
    it first with `reshape_and_cache`). scale multiplies q.k. num_splits: 1 for one pass;
    more for split-K (flash decoding), the partials merged by a second kernel with the
    log-sum-exp rule. block_n: key positions per tile (a power of two >= 16; a tile may span
    several blocks, each position looks its block up; default `default_block_n`). out: a
    preallocated (B, H, D) output
    in q's dtype.

    Query head h reads KV head h // (H // Hkv); the heads of one KV head share a program, so
    each key is loaded once for all of them. Returns out (B, H, D) in q's dtype; a request
    with seq_len 0 gets zeros.

    Raises ParameterError naming the parameter for: dtypes ("dtype"; bfloat16 too under the
    interpreter), devices ("device"), head_dim ("head_dim"), block sizes that are not a power
    of two in 1..256 ("block_size"), H not a multiple of Hkv ("num_heads"), num_splits
    ("num_splits"), block_n ("block_n"), shapes ("q", "k_cache", "block_tables", "out"); on
    host tensors also seq_lens past the table ("seq_lens") or block ids outside the pool
    ("block_tables"). Follows PagedAttention (Kwon et al. 2023)
    for the block walk and Flash-Decoding (Dao et al. 2023) for the splits.
    """
    block_n = default_block_n(q) if block_n is None else block_n
    device, group, block_size, block_d = _check_decode(q, k_cache, v_cache, block_tables,
                                                       seq_lens, num_splits, block_n)
    num_reqs, num_heads, head_dim = q.shape
    q = _unit_stride(q)
    out = _check_out(out, tuple(q.shape), q.dtype, device)
    if num_reqs == 0:
        return out
    if num_splits == 1:               # one pass: the kernel normalises and writes out itself
        _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, out, 1,
                       group, block_size, block_d, block_n, write_lse=False)
        return out
    part_out, part_lse = paged_decode_partials(q, k_cache, v_cache, block_tables, seq_lens,
                                               scale, num_splits=num_splits, block_n=block_n)
    _merge_splits_kernel[(num_reqs, num_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d)
    return out


# ---------------------------------------------------------------------------------------------
# Kernel 4's wrapper
# ---------------------------------------------------------------------------------------------

def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's keys and values into the pool, in place.

    k, v: (N, Hkv, D); k_cache, v_cache: one layer's pool (num_blocks, block_size, Hkv, D),
    any strides with D contiguous (the same for both), the same dtype as k. slot_mapping:
    int64 (or int32) (N,): token n goes to block slot // block_size, offset slot % block_size;
    a negative slot is a padding token and is skipped (vLLM's convention). Returns None.

    Raises ParameterError for dtypes ("dtype"), devices ("device"), head_dim, block_size,
    shapes ("k", "k_cache", "slot_mapping"), and on host tensors a slot past the pool
    ("slot_mapping"). vLLM's `reshape_and_cache` (its CUDA kernel); the slot arithmetic is
    S12's.
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ParameterError(f"k and v must both be (N, Hkv, D), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}", "k")
    device = _check_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                           slot_mapping=slot_mapping)
    _check_dtype(False, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    n, num_kv_heads, head_dim = k.shape
    block_d = _check_head_dim(head_dim)
    block_size = _check_pool(k_cache, v_cache, num_kv_heads, head_dim)
    _check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != n:
        raise ParameterError(f"slot_mapping needs one slot per token ({n}), got "
                             f"{slot_mapping.shape[0]}", "slot_mapping")
    if device.type == "cpu" and n and int(slot_mapping.max()) >= k_cache.shape[0] * block_size:
        raise ParameterError(f"slot_mapping holds a slot past the pool's "
                             f"{k_cache.shape[0] * block_size}", "slot_mapping")
    if n == 0:
        return None
    k, v = _unit_stride(k), _unit_stride(v)
    _reshape_and_cache_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size)
    return None
