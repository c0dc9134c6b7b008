"""Compiled CPU kernels for decoding: linear, attention, rms_norm, silu_mul.

Why: speculative decoding verifies k drafted tokens in one forward over M rows, which only
pays if M rows cost about one. These kernels stream each weight once for all rows (memory
bound), in float32 and bfloat16, and are bitwise row invariant: a row's result does not
depend on M, on the other rows, on its tile or on the thread split (see csrc/impl.h).

The extension is built on first use (`status()`) into a cache folder keyed by sources,
torch, Python and CPU; without a compiler, or when the build fails, `status().available` is
False with the reason and callers use torch. `MTP_KERNELS=off` turns them off (`active()`).
Only torch and the standard library are imported here.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["DTYPES", "ISAS", "PackedLinear", "Status", "active", "attention", "isas",
           "rms_norm", "rope_write", "silu_mul", "status", "switched_off",
           "why_inactive"]

DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take (activations and weights)
# Instruction paths, best first; the position in the C++ numbering is the reverse.
ISAS = ("avx512_bf16", "avx512", "avx2", "portable")
_CODES = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}


class Status(NamedTuple):
    """Whether the compiled kernels are there, which instruction path, and one line why."""
    available: bool
    isa: str
    reason: str


_lock = threading.Lock()
_status: Status | None = None
_isas: list[str] = []
_default_code = -1  # the status' path as the C++ number, once loaded (a fast path for calls)
_ops = None  # torch.ops.mtp_kernels once loaded
_amx = False  # AMX-BF16 usable (the avx512_bf16 path then runs bf16 x bf16 on tiles)
_AMX_CODE = _CODES["avx512_bf16"]


def _load() -> Status:
    """Build/load the extension; an unavailable Status (never an exception) when it fails."""
    from . import build  # the builder, needed on the first status() only

    if build.compiler() is None:
        return Status(False, "", "no C++ compiler found (set CXX)")
    try:
        build.build_and_load()
        codes = list(torch.ops.mtp_kernels.cpu_isas())
    except Exception as e:  # any build/load failure means: decode with torch
        lines = str(e).strip().splitlines() or [type(e).__name__]
        first = next((x for x in lines if "error" in x.lower() and "Error building" not in x),
                     lines[0]).strip()
        return Status(False, "", f"build failed: {first[:200]}")
    global _default_code, _ops, _amx
    by_code = {v: k for k, v in _CODES.items()}
    _isas[:] = [by_code[c] for c in codes]
    _default_code, _ops = codes[0], torch.ops.mtp_kernels
    _amx = _AMX_CODE in codes and bool(_ops.amx_ready())
    amx = ", amx" if _amx else ""
    return Status(True, _isas[0], f"compiled kernels ({_isas[0]}{amx}, "
                                  f"{torch.get_num_threads()} threads)")


def status() -> Status:
    """The kernels' status; builds/loads on the first call (cached in-process). Never raises."""
    global _status
    with _lock:
        if _status is None:
            _status = _load()
            if not _status.available:
                print(f"mtp: compiled kernels unavailable ({_status.reason}); decoding uses "
                      "torch", file=sys.stderr)
        return _status


def switched_off() -> bool:
    """Whether MTP_KERNELS turns the kernels off (off, 0 or false)."""
    return os.environ.get("MTP_KERNELS", "on").lower() in ("off", "0", "false")


def active() -> bool:
    """Whether to decode on the kernels: MTP_KERNELS not off (checked first: no build) and
    the kernels available."""
    return not switched_off() and status().available


def why_inactive() -> str | None:
    """One line saying why the kernels do not decode here (None: they do)."""
    if switched_off():
        return f"MTP_KERNELS={os.environ['MTP_KERNELS']}"
    return None if status().available else status().reason


def isas() -> list[str]:
    """The instruction paths this CPU runs, best first, ending in "portable" ([] without
    the kernels)."""
    status()
    return list(_isas)


def _isa_code(isa: str | None) -> int:
    """The C++ number of `isa` (None: the status' path); ValueError naming it otherwise."""
    st = status()
    if not st.available:
        raise ValueError(f"compiled kernels unavailable: {st.reason}")
    name = st.isa if isa is None else isa
    if name not in _isas:
        raise ValueError(f"instruction path {name!r} is not one of this CPU's {_isas}")
    return _CODES[name]


def _check_dtype(t: Tensor, what: str) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{what} dtype {t.dtype} not supported (float32 or bfloat16)")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}, the kernels run on the CPU")


