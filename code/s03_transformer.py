"""S03, opening the box: a transformer forward pass in NumPy that loads real checkpoints.

What is new since S02
    The model. Chapter 1's loop ran a bigram table; here `Transformer.forward(token_ids)` is a
    real decoder-only transformer, written in NumPy float32 from its parts, in the order data
    flows: token embeddings, then L blocks of (norm, attention, residual, norm, MLP, residual),
    then a final norm and the LM head that turns the last hidden state into V logits. It keeps
    the S01 contract, `forward(token_ids) -> logits (T, V)`, so `Engine` runs it unchanged.

    Two architecture families, the two shapes nearly every open checkpoint takes:
    - Qwen3 / Llama: RMSNorm, rotary position embeddings (RoPE) with the checkpoint's theta
      (and Llama 3's frequency scaling), grouped-query attention (fewer K/V heads than query
      heads), Qwen3's per-head RMSNorm on q and k, SwiGLU MLP, tied or untied LM head.
    - GPT-2: LayerNorm with bias, learned position embeddings, one fused QKV projection stored
      as GPT-2 stores it (input-major "Conv1D" weights), GELU (tanh approximation) MLP, LM head
      tied to the token embeddings.
    Weights come from a Hugging Face checkpoint directory (config.json, model.safetensors or a
    sharded index, generation_config.json for the EOS ids, tokenizer.json), read by a
    safetensors reader written here (float32, float16 and bfloat16 tensors), or from a hub id
    through `huggingface_hub` when a network is there. `parameter_count`, `flops_per_token` and
    `bytes_per_token` compute the model's size and the cost of one token from the config alone.

What it does not handle yet
    Every pass still recomputes the whole context: S05 adds the KV cache (this file already
    splits a block into `qkv` -> `attention` -> `finish` so a cache can be slotted between the
    steps, and `rope` takes explicit absolute positions). One sequence at a time (S08 batches).
    No sliding-window attention, no rope scaling other than "linear" and "llama3", no biases
    on q/k/v alone (Qwen2), no mixture of experts, no quantised weights (S14), no GPU (S06).
    Tokenizers are read with the HF `tokenizers` library so any checkpoint's tokenizer.json
    works (S02 built the project's own byte-level BPE, saved in the same format).

Run it
    python code/s03_transformer.py --prompt "Romeo." --max-tokens 60
    python code/s03_transformer.py --model path/to/checkpoint_dir   (or a hub id when online)

Tests
    tests/test_s03_transformer.py: tiny random GPT-2, Llama and Qwen3 models (GQA, tied and
    untied heads, qk-norm, rope theta, llama3 rope scaling) built with `transformers`, saved,
    loaded here; logits allclose to transformers at every position and greedy tokens through
    the S01 loop equal to `generate(do_sample=False)`. The same on the bundled model. Parameter
    counts against transformers, FLOPs against torch's FLOP counter, the safetensors reader
    against the `safetensors` package, and every error message.

References
    Vaswani et al., "Attention Is All You Need" (2017); Radford et al., "Language Models are
    Unsupervised Multitask Learners" (GPT-2, 2019); Zhang & Sennrich, "Root Mean Square Layer
    Normalization" (2019); Su et al., "RoFormer: Enhanced Transformer with Rotary Position
    Embedding" (2021); Shazeer, "GLU Variants Improve Transformer" (2020); Ainslie et al., "GQA"
    (2023); Touvron et al., "LLaMA" (2023); Qwen team, "Qwen3 Technical Report" (2025);
    Kaplan et al., "Scaling Laws for Neural Language Models" (2020) for the 2 FLOPs per
    parameter per token count. Followed for the exact conventions (rotate-half RoPE, GQA head
    order, where each norm sits, weight names): Hugging Face transformers' modeling_gpt2.py,
    modeling_llama.py, modeling_qwen3.py and modeling_rope_utils.py (v5). The safetensors file
    layout: huggingface/safetensors README ("Format").

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C is the hidden size
(`hidden_size`) and I the MLP's inner size (`intermediate_size`).
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL_DIR = ROOT / "data" / "model"

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "qwen3")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: a file or tensor is missing, a shape or dtype is wrong, or
    the architecture is one this chapter does not implement. The message names what and where."""


class UnsupportedArchitectureError(CheckpointError):
    """The config asks for an architecture or a feature this chapter does not implement."""


class MissingTensorError(CheckpointError):
    """The checkpoint lacks tensors the config says the model has."""


# ---------------------------------------------------------------------------------------------
# Reading checkpoints: safetensors files, shards, a hub id
# ---------------------------------------------------------------------------------------------

# safetensors dtype tag -> (NumPy dtype of the stored bytes, bytes per element).
# bfloat16 has no NumPy dtype: its bytes are read as uint16 and widened below.
_SAFETENSORS_DTYPES = {
    "F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2),
    "I64": (np.int64, 8), "I32": (np.int32, 4), "I16": (np.int16, 2), "I8": (np.int8, 1),
    "U8": (np.uint8, 1), "BOOL": (np.bool_, 1),
}


def bfloat16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values, given as their raw uint16 bit patterns, to float32 exactly.

    bfloat16 is the top half of a float32 (sign, 8 exponent bits, 7 mantissa bits), so shifting
    the 16 bits into the high half of a 32-bit word and reinterpreting is lossless.
    raw: uint16 array of any shape. Returns float32 of the same shape.
    """
    return (raw.astype(np.uint32) << 16).view(np.float32)


_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean",
                    int: "number", float: "number", type(None): "null"}


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type ("array", "string", ...), for error messages."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def read_json_object(path: str | Path) -> dict:
    """Parse a checkpoint's JSON file (config.json, generation_config.json, an index) that must
    hold one JSON object. Returns it as a dict.

    Raises CheckpointError naming the file when it cannot be read, is not UTF-8, is not valid
    JSON (an empty file included), or holds something other than an object (a list, a number).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not UTF-8 text (invalid byte at offset {err.start})") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} "
                              f"column {err.colno})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, found a JSON {_json_type(data)}")
    return data


def _is_int(value: object) -> bool:
    """True for Python and NumPy integers, False for bools (True is not a count or an id)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: object) -> bool:
    """True for ints and floats (Python or NumPy), False for bools, strings, None."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_))


