"""mtp.kernels: agreement with torch and bitwise row invariance, on every instruction path.

Row invariance is the property speculative decoding relies on: a row's result must not
depend on how many rows share the call, what they hold, where the row sits or how threads
split the work. Each test runs on every path this CPU has (`isas()`).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mtp import kernels
from mtp.kernels import build

_status = kernels.status()
pytestmark = pytest.mark.skipif(not _status.available, reason=_status.reason)

ISAS = kernels.isas() if _status.available else []
# (weight dtype, activation dtype)
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32)]


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype,xdtype", DTYPES)
@pytest.mark.parametrize("K,N", [(64, 48), (100, 37)])
def test_linear_row_invariant_and_correct(isa, wdtype, xdtype, K, N, gen):
    w = torch.randn(N, K, generator=gen).to(wdtype)
    bias = torch.randn(N, generator=gen)
    lin = kernels.PackedLinear(w, bias)
    target = torch.randn(1, K, generator=gen).to(xdtype)
    alone = lin(target, isa=isa)
    assert alone.dtype == xdtype and alone.shape == (1, N)
    for M in [*range(1, 17), 37]:
        for filler in ("random", "zeros"):
            x = torch.randn(M, K, generator=gen).to(xdtype)
            if filler == "zeros":
                x.zero_()
            pos = int(torch.randint(M, (1,), generator=gen))
            x[pos] = target[0]
            y = lin(x, isa=isa)
            assert torch.equal(y[pos], alone[0]), (M, filler, pos)
            ref = F.linear(x.float(), w.float(), bias)
            torch.testing.assert_close(y.float(), ref, **_tol(xdtype))


@pytest.mark.parametrize("isa", ISAS)
def test_linear_leading_dims_and_strides(isa, gen):
    w = torch.randn(37, 100, generator=gen)
    lin = kernels.PackedLinear(w)
    x = torch.randn(2, 3, 200, generator=gen)[..., ::2]  # odd strides: made contiguous
    y = lin(x, isa=isa)
    assert y.shape == (2, 3, 37)
    torch.testing.assert_close(y, F.linear(x, w), **_tol(torch.float32))
    assert lin(torch.zeros(0, 100), isa=isa).shape == (0, 37)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_invariance(isa, dtype, gen):
    w = torch.randn(300, 130, generator=gen).to(dtype)
    lin = kernels.PackedLinear(w)
    x = torch.randn(9, 130, generator=gen).to(dtype)
    q = torch.randn(2, 5, 6, 64, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 50, 64, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(2, 5, 50, generator=gen) < 0.7
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((lin(x, isa=isa), kernels.attention(q, k, v, mask, isa=isa)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


def _sdpa(q, k, v, mask):
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float(), v.float(),
                                         attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 32])
def test_attention_row_invariant_and_correct(isa, dtype, hd, gen):
    B, H, KV, L, T = 2, 6, 2, 50, 5
    q = torch.randn(B, T, H, hd, generator=gen).to(dtype)
    # the cache: a view of a bigger store (more slots, more heads), strided in L and KV
    store = torch.randn(2, B, KV + 1, L + 20, hd, generator=gen).to(dtype)
    k, v = store[0, :, 1:, :L], store[1, :, 1:, :L]
    mask = torch.rand(B, T, L, generator=gen) < 0.6
    mask[..., 0] = True
    out = kernels.attention(q, k, v, mask, isa=isa)
    assert out.shape == (B, T, H, hd) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), _sdpa(q, k, v, mask), **_tol(dtype))
    t = 3
    alone = kernels.attention(q[:, t:t + 1], k, v, mask[:, t:t + 1], isa=isa)
    assert torch.equal(alone, out[:, t:t + 1])
    # garbage in the masked-out slots, and more masked slots at the end of a longer cache
    k2 = torch.randn(B, KV, L + 7, hd, generator=gen).to(dtype)
    v2 = torch.randn(B, KV, L + 7, hd, generator=gen).to(dtype)
    m2 = torch.zeros(B, 1, L + 7, dtype=torch.bool)
    m2[:, 0, :L] = mask[:, t]
    k2[:, :, :L] = torch.where(m2[:, :, :L, None], k, k2[:, :, :L])
    v2[:, :, :L] = torch.where(m2[:, :, :L, None], v, v2[:, :, :L])
    assert torch.equal(kernels.attention(q[:, t:t + 1], k2, v2, m2, isa=isa), alone)


@pytest.mark.parametrize("isa", ISAS)
def test_attention_broadcast_mask(isa, gen):
    q = torch.randn(2, 3, 4, 32, generator=gen)
    k, v = (torch.randn(2, 4, 10, 32, generator=gen) for _ in range(2))
    mask = (torch.rand(1, 3, 10, generator=gen) < 0.5).expand(2, 3, 10).clone()
    mask[..., 2] = True
    out = kernels.attention(q, k, v, mask[:1].expand(2, 3, 10), isa=isa)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), **_tol(torch.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("xdtype,wdtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
def test_rms_norm(isa, xdtype, wdtype, gen):
    x = (torch.randn(9, 100, generator=gen) * 3).to(xdtype)
    w = torch.randn(100, generator=gen).to(wdtype)
    y = kernels.rms_norm(x, w, 1e-5, isa=isa)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x)
    ref = normed * w
    assert y.dtype == ref.dtype
    torch.testing.assert_close(y.float(), ref.float(), **_tol(y.dtype))
    assert torch.equal(kernels.rms_norm(x[4:5], w, 1e-5, isa=isa), y[4:5])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(isa, dtype, gen):
    g = (torch.randn(9, 1000, generator=gen) * 4).to(dtype)
    u = torch.randn(9, 1000, generator=gen).to(dtype)
    y = kernels.silu_mul(g, u, isa=isa)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), (F.silu(g) * u).float(), **_tol(dtype))
    assert torch.equal(kernels.silu_mul(g[4:5], u[4:5], isa=isa), y[4:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_rotates_as_torch_and_writes_the_cache(dtype, gen):
    """q and k rotated bit for bit as `mtp.model.apply_rope` does; k and v land at the slots
    (strided cache views), the other slots untouched."""
    from mtp.model import apply_rope

    B, T, H, KV, hd, L = 2, 3, 6, 2, 16, 10
    q, k, v = (torch.randn(B, T, n, hd, generator=gen).to(dtype) for n in (H, KV, KV))
    angles = torch.rand(B, T, hd // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    store = torch.full((3, B, KV, L, hd), 7.0, dtype=dtype)  # blocks: write block 1's
    keys, values = store[1], store[1].clone()
    slots = torch.tensor([[4, 5, 6], [0, 8, 2]])
    rotated = kernels.rope_write(q, k, v, cos, sin, keys, values, slots)
    assert torch.equal(rotated, apply_rope(q, cos, sin))
    rows = torch.arange(B)[:, None]
    assert torch.equal(keys[rows, :, slots], apply_rope(k, cos, sin))
    assert torch.equal(values[rows, :, slots], v)
    untouched = torch.ones(B, L, dtype=torch.bool)
    untouched[rows, slots] = False
    assert (keys.transpose(1, 2)[untouched] == 7).all() and (store[0] == 7).all()
    with pytest.raises(ValueError, match="slot 10 is outside the 10 of the cache"):
        kernels.rope_write(q, k, v, cos, sin, keys, values, slots + 6)


def test_bad_inputs():
    lin = kernels.PackedLinear(torch.randn(8, 16))
    with pytest.raises(ValueError, match="float16"):
        lin(torch.randn(2, 16).half())
    with pytest.raises(ValueError, match="int64"):
        kernels.PackedLinear(torch.zeros(8, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="17"):
        lin(torch.randn(2, 17))
    with pytest.raises(ValueError, match="nonsense"):
        lin(torch.randn(2, 16), isa="nonsense")
    with pytest.raises(ValueError, match="float16"):
        kernels.silu_mul(torch.randn(3).half(), torch.randn(3).half())
    with pytest.raises(ValueError, match="int32"):
        kernels.rms_norm(torch.zeros(3, 4, dtype=torch.int32), torch.ones(4), 1e-5)
    q = torch.randn(1, 1, 4, 8)
    kv = torch.randn(1, 3, 5, 8)  # 4 heads, 3 kv heads
    with pytest.raises(ValueError, match="3"):
        kernels.attention(q, kv, kv, torch.ones(1, 1, 5, dtype=torch.bool))


def test_off_switch(monkeypatch):
    monkeypatch.setenv("MTP_KERNELS", "off")
    assert not kernels.active()
    monkeypatch.setenv("MTP_KERNELS", "on")
    assert kernels.active()


def test_isas_and_status():
    assert kernels.isas()[-1] == "portable"
    assert _status.isa == kernels.isas()[0]
    assert _status.isa in _status.reason


def test_no_compiler_means_unavailable(tmp_path):
    """Without a compiler: unavailable with the reason, one line on stderr, no exception."""
    code = ("from mtp import kernels; s = kernels.status(); kernels.status(); "
            "print(s.available, kernels.active(), kernels.isas(), s.reason)")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "MTP_KERNELS_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("False False [] no C++ compiler")
    assert run.stderr.count("mtp: compiled kernels unavailable") == 1


def test_a_killed_build_s_lock_does_not_stall_the_next_load():
    """torch's builder waits while its `lock` file exists: one left by a killed build (a
    timeout, ^C) is removed under mtp's own lock instead of stalling every later load."""
    folder = build.cache_root() / build.build_key()
    (folder / "lock").touch()
    code = "from mtp.kernels import build; build.build_and_load(); print('loaded')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.stdout.strip() == "loaded", run.stderr
    assert not (folder / "lock").exists()
