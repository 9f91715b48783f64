"""Fused kernels vs the reference: RMSNorm+quant (bytes exact given the kernel's rsigma), RoPE+quant both ways
(bit exact: fp32 RoPE with the same operation order), RMSNorm backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from mla_qproj._config import QProjConfig
from mla_qproj.kernels import rmsnorm_quant as RN
from mla_qproj.kernels._common import image_multipliers_rceil
from mla_qproj.kernels.rmsnorm_bwd import RMSNormBwdConfig, rmsnorm_bwd
from mla_qproj.kernels.rmsnorm_quant import rmsnorm_quant_fwd
from mla_qproj.kernels.rope_quant import RopeQuantConfig, rope_quant
from mla_qproj.reference import mxfp8 as RM
from mla_qproj.reference import qproj as RQ
from mla_qproj.reference import rope as RR

from _tolerances import assert_bytes_equal, assert_rel_err
from conftest import DEVICE

GATHER = RopeQuantConfig(FAST=False)  # the general (gather) RoPE kernel at any geometry


def norm_config(T: int, K: int, split: bool) -> RN.RMSNormQuantConfig:
    """The default RMSNorm + quantize launch at [T, K] with the two-launch (split) or one-kernel form forced."""
    return dataclasses.replace(RN.default_config(T, K, DEVICE), SPLIT=split)


GEOMS = [  # (H, nope, rope, D)
    (3, 16, 16, 32),
    (2, 0, 32, 32),  # no pass-through
    (2, 24, 40, 96),  # trailing pass-through, rope not a multiple of 32
    (1, 128, 64, 192),  # DeepSeek head (contiguous-tile RoPE kernel)
    (2, 32, 64, 128),  # contiguous-tile kernel with a trailing pass-through block
]


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("T", [1, 33, 64])
@pytest.mark.parametrize("split", [True, False], ids=["rsigma-kernel", "one-kernel"])
def test_rmsnorm_quant(precision, zc, T, split):
    K = 96
    x = (torch.randn(T, K) * 3).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(K, device=DEVICE)
    rs, a, cd, cs = rmsnorm_quant_fwd(x, w, 1e-6, zc, precision, "rceil", config=norm_config(T, K, split))
    _, rs_ref = RQ.rmsnorm_fwd(x, w, 1e-6, zc)
    assert_rel_err(rs, rs_ref, 1e-6, "rsigma")
    # same rsigma -> the quantized bytes must be identical to the reference (no tolerance)
    g = w.float() + 1 if zc else w.float()
    xn = x.float() * rs[:, None] * g
    if precision == "mxfp8":
        assert_bytes_equal(a, RM.dequantize_rowwise(*RM.quantize_rowwise(xn), dtype=torch.bfloat16), "A image")
        rcd, rcs = RM.quantize_columnwise(xn)
        assert_bytes_equal(cd, rcd, "xn columnwise data")
        assert_bytes_equal(cs, rcs, "xn columnwise scale")
    else:
        assert_bytes_equal(a, xn.to(torch.bfloat16), "xn bf16")


@pytest.mark.parametrize("split", [True, False], ids=["rsigma-kernel", "one-kernel"])
@pytest.mark.parametrize("K", [96, 1536])
def test_rmsnorm_quant_without_columnwise(split, K):
    """Inference (nothing saved for backward): the columnwise pair is skipped and left empty; rsigma and the A image
    are the same bytes as with it (the no-grad and the autograd forward give the same query)."""
    T = 45
    x = (torch.randn(T, K) * 3).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(K, device=DEVICE)
    conf = norm_config(T, K, split)
    full = rmsnorm_quant_fwd(x, w, 1e-6, False, "mxfp8", "rceil", config=conf)
    rs, a, cd, cs = rmsnorm_quant_fwd(x, w, 1e-6, False, "mxfp8", "rceil", columnwise=False, config=conf)
    assert cd.numel() == 0 and cs.numel() == 0
    assert_bytes_equal(rs, full[0], "rsigma")
    assert_bytes_equal(a, full[1], "A image")


@pytest.mark.parametrize("split", [True, False], ids=["rsigma-kernel", "one-kernel"])
def test_rmsnorm_quant_special_values(split):
    """Special values reach the quantizer through the norm weight: inf and NaN columns, magnitudes at the E4M3 /
    E8M0 edges, subnormal and zero columns, a NaN token row; the A image equals the reference's (NaN positions only
    for NaN) and the columnwise codes / scales are byte-identical."""
    T, K = 45, 128
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(T, K, generator=g) * 3).to(torch.bfloat16)
    x[5] = float("nan")
    w = torch.rand(K, generator=g) * torch.exp2(torch.randint(-30, 30, (K,), generator=g).float())
    w[3], w[40], w[41], w[70] = float("inf"), float("nan"), -float("inf"), 0.0
    w[64:96] = 448.0 * 2.0 ** 100
    w[96:100] = 1e-41
    x, w = x.to(DEVICE), w.to(DEVICE)
    rs, a, cd, cs = rmsnorm_quant_fwd(x, w, 1e-6, False, "mxfp8", "rceil", config=norm_config(T, K, split))
    xn = x.float() * rs[:, None] * w
    _same_bytes_or_both_nan(a, RM.dequantize_rowwise(*RM.quantize_rowwise(xn), dtype=torch.bfloat16), "A image")
    rcd, rcs = RM.quantize_columnwise(xn)
    assert_bytes_equal(cd, rcd, "xn columnwise data")
    assert_bytes_equal(cs, rcs, "xn columnwise scale")


@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("geom", GEOMS)
def test_rope_quant_forward(style, geom):
    H, nope, R, D = geom
    T = 37
    y = torch.randn(T, H * D, device=DEVICE) * 4
    c, s = torch.randn(T, R // 2, device=DEVICE), torch.randn(T, R // 2, device=DEVICE)
    cfg = QProjConfig.make(32, H, nope, R, D, rope_style=style, columnwise_output=True)
    y_ref = RR.apply_rope(y.view(T, H, D), c, s, nope, R, style)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style=style, inverse=False,
              scale_mode="rceil")
    out = rope_quant(y, c, s, mode="fp32", columnwise=False, **kw)[0]
    assert_bytes_equal(out.view(T, H, D), y_ref, "rope fp32")
    rd, rs, cd, cs = rope_quant(y, c, s, mode="mxfp8", columnwise=True, **kw)
    ref = RQ.quantize_output(y_ref, cfg)
    assert_bytes_equal(rd.view(T, H, D), ref[0], "q rowwise data")
    assert_bytes_equal(rs.view(T, H, D // 32), ref[1], "q rowwise scale")
    assert_bytes_equal(cd.view(T, H, D), ref[2], "q columnwise data")
    assert_bytes_equal(cs.view(-1, H, D), ref[3], "q columnwise scale")
    ob = rope_quant(y, c, s, mode="bf16", columnwise=False, **kw)[0]
    assert_bytes_equal(ob.view(T, H, D), y_ref.to(torch.bfloat16), "q bf16")


@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("geom", GEOMS)
def test_rope_quant_inverse_and_images(style, geom):
    H, nope, R, D = geom
    T = 33
    g = torch.randn(T, H * D, device=DEVICE)
    c, s = torch.randn(T, R // 2, device=DEVICE), torch.randn(T, R // 2, device=DEVICE)
    cfg = QProjConfig.make(32, H, nope, R, D, rope_style=style)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style=style, inverse=True,
              scale_mode="rceil")
    out = rope_quant(g, c, s, mode="fp32", columnwise=False, **kw)[0]
    assert_bytes_equal(out.view(T, H, D), RR.apply_rope_inverse(g.view(T, H, D), c, s, nope, R, style), "inverse")
    row, _, col, _ = rope_quant(g, c, s, mode="mxfp8_images", columnwise=True, **kw)
    rrow, rcol = RQ.grad_operands(g.view(T, H, D), c, s, cfg)
    assert_bytes_equal(row, rrow.to(torch.bfloat16), "dgrad operand")
    assert_bytes_equal(col, rcol.to(torch.bfloat16), "wgrad operand")


def _same_bytes_or_both_nan(a: torch.Tensor, b: torch.Tensor, label: str) -> None:
    """Bytes equal, except that a NaN may differ in payload/sign from a NaN (bf16 images and bf16/fp32 outputs:
    only MXFP8 codes carry a NaN sign contract, SPEC §2)."""
    if a.dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(a.isnan(), b.isnan()), f"{label}: NaN positions differ"
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    assert_bytes_equal(a, b, label)


@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_rope_fast_kernel_matches_general(style, inverse, scale_mode):
    """The contiguous-tile kernel against the gather kernel (both checked against the reference above) on special
    values: NaN of both signs, inf, zero rows/blocks, magnitudes around the E4M3 and E8M0 edges, a partial T."""
    compiled = DEVICE.type == "cuda"
    if compiled and scale_mode == "floor":  # up to 8 kernel compiles per case on the GPU; the interpreter runs all
        pytest.skip("compiled lane: rceil only (floor runs in the interpreter lane; E8M0 rules: test_mxfp8_quant)")
    H, nope, R, D = 2, 32, 128, 192  # two rope chunks, a trailing pass-through block
    T = 45
    g = torch.Generator().manual_seed(7)
    y = torch.randn(T, H * D, generator=g) * torch.exp2(torch.randint(-20, 20, (T, H * D), generator=g).float())
    y[3, 5], y[4, nope + 3], y[6, D + nope + 64] = float("nan"), -float("nan"), float("inf")
    y[7] = 0.0
    y[8, :32] = 448.0 * 2.0 ** 3
    y[9, nope:nope + 64] = 1e-40
    y = y.to(DEVICE)
    c, s = torch.randn(T, R // 2, generator=g).to(DEVICE), torch.randn(T, R // 2, generator=g).to(DEVICE)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style=style, inverse=inverse,
              scale_mode=scale_mode)
    modes = (("mxfp8", True), ("mxfp8_images", True)) + (() if compiled else (("bf16", False), ("fp32", False)))
    for mode, col in modes:
        fast = rope_quant(y, c, s, mode=mode, columnwise=col, **kw)  # the default: the contiguous-tile kernel
        slow = rope_quant(y, c, s, mode=mode, columnwise=col, config=GATHER, **kw)
        for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
            _same_bytes_or_both_nan(a, b, f"{mode} output {i}")


@pytest.mark.parametrize("P", [64, 96], ids=["pass_w64_default", "pass_w32_default"])
def test_rope_fast_kernel_configs(P):
    """The contiguous-tile kernel's other launch configs give the default's bytes: 32-wide pass-through tiles where
    64 divide qk_head_dim, a token-major grid, 4 warps; and configs that do not fit the geometry are refused."""
    H, R = 3, 64
    D, T = P + R, 45
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(T, H * D, generator=g) * 5).to(DEVICE)
    y[2, D + P + 1] = float("nan")
    c, s = torch.randn(T, R // 2, generator=g).to(DEVICE), torch.randn(T, R // 2, generator=g).to(DEVICE)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=P, rope_dim=R, rope_style="deepseek", inverse=True,
              scale_mode="rceil", columnwise=True)
    base = RopeQuantConfig(FAST=True, PASS_W=64 if P % 64 == 0 else 32, HEAD_MAJOR=True, num_warps=1)
    others = [dataclasses.replace(base, HEAD_MAJOR=False), dataclasses.replace(base, num_warps=4)]
    if P % 64 == 0:
        others.append(dataclasses.replace(base, PASS_W=32))
    for mode in ("mxfp8", "mxfp8_images"):
        one = rope_quant(y, c, s, mode=mode, config=base, **kw)
        for i, (a, b) in enumerate(zip(rope_quant(y, c, s, mode=mode, **kw), one, strict=True)):
            _same_bytes_or_both_nan(a, b, f"{mode} output {i}, default config")
        for conf in others:
            many = rope_quant(y, c, s, mode=mode, config=conf, **kw)
            for i, (a, b) in enumerate(zip(many, one, strict=True)):
                _same_bytes_or_both_nan(a, b, f"{mode} output {i}, {conf}")
    if P % 64:
        with pytest.raises(ValueError, match="PASS_W"):
            rope_quant(y, c, s, mode="mxfp8", config=dataclasses.replace(base, PASS_W=64), **kw)
    with pytest.raises(ValueError, match="FAST"):  # a trailing pass-through of 16 columns: gather kernel only
        rope_quant(torch.zeros(T, 2 * 96, device=DEVICE), c, s, num_heads=2, head_dim=96, qk_head_dim=16, rope_dim=R,
                   rope_style="deepseek", inverse=False, mode="fp32", columnwise=False, scale_mode="rceil",
                   config=base)
    with pytest.raises(TypeError, match="RopeQuantConfig"):
        rope_quant(y, c, s, mode="mxfp8", config={"FAST": True}, **kw)


@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("geom", [(3, 8, 16, 32), (3, 32, 64, 128)], ids=["gather", "contiguous"])
def test_rope_kernel_stays_inside_heads(style, geom):
    """Poison every column outside [nope, nope + R) of each head with NaN: rope columns must stay finite."""
    H, nope, R, D = geom
    T = 5
    y = torch.randn(T, H, D, device=DEVICE)
    poisoned = y.clone()
    poisoned[..., :nope] = float("nan")
    poisoned[..., nope + R:] = float("nan")
    c, s = torch.rand(T, R // 2, device=DEVICE), torch.rand(T, R // 2, device=DEVICE)
    for inverse in (False, True):
        out = rope_quant(poisoned.reshape(T, -1), c, s, num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R,
                         rope_style=style, inverse=inverse, mode="fp32", columnwise=False, scale_mode="rceil")[0]
        assert torch.isfinite(out.view(T, H, D)[..., nope:nope + R]).all()


@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("T, K, small_sum", [(45, 96, False), (700, 96, False), (700, 96, True), (1500, 96, True),
                                             (300, 128, False), (700, 128, True)])
def test_rmsnorm_bwd(zc, T, K, small_sum):
    """T = 700 with one program per SM's worth (132): 8 rows per program (the last one partial), the next row
    prefetched; 1500: 16 per program. K = 96 is a row as two chunks (64 + 32), K = 128 one. small_sum: the partials
    summed [16 partials, 16 columns] at a time (several unrolled steps)."""
    x = torch.randn(T, K, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(K, device=DEVICE)
    dxn = torch.randn(T, K, device=DEVICE)
    _, rs = RQ.rmsnorm_fwd(x, w, 1e-6, zc)
    conf = RMSNormBwdConfig(num_warps=4, progs_per_sm=4 if T < 132 else 1)
    if small_sum:
        conf = dataclasses.replace(conf, SUM_BLOCK_P=16, SUM_BLOCK_K=16)
    dx, dg = rmsnorm_bwd(dxn, x, rs, w, zc, config=conf)
    rdx, rdg = RQ.rmsnorm_bwd(dxn, x, rs, w, zc)
    assert_rel_err(dx.float(), rdx.float(), 1e-2, "dx")
    assert_rel_err(dg, rdg, 1e-5, "dnorm_weight")
    dx2, dg2 = rmsnorm_bwd(dxn, x, rs, w, zc, config=conf)
    assert_bytes_equal(dg2, dg, "dnorm_weight determinism")
    assert_bytes_equal(dx2, dx, "dx determinism")


@pytest.mark.gpu
def test_gpu_full_size_kernels():
    T, K, H, nope, R, D = 4096, 1536, 128, 128, 64, 192
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(K, device="cuda") + 0.5
    rs, a, cd, cs = rmsnorm_quant_fwd(x, w, 1e-6, False, "mxfp8", "rceil")
    xn = x.float() * rs[:, None] * w
    assert_bytes_equal(a, RM.dequantize_rowwise(*RM.quantize_rowwise(xn), dtype=torch.bfloat16), "A image")
    y = torch.randn(T, H * D, device="cuda")
    c, s = torch.randn(T, R // 2, device="cuda"), torch.randn(T, R // 2, device="cuda")
    cfg = QProjConfig.make(K, H, nope, R, D, columnwise_output=True)
    rd, rsc, cdd, csc = rope_quant(y, c, s, num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R,
                                   rope_style="deepseek", inverse=False, mode="mxfp8", columnwise=True,
                                   scale_mode="rceil")
    ref = RQ.quantize_output(RR.apply_rope(y.view(T, H, D), c, s, nope, R, "deepseek"), cfg)
    assert_bytes_equal(rd.view(T, H, D), ref[0], "q rowwise data")
    assert_bytes_equal(cdd.view(T, H, D), ref[2], "q columnwise data")


def test_custom_ops_opcheck():
    """The torch.library registrations (schemas, fake implementations) that torch.compile relies on."""
    from mla_qproj.kernels.mxfp8_quant import dequantize_columnwise_bf16_op, mxfp8_quantize_2d_op
    from mla_qproj.kernels.rmsnorm_bwd import rmsnorm_bwd_op
    from mla_qproj.kernels.rmsnorm_quant import rmsnorm_quant_fwd_op
    from mla_qproj.kernels.rope_quant import rope_quant_op

    T, H, D, K = 33, 2, 64, 64
    x = torch.randn(T, K, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(K, device=DEVICE)
    y = torch.randn(T, H * D, device=DEVICE)
    c, s = torch.randn(T, 16, device=DEVICE), torch.randn(T, 16, device=DEVICE)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(mxfp8_quantize_2d_op.op, (y, True, True, "rceil"), test_utils=tests)
    for precision in ("mxfp8", "bf16"):
        cfg = QProjConfig.make(K, H, 16, 32, D, precision=precision).encode()
        for colwise in (True, False):
            torch.library.opcheck(rmsnorm_quant_fwd_op.op, (x, w, cfg, colwise), test_utils=tests)
    cfg = QProjConfig.make(K, H, 16, 32, D).encode()
    for mode in ("mxfp8", "mxfp8_images", "bf16", "fp32"):
        args = (y, c, s, cfg, mode == "mxfp8_images", mode, mode != "bf16")
        torch.library.opcheck(rope_quant_op.op, args, test_utils=tests)
    cd, cs = RM.quantize_columnwise(y)
    # test_schema compares fp8 inputs with a multiply that CPU torch lacks for float8: fake tensors only
    torch.library.opcheck(dequantize_columnwise_bf16_op.op, (cd, cs), test_utils=("test_faketensor",))
    rs = torch.rand(T, device=DEVICE) + 0.5
    torch.library.opcheck(rmsnorm_bwd_op.op, (torch.randn(T, K, device=DEVICE), x, rs, w, False), test_utils=tests)
    # a strided x: the fake's dx is contiguous like the launcher's
    xs = torch.randn(K, T, device=DEVICE, dtype=torch.bfloat16).t()
    torch.library.opcheck(rmsnorm_bwd_op.op, (torch.randn(T, K, device=DEVICE), xs, rs, w, False),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("T", [1, 45, 96])
def test_dequantize_columnwise_kernel(T):
    """bf16 image of the saved columnwise xn: bytes of the reference's dequantize (NaN positions kept)."""
    x = torch.randn(T, 96) * torch.exp2(torch.randint(-30, 30, (T, 96)).float())
    x[0, 3], x[-1, 5], x[T // 2, 7] = float("nan"), -float("nan"), float("inf")
    x[:, 9] = 0.0
    cd, cs = RM.quantize_columnwise(x.to(DEVICE))
    from mla_qproj.kernels.mxfp8_quant import dequantize_columnwise_bf16

    _same_bytes_or_both_nan(dequantize_columnwise_bf16(cd, cs), RM.dequantize_columnwise(cd, cs, torch.bfloat16),
                            "xn image")



@triton.jit
def _image_multipliers_probe(amax_ptr, r_ptr, s_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    b_r, b_s = image_multipliers_rceil(tl.load(amax_ptr + o, mask=m, other=0.0))
    tl.store(r_ptr + o, b_r, mask=m)
    tl.store(s_ptr + o, b_s, mask=m)


def test_image_multipliers_rceil():
    """The GPU image path's (r, s), formed from the amax bits without the scale byte, against SPEC §2 rceil:
    r = quant_multiplier(byte), s = 2^(byte - 127) for bytes 1..254; byte 0 (every code ±0) and an all-NaN block (every
    code NaN) give r = 1, s = 0 (the same images). Edges: v = amax / 448 subnormal on both sides of 2^-127, exact
    powers of two, the 0xFE exponent with and without mantissa, fp32 max, inf, NaN; random magnitudes over the range."""
    g = torch.Generator().manual_seed(11)
    inv = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    v_edges = torch.tensor([0x400000, 0x400001, 0x3FFFFF, 0x7FFFFF, 0x800000, 0x800001, 1, 0x7F000000, 0x7F000001,
                            0x7F7FFFFF, 0x3F800000, 0x3F800001], dtype=torch.int32).view(torch.float32)
    amax = torch.cat([
        torch.tensor([0.0, 448.0, 448.0 * 2.0 ** -20, float(torch.finfo(torch.float32).max), float("inf"),
                      float("nan"), 1e-45, 2.0 ** -126, 2.0 ** 127]),
        v_edges / inv, v_edges / inv * (1 + 2.0 ** -23), v_edges / inv * (1 - 2.0 ** -23),
        torch.rand(400, generator=g) * torch.exp2(torch.randint(-149, 128, (400,), generator=g).float()),
    ]).abs()
    amax = amax.to(DEVICE)
    n = amax.numel()
    r, s = torch.empty_like(amax), torch.empty_like(amax)
    _image_multipliers_probe[(1,)](amax, r, s, n, BLOCK=triton.next_power_of_2(n))
    byte = RM.e8m0_from_amax_rceil(amax).to(torch.int32)
    mid = (byte >= 1) & (byte <= 254)
    assert mid.sum() > 300 and (byte == 0).any() and (byte == 255).any() and (byte == 254).any(), "edges not hit"
    assert_bytes_equal(r[mid], RM.quant_multiplier(byte[mid]), "r for bytes 1..254")
    assert_bytes_equal(s[mid], RM.e8m0_to_fp32(byte[mid]), "s for bytes 1..254")
    ends = ~mid
    assert torch.equal(r[ends], torch.ones_like(r[ends])), "r for byte 0 / 0xFF"
    assert torch.equal(s[ends], torch.zeros_like(s[ends])), "s for byte 0 / 0xFF"


def test_rope_quant_table_checks():
    """Pair tables reach the kernels only as [T, R/2] float views with a unit inner stride, shared by cos and sin."""
    T, H, nope, R, D = 5, 2, 32, 64, 96
    y = torch.randn(T, H * D, device=DEVICE)
    c = torch.rand(T, R, device=DEVICE)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style="deepseek", inverse=False,
              mode="fp32", columnwise=False, scale_mode="rceil")
    half = c[:, : R // 2]  # a strided view: accepted as is
    out = rope_quant(y, half, half, **kw)[0]
    ref = rope_quant(y, half.contiguous(), half.contiguous(), **kw)[0]
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="cos_h"):
        rope_quant(y, half[:-1], half[:-1], **kw)  # T - 1 rows
    with pytest.raises(ValueError, match="unit inner stride"):
        rope_quant(y, c[:, ::2], c[:, ::2], **kw)
    with pytest.raises(ValueError, match="share"):
        rope_quant(y, half, half.contiguous(), **kw)
    with pytest.raises(TypeError, match="cos_h"):
        rope_quant(y, half.double(), half.double(), **kw)


def bf16_subnormal_heavy(shape, seed: int) -> torch.Tensor:
    """bf16 values that are mostly subnormal (exponent field 0, random mantissa and sign), a few tiny normals and
    zeros: every MX block's scale is small enough that the subnormals decide its codes (SPEC §2 bytes)."""
    gen = torch.Generator().manual_seed(seed)
    mant = torch.randint(0, 0x80, shape, generator=gen, dtype=torch.int32)
    exp = torch.where(torch.rand(shape, generator=gen) < 0.1, torch.randint(1, 4, shape, generator=gen), 0)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int32)
    bits = (sign << 15) | (exp.to(torch.int32) << 7) | mant
    return bits.to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("split", [True, False], ids=["rsigma-kernel", "one-kernel"])
