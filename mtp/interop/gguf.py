"""GGUF files (llama.cpp's format) of Llama-architecture models, import only.

The header is parsed here with `struct` over a memory map (the `gguf` package's `GGUFReader`
takes seconds on a 49k vocabulary); tensors are dequantized one at a time to the requested
dtype, so `mtp.load` holds one copy. The last block is head 0; llama.cpp's converter already
permutes query/key rows to mtp's interleaved pairs. Anything mtp cannot honour (another
architecture, experts, partial rotary, an unknown `llama.*` field or tensor) is refused.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mtp.interop.fields import check_keys, require
from mtp.interop.gguf_tokenizer import gguf_tokenizer
from mtp.interop.hf import key_map
from mtp.model import MTPConfig
from mtp.rope import RopeScaling
from mtp.tokenizers import Tokenizer

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ARCHITECTURE = "llama"
# llama.* metadata mtp maps (the rest of its meaning is fixed by the architecture); any other
# llama.* key is refused, since it could change what the model computes.
KNOWN_FIELDS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "expert_count",
    "expert_used_count",
}
# transformers' Llama tensor stems (`hf.key_map`'s) -> GGUF's, as llama.cpp's converter names
# them; a block's `model.layers.{i}.<stem>` is `blk.{i}.<GGUF stem>`.
TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
               "lm_head": "output"}
BLOCK_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                 "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
ROPE_FREQS = "rope_freqs.weight"
# Scalar metadata value types (gguf.GGUFValueType): struct format; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its shape (torch order), ggml type and bytes in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    start: int
    nbytes: int


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def read_gguf(path: Path, dtype: torch.dtype | None = None,
              ) -> tuple[MTPConfig, dict[str, Tensor], Tokenizer]:
    """Config, weights (mtp names, dequantized to `dtype`, default float32) and tokenizer."""
    gguf = require("gguf", f"reading the GGUF file {path}", package="gguf")
    with open(path, "rb") as f:
        try:
            blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise ValueError(f"{path} is not a GGUF file: {e}") from e
    metadata, tensors = read_header(blob, path, gguf)
    architecture = metadata.get("general.architecture")
    if architecture != ARCHITECTURE:
        raise ValueError(f"{path}: general.architecture is {architecture!r}; mtp reads GGUF "
                         f"files of the {ARCHITECTURE!r} architecture only")
    tokenizer = gguf_tokenizer(metadata, path)
    rope_freqs = next((_dequantize(blob, t, torch.float32, gguf, path)
                       for t in tensors if t.name == ROPE_FREQS), None)
    config = gguf_config(metadata, tensors, path, rope_freqs)
    names = _tensor_names(config)
    check_keys((t.name for t in tensors), names, f"{path}: tensors do not fit its llama.* "
               f"metadata", allowed=[ROPE_FREQS])
    state = {names[t.name]: _dequantize(blob, t, dtype or torch.float32, gguf, path)
             for t in tensors if t.name != ROPE_FREQS}
    return config, state, tokenizer


def read_header(blob: mmap.mmap, path: Path, gguf: Any) -> tuple[dict[str, Any],
                                                                 list[TensorInfo]]:
    """The metadata and tensor table; a ValueError naming the file for anything malformed."""
    if blob[:4] != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    reader = _Reader(blob, path)
    version, n_tensors, n_fields = reader.unpack("<IQQ")
    if version not in VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; mtp reads versions {VERSIONS}")
    metadata = {}
    for _ in range(n_fields):
        key = reader.string("a metadata key")
        metadata[key] = reader.value(reader.unpack("<I")[0], key)
    table = []
    for _ in range(n_tensors):
        name = reader.string("a tensor name")
        dims = reader.unpack(f"<{reader.unpack('<I')[0]}Q")
        ggml_type, offset = reader.unpack("<IQ")
        table.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-reader.pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in table:
        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name!r} has ggml type {ggml_type}, which the gguf "
                             f"package (version {package_version('gguf')}) does not know") from None
        if shape[-1] % block:
            raise ValueError(f"{path}: tensor {name!r} of type {qtype.name} has rows of "
                             f"{shape[-1]} values, not a multiple of its blocks of {block}")
        info = TensorInfo(name, shape, ggml_type, data_start + offset,
                          math.prod(shape) // block * block_bytes)
        if info.start + info.nbytes > len(blob):
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte "
                             f"{info.start + info.nbytes}, the file has {len(blob)} bytes")
        tensors.append(info)
    return metadata, tensors


class _Reader:
    """Sequential reads of GGUF's little-endian values; errors name the file."""

    def __init__(self, blob: mmap.mmap, path: Path) -> None:
        self.blob, self.path, self.pos = blob, path, 4

    def unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self.blob, self.pos)
        except struct.error:
            raise ValueError(f"{self.path} is truncated: its header ends at byte "
                             f"{len(self.blob)}") from None
        self.pos += struct.calcsize(fmt)
        return values

    def string(self, what: str) -> str:
        (raw,) = self.unpack(f"{self.unpack('<Q')[0]}s")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: {what} holds invalid UTF-8 ({e})") from None

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string(f"metadata {key!r}")
        if kind == _ARRAY:
            item, count = self.unpack("<IQ")
            if item in _SCALARS:
                return list(self.unpack(f"<{count}{_SCALARS[item][1]}"))
            return [self.value(item, key) for _ in range(count)]
        raise ValueError(f"{self.path}: metadata {key!r} has value type {kind}, which is not "
                         f"a GGUF type")