def _check_tensor_entry(path: Path, name: str, info: object) -> tuple[str, tuple[int, ...], int, int]:
    """One header entry of a safetensors file, checked: (dtype tag, shape, begin, end).
    Raises CheckpointError naming the file, the tensor and the rule broken."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: its header entry must be a JSON object with dtype, shape "
                              f"and data_offsets, found a JSON {_json_type(info)}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: its header entry has no {key!r}")
    tag, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(tag, str) or tag not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where} has dtype {tag}, which this reader does not support "
                              f"(supported: {', '.join(_SAFETENSORS_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where} has shape {shape!r}: a shape must be a list of "
                              "integers >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where} has data_offsets {offsets!r}: they must be two integers "
                              "[begin, end] with 0 <= begin <= end")
    begin, end = offsets
    needed = _SAFETENSORS_DTYPES[tag][1] * math.prod(shape)
    if end - begin != needed:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
                              f"but {tag} {shape} takes {needed} bytes")
    return tag, tuple(shape), begin, end


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Read every tensor of a .safetensors file; floating-point tensors come back as float32.

    The format: 8 bytes little-endian header length N, N bytes of UTF-8 JSON mapping each
    tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
    end of the header; an optional "__metadata__" entry holds strings), then the raw
    little-endian tensor bytes, stored back to back: the tensors' byte ranges tile the data
    section exactly, with no gap, overlap or trailing byte. float16 and bfloat16 are widened to
    float32 (exactly); integer and bool tensors keep their dtype.

    Raises CheckpointError naming the file (and the tensor) for: a file that cannot be read or
    is shorter than its 8-byte length field or its header, a header that is not UTF-8 JSON
    holding an object, an entry without dtype / shape / data_offsets, a dtype this reader does
    not know, a negative dimension or offset, a byte range whose length does not match dtype
    and shape, ranges that are not back to back, and a file truncated before the last tensor
    ends (with both sizes). The same rules as the `safetensors` package; the layout is the
    huggingface/safetensors README ("Format").
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        data = np.memmap(path, dtype=np.uint8, mode="r") if size >= 8 else None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot be read ({getattr(err, 'strerror', None) or err})"
                              ) from None
    if data is None:
        raise CheckpointError(f"{path}: too short to be a safetensors file ({size} bytes; the "
                              "header length field alone takes 8)")
    header_len = int(data[:8].view("<u8")[0])
    if 8 + header_len > size:
        raise CheckpointError(f"{path}: header length {header_len} runs past the end of the file "
                              f"({size} bytes)")
    try:
        header = json.loads(bytes(data[8:8 + header_len]).decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: the header is not UTF-8 text (invalid byte at header "
                              f"offset {err.start}); not a safetensors file?") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path}: the header is not valid JSON "
                              f"({getattr(err, 'msg', 'nested too deeply')})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header must be a JSON object mapping tensor names to "
                              f"entries, found a JSON {_json_type(header)}")
    body = data[8 + header_len:]
    entries = {name: _check_tensor_entry(path, name, info)
               for name, info in header.items() if name != "__metadata__"}
    data_end = max((end for *_, end in entries.values()), default=0)
    if data_end > body.size:
        raise CheckpointError(
            f"{path}: the file is truncated: it has {size} bytes, but its header places tensor "
            f"data up to byte {8 + header_len + data_end}")
    position = 0  # ranges sorted by start must follow one another from byte 0 to the end
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin != position:
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at data byte {begin}, but the tensor before it "
                f"ends at byte {position} (tensors must be stored back to back, without gaps "
                "or overlaps)")
        position = end
    if position != body.size:
        raise CheckpointError(f"{path}: {body.size - position} bytes after the last tensor belong "
                              "to no tensor (the data section must be covered exactly)")
    tensors: dict[str, np.ndarray] = {}
    for name, (tag, shape, begin, end) in entries.items():
        np_dtype = _SAFETENSORS_DTYPES[tag][0]
        array = body[begin:end].view(np.dtype(np_dtype).newbyteorder("<")).reshape(shape)
        if tag == "BF16":
            array = bfloat16_to_float32(array)
        elif np.issubdtype(array.dtype, np.floating):
            array = array.astype(np.float32)   # a copy: the memory map can then be closed
        else:
            array = np.array(array)
        tensors[name] = array
    return tensors


def load_state_dict(checkpoint_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory, by their names in the checkpoint.

    Reads model.safetensors, or every shard listed in model.safetensors.index.json
    ("weight_map": tensor name -> shard file name in the same directory). Raises
    CheckpointError when neither file exists (PyTorch .bin checkpoints are not read: they are
    pickles, which can run code on load), when the index is not a JSON object with a
    weight_map of names to shard file names, when a shard is missing or names a path outside
    the directory, when two shards hold the same tensor, or as `read_safetensors`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    single = checkpoint_dir / "model.safetensors"
    index = checkpoint_dir / "model.safetensors.index.json"
    if single.exists():
        return read_safetensors(single)
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(s, str) for s in weight_map.values()):
            raise CheckpointError(f"{index}: needs a \"weight_map\" object mapping each tensor "
                                  "name to the shard file that holds it")
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(f"{index}: shard {shard!r} is not a file name; shards must "
                                      "sit in the checkpoint directory itself")
            if not (checkpoint_dir / shard).is_file():
                raise CheckpointError(f"{checkpoint_dir}: shard {shard} listed in "
                                      "model.safetensors.index.json is missing")
            part = read_safetensors(checkpoint_dir / shard)
            repeated = sorted(set(part) & set(tensors))
            if repeated:
                raise CheckpointError(f"{checkpoint_dir}: tensor {repeated[0]!r} is stored in more "
                                      f"than one shard ({shard} and another)")
            tensors.update(part)
        return tensors
    raise CheckpointError(
        f"{checkpoint_dir}: no model.safetensors or model.safetensors.index.json (PyTorch .bin "
        "checkpoints are not supported; re-save the model with save_pretrained, which writes "
        "safetensors)")


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A local checkpoint directory for `name_or_path`: the directory itself when it exists,
    otherwise a download of the hub id (config, tokenizer and safetensors files only) through
    `huggingface_hub.snapshot_download`, which reuses its local cache.

    Raises CheckpointError when the path is a file, or when it is not a directory and the hub
    cannot provide it (no network, unknown id, gated model), with the hub's reason.
    """
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass the checkpoint's directory")
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(str(name_or_path), allow_patterns=[
            "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "*.safetensors", "model.safetensors.index.json"])
    except Exception as err:  # the hub raises many types (offline, 404, gated); one message
        raise CheckpointError(
            f"{name_or_path!r} is not a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            "Offline? Download it on a machine with a network and pass the directory.") from err
    return Path(local)


# ---------------------------------------------------------------------------------------------
# Config: the architecture, read from config.json with Hugging Face's field names
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerConfig:
    """Everything the forward pass needs to know about a checkpoint, with HF field names.

    model_type: "qwen3", "llama" or "gpt2". head_dim is D; num_key_value_heads is Hkv (equal
    to num_attention_heads H without GQA). norm_eps is rms_norm_eps (Qwen3/Llama) or
    layer_norm_epsilon (GPT-2). rope_theta / rope_scaling are None for GPT-2, which learns its
    positions instead. eos_token_ids come from generation_config.json when it names them.
    Raises ValueError when the numbers are inconsistent (heads that do not divide, a missing
    rope theta, ...).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float | None = None
    rope_scaling: Mapping[str, float] | None = field(default=None, hash=False)
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    scale_attn_weights: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not supported (this chapter implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if not _is_real(self.norm_eps) or not math.isfinite(self.norm_eps) or self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be a finite number > 0 (got {self.norm_eps!r}): it "
                             "keeps the norm's division away from zero")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.model_type == "gpt2":
            if self.num_attention_heads * self.head_dim != self.hidden_size:
                raise ValueError("GPT-2 needs n_embd == n_head * head_dim")
        elif (not _is_real(self.rope_theta) or not math.isfinite(self.rope_theta)
              or self.rope_theta <= 0):
            raise ValueError(f"{self.model_type} uses RoPE and needs a finite rope_theta > 0 "
                             f"(got {self.rope_theta})")
        if self.model_type != "gpt2" and self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: head_dim must be even "
                             f"(got {self.head_dim})")
        for eos in self.eos_token_ids:
            if not _is_int(eos) or not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos_token_id {eos!r} must be a token id in "
                                 f"[0, vocab_size={self.vocab_size})")

    @property
    def is_rope(self) -> bool:
        """True for the Qwen3 / Llama family (rotary positions), False for GPT-2."""
        return self.model_type != "gpt2"

    @classmethod
    def from_hf_dict(cls, cfg: Mapping, generation_config: Mapping | None = None
                     ) -> "TransformerConfig":
        """Map a Hugging Face config.json (as a dict) to a TransformerConfig.

        Fields missing from the dict take the defaults of the matching transformers config
        class (Qwen3Config, LlamaConfig, GPT2Config in transformers v5), since save_pretrained
        may leave defaults out; as there, a null num_key_value_heads means "one K/V head per
        query head" and a null head_dim / n_inner the family's derived value. Both the v5
        `rope_parameters` dict and the older top-level `rope_theta` / `rope_scaling` are read.
        EOS ids: generation_config's eos_token_id when present (an int or a list), else
        config.json's; every one must be a token id in [0, vocab_size).

        Raises CheckpointError naming the field and the rule for a value of the wrong type or
        out of range (a size that is not an integer >= 1, an epsilon or rope theta that is not
        a finite number > 0, a flag that is not true/false, an EOS id outside the vocabulary),
        and UnsupportedArchitectureError for another model_type or a feature not implemented
        here (sliding-window attention, an activation other than the family's, a rope type
        other than default/linear/llama3, GPT-2's per-layer attention scaling).
        """
        if not isinstance(cfg, Mapping):
            raise CheckpointError(f"config must be a JSON object, found a JSON {_json_type(cfg)}")
        if generation_config is not None and not isinstance(generation_config, Mapping):
            raise CheckpointError("generation_config must be a JSON object, found a JSON "
                                  f"{_json_type(generation_config)}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} (architectures {cfg.get('architectures')}) is not "
                f"supported; this chapter implements {', '.join(SUPPORTED_MODEL_TYPES)}")

        def integer(key: str, default: int | None) -> int:
            value = cfg.get(key, default)
            if not _is_int(value) or value < 1:
                raise CheckpointError(f"config field {key} must be an integer >= 1 (got {value!r})")
            return int(value)

        def positive(key: str, default: float, where: Mapping = cfg, label: str = "config field"
                     ) -> float:
            value = where.get(key, default)
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"{label} {key} must be a finite number > 0 (got {value!r})")
            return float(value)

        def flag(key: str, default: bool) -> bool:
            value = cfg.get(key, default)
            if not isinstance(value, bool):
                raise CheckpointError(f"config field {key} must be true or false (got {value!r})")
            return value

        def optional_id(key: str, default: int | None, where: Mapping = cfg,
                        label: str = "config field") -> int | None:
            value = where.get(key, default)
            if value is not None and not _is_int(value):
                raise CheckpointError(f"{label} {key} must be an integer or null (got {value!r})")
            return value

        gen = dict(generation_config or {})
        vocab_default = {"gpt2": 50257, "qwen3": 151936, "llama": 32000}[model_type]
        vocab_size = integer("vocab_size", vocab_default)
        eos_lists = {}  # both files' EOS ids are checked, though generation_config's win
        for source, where, default in (
                ("config.json", cfg, 50256 if model_type == "gpt2" else 2 if model_type == "llama"
                 else None), ("generation_config.json", gen, None)):
            eos = where.get("eos_token_id", default)
            eos_lists[source] = eos if isinstance(eos, list) else [] if eos is None else [eos]
            for i in eos_lists[source]:
                if not _is_int(i) or not 0 <= i < vocab_size:
                    raise CheckpointError(f"eos_token_id {i!r} ({source}) must be a token id in "
                                          f"[0, vocab_size={vocab_size})")
        eos_list = (eos_lists["generation_config.json"]
                    if gen.get("eos_token_id") is not None else eos_lists["config.json"])
        pad = (optional_id("pad_token_id", None, gen, "generation_config.json field")
               if gen.get("pad_token_id") is not None else optional_id("pad_token_id", None))
        common = dict(pad_token_id=pad, eos_token_ids=tuple(int(i) for i in eos_list))

        if model_type == "gpt2":
            act = cfg.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise UnsupportedArchitectureError(
                    f"GPT-2 activation_function {act!r} is not supported (only the tanh GELU: "
                    "gelu_new, gelu_pytorch_tanh)")
            if cfg.get("scale_attn_by_inverse_layer_idx", False):
                raise UnsupportedArchitectureError(
                    "GPT-2 scale_attn_by_inverse_layer_idx=True is not supported")
            if cfg.get("add_cross_attention", False):
                raise UnsupportedArchitectureError("GPT-2 cross-attention is not supported")
            hidden, heads = integer("n_embd", 768), integer("n_head", 12)
            inner = 4 * hidden if cfg.get("n_inner") is None else integer("n_inner", None)
            return cls(
                model_type="gpt2", vocab_size=vocab_size, hidden_size=hidden,
                num_hidden_layers=integer("n_layer", 12), num_attention_heads=heads,
                num_key_value_heads=heads, head_dim=hidden // heads, intermediate_size=inner,
                max_position_embeddings=integer("n_positions", 1024),
                norm_eps=positive("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=flag("tie_word_embeddings", True),
                attention_bias=True, mlp_bias=True, hidden_act="gelu_tanh",
                scale_attn_weights=flag("scale_attn_weights", True),
                bos_token_id=optional_id("bos_token_id", 50256), **common)

        is_qwen3 = model_type == "qwen3"
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"{model_type} hidden_act {act!r} is not "
                                               "supported (only silu, as in SwiGLU)")
        layer_types = cfg.get("layer_types") or []
        if cfg.get("use_sliding_window", False) or "sliding_attention" in layer_types:
            raise UnsupportedArchitectureError(
                f"{model_type} sliding-window attention is not supported")
        rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        rope = cfg.get(rope_key) or {}
        if not isinstance(rope, Mapping):
            raise CheckpointError(f"config field {rope_key} must be an object (got {rope!r})")
        rope = dict(rope)
        rope_theta = (positive("rope_theta", None, rope, f"config field {rope_key}:")
                      if rope.get("rope_theta") is not None else positive("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedArchitectureError(
                f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedArchitectureError("partial_rotary_factor != 1 is not supported")
        max_positions = integer("max_position_embeddings", 32768 if is_qwen3 else 2048)
        rope_scaling = None
        if rope_type != "default":
            label = f"config field {rope_key}:"
            rope_scaling = {"rope_type": rope_type, "factor": positive("factor", None, rope, label)}
            if rope_type == "llama3":
                low = positive("low_freq_factor", None, rope, label)
                high = positive("high_freq_factor", None, rope, label)
                if high <= low:
                    raise CheckpointError(f"{label} high_freq_factor ({high}) must be greater than "
                                          f"low_freq_factor ({low})")
                original = rope.get("original_max_position_embeddings", max_positions)
                if not _is_int(original) or original < 1:
                    raise CheckpointError(f"{label} original_max_position_embeddings must be an "
                                          f"integer >= 1 (got {original!r})")
                rope_scaling.update(low_freq_factor=low, high_freq_factor=high,
                                    original_max_position_embeddings=float(original))
        hidden, heads = integer("hidden_size", 4096), integer("num_attention_heads", 32)
        # As in transformers: Qwen3Config's class default is 128 / 32, LlamaConfig derives both;
        # an explicit null means "derive" (one K/V head per query head, C / H dims per head).
        head_dim = (hidden // heads if cfg.get("head_dim", 0 if is_qwen3 else None) is None
                    else integer("head_dim", 128))
        kv_heads = (heads if cfg.get("num_key_value_heads", 0 if is_qwen3 else None) is None
                    else integer("num_key_value_heads", 32))
        return cls(
            model_type=model_type, vocab_size=vocab_size, hidden_size=hidden,
            num_hidden_layers=integer("num_hidden_layers", 32), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=integer("intermediate_size", 22016 if is_qwen3 else 11008),
            max_position_embeddings=max_positions,
            norm_eps=positive("rms_norm_eps", 1e-6),
            tie_word_embeddings=flag("tie_word_embeddings", False),
            rope_theta=rope_theta, rope_scaling=rope_scaling, qk_norm=is_qwen3,
            attention_bias=flag("attention_bias", False),
            mlp_bias=False if is_qwen3 else flag("mlp_bias", False),
            hidden_act="silu", bos_token_id=optional_id("bos_token_id", None if is_qwen3 else 1),
            **common)

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> "TransformerConfig":
        """Read config.json (and generation_config.json when present) from a directory.
        Raises CheckpointError naming the directory when config.json is missing, when either
        file is not a readable JSON object, or for any value `from_hf_dict` or the class
        rejects (UnsupportedArchitectureError for an architecture not implemented here)."""
        checkpoint_dir = Path(checkpoint_dir)
        cfg_path = checkpoint_dir / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{checkpoint_dir}: no config.json")
        gen_path = checkpoint_dir / "generation_config.json"
        gen = read_json_object(gen_path) if gen_path.exists() else None
        cfg = read_json_object(cfg_path)
        try:
            return cls.from_hf_dict(cfg, gen)
        except CheckpointError as err:  # keep the subclass, name the checkpoint
            raise type(err)(f"{checkpoint_dir}: {err}") from None
        except ValueError as err:       # the dataclass's own consistency checks
            raise CheckpointError(f"{checkpoint_dir}: config.json: {err}") from None


# ---------------------------------------------------------------------------------------------
# The building blocks, as functions of arrays
# ---------------------------------------------------------------------------------------------

def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x W^T + b with W stored (out, in), the torch.nn.Linear layout of HF checkpoints.
    x: float32 (T, in). Returns float32 (T, out). This is where a transformer's FLOPs are."""
    y = x @ weight.T
    return y if bias is None else y + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps) * weight, over the last axis.

    No mean subtraction and no bias, unlike LayerNorm. x: float32 (..., N); weight (N,).
    Returns float32 (..., N). As in HF's LlamaRMSNorm / Qwen3RMSNorm.
    """
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm (Ba et al., 2016): (x - mean) / sqrt(var + eps) * weight + bias, last axis,
    biased variance as torch.nn.LayerNorm. x: float32 (..., N). Returns float32 (..., N)."""
    mean = np.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = np.mean(centered * centered, axis=-1, keepdims=True)
    return centered / np.sqrt(variance + eps) * weight + bias


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Mapping[str, float] | None = None
                  ) -> np.ndarray:
    """The RoPE rotation speeds: inv_freq[i] = theta^(-2i / D) radians per position, i < D/2.

    Dimension pair i turns by angle position * inv_freq[i]: the first pairs spin fast (fine
    position), the last slowly (coarse position). A larger theta slows all of them, which is
    how long-context checkpoints (theta 1e6 in Qwen3) keep far positions apart.
    rope_scaling: None, {"rope_type": "linear", "factor": f} (every speed divided by f), or
    Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}: wavelengths longer than original/low_freq_factor are
    divided by factor, shorter than original/high_freq_factor kept, and the band between
    interpolated. Returns float32 (D/2,). Follows HF modeling_rope_utils
    (_compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
    _compute_llama3_parameters).
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope_type != "default":
        raise UnsupportedArchitectureError(f"rope_type {rope_type!r} is not supported")
    return inv_freq.astype(np.float32)


def rope(positions: np.ndarray | Sequence[int], inv_freq: np.ndarray
         ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every rotation angle for the given absolute positions.

    positions: ints (T,), the token's index in its sequence (0 for the first prompt token),
    not its index in this step: a decode step at position 57 passes [57]. inv_freq: (D/2,).
    Returns cos, sin: float32 (T, D), the D/2 angles written twice, matching the rotate-half
    layout of `apply_rope`.
    """
    angles = np.outer(np.asarray(positions, dtype=np.float32), inv_freq)  # (T, D/2)
    angles = np.concatenate([angles, angles], axis=-1)                    # (T, D)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each (x[i], x[i + D/2]) pair of every head by its angle (RoFormer, 2021).

    The "rotate half" pairing (dimension i with i + D/2) is the one HF Llama/Qwen checkpoints
    are trained with; the paper pairs neighbours (2i, 2i + 1), which gives different numbers on
    the same weights. x: float32 (H, T, D); cos, sin: (T, D) from `rope`. Returns (H, T, D).
    Because q and k are both rotated by their own position, q.k depends only on the distance.
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # (H, T, D)
    return x * cos + rotated * sin


def attention_probs(q: np.ndarray, k: np.ndarray, q_positions: np.ndarray,
                    k_positions: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Causal attention weights softmax(q k^T * scale), with grouped-query head sharing.

    q: float32 (H, T, D); k: float32 (Hkv, S, D) with H a multiple of Hkv. Query head h reads
    key head h // (H / Hkv) (HF's repeat_kv order). q_positions (T,), k_positions (S,) are
    absolute positions: query t may read key s only when k_positions[s] <= q_positions[t]
    (causal mask). scale defaults to 1 / sqrt(D). Returns float32 (H, T, S), rows summing to 1.
    Raises ValueError when the head counts do not divide or a query can see no key.
    """
    n_heads, t_len, head_dim = q.shape
    n_kv_heads, s_len, _ = k.shape
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads "
                         f"({n_kv_heads})")
    scale = head_dim ** -0.5 if scale is None else scale
    group = n_heads // n_kv_heads
    q_grouped = q.reshape(n_kv_heads, group, t_len, head_dim)       # (Hkv, H/Hkv, T, D)
    scores = q_grouped @ k[:, None].transpose(0, 1, 3, 2) * scale   # (Hkv, H/Hkv, T, S)
    visible = np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]  # (T, S)
    if not visible.any(axis=1).all():
        raise ValueError("every query needs at least one key at or before its position")
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)  # softmax is shift-invariant; no overflow
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs.reshape(n_heads, t_len, s_len).astype(np.float32, copy=False)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
              k_positions: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Causal scaled dot-product attention with grouped-query heads (Vaswani 2017; GQA 2023).

    q: float32 (H, T, D); k, v: float32 (Hkv, S, D); positions as in `attention_probs`. The keys
    and values may be longer than the queries (S > T): that is how a KV cache (S05) hands a
    decode step the past. Returns float32 (H, T, D): each query's weighted mix of the values.
    """
    probs = attention_probs(q, k, q_positions, k_positions, scale)  # (H, T, S)
    n_heads, t_len, s_len = probs.shape
    n_kv_heads = v.shape[0]
    group = n_heads // n_kv_heads
    out = probs.reshape(n_kv_heads, group, t_len, s_len) @ v[:, None]  # (Hkv, H/Hkv, T, D)
    return out.reshape(n_heads, t_len, v.shape[-1])


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: x * sigmoid(x). Elementwise, float32."""
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel, 2016), as GPT-2 was trained ("gelu_new"):
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Elementwise, float32."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + 0.044715 * x ** 3)))


def swiglu_mlp(x: np.ndarray, gate_proj: np.ndarray, up_proj: np.ndarray,
               down_proj: np.ndarray) -> np.ndarray:
    """SwiGLU MLP (Shazeer, 2020): down(silu(gate(x)) * up(x)).

    x: float32 (T, C); gate_proj, up_proj: (I, C); down_proj: (C, I). Returns (T, C). Three
    matmuls of C x I each: two thirds of a Llama/Qwen layer's weights live here.
    """
    return linear(silu(linear(x, gate_proj)) * linear(x, up_proj), down_proj)


def gpt2_mlp(x: np.ndarray, c_fc_w: np.ndarray, c_fc_b: np.ndarray, c_proj_w: np.ndarray,
             c_proj_b: np.ndarray) -> np.ndarray:
    """GPT-2's MLP: proj(gelu_tanh(fc(x))), weights as GPT-2 stores them, input-major.

    x: float32 (T, C); c_fc_w: (C, I); c_proj_w: (I, C) (GPT-2's "Conv1D" keeps W as (in, out),
    so the product is x @ W, not x @ W^T). Returns (T, C).
    """
    return gelu_tanh(x @ c_fc_w + c_fc_b) @ c_proj_w + c_proj_b


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """(T, n_heads * D) -> (n_heads, T, D): one matrix per head."""
    t_len = x.shape[0]
    return x.reshape(t_len, n_heads, -1).transpose(1, 0, 2)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(n_heads, T, D) -> (T, n_heads * D), the inverse of `split_heads`."""
    n_heads, t_len, head_dim = x.shape
    return x.transpose(1, 0, 2).reshape(t_len, n_heads * head_dim)


# ---------------------------------------------------------------------------------------------
# Blocks: qkv -> attention -> finish, so a KV cache can sit between the steps
# ---------------------------------------------------------------------------------------------

class Qwen3Block:
    """One Qwen3 / Llama decoder layer (pre-norm), weights from an HF checkpoint.

        h = x + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))  with q, k, v from
                                                            q/k/v_proj(rms_norm(x))
        out = h + swiglu_mlp(rms_norm(h))

    Llama is the same layer without q_norm / k_norm (Qwen3 added them to keep attention logits
    in range), so one class serves both; `config.qk_norm` says which. Weights (HF names, layout
    (out, in)): self_attn.{q,k,v,o}_proj.weight [(+ .bias when attention_bias)],
    self_attn.{q,k}_norm.weight (D,) for Qwen3, mlp.{gate,up,down}_proj.weight,
    input_layernorm.weight, post_attention_layernorm.weight (C,).

    The forward pass is split in three so S05 can cache keys and values between them:
    `qkv` (new tokens -> q, k, v at their positions), `attention` (a free function: q against
    any K/V), `finish` (output projection, residual, MLP).
    """

    def __init__(self, config: TransformerConfig, weights: Mapping[str, np.ndarray]):
        self.config = config
        self.w = dict(weights)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def _proj(self, x: np.ndarray, name: str) -> np.ndarray:
        return linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def qkv(self, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries, keys and values of the tokens in x, rotated to their absolute positions.

        x: float32 (T, C), the residual stream entering the layer; positions: ints (T,).
        Returns q (H, T, D), k (Hkv, T, D), v (Hkv, T, D), float32.
        """
        cfg = self.config
        h = rms_norm(x, self.w["input_layernorm.weight"], cfg.norm_eps)
        q = split_heads(self._proj(h, "self_attn.q_proj"), cfg.num_attention_heads)  # (H, T, D)
        k = split_heads(self._proj(h, "self_attn.k_proj"), cfg.num_key_value_heads)  # (Hkv, T, D)
        v = split_heads(self._proj(h, "self_attn.v_proj"), cfg.num_key_value_heads)  # (Hkv, T, D)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's D dims, before the rotation
            q = rms_norm(q, self.w["self_attn.q_norm.weight"], cfg.norm_eps)
            k = rms_norm(k, self.w["self_attn.k_norm.weight"], cfg.norm_eps)
        cos, sin = rope(positions, self.inv_freq)  # (T, D) each
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """The rest of the layer after attention: output projection, residual, MLP, residual.
        x: float32 (T, C), the layer's input; attn: (H, T, D) from `attention`. Returns (T, C)."""
        cfg = self.config
        h = x + self._proj(merge_heads(attn), "self_attn.o_proj")
        m = rms_norm(h, self.w["post_attention_layernorm.weight"], cfg.norm_eps)
        if cfg.mlp_bias:
            return h + linear(silu(self._proj(m, "mlp.gate_proj")) * self._proj(m, "mlp.up_proj"),
                              self.w["mlp.down_proj.weight"], self.w["mlp.down_proj.bias"])
        return h + swiglu_mlp(m, self.w["mlp.gate_proj.weight"], self.w["mlp.up_proj.weight"],
                              self.w["mlp.down_proj.weight"])

    def attention_scale(self) -> float:
        """1/sqrt(D), the softmax temperature of q.k (same method on `GPT2Block`)."""
        return self.config.head_dim ** -0.5

    def forward(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The whole layer without a cache: every token attends to the tokens of x up to itself.
        x: float32 (T, C); positions: ints (T,). Returns float32 (T, C)."""
        q, k, v = self.qkv(x, positions)
        return self.finish(x, attention(q, k, v, positions, positions, self.attention_scale()))


LlamaBlock = Qwen3Block  # the same layer; config.qk_norm is False for Llama


class GPT2Block:
    """One GPT-2 decoder layer (pre-norm), weights as GPT-2 checkpoints store them.

        h = x + c_proj(attention(split(c_attn(layer_norm_1(x)))))
        out = h + gpt2_mlp(layer_norm_2(h))

    c_attn is one fused projection producing q, k and v side by side (C -> 3C), and every
    weight is stored input-major (in, out) ("Conv1D"). No rotary positions: GPT-2 adds a
    learned position vector to the embedding instead, so `qkv` ignores positions beyond
    passing them through. Same qkv -> attention -> finish split as `Qwen3Block`.
    """

    def __init__(self, config: TransformerConfig, weights: Mapping[str, np.ndarray]):
        self.config = config
        self.w = dict(weights)

    def qkv(self, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v (H, T, D) each from x (T, C); positions are unused (see the class docstring)."""
        cfg = self.config
        h = layer_norm(x, self.w["ln_1.weight"], self.w["ln_1.bias"], cfg.norm_eps)
        fused = h @ self.w["attn.c_attn.weight"] + self.w["attn.c_attn.bias"]  # (T, 3C)
        q, k, v = np.split(fused, 3, axis=-1)                                   # (T, C) each
        heads = cfg.num_attention_heads
        return split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)

    def finish(self, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """Output projection, residual, MLP, residual. x: (T, C); attn: (H, T, D). Returns (T, C)."""
        cfg = self.config
        h = x + merge_heads(attn) @ self.w["attn.c_proj.weight"] + self.w["attn.c_proj.bias"]
        m = layer_norm(h, self.w["ln_2.weight"], self.w["ln_2.bias"], cfg.norm_eps)
        return h + gpt2_mlp(m, self.w["mlp.c_fc.weight"], self.w["mlp.c_fc.bias"],
                            self.w["mlp.c_proj.weight"], self.w["mlp.c_proj.bias"])

    def attention_scale(self) -> float:
        """1/sqrt(D), or 1 when the checkpoint was trained with scale_attn_weights=False."""
        return self.config.head_dim ** -0.5 if self.config.scale_attn_weights else 1.0

    def forward(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The whole layer without a cache. x: float32 (T, C); positions (T,). Returns (T, C)."""
        q, k, v = self.qkv(x, positions)
        return self.finish(x, attention(q, k, v, positions, positions, self.attention_scale()))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

# Tensors some checkpoints carry that are not weights: GPT-2's stored causal masks, old
# Llama exports' cached RoPE frequencies. They are recomputed here, so skipping them is safe.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def expected_tensors(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold for this config, with its shape, in HF's
    naming ("model.layers.0.self_attn.q_proj.weight", "transformer.h.0.attn.c_attn.weight").
    lm_head.weight is expected only when the head is not tied to the embeddings."""
    c, i_size, v = config.hidden_size, config.intermediate_size, config.vocab_size
    h_d, kv_d = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if config.model_type == "gpt2":
        shapes["transformer.wte.weight"] = (v, c)
        shapes["transformer.wpe.weight"] = (config.max_position_embeddings, c)
        for layer in range(config.num_hidden_layers):
            p = f"transformer.h.{layer}."
            for norm in ("ln_1", "ln_2"):
                shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (c,)
            shapes[p + "attn.c_attn.weight"], shapes[p + "attn.c_attn.bias"] = (c, 3 * c), (3 * c,)
            shapes[p + "attn.c_proj.weight"], shapes[p + "attn.c_proj.bias"] = (c, c), (c,)
            shapes[p + "mlp.c_fc.weight"], shapes[p + "mlp.c_fc.bias"] = (c, i_size), (i_size,)
            shapes[p + "mlp.c_proj.weight"], shapes[p + "mlp.c_proj.bias"] = (i_size, c), (c,)
        shapes["transformer.ln_f.weight"] = shapes["transformer.ln_f.bias"] = (c,)
    else:
        shapes["model.embed_tokens.weight"] = (v, c)
        for layer in range(config.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (c,)
            for name, out_dim in (("q_proj", h_d), ("k_proj", kv_d), ("v_proj", kv_d)):
                shapes[p + f"self_attn.{name}.weight"] = (out_dim, c)
                if config.attention_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (out_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (c, h_d)
            if config.attention_bias:
                shapes[p + "self_attn.o_proj.bias"] = (c,)
            if config.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
            shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (i_size, c)
            shapes[p + "mlp.down_proj.weight"] = (c, i_size)
            if config.mlp_bias:
                shapes[p + "mlp.gate_proj.bias"] = shapes[p + "mlp.up_proj.bias"] = (i_size,)
                shapes[p + "mlp.down_proj.bias"] = (c,)
        shapes["model.norm.weight"] = (c,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, c)
    return shapes


def check_state_dict(config: TransformerConfig, state_dict: Mapping[str, np.ndarray]
                     ) -> dict[str, np.ndarray]:
    """The tensors the model uses, checked against the config; GPT-2 names are normalised.

    Original GPT-2 checkpoints name tensors without the "transformer." prefix ("h.0.ln_1.weight");
    they get it here. Known non-weight buffers are dropped, and so is a stored lm_head.weight
    when the head is tied (it is then a copy of the embeddings).
    Raises MissingTensorError listing the missing tensors, CheckpointError for a tensor with the
    wrong shape or a dtype that is not floating point (an I32 tensor is not reinterpreted as
    weights), or an unexpected tensor (which means an architecture feature the config did not
    announce and this code would silently ignore).
    """
    tensors = dict(state_dict)
    if config.model_type == "gpt2" and "transformer.wte.weight" not in tensors:
        tensors = {("transformer." + k if not k.startswith(("transformer.", "lm_head.")) else k): t
                   for k, t in tensors.items()}
    tensors = {k: t for k, t in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = expected_tensors(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingTensorError(f"checkpoint is missing {len(missing)} tensor(s) the "
                                 f"{config.model_type} config requires: {shown}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint has tensor(s) the {config.model_type} config does not "
                              f"account for: {', '.join(unexpected[:8])}")
    for name, shape in expected.items():
        dtype = np.asarray(tensors[name]).dtype
        if not np.issubdtype(dtype, np.floating):
            # An integer tensor's bytes are not weights: casting them would run garbage.
            raise CheckpointError(f"tensor {name} has dtype {dtype}: model weights must be "
                                  "floating point (F32, F16, BF16 or F64 in safetensors)")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(tensors[name].shape)}, the config "
                                  f"implies {list(shape)}")
    return {name: np.ascontiguousarray(tensors[name], dtype=np.float32) for name in expected}


class Transformer:
    """A decoder-only transformer in NumPy float32: Qwen3, Llama or GPT-2 weights.

    forward(token_ids) -> logits (T, V), the S01 model contract. Build it with
    `Transformer.from_pretrained(dir_or_hub_id)` or from a config and a state dict (HF tensor
    names; see `expected_tensors`). Attributes: config, blocks (L blocks with
    qkv/finish/forward), and the embedding and head tensors.
    """

    def __init__(self, config: TransformerConfig, state_dict: Mapping[str, np.ndarray]):
        self.config = config
        w = check_state_dict(config, state_dict)
        if config.model_type == "gpt2":
            self.embed_tokens = w["transformer.wte.weight"]    # (V, C)
            self.embed_positions = w["transformer.wpe.weight"]  # (max_position_embeddings, C)
            self.blocks = [GPT2Block(config, _strip(w, f"transformer.h.{i}."))
                           for i in range(config.num_hidden_layers)]
            self.final_norm = (w["transformer.ln_f.weight"], w["transformer.ln_f.bias"])
        else:
            self.embed_tokens = w["model.embed_tokens.weight"]  # (V, C)
            self.embed_positions = None
            self.blocks = [Qwen3Block(config, _strip(w, f"model.layers.{i}."))
                           for i in range(config.num_hidden_layers)]
            self.final_norm = (w["model.norm.weight"],)
        # A tied head reuses the embedding matrix: the same (V, C) numbers read in reverse.
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else w["lm_head.weight"]

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path) -> "Transformer":
        """Load config.json (+ generation_config.json) and the safetensors weights from a
        checkpoint directory or a hub id. Raises CheckpointError (see `resolve_checkpoint`,
        `load_state_dict`, `check_state_dict`) or UnsupportedArchitectureError."""
        checkpoint_dir = resolve_checkpoint(name_or_path)
        config = TransformerConfig.from_pretrained(checkpoint_dir)
        state_dict = load_state_dict(checkpoint_dir)
        try:
            return cls(config, state_dict)
        except CheckpointError as err:  # keep the subclass, name the checkpoint
            raise type(err)(f"{checkpoint_dir}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def check_positions(self, token_ids: Sequence[int], positions: Sequence[int] | None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Validate a step's input. Returns ids and positions as int64 (T,).
        Raises ValueError for an empty or non-1-D sequence, an id or position that is not an
        integer (1.5 or True is never truncated to an id), an id outside [0, V) (however large:
        2**63 is out of range, not an overflow), positions of another length, or a position
        outside [0, max_position_embeddings)."""
        ids = _integers_in_range(token_ids, self.vocab_size, "token ids", "forward needs a "
                                 "non-empty 1-D sequence of token ids", f"[0, {self.vocab_size})")
        limit = self.config.max_position_embeddings
        if positions is None:
            return ids, np.arange(ids.size)
        pos = _integers_in_range(positions, limit, "positions", "positions must be a 1-D sequence",
                                 f"[0, max_position_embeddings={limit})")
        if pos.shape != ids.shape:
            raise ValueError(f"positions must have one entry per token ({ids.size}), got {pos.shape}")
        return ids, pos

    def embed(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Token embedding rows (plus GPT-2's learned position rows). Returns float32 (T, C)."""
        x = self.embed_tokens[token_ids]
        if self.embed_positions is not None:
            x = x + self.embed_positions[positions]
        return x

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm, then the LM head: hidden states (T, C) -> logits float32 (T, V)."""
        if self.config.model_type == "gpt2":
            x = layer_norm(x, *self.final_norm, self.config.norm_eps)
        else:
            x = rms_norm(x, *self.final_norm, self.config.norm_eps)
        return x @ self.lm_head.T

    def forward(self, token_ids: Sequence[int], positions: Sequence[int] | None = None
                ) -> np.ndarray:
        """Logits for the token after each position, recomputing everything (no cache).

        token_ids: T ints in [0, V); positions: their absolute positions, default 0..T-1.
        Returns float32 (T, V). Raises ValueError as `check_positions`.
        """
        ids, pos = self.check_positions(token_ids, positions)
        x = self.embed(ids, pos)  # (T, C)
        for block in self.blocks:
            x = block.forward(x, pos)
        return self.head(x).astype(np.float32, copy=False)


def _integers_in_range(values: Sequence[int], limit: int, what: str, shape_rule: str,
                       bounds: str) -> np.ndarray:
    """values as int64 (T,), after checking they are a non-empty 1-D run of integers in
    [0, limit). NumPy alone would truncate 1.5 to 1, read True as 1, overflow on 2**63 or turn
    [3, 2**63] into floats, hence the explicit checks (Python values one by one, arrays by
    dtype). Raises ValueError with `shape_rule`, or naming `what` and `bounds`."""
    if isinstance(values, (list, tuple)):
        if not values or any(isinstance(v, (list, tuple, np.ndarray)) for v in values):
            raise ValueError(shape_rule)
        if not all(_is_int(v) for v in values):
            bad = next(v for v in values if not _is_int(v))
            raise ValueError(f"{what} must be integers (got {bad!r})")
        if not all(0 <= v < limit for v in values):
            raise ValueError(f"{what} must lie in {bounds}")
        return np.array(values, dtype=np.int64)
    raw = np.asarray(values)
    if raw.ndim != 1 or raw.size == 0:
        raise ValueError(shape_rule)
    if raw.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers (got dtype {raw.dtype})")
    if raw.min() < 0 or raw.max() >= limit:
        raise ValueError(f"{what} must lie in {bounds}")
    return raw.astype(np.int64, copy=False)


def _strip(tensors: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------------
# Tokenizer of a checkpoint
# ---------------------------------------------------------------------------------------------

class CheckpointTokenizer:
    """A checkpoint's tokenizer.json, with the interface S01's Engine needs.

    encode(text) -> ids adds the checkpoint's special tokens the way `transformers` does by
    default (for example Llama's BOS; nothing for GPT-2, Qwen3 or the bundled model), and, as
    S02's `BPETokenizer.encode`, treats special-token strings typed in the text as plain text:
    a user who writes "<|endoftext|>" gets its ordinary pieces, never the EOS id, unless the
    caller allows it with `allowed_special`. decode drops special tokens. eos_id is the first
    EOS id of the config (generation_config.json first); eos_ids lists all of them. Read with
    the HF `tokenizers` library, which runs any tokenizer.json, including the one S02 exports.
    Raises CheckpointError when tokenizer.json is missing or unreadable, or no EOS id is known.
    """

    def __init__(self, tokenizer_json: str | Path, eos_ids: Sequence[int]):
        from tokenizers import Tokenizer
        path = Path(tokenizer_json)
        if not path.exists():
            raise CheckpointError(f"{path.parent}: no tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise CheckpointError(f"{path}: not a tokenizer.json the HF tokenizers library can "
                                  f"read ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                                  ) from None
        # Special-token strings in the text are ordinary text (HF's `split_special_tokens`).
        self.tokenizer.encode_special_tokens = True
        self._with_specials = None  # a second copy that recognises them, built on first need
        self.special_tokens = {token.content: token_id for token_id, token
                               in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        if not eos_ids:
            raise CheckpointError(f"{path.parent}: neither generation_config.json nor config.json "
                                  "names an eos_token_id")
        self.eos_ids = tuple(eos_ids)
        self.eos_id = self.eos_ids[0]

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path) -> "CheckpointTokenizer":
        """The tokenizer of a checkpoint directory or hub id (see `resolve_checkpoint`)."""
        checkpoint_dir = resolve_checkpoint(name_or_path)
        config = TransformerConfig.from_pretrained(checkpoint_dir)
        return cls(checkpoint_dir / "tokenizer.json", config.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, allowed_special: Iterable[str] | str = ()) -> list[int]:
        """Text -> token ids, with the checkpoint's template tokens (a BOS) added.

        allowed_special: as in S02's `BPETokenizer.encode`, the special-token strings to
        recognise in `text` ("all" for every one); by default none is. With some allowed, the
        text is split at them, the pieces between are encoded as ordinary text and the special
        ids put between (the same ids HF gives with its special-token matching on, for
        byte-level BPE tokenizers). Raises ValueError when `text` is not a str or is not valid
        Unicode (a lone surrogate such as "\\ud800" has no UTF-8 encoding), or for an allowed
        name that is not a special token of this tokenizer.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str (got {type(text).__name__})")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"text must be valid Unicode: {err.object[err.start]!r} at index "
                             f"{err.start} is a lone surrogate, which has no UTF-8 encoding"
                             ) from None
        if isinstance(allowed_special, str):
            if allowed_special != "all":
                raise ValueError("allowed_special must be 'all' or a collection of special tokens")
            allowed = set(self.special_tokens)
        else:
            allowed = set(allowed_special)
            unknown = allowed - set(self.special_tokens)
            if unknown:
                raise ValueError(f"allowed_special names tokens that are not special tokens: "
                                 f"{sorted(unknown)}")
        if not allowed or not any(s in text for s in allowed):
            return self.tokenizer.encode(text).ids
        from tokenizers import Encoding, Tokenizer
        if self._with_specials is None:
            self._with_specials = Tokenizer.from_str(self.tokenizer.to_str())
            self._with_specials.encode_special_tokens = False
        # Longest first, so a special token that is a prefix of another never wins wrongly.
        pattern = "(" + "|".join(re.escape(s) for s in sorted(allowed, key=len, reverse=True)) + ")"
        parts = [(self._with_specials if i % 2 else self.tokenizer).encode(
                     chunk, add_special_tokens=False)
                 for i, chunk in enumerate(re.split(pattern, text)) if chunk]
        return self.tokenizer.post_process(Encoding.merge(parts, growing_offsets=True)).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load(name_or_path: str | Path = BUNDLED_MODEL_DIR) -> tuple[Transformer, CheckpointTokenizer]:
    """Model and tokenizer of a checkpoint directory or hub id (default: the bundled model)."""
    checkpoint_dir = resolve_checkpoint(name_or_path)
    return (Transformer.from_pretrained(checkpoint_dir),
            CheckpointTokenizer.from_pretrained(checkpoint_dir))


# ---------------------------------------------------------------------------------------------
# Size and cost from the config: parameters, FLOPs and bytes per token
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PartCost:
    """One row of `cost_breakdown`: a part of the model, its parameters, and what it costs for
    one token that attends to `context_len` positions (itself included).

    flops: floating-point operations of the part's matrix products (a multiply-add is 2).
    bytes: bytes read from memory for one decode step at batch 1 with a KV cache: every weight
    of the part once, plus, for attention, the cached K and V of the context (and the new K, V
    written). Activations are not counted: at these sizes they are a rounding error.
    """

    part: str
    params: int
    flops: int
    bytes: int


def _check_cost_args(context_len: int, dtype_bytes: int) -> None:
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1 (got {context_len})")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1 (got {dtype_bytes})")


def layer_breakdown(config: TransformerConfig, context_len: int = 1, dtype_bytes: int = 4
                    ) -> list[PartCost]:
    """The anatomy of one decoder layer for one token attending to S = context_len positions.

    Rows:
    - "q, k, v, o projections": C x (H + 2 Hkv) D in, H D x C out; 2 FLOPs per weight.
    - "attention (q k^T, p v)": no weights; 2 H D S FLOPs for the scores and 2 H D S for the
      weighted sum of values; reads the cached K and V of S - 1 positions and writes the new
      token's (2 Hkv D values each).
    - "mlp": 3 matrices of C x I (SwiGLU) or 2 (GPT-2), plus biases where the model has them.
    - "norms": RMSNorm / LayerNorm weights (Qwen3's q/k norms included); O(C) work, counted as
      0 FLOPs like RoPE, softmax and activations.
    Raises ValueError for context_len < 1 or dtype_bytes < 1.
    """
    _check_cost_args(context_len, dtype_bytes)
    cfg = config
    c, i_size, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h_d, kv_d = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    gpt2 = cfg.model_type == "gpt2"
    proj_weights = c * h_d + 2 * c * kv_d + h_d * c
    proj_params = proj_weights + ((h_d + 2 * kv_d + c) if cfg.attention_bias else 0)
    mlp_weights = (2 if gpt2 else 3) * c * i_size
    mlp_params = mlp_weights + ((i_size + c) if gpt2 else ((2 * i_size + c) if cfg.mlp_bias else 0))
    norm_params = (4 * c) if gpt2 else (2 * c + (2 * d if cfg.qk_norm else 0))
    kv_bytes = 2 * kv_d * (context_len - 1) * dtype_bytes + 2 * kv_d * dtype_bytes  # read + write
    return [
        PartCost("q, k, v, o projections", proj_params, 2 * proj_weights, proj_params * dtype_bytes),
        PartCost("attention (q k^T, p v)", 0, 2 * 2 * h_d * context_len, kv_bytes),
        PartCost("mlp", mlp_params, 2 * mlp_weights, mlp_params * dtype_bytes),
        PartCost("norms", norm_params, 0, norm_params * dtype_bytes),
    ]


def cost_breakdown(config: TransformerConfig, context_len: int = 1, dtype_bytes: int = 4
                   ) -> list[PartCost]:
    """Parameters, FLOPs and bytes of one token's forward pass, part by part, from the config.

    Rows: "embedding" (and "position embedding" for GPT-2), "layer 0" ... "layer L-1" (each
    the sum of `layer_breakdown`), "final norm", "lm head" (0 parameters when tied to the
    embedding, but its 2 C V FLOPs and its V x C read are still there). An embedding lookup
    moves one row (C values) and does no FLOPs. Raises ValueError for context_len < 1 or
    dtype_bytes < 1. Counting conventions: Kaplan et al. 2020 (2 FLOPs per parameter per
    token) plus the attention term.
    """
    _check_cost_args(context_len, dtype_bytes)
    cfg = config
    c, v = cfg.hidden_size, cfg.vocab_size
    gpt2 = cfg.model_type == "gpt2"
    parts = layer_breakdown(cfg, context_len, dtype_bytes)
    rows = [PartCost("embedding", v * c, 0, c * dtype_bytes)]
    if gpt2:
        rows.append(PartCost("position embedding", cfg.max_position_embeddings * c, 0, c * dtype_bytes))
    for layer in range(cfg.num_hidden_layers):
        rows.append(PartCost(f"layer {layer}", sum(p.params for p in parts),
                             sum(p.flops for p in parts), sum(p.bytes for p in parts)))
    final_norm = 2 * c if gpt2 else c
    rows.append(PartCost("final norm", final_norm, 0, final_norm * dtype_bytes))
    head_params = 0 if cfg.tie_word_embeddings else v * c
    rows.append(PartCost("lm head", head_params, 2 * c * v, v * c * dtype_bytes))
    return rows


def parameter_count(config: TransformerConfig) -> int:
    """Number of parameters (a tied embedding / LM head matrix counted once)."""
    return sum(row.params for row in cost_breakdown(config))


def flops_per_token(config: TransformerConfig, context_len: int) -> int:
    """Matmul FLOPs of one token's forward pass when it attends to context_len positions
    (see `cost_breakdown`). About 2 x (parameters outside the embedding) plus 4 L H D S."""
    return sum(row.flops for row in cost_breakdown(config, context_len))


def bytes_per_token(config: TransformerConfig, context_len: int, dtype_bytes: int = 4) -> int:
    """Bytes a decode step moves at batch 1 with a KV cache of context_len - 1 positions:
    all weights (the tied head counted as read once for the head and one row for the lookup)
    plus K and V of every layer (see `cost_breakdown`). dtype_bytes: 4 for float32, 2 for
    bf16. FLOPs / bytes is the step's arithmetic intensity, about 0.5 FLOP per byte in float32:
    far below what any processor needs to be compute-bound, hence decode is bandwidth-bound."""
    return sum(row.bytes for row in cost_breakdown(config, context_len, dtype_bytes))


def format_cost_table(config: TransformerConfig, context_len: int) -> str:
    """The per-part breakdown, then one layer's anatomy, as aligned text tables."""
    def table(rows: list[PartCost], title: str) -> list[str]:
        total_p = sum(r.params for r in rows) or 1
        total_f = sum(r.flops for r in rows) or 1
        lines = [f"{title:<24} {'parameters':>12} {'share':>6} {'FLOPs/token':>13} {'share':>6} "
                 f"{'bytes/token':>13}"]
        for r in rows:
            lines.append(f"{r.part:<24} {r.params:>12,} {r.params / total_p:>6.1%} "
                         f"{r.flops:>13,} {r.flops / total_f:>6.1%} {r.bytes:>13,}")
        lines.append(f"{'total':<24} {sum(r.params for r in rows):>12,} {'':>6} "
                     f"{sum(r.flops for r in rows):>13,} {'':>6} {sum(r.bytes for r in rows):>13,}")
        return lines

    rows = cost_breakdown(config, context_len)
    flops, moved = sum(r.flops for r in rows), sum(r.bytes for r in rows)
    lines = table(rows, "part")
    lines.append("")
    lines += table(layer_breakdown(config, context_len), "inside one layer")
    lines.append(f"\n(one token attending to {context_len} positions, float32 weights, batch 1 with a "
                 f"KV cache: {flops / moved:.2f} FLOP per byte moved)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    from s01_generation_loop import Engine

    parser = argparse.ArgumentParser(
        description="Chapter 3: a NumPy transformer running real checkpoints in the S01 loop.")
    parser.add_argument("--model", default=str(BUNDLED_MODEL_DIR),
                        help="checkpoint directory or Hugging Face hub id (default: bundled model)")
    parser.add_argument("--prompt", default="Romeo.\n", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=60, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    args = parser.parse_args(argv)
    try:  # a command line in another encoding arrives as lone surrogates (surrogateescape)
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        parser.error("--prompt must be valid UTF-8 text (the command line held bytes that are "
                     "not UTF-8)")

    try:
        model, tokenizer = load(args.model)
    except CheckpointError as err:  # every loading problem is one, naming the file
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}: {parameter_count(cfg):,} parameters, L={cfg.num_hidden_layers}, "
          f"C={cfg.hidden_size}, H={cfg.num_attention_heads}, Hkv={cfg.num_key_value_heads}, "
          f"D={cfg.head_dim}, V={cfg.vocab_size}")
    engine = Engine(model, tokenizer, max_context=cfg.max_position_embeddings)
    try:
        result = engine.generate(args.prompt, args.max_tokens, args.temperature, args.seed)
    except ValueError as err:
        parser.error(str(err))
    s = result.stats
    print("--- prompt ---\n" + args.prompt)
    print("--- completion ---\n" + result.text)
    print(f"--- {s.tokens_out} tokens, finish_reason={s.finish_reason}, {s.passes} passes (no "
          f"cache: every pass recomputes the context), {sum(s.pass_times_s):.2f} s ---\n")
    context = s.prompt_tokens + s.tokens_out
    print(format_cost_table(cfg, context_len=context))


if __name__ == "__main__":
    sys.exit(main())