def test_rmsnorm_quant_bf16_subnormal_input(split):
    """x in bf16 subnormals: the kernels widen bf16 exactly (under the interpreter through its bits), so rsigma and
    every quantized byte equal the reference's."""
    T, K = 40, 96
    x = bf16_subnormal_heavy((T, K), 3).to(DEVICE)
    w = torch.randn(K, device=DEVICE)
    for scale_mode in ("rceil", "floor"):
        rs, a, cd, cs = rmsnorm_quant_fwd(x, w, 1e-30, False, "mxfp8", scale_mode, config=norm_config(T, K, split))
        _, rs_ref = RQ.rmsnorm_fwd(x, w, 1e-30, False)
        assert_rel_err(rs, rs_ref, 1e-6, "rsigma")
        xn = x.float() * rs[:, None] * w
        assert_bytes_equal(a, RM.dequantize_rowwise(*RM.quantize_rowwise(xn, scale_mode), dtype=torch.bfloat16),
                           f"A image {scale_mode}")
        rcd, rcs = RM.quantize_columnwise(xn, scale_mode)
        assert_bytes_equal(cd, rcd, f"xn columnwise data {scale_mode}")
        assert_bytes_equal(cs, rcs, f"xn columnwise scale {scale_mode}")


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[3]], ids=["general", "contiguous-tile"])
def test_rope_quant_bf16_subnormal_gradient(geom):
    """A bf16 gradient of subnormals: inverse RoPE + quantization give the reference's images and codes."""
    H, nope, R, D = geom
    T = 33
    g = bf16_subnormal_heavy((T, H * D), 5).to(DEVICE)
    c, s = torch.rand(T, R // 2, device=DEVICE), torch.rand(T, R // 2, device=DEVICE)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style="deepseek", scale_mode="floor")
    ref = RR.apply_rope_inverse(g.float().view(T, H, D), c, s, nope, R, "deepseek").reshape(T, H * D)
    out = rope_quant(g, c, s, inverse=True, mode="fp32", columnwise=False, **kw)[0]
    assert_bytes_equal(out, ref, "inverse rope fp32")
    rd, rs, cd, cs = rope_quant(g, c, s, inverse=True, mode="mxfp8", columnwise=True, **kw)
    rrd, rrs = RM.quantize_rowwise(ref, "floor")
    rcd, rcs = RM.quantize_columnwise(ref, "floor")
    for got, want, label in ((rd, rrd, "row data"), (rs, rrs, "row scale"), (cd, rcd, "col data"),
                             (cs, rcs, "col scale")):
        assert_bytes_equal(got, want, label)
