"""Model FLOPs per token and model FLOPs utilisation (MFU).

Matrix products only (elementwise work is negligible), a multiply-add as 2 FLOPs; D = dim,
H = n_heads, K = n_kv_heads, hd = head_dim, F = ffn_hidden, V = vocab_size, T = seq_len:

    block, forward         2 D hd (2H + 2K) + 2 * 3 D F + 2 * 2 T H hd   (qkvo, SwiGLU, attention)
    head, forward          2 D V                 the shared unembedding, once per head
    sequential module      2 * 2D * D            its eh_proj
    resblock/linear/medusa 2 D D                 per layer of heads 1..n-1 (head 0's are blocks)
    forward                (n_layers + head_layers) blocks + heads 1..n-1 + n_future unembeddings
    training               3 x forward           (backward: input and weight gradients)
    heads-only training    forward + 2 x heads 1..n-1 + (n_future - 1) unembeddings
                           (`trains_base=False`, Medusa-1; a non-block head's first layer
                           needs no input gradient)

Attention counts the full T x T scores (PaLM's MFU convention, torchtitan,
`torch.utils.flop_counter`); recomputation (activation checkpointing, Medusa heads re-reading
head 0) is not counted, so MFU does not reward it.
MFU = achieved model FLOPs per second / the hardware's peak FLOPs per second.
"""

from __future__ import annotations

import time

import torch

from mtp.cli import check_number, check_positive
from mtp.model import BLOCK_HEAD_TYPES, MTPConfig

# Dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity), per device.
PEAK_FLOPS: dict[str, float] = {
    "h100-bf16": 989.4e12,  # H100 SXM5
    "h100-pcie-bf16": 756.0e12,
    "a100-bf16": 312.0e12,
}


def flops_per_token(config: MTPConfig, seq_len: int, *, training: bool = True,
                    trains_base: bool = True) -> float:
    """Model FLOPs per input token of a training step (a forward when training=False);
    `trains_base=False`: heads 1..n-1 train alone."""
    check_positive("seq_len", seq_len)
    D, hd, F, V = config.dim, config.head_dim, config.ffn_hidden, config.vocab_size
    H, K = config.n_heads, config.n_kv_heads
    block = 2 * D * hd * (2 * H + 2 * K) + 2 * 3 * D * F + 2 * 2 * seq_len * H * hd
    unembedding = 2 * D * V
    extra_layer = block if config.head_type in BLOCK_HEAD_TYPES else 2 * D * D
    extra = (config.n_future - 1) * config.head_layers * extra_layer  # heads 1..n-1
    if config.head_type == "sequential":
        extra += (config.n_future - 1) * 2 * 2 * D * D
    forward = (config.n_layers + config.head_layers) * block + extra \
        + config.n_future * unembedding
    if not training:
        return float(forward)
    if trains_base:
        return 3.0 * forward
    backward = 2 * extra + (config.n_future - 1) * unembedding
    if config.head_type not in BLOCK_HEAD_TYPES:  # a first layer x + f(x W) reads a frozen x:
        backward -= (config.n_future - 1) * 2 * D * D  # W's gradient alone
    return float(forward + backward)


def measure_peak_flops(dtype: torch.dtype = torch.float32, *, device: str = "cpu",
                       size: int = 1024, seconds: float = 0.5) -> float:
    """Measured matrix-product FLOPs/s in `dtype` (best of repeated products): the MFU
    ceiling where no data sheet applies."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up: kernel selection, page faults
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def check_peak_flops(peak: object) -> None:
    """A ValueError naming `trainer.peak_flops` unless `resolve_peak_flops` takes it."""
    if peak is None or peak == "cpu":
        return
    if isinstance(peak, str):
        if peak not in PEAK_FLOPS:
            raise ValueError(f"trainer.peak_flops={peak!r} is not a number, 'cpu' or one of "
                             f"{sorted(PEAK_FLOPS)}")
        return
    check_number("trainer.peak_flops", peak, lambda v: v > 0, "> 0 FLOPs/s")


def resolve_peak_flops(peak: float | str | None, precision: str) -> float | None:
    """`trainer.peak_flops` as FLOPs/s: a number, a `PEAK_FLOPS` preset, "cpu" (measured in
    the run's precision, half a second) or None (no MFU)."""
    check_peak_flops(peak)
    if peak is None:
        return None
    if peak == "cpu":
        return measure_peak_flops(torch.bfloat16 if "bf16" in precision else torch.float32)
    return PEAK_FLOPS[peak] if isinstance(peak, str) else float(peak)


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOPs/s over the peak (both for all devices)."""
    return tokens_per_second * flops_per_token / peak_flops