class PackedLinear:
    """A linear's weight packed once for decoding (weight (N, K) float32 or bfloat16, bias
    (N,) or None). Calls stream the weight once for all rows; a row's bits do not depend on
    the other rows."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        _check_dtype(weight, "weight")
        if weight.dim() != 2:
            raise ValueError(f"weight shape {tuple(weight.shape)} is not (out, in)")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight "
                             f"{tuple(weight.shape)}")
        self.weight = weight.detach().contiguous()
        # Bias in float32: added to the float32 sum before the single rounding.
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.dtype = self.weight.dtype
        self._amx: Tensor | None = None

    def __repr__(self) -> str:
        return (f"PackedLinear({self.in_features} -> {self.out_features}, {self.dtype}, "
                f"bias={self.bias is not None})")

    def __call__(self, x: Tensor, isa: str | None = None) -> Tensor:
        """x (..., K) float32 or bfloat16 -> (..., N) in x.dtype (float32 accumulation,
        rounded once)."""
        _check_dtype(x, "x")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x shape {tuple(x.shape)} does not end in in_features "
                             f"{self.in_features}")
        code = _default_code if isa is None and _default_code >= 0 else _isa_code(isa)
        packed = self._amx_tiles() if code == _AMX_CODE and x.dtype == torch.bfloat16 else None
        if x.dim() == 2:  # the common case, without reshapes (each costs a microsecond)
            return _ops.linear(x, self.weight, self.bias, code, packed)
        y = _ops.linear(x.reshape(-1, self.in_features), self.weight, self.bias, code, packed)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _amx_tiles(self) -> Tensor | None:
        """The weight in AMX's tile layout (bf16 on the avx512_bf16 path, CPUs with AMX),
        packed on first use: bf16 x bf16 then runs on the tile unit, whose throughput keeps
        M = 8..40 rows memory bound. None where AMX is not."""
        if self.dtype != torch.bfloat16 or not _amx:
            return None
        if self._amx is None:
            self._amx = _ops.pack_amx(self.weight)
        return self._amx


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, isa: str | None = None) -> Tensor:
    """Softmax attention of q (B, T, H, hd) over k, v (B, KV, L, hd) (views of a cache are
    fine) where mask (B, T, L) is True; grouped-query heads; scale hd ** -0.5. Returns
    (B, T, H, hd) contiguous in q.dtype. A query's bits depend only on its row and its
    visible keys/values in slot order."""
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        _check_dtype(t, what)
    if not (q.dim() == k.dim() == v.dim() == 4 and mask.dim() == 3):
        raise ValueError(f"attention shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)} mask {tuple(mask.shape)} not 4/4/4/3-d")
    if mask.dtype != torch.bool:
        raise ValueError(f"attention mask dtype {mask.dtype} is not bool")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    code = _isa_code(isa)
    try:
        return _ops.attention(q, k, v, mask, code)
    except RuntimeError as e:  # a shape check of the C++ side: callers expect ValueError
        raise ValueError(str(e).splitlines()[0]) from None


def rms_norm(x: Tensor, weight: Tensor, eps: float, isa: str | None = None) -> Tensor:
    """mtp.model.RMSNorm: round_x(x * rsqrt(mean(x^2) + eps)) * weight, statistics in
    float32, in torch.promote_types(x.dtype, weight.dtype)."""
    _check_dtype(x, "x")
    _check_dtype(weight, "weight")
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x shape {tuple(x.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    return _ops.rms_norm(x, weight, float(eps), _isa_code(isa))


def silu_mul(gate: Tensor, up: Tensor, isa: str | None = None) -> Tensor:
    """F.silu(gate) * up in gate.dtype, with torch's roundings (silu rounded, then the
    product rounded)."""
    _check_dtype(gate, "gate")
    if up.dtype != gate.dtype or up.shape != gate.shape:
        raise ValueError(f"silu_mul: up {tuple(up.shape)} {up.dtype} does not match gate "
                         f"{tuple(gate.shape)} {gate.dtype}")
    return _ops.silu_mul(gate, up, _isa_code(isa))


def rope_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, key_cache: Tensor,
               value_cache: Tensor, slots: Tensor) -> Tensor:
    """A decode step's rotary embedding and cache write in one call: q (B, T, H, hd), k, v
    (B, T, KV, hd) as projected, cos and sin (B, T, hd / 2) float32; k rotated and v are
    written to key_cache and value_cache (B, KV, max_len, hd) at `slots` (B, T); returns q
    rotated. Rotates in torch's order and roundings (`mtp.model.apply_rope`)."""
    for t, what in ((q, "q"), (k, "k"), (v, "v"), (key_cache, "key_cache"),
                    (value_cache, "value_cache")):
        _check_dtype(t, what)
    _isa_code(None)  # the kernels are built
    return _ops.rope_write(q, k, v, cos, sin, key_cache, value_cache, slots)
