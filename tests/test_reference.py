"""The pure-PyTorch references alone, expected values from the SPEC's rules evaluated by hand or with numpy float32
arithmetic, never from the code under test. MXFP8 (SPEC §2, reference/mxfp8.py): hand-derived scale bytes and grid
roundings, the floor rule's byte 0, the encoder against the explicit E4M3 grid, the round-trip error. Block-scaled
FP8 (SPEC §5, reference/fp8_block.py): hand-derived scale and code examples, the GEMM reference against a float64
dequantize-then-matmul within a rounding-error bound, and the layer's forward / backward recipe against an fp64
unquantized composition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj import mxfp8_quantize
from mla_qproj._config import QProjConfig
from mla_qproj.reference import fp8_block as F
from mla_qproj.reference import mxfp8 as R
from mla_qproj.reference.mxfp8 import dequantize_rowwise
from mla_qproj.reference.rope import apply_rope

from _tolerances import REL_ERR_FP8_BLOCK, REL_ERR_MXFP8, assert_bytes_equal, assert_rel_err
from conftest import examples

NAN = float("nan")
INF = float("inf")
HYP = settings(max_examples=examples(15), deadline=None)


def codes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def f32(v: float) -> float:
    return float(np.float32(v))


def f32_div(a: float, b: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(a) / np.float32(b))


# ------------------------------------------------------------------------------------------------ scales


@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
def test_scale_special_amax(block_scale):
    # amax 0, NaN (all-NaN block) and inf give scale 1.0 and scale_inv 1.0 (SPEC §5)
    s, si = F.fp8_block_scale(torch.tensor([0.0, NAN, INF]), block_scale)
    assert s.tolist() == [1.0, 1.0, 1.0] and si.tolist() == [1.0, 1.0, 1.0]


def test_scale_fp32_is_the_rounded_division():
    amax = [3.0, 1.0, 448.0, 0.1, 1e-20, 7e30]
    s, si = F.fp8_block_scale(torch.tensor(amax), "fp32")
    assert s.tolist() == [f32_div(448.0, a) for a in amax]
    assert si.tolist() == [f32_div(1.0, f32_div(448.0, a)) for a in amax]


def test_scale_overflow_gives_flt_max():
    # 448 / 2^-125 = 1.75 * 2^133 overflows fp32 -> FLT_MAX; pow2 clears its mantissa: 2^127, scale_inv 2^-127
    s, si = F.fp8_block_scale(torch.tensor([2.0**-125, 2.0**-149]), "fp32")
    assert s.tolist() == [3.4028234663852886e38] * 2
    assert si.tolist() == [f32_div(1.0, 3.4028234663852886e38)] * 2  # the subnormal 2^-128 (rounded)
    s, si = F.fp8_block_scale(torch.tensor([2.0**-125]), "pow2")
    assert s.item() == 2.0**127 and si.item() == 2.0**-127  # exact, a subnormal


def test_scale_pow2_rounds_down():
    # 448/3 = 149.33 -> 128; 448/1 = 448 -> 256; 448/448 = 1 -> 1; 448/500 = 0.896 -> 0.5; 448/0.1 = 4480 -> 4096
    s, si = F.fp8_block_scale(torch.tensor([3.0, 1.0, 448.0, 500.0, 0.1]), "pow2")
    assert s.tolist() == [128.0, 256.0, 1.0, 0.5, 4096.0]
    assert si.tolist() == [2.0**-7, 2.0**-8, 1.0, 2.0, 2.0**-12]


@settings(max_examples=examples(40), deadline=None)
@given(e=st.integers(-148, 127), frac=st.floats(1.0, 2.0, exclude_max=True))
def test_scale_pow2_exact_inverse(e, frac):
    # pow2: scale = 2^floor(log2(fp32(448 / amax))) (FLT_MAX on overflow), and scale_inv is exactly its inverse
    amax = f32(frac * 2.0**e)
    if amax == 0 or math.isinf(amax):
        return
    s, si = F.fp8_block_scale(torch.tensor([amax]), "pow2")
    q = f32_div(448.0, amax)
    q = 3.4028234663852886e38 if math.isinf(q) else q
    expect = 2.0 ** (math.frexp(q)[1] - 1)
    assert s.item() == expect
    assert si.item() == 1.0 / expect and s.item() * si.item() == 1.0


# ------------------------------------------------------------------------------------------------ codes


def test_codes_special_blocks():
    # one 1x128 block per row
    x = torch.zeros(6, 128)
    x[0, 5] = -0.0  # amax 0: scale 1; the sign of zero is kept
    x[1] = NAN
    x[1, 1::2] = -NAN  # all-NaN block: scale 1; NaN codes 0x7F / 0xFF with the sign
    x[2, :3] = torch.tensor([INF, 1.5, -2.0])  # amax inf: scale 1, inf saturates to 448
    x[3, :3] = torch.tensor([3.0, -1e-30, NAN])  # pow2 scale 128: 3 -> 384; tiny negative -> -0; NaN ignored
    x[4, :2] = torch.tensor([2.0**-125, -(2.0**-126)])  # overflow: 2^127 -> 4, -2
    x[5, :2] = torch.tensor([-(2.0**-130), 2.0**-131])  # fp32 subnormals, scale 2^127: -2^-3, 2^-4
    d, si = F.quantize_blocks(x, (1, 128), "pow2")
    c = d.view(torch.uint8)
    assert si.flatten().tolist() == [1.0, 1.0, 1.0, 2.0**-7, 2.0**-127, 2.0**-127]
    assert c[0, 5] == 0x80 and (c[0, :5] == 0).all()
    assert codes(c[1, :4]) == [0x7F, 0xFF, 0x7F, 0xFF]
    assert codes(c[2, :4]) == [0x7E, 0x3C, 0xC0, 0x00]  # 448, 1.5, -2, 0
    assert codes(c[3, :3]) == [0x7C, 0x80, 0x7F]  # 384 = 1.5 * 2^8, -0, NaN
    assert codes(c[4, :2]) == [0x48, 0xC0]  # 4, -2
    assert codes(c[5, :2]) == [0xA0, 0x18]  # -0.125 = -2^-3 (exponent field 4), 2^-4 (field 3)


def test_codes_fp32_scale():
    # fp32 scale = fp32(448/3); 3 * scale = 448.0000076 rounds to 448 (0x7E); 1 * scale = 149.33 -> 144 (E4M3 spacing
    # in [128, 256) is 16; 144 = 1.125 * 2^7 -> 0b0_1110_001 = 0x71)
    x = torch.zeros(1, 128)
    x[0, :3] = torch.tensor([3.0, 1.0, -0.75])  # -0.75 * 149.33 = -112 -> -112 = -1.75 * 2^6 -> 0xEE
    d, si = F.quantize_blocks(x, (1, 128), "fp32")
    assert codes(d[0, :3]) == [0x7E, 0x71, 0xEE]
    assert si.item() == f32_div(1.0, f32_div(448.0, 3.0))
    # the overflow case with fp32 scales: 2^-125 * FLT_MAX = 8 - 2^-20 -> 8 (0x50)
    x[0, :3] = torch.tensor([2.0**-125, 0.0, 0.0])
    d, si = F.quantize_blocks(x, (1, 128), "fp32")
    assert codes(d[0, :1]) == [0x50]


@pytest.mark.parametrize("block_shape", F.BLOCK_SHAPES)
def test_partial_blocks(block_shape):
    # [130, 200]: the edge blocks hold 2 rows and/or 72 columns; their amax is over the elements that exist
    bm, bn = block_shape
    x = torch.full((130, 200), 0.5)
    x[129, 199] = -3.0  # in the last block of every shape: amax 3 -> pow2 scale 128
    d, si = F.quantize_blocks(x, block_shape, "pow2")
    assert si.shape == (math.ceil(130 / bm), math.ceil(200 / bn))
    assert si[-1, -1].item() == 2.0**-7 and d[129, 199].float().item() == -384.0
    first = si[0, 0].item()  # a block of only 0.5: scale 448 / 0.5 = 896 -> 512
    assert first == 2.0**-9 and d[0, 0].float().item() == 256.0
    back = F.dequantize_blocks(d, si, block_shape)
    assert back[129, 199].item() == -3.0 and back[0, 0].item() == 0.5


def test_block_geometry_is_the_spec_one():
    # a single large element sets the scale of exactly its block: its row (1x128), its column (128x1), its tile
    x = torch.ones(256, 256)
    x[130, 3] = 100.0
    big = f32_div(1.0, 2.0 ** math.floor(math.log2(448 / 100)))  # pow2 scale_inv of amax 100: 2^-2
    for shape, where in (((1, 128), (130, 0)), ((128, 1), (1, 3)), ((128, 128), (1, 0))):
        _, si = F.quantize_blocks(x, shape, "pow2")
        assert si[where].item() == big
        assert (si == 2.0**-8).sum().item() == si.numel() - 1  # all other blocks have amax 1


@HYP
@given(m=st.integers(1, 300), n=st.integers(1, 300), shape=st.sampled_from(F.BLOCK_SHAPES),
       block_scale=st.sampled_from(F.BLOCK_SCALES), log2mag=st.integers(-100, 100))
def test_roundtrip_error(m, n, shape, block_scale, log2mag):
    # every element within half an E4M3 step of its block's grid: |dq - x| <= 2^-4 |x| above the subnormal range,
    # and <= half the smallest subnormal step (2^-10 * scale_inv) below it
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, n, generator=g) * 2.0**log2mag
    d, si = F.quantize_blocks(x, shape, block_scale)
    back = F.dequantize_blocks(d, si, shape).double()
    step = F._expand(si.double(), *shape, m, n) * 2.0**-10
    err = (back - x.double()).abs()
    assert (err <= torch.maximum(x.double().abs() * 2.0**-4, step)).all()


# ------------------------------------------------------------------------------------------------ GEMMs


def _gamma(n: int) -> float:
    u = 2.0**-24
    return n * u / (1 - n * u)


def _check_mm(a64, b64, out, nb, label):
    """|out - a @ b^T| <= gamma_n (|a| @ |b|^T) elementwise with n = 128 + 2 + nb: a block's product sums 128
    exact E4M3 products (<= 127 fp32 roundings in any order), two roundings scale it, nb roundings accumulate it."""
    ref = a64 @ b64.t()
    bound = _gamma(FP8 + 2 + nb) * (a64.abs() @ b64.abs().t()) + 1e-300
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"{label}: max err / bound {(err / bound).max().item():.3g}"


FP8 = F.FP8_BLOCK


@HYP
@given(m=st.integers(1, 150), nout=st.integers(1, 150), r=st.integers(1, 400),
       block_scale=st.sampled_from(F.BLOCK_SCALES), b_tiles=st.booleans())
def test_block_scaled_mm_bound(m, nout, r, block_scale, b_tiles):
    g = torch.Generator().manual_seed(m + 7 * nout + 31 * r)
    a = torch.randn(m, r, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g).float())
    b = torch.randn(nout, r, generator=g) * torch.exp2(torch.randint(-8, 8, (1, r), generator=g).float())
    ad, asi = F.quantize_blocks(a, (1, FP8), block_scale)
    bshape = (FP8, FP8) if b_tiles else (1, FP8)
    bd, bsi = F.quantize_blocks(b, bshape, block_scale)
    out = F.block_scaled_mm(ad, asi, bd, bsi, 1, bshape[0])
    a64 = F.dequantize_blocks(ad, asi, (1, FP8), torch.float64)
    b64 = F.dequantize_blocks(bd, bsi, bshape, torch.float64)
    _check_mm(a64, b64, out, math.ceil(r / FP8), "A B^T")


def test_block_scaled_mm_layer_gemms():
    # the three layer GEMMs through one function: forward, dgrad (B = W^T, blocks along N), wgrad (128x1 along T)
    T, K, N = 150, 256, 200
    xn, w, dy = torch.randn(T, K), torch.randn(N, K) * 0.05, torch.randn(T, N)
    xr, xrs = F.quantize_blocks(xn, (1, FP8))
    xc, xcs = F.quantize_blocks(xn, (FP8, 1))
    wd, ws = F.quantize_blocks(w, (FP8, FP8))
    dr, drs = F.quantize_blocks(dy, (1, FP8))
    dc, dcs = F.quantize_blocks(dy, (FP8, 1))
    w64 = F.dequantize_blocks(wd, ws, (FP8, FP8), torch.float64)
    y = F.block_scaled_mm(xr, xrs, wd, ws, 1, FP8)
    _check_mm(F.dequantize_blocks(xr, xrs, (1, FP8), torch.float64), w64, y, K // FP8, "forward")
    dxn = F.block_scaled_mm(dr, drs, wd.t(), ws.t(), 1, FP8)
    _check_mm(F.dequantize_blocks(dr, drs, (1, FP8), torch.float64), w64.t(), dxn, 2, "dgrad")
    dw = F.block_scaled_mm(dc.t(), dcs.t(), xc.t(), xcs.t(), 1, 1)
    _check_mm(F.dequantize_blocks(dc, dcs, (FP8, 1), torch.float64).t(),
              F.dequantize_blocks(xc, xcs, (FP8, 1), torch.float64).t(), dw, 2, "wgrad")


def test_block_scaled_mm_checks_shapes():
    a, asi = F.quantize_blocks(torch.randn(4, 256))
    with pytest.raises(ValueError, match="b_sinv"):
        F.block_scaled_mm(a, asi, a, asi, 1, FP8)  # B tiles would be [1, 2]
    with pytest.raises(ValueError, match="reduction"):
        F.block_scaled_mm(a, asi, a[:, :128], asi[:, :1], 1, 1)
    with pytest.raises(ValueError, match="block_shape"):
        F.quantize_blocks(a.float(), (32, 32))
    with pytest.raises(ValueError, match="block_scale"):
        F.fp8_block_scale(torch.ones(1), "e8m0")


# ------------------------------------------------------------------------------------------------ the layer


def _cfg(H, nope, R, D, K, style, output_format="bf16", columnwise=False, zc=False):
    return QProjConfig(q_lora_rank=K, num_heads=H, qk_head_dim=nope, rope_dim=R, q_head_dim=D,
                       zero_centered_gamma=zc, rope_style=style, precision="fp8_block", output_format=output_format,
                       columnwise_output=columnwise)


def _oracle(x, nw, w, cos_h, sin_h, dq, cfg):
    """fp64 autograd of the unquantized math: RMSNorm -> xn @ W^T -> RoPE."""
    x64, nw64, w64 = (t.detach().double().requires_grad_() for t in (x, nw, w))
    g = nw64 + 1 if cfg.zero_centered_gamma else nw64
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + cfg.eps) * g
    y = (xn @ w64.t()).unflatten(-1, (cfg.num_heads, cfg.q_head_dim))
    q = apply_rope(y, cos_h.double(), sin_h.double(), cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style)
    return q.detach(), torch.autograd.grad(q, (x64, nw64, w64), dq.double())


LAYER_GEOMS = [(3, 16, 16, 48), (2, 0, 32, 32), (1, 128, 64, 192), (2, 32, 64, 128)]  # (H, nope, R, D)


@pytest.mark.parametrize("geom", LAYER_GEOMS)
@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
def test_layer_vs_fp64(geom, style, block_scale):
    H, nope, R, D = geom
    T, K = 150, 256
    cfg = _cfg(H, nope, R, D, K, style, zc=style == "neox")
    x = (torch.randn(T, K) * 3).to(torch.bfloat16)
    nw = 0.2 * torch.randn(K) + (0.0 if cfg.zero_centered_gamma else 1.0)
    w = torch.randn(H * D, K) / K**0.5
    ang = torch.rand(T, R // 2) * 6.3
    cos_h, sin_h = ang.cos(), ang.sin()
    wd, ws = F.prepare_weight_fp8_block(w, block_scale)
    (q,), rsigma, xn_saved = F.qproj_fwd_fp8_block(x, nw, wd, ws, cos_h, sin_h, cfg, block_scale)
    dq = torch.randn(T, H, D)
    q64, (dx64, dg64, dw64) = _oracle(x, nw, w, cos_h, sin_h, dq, cfg)
    tag = f"[{geom} {style} {block_scale}]"
    assert q.dtype == torch.bfloat16 and q.shape == (T, H, D)
    assert_rel_err(q.float(), q64, REL_ERR_FP8_BLOCK, f"{tag}  q")
    assert xn_saved[0].shape == (T, K) and xn_saved[1].shape == (2, K)
    dx, dg, dw = F.qproj_bwd_fp8_block(dq, x, rsigma, xn_saved, nw, wd, ws, cos_h, sin_h, cfg, block_scale)
    assert dx.dtype == x.dtype and dw.dtype == torch.float32 and dw.shape == w.shape
    assert_rel_err(dx.float(), dx64, REL_ERR_FP8_BLOCK, f"{tag} dx")
    assert_rel_err(dg.float(), dg64, REL_ERR_FP8_BLOCK, f"{tag} dnorm_weight")
    assert_rel_err(dw, dw64, REL_ERR_FP8_BLOCK, f"{tag} dW")


def test_layer_saves_columnwise_xn_and_mxfp8_output():
    # xn_saved is xn in 128x1 blocks along T (not the 1x128 GEMM form); MXFP8 output (rowwise + columnwise)
    H, nope, R, D, T, K = 2, 32, 64, 128, 130, 128
    cfg = _cfg(H, nope, R, D, K, "deepseek", output_format="mxfp8", columnwise=True)
    x = torch.randn(T, K)
    nw = torch.ones(K)
    w = torch.randn(H * D, K) / K**0.5
    ang = torch.rand(T, R // 2) * 6.3
    wd, ws = F.prepare_weight_fp8_block(w)
    (rd, rs, cd, cs), rsigma, (xc, xcs) = F.qproj_fwd_fp8_block(x, nw, wd, ws, ang.cos(), ang.sin(), cfg)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps)
    ec, ecs = F.quantize_blocks(xn, (FP8, 1))
    assert torch.equal(xc.view(torch.uint8), ec.view(torch.uint8)) and torch.equal(xcs, ecs)
    assert rd.shape == (T, H, D) and rs.shape == (T, H, D // 32) and cs.shape == (5, H, D)
    q64, _ = _oracle(x, nw, w, ang.cos(), ang.sin(), torch.zeros(T, H, D), cfg)
    assert_rel_err(dequantize_rowwise(rd, rs), q64, REL_ERR_MXFP8, "q (mxfp8 output: a third quantization)")


def test_layer_nan_is_canonical():
    # a NaN in x (either sign) makes its token's xn NaN: codes 0x7F on every device (module docstring)
    cfg = _cfg(1, 0, 32, 32, 128, "gptj")
    x = torch.randn(3, 128)
    x[1, 7] = -NAN
    w = torch.randn(32, 128)
    wd, ws = F.prepare_weight_fp8_block(w)
    ang = torch.rand(3, 16)
    _, _, (xc, xcs) = F.qproj_fwd_fp8_block(x, torch.ones(128), wd, ws, ang.cos(), ang.sin(), cfg)
    assert (xc.view(torch.uint8)[1] == 0x7F).all()
    assert torch.isfinite(xcs).all()  # NaN is ignored by the column amax
    dq = torch.randn(3, 1, 32)
    dq[2, 0, 5] = -NAN
    dr, _, dc, _ = F.grad_operands_fp8_block(dq, ang.cos(), ang.sin(), cfg)
    assert dr.view(torch.uint8)[2, 4].item() == 0x7F and dc.view(torch.uint8)[2, 4].item() == 0x7F  # gptj partner


# ------------------------------------------------------------------------------------------------ MXFP8 (SPEC §2)


def test_hand_derived_examples():
    # amax 448 -> v = 1 exactly -> byte 127, elements unscaled; 449 -> v has mantissa bits -> 128
    assert R.e8m0_from_amax_rceil(torch.tensor([448.0, 449.0, 0.0])).tolist() == [127, 128, 0]
    # floor: floor(log2(448)) = 8 -> 8 - 8 + 127 = 127; 256 -> 127; 255 -> 126
    assert R.e8m0_from_amax_floor(torch.tensor([448.0, 256.0, 255.0])).tolist() == [127, 127, 126]
    # RNE onto the grid: 17 is halfway between 16 and 18 -> 16 (even); 19 -> 20; 127.97 -> 128; 464 -> 448
    g = R.round_to_e4m3_grid(torch.tensor([17.0, 19.0, 127.97, 464.0, -1e-12]))
    assert g[:4].tolist() == [16.0, 20.0, 128.0, 448.0]
    assert g[4].item() == 0.0 and math.copysign(1.0, g[4].item()) == -1.0


def test_floor_byte_zero_decodes_with_two_pow_127():
    # SPEC §2 floor: amax 2^-125 -> floor(log2) - 8 + 127 = -6 -> byte 0, and r = 2^127 for byte 0 too, so the block
    # keeps its codes: 2^-125 * 2^127 = 4.0, decoding back exactly (4 * 2^-127); rceil's byte 0 gives r = 1 (zeros)
    x = torch.full((1, 32), 2.0**-125)
    x[0, 1] = -(2.0**-126)
    data, scale = R.quantize_rowwise(x, "floor")
    assert scale.tolist() == [[0]]
    assert data.float()[0, :2].tolist() == [4.0, -2.0]
    assert torch.equal(R.dequantize_rowwise(data, scale), x)
    data, scale = R.quantize_rowwise(x, "rceil")  # v = 2^-125 / 448 < 2^-127: byte 0, r = 1
    assert scale.tolist() == [[0]] and (data.float() == 0).all()


def test_reference_encoder_matches_explicit_grid():
    # the reference encodes with torch's cast after clamping (one pass); the kernels' emulated path rounds
    # explicitly (round_to_e4m3_grid): both must agree on every fp32 value (random bit patterns over all exponents,
    # scaled normals, the grid's midpoints and their neighbours, NaN and inf)
    g = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    g = g[torch.isfinite(g)].unique()
    mids = (g[1:] + g[:-1]) / 2
    x = torch.cat([
        torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int64).to(torch.int32).view(torch.float32),
        torch.randn(1 << 16) * torch.exp2(torch.randint(-20, 12, (1 << 16,)).float()),
        mids, -mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
        torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 448.0, 464.0, 465.0]),
    ])
    for dev in ("cpu",) + (("cuda",) if torch.cuda.is_available() else ()):  # torch's cast differs past the grid
        xd = x.to(dev)
        assert_bytes_equal(R.encode_e4m3(xd, xd), R.to_e4m3(R.round_to_e4m3_grid(xd), xd), f"encode vs grid {dev}")


def test_dequantize_roundtrip_error():
    x = torch.randn(64, 128)
    q = mxfp8_quantize(x, columnwise=True, backend="torch")
    for deq in (R.dequantize_rowwise(q.rowwise_data, q.rowwise_scale),
                R.dequantize_columnwise(q.columnwise_data, q.columnwise_scale)):
        big = x.abs() > 2.0**-6 * x.abs().max()
        assert ((deq - x).abs()[big] <= x.abs()[big] * 2.0**-4).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_fp8_block_scales_are_correctly_rounded_fp32_divisions(device):
    """SPEC §5's scale rules are IEEE fp32 divisions (448 / amax, amax / 448) on every device: against the same
    quotients taken in fp64 and rounded once to fp32 (innocuous for a quotient of two fp32 values: 53 >= 2 * 24 + 2
    bits). A Python-scalar divisor on CUDA is a multiplication by the rounded reciprocal, one ulp off in places."""
    g = torch.Generator().manual_seed(5)
    amax = torch.exp2(torch.empty(1 << 16).uniform_(-100, 100, generator=g)).float().to(device)
    for rule in ("fp32", "deepseek"):
        _, sinv = F.fp8_block_scale(amax, rule)
        if rule == "deepseek":
            want = (amax.double() / 448.0).float()
        else:
            want = (1.0 / (448.0 / amax.double()).float().double()).float()  # scale_inv = fp32(1 / fp32(448 / amax))
        assert torch.equal(sinv.cpu(), want.cpu()), f"{rule} on {device}: {(sinv != want).sum().item()} differ"