def gguf_config(metadata: dict[str, Any], tensors: list[TensorInfo], path: Path,
                rope_freqs: Tensor | None = None) -> MTPConfig:
    """The MTPConfig of a llama GGUF (one head: the last block is head 0)."""
    prefix = f"{ARCHITECTURE}."
    unknown = sorted(k for k in metadata if k.startswith(prefix)
                     and k[len(prefix):] not in KNOWN_FIELDS)
    if unknown:
        raise ValueError(f"{path}: metadata {unknown[:4]} is not something mtp's Llama "
                         f"implements")

    def get(key: str, kind: type, default: Any = None) -> Any:
        value = metadata.get(prefix + key, default)
        if value is None:
            raise ValueError(f"{path}: metadata {prefix + key} is missing")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise ValueError(f"{path}: metadata {prefix + key} must be a single "
                             f"{kind.__name__}, got {value!r:.80}")
        return value

    if get("expert_count", int, 0):
        raise ValueError(f"{path}: metadata {prefix}expert_count is "
                         f"{get('expert_count', int)}: mtp implements no mixture of experts")
    shapes = {t.name: t.shape for t in tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: no tensor token_embd.weight")
    dim = get("embedding_length", int)
    n_heads = get("attention.head_count", int)
    head_dim = get("attention.key_length", int, dim // n_heads)
    value_dim = get("attention.value_length", int, head_dim)
    rotary = get("rope.dimension_count", int, head_dim)
    for key, value in (("attention.value_length", value_dim), ("rope.dimension_count", rotary)):
        if value != head_dim:
            raise ValueError(f"{path}: metadata {prefix}{key}={value} differs from the head "
                             f"width {head_dim}; mtp rotates and attends over whole heads")
    fields = dict(
        vocab_size=shapes["token_embd.weight"][0], dim=dim,
        n_layers=get("block_count", int) - 1, n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", int, n_heads), head_dim=head_dim,
        ffn_hidden=get("feed_forward_length", int), max_seq_len=get("context_length", int),
        rope_theta=get("rope.freq_base", float, 10000.0),
        rope_scaling=_rope_scaling(get, rope_freqs, head_dim, path),
        norm_eps=get("attention.layer_norm_rms_epsilon", float),
        qkv_bias="blk.0.attn_q.bias" in shapes, out_bias="blk.0.attn_output.bias" in shapes,
        mlp_bias="blk.0.ffn_down.bias" in shapes,
        tie_embeddings="output.weight" not in shapes)
    vocab = get("vocab_size", int, fields["vocab_size"])
    tokens = len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab == fields["vocab_size"] == tokens:
        raise ValueError(f"{path}: the vocabulary sizes disagree: token_embd.weight has "
                         f"{fields['vocab_size']} rows, {prefix}vocab_size is {vocab}, "
                         f"tokenizer.ggml.tokens has {tokens} tokens")
    try:
        return MTPConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _rope_scaling(get: Any, rope_freqs: Tensor | None, head_dim: int,
                  path: Path) -> RopeScaling | None:
    kind = get("rope.scaling.type", str, "none")
    factor = get("rope.scaling.factor", float, 0.0) or get("rope.scale_linear", float, 0.0)
    if rope_freqs is not None:
        if kind != "none":
            raise ValueError(f"{path}: both {ROPE_FREQS} and llama.rope.scaling.type={kind!r}")
        return llama3_scaling(rope_freqs, get("rope.freq_base", float, 10000.0), head_dim, path)
    if kind == "linear" or (kind == "none" and factor not in (0.0, 1.0)):
        return RopeScaling(type="linear", factor=factor)
    if kind != "none":
        raise ValueError(f"{path}: metadata llama.rope.scaling.type is {kind!r}; mtp implements "
                         f"'linear' and Llama 3's (the {ROPE_FREQS} tensor)")
    return None


def llama3_scaling(divisors: Tensor, theta: float, head_dim: int, path: Path) -> RopeScaling:
    """The `llama3` RopeScaling whose frequencies are the base ones over `divisors` (Llama
    3.1's rope_freqs tensor). Between 1 and `factor` they are 1 / ((1 - s) / factor + s),
    s = (old / wavelength - low) / (high - low) linear in 1 / wavelength: its slope and
    intercept fix (old, low, high) given low = 1 (every Llama 3.x has it)."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)
    divisors = divisors.double()
    if divisors.shape != base.shape:
        raise ValueError(f"{path}: {ROPE_FREQS} has {divisors.numel()} values for heads of "
                         f"width {head_dim} ({base.numel()} frequencies)")
    factor = float(divisors.max())
    middle = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    if int(middle.sum()) >= 2:
        smooth = (factor / divisors[middle] - 1) / (factor - 1)
        inverse_wavelength = base[middle] / (2 * math.pi)
        slope, intercept = np.polyfit(inverse_wavelength.numpy(), smooth.numpy(), 1)
        if intercept < 0:  # s = old / (high - low) / wavelength - low / (high - low)
            # high - low, with low = 1; rounded, as float32 divisors blur it (the check
            # below holds the rounding to account).
            scale = round(float(-1 / intercept), 3)
            scaling = RopeScaling(type="llama3", factor=factor, low_freq_factor=1.0,
                                  high_freq_factor=1.0 + scale,
                                  original_max_seq_len=round(float(slope * scale)))
            scaled = scaling.frequencies(base.float()).double()
            if torch.allclose(base / scaled, divisors, rtol=1e-4, atol=0):
                return scaling
    raise ValueError(f"{path}: {ROPE_FREQS} is not Llama 3.1's rope scaling (1 at short "
                     f"wavelengths, a factor at long ones, a smooth step between): "
                     f"{[round(v, 4) for v in divisors.tolist()[:8]]}...")


def _tensor_names(config: MTPConfig) -> dict[str, str]:
    """Every GGUF tensor name the config implies -> its mtp name (GGUF's query and key rows
    are mtp's already)."""
    names = {}
    for ours, (theirs, _) in key_map(config).items():
        stem, kind = theirs.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, sub = stem.split(".", 3)
            names[f"blk.{layer}.{BLOCK_TENSORS[sub]}.{kind}"] = ours
        else:
            names[f"{TOP_TENSORS[stem]}.{kind}"] = ours
    return names


def _dequantize(blob: mmap.mmap, info: TensorInfo, dtype: torch.dtype, gguf: Any,
                path: Path) -> Tensor:
    """One tensor, dequantized and cast to `dtype`."""
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    raw = np.frombuffer(blob, dtype=np.uint8, count=info.nbytes, offset=info.start)
    if qtype.name in ("F32", "F16", "BF16"):
        stored = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype.name]
        # A copy out of the map (torch wants writable memory), then the cast if any.
        return torch.frombuffer(bytearray(raw), dtype=stored).view(info.shape).to(dtype)
    try:
        values = gguf.quants.dequantize(raw.reshape(*info.shape[:-1], -1), qtype)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {info.name!r} is {qtype.name}, which the gguf "
                         f"package (version {package_version('gguf')}) cannot dequantize") from None
    return torch.from_numpy(values).view(info.shape).to(dtype)
