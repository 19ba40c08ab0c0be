"""S03, loading: Hugging Face checkpoints read into the NumPy transformer of s03_transformer.py.

What is new since S02
    Real weights. A Hugging Face checkpoint directory (config.json, model.safetensors or a
    sharded model.safetensors.index.json, generation_config.json for the EOS ids,
    tokenizer.json) or a hub id (fetched with `huggingface_hub` when a network is there)
    becomes the `Transformer` and `TransformerConfig` of code/s03_transformer.py:
    - `read_safetensors`: the safetensors format read by hand (float32, float16, bfloat16 and
      integer tensors), every header rule checked, the way the `safetensors` package does;
    - `config_from_hf_dict` / `load_config`: config.json (with transformers' defaults for the
      fields it leaves out) mapped to the fields the forward pass needs;
    - `expected_tensors` / `check_state_dict`: the tensor names and shapes a config implies,
      checked against what the checkpoint holds (GPT-2's unprefixed names normalised);
    - `CheckpointTokenizer`: tokenizer.json run by HF `tokenizers`, with S01's tokenizer
      interface and S02's rule that special-token text typed by a user stays text;
    - `load(dir_or_hub_id)`: model and tokenizer in one call.
    Every problem is a `CheckpointError` (a ValueError) naming the file and the rule broken;
    `UnsupportedArchitectureError` for an architecture or feature the model does not implement,
    `MissingTensorError` for absent weights.

What it does not handle yet
    PyTorch .bin checkpoints (pickles, which can run code when loaded), GGUF, quantised
    weights (S14); tensors are widened to float32 on load and copied into memory, never
    memory-mapped into the model. A string with at most one "/" that is not a local directory
    ("org/name") is taken for a hub id, as transformers does.

Run it
    python code/s03_transformer.py --model path/to/checkpoint_dir   (this module has no main:
    the chapter's command line loads through it)

Tests
    tests/test_s03_transformer.py: the safetensors reader against the `safetensors` package
    (and every broken file it refuses, with the rule named), bfloat16 bits by hand, sharded
    checkpoints, original GPT-2 names, config defaults against `transformers`' AutoConfig,
    every config, index, JSON and tensor error by its message, the tokenizer against S02 and
    HF tokenizers (special tokens included), decode's id range, and a local path that does
    not exist.

References
    The safetensors file layout: huggingface/safetensors README ("Format"). Config fields and
    their defaults: transformers' configuration_gpt2.py, configuration_llama.py and
    configuration_qwen3.py (v5); tensor names: modeling_gpt2.py, modeling_llama.py,
    modeling_qwen3.py. Hub downloads: huggingface_hub's `snapshot_download`.

Shape legend: as in code/s03_transformer.py (C hidden size, I MLP inner size, V vocabulary).
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import math
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

import s01_generation_loop as s01
import s03_transformer as s03


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
    if not isinstance(shape, list) or not all(s01.is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where} has shape {shape!r}: a shape must be a list of "
                              "integers >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(s01.is_int, offsets))
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
    """A local checkpoint directory for `name_or_path`: the directory itself when it exists
    ("~" is the home directory), otherwise a download of the hub id (config, tokenizer and
    safetensors files only) through `huggingface_hub.snapshot_download`, which reuses its
    local cache.

    Raises CheckpointError when the path is a file; "no such directory" when it does not
    exist and cannot be a hub id (see `_looks_like_a_path`), so a mistyped local path is not
    sent to the hub; and, for a hub id the hub cannot provide (no network, unknown id, gated
    model), with the hub's reason.
    """
    path = Path(name_or_path).expanduser()
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as err:   # a name too long for the file system, for one (ENAMETOOLONG)
        shown = str(name_or_path)
        shown = shown if len(shown) <= 80 else shown[:80] + "..."
        raise CheckpointError(f"{shown}: not a usable path ({err.strerror})") from None
    if is_dir:
        return path
    if exists:
        raise CheckpointError(f"{path} is a file; pass the checkpoint's directory")
    if _looks_like_a_path(name_or_path):
        raise CheckpointError(f"no such directory: {name_or_path} (a local path, so it is not "
                              "looked up on the Hugging Face Hub)")
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


def _looks_like_a_path(name_or_path: str | Path) -> bool:
    """True when `name_or_path` cannot be a hub id, which is "name" or "namespace/name": a
    Path object, text starting with ".", "/" or "~", or text with a separator a hub id never
    has (a second "/", a leading or trailing one, a backslash)."""
    if isinstance(name_or_path, Path):
        return True
    text = str(name_or_path)
    return (text.startswith((".", "/", "~")) or text.endswith("/") or text.count("/") > 1
            or "\\" in text)


# ---------------------------------------------------------------------------------------------
# Config: the architecture, read from config.json with Hugging Face's field names
# ---------------------------------------------------------------------------------------------

def config_from_hf_dict(cfg: Mapping, generation_config: Mapping | None = None
                        ) -> s03.TransformerConfig:
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
    if model_type not in s03.SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} (architectures {cfg.get('architectures')}) is not "
            f"supported; this chapter implements {', '.join(s03.SUPPORTED_MODEL_TYPES)}")

    def integer(key: str, default: int | None) -> int:
        value = cfg.get(key, default)
        if not s01.is_int(value) or value < 1:
            raise CheckpointError(f"config field {key} must be an integer >= 1 (got {value!r})")
        return int(value)

    def positive(key: str, default: float, where: Mapping = cfg, label: str = "config field"
                 ) -> float:
        value = where.get(key, default)
        if not s01.is_finite(value) or value <= 0:
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
        if value is not None and not s01.is_int(value):
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
            if not s01.is_int(i) or not 0 <= i < vocab_size:
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
        return s03.TransformerConfig(
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
            if not s01.is_int(original) or original < 1:
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
    return s03.TransformerConfig(
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


def load_config(checkpoint_dir: str | Path) -> s03.TransformerConfig:
    """Read config.json (and generation_config.json when present) from a directory.
    Raises CheckpointError naming the directory when config.json is missing, when either
    file is not a readable JSON object, or for any value `config_from_hf_dict` or the class
    rejects (UnsupportedArchitectureError for an architecture not implemented here)."""
    checkpoint_dir = Path(checkpoint_dir)
    cfg_path = checkpoint_dir / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{checkpoint_dir}: no config.json")
    gen_path = checkpoint_dir / "generation_config.json"
    gen = read_json_object(gen_path) if gen_path.exists() else None
    cfg = read_json_object(cfg_path)
    try:
        return config_from_hf_dict(cfg, gen)
    except CheckpointError as err:  # keep the subclass, name the checkpoint
        raise type(err)(f"{checkpoint_dir}: {err}") from None
    except ValueError as err:       # the dataclass's own consistency checks
        raise CheckpointError(f"{checkpoint_dir}: config.json: {err}") from None


# ---------------------------------------------------------------------------------------------
# Weights: the tensors a config implies, checked against what the checkpoint holds
# ---------------------------------------------------------------------------------------------

# Tensors some checkpoints carry that are not weights: GPT-2's stored causal masks, old
# Llama exports' cached RoPE frequencies. They are recomputed here, so skipping them is safe.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def expected_tensors(config: s03.TransformerConfig) -> dict[str, tuple[int, ...]]:
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


def check_state_dict(config: s03.TransformerConfig, state_dict: Mapping[str, np.ndarray]
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


def strip_prefix(tensors: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The tensors named `prefix...`, renamed without the prefix (one layer's weights)."""
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
    caller allows it with `allowed_special`. decode drops special tokens and refuses ids
    outside [0, vocab_size). eos_id is the first EOS id of the config (generation_config.json
    first); eos_ids lists all of them. Read with the HF `tokenizers` library, which runs any
    tokenizer.json, including the one S02 exports.
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
        config = load_config(checkpoint_dir)
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
        s01.check_text(text)
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
        """Token ids -> text, special tokens dropped (HF's `skip_special_tokens=True`).

        Raises ValueError for an id that is not an integer (True is not 1, 2.7 is not 2) or
        lies outside [0, V), V = `vocab_size`: left to HF tokenizers, -1 would be an
        OverflowError and an id past the vocabulary would vanish from the text unnoticed.
        """
        ids = list(ids)
        vocab_size = self.vocab_size
        for i in ids:
            if not s01.is_int(i):
                raise ValueError(f"token ids must be integers (got {i!r})")
            if not 0 <= i < vocab_size:
                raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}) (got {i})")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load(name_or_path: str | Path = s03.BUNDLED_MODEL_DIR
         ) -> tuple[s03.Transformer, CheckpointTokenizer]:
    """Model and tokenizer of a checkpoint directory or hub id (default: the bundled model)."""
    checkpoint_dir = resolve_checkpoint(name_or_path)
    return (s03.Transformer.from_pretrained(checkpoint_dir),
            CheckpointTokenizer.from_pretrained(checkpoint_dir))
