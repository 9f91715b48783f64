"""RoPE + MXFP8 quantize (kernels/triton/rope_quant.py) vs the reference, bit exact (fp32 RoPE in the same operation
order): the forward (fp32, MXFP8 rowwise + columnwise, bf16) and the inverse with the gradient's images; the
contiguous-tile kernel against the gather kernel on special values and over its launch configs; the pair-table
checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_qproj.kernels.triton.rope_quant import RopeQuantConfig, rope_quant
from mla_qproj.reference import mxfp8 as RM
from mla_qproj.reference import qproj as RQ
from mla_qproj.reference import rope as RR

from _helpers import _same_bytes_or_both_nan, bf16_subnormal_heavy, make_config
from _tolerances import assert_bytes_equal
from conftest import DEVICE

GATHER = RopeQuantConfig(FAST=False)  # the general (gather) RoPE kernel at any geometry


GEOMS = [  # (H, nope, rope, D)
    (3, 16, 16, 32),
    (2, 0, 32, 32),  # no pass-through
    (2, 24, 40, 96),  # trailing pass-through, rope not a multiple of 32
    (1, 128, 64, 192),  # DeepSeek head (contiguous-tile RoPE kernel)
    (2, 32, 64, 128),  # contiguous-tile kernel with a trailing pass-through block
]


@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("geom", GEOMS)
def test_rope_quant_forward(style, geom):
    H, nope, R, D = geom
    T = 37
    y = torch.randn(T, H * D, device=DEVICE) * 4
    c, s = torch.randn(T, R // 2, device=DEVICE), torch.randn(T, R // 2, device=DEVICE)
    cfg = make_config(32, H, nope, R, D, rope_style=style, columnwise_output=True)
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
    cfg = make_config(32, H, nope, R, D, rope_style=style)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style=style, inverse=True,
              scale_mode="rceil")
    out = rope_quant(g, c, s, mode="fp32", columnwise=False, **kw)[0]
    assert_bytes_equal(out.view(T, H, D), RR.apply_rope_inverse(g.view(T, H, D), c, s, nope, R, style), "inverse")
    row, _, col, _ = rope_quant(g, c, s, mode="mxfp8_images", columnwise=True, **kw)
    rrow, rcol = RQ.mxfp8_grad_images(RQ.rope_inverse_grad(g.view(T, H, D), c, s, cfg), cfg.scale_mode)
    assert_bytes_equal(row, rrow.to(torch.bfloat16), "dgrad operand")
    assert_bytes_equal(col, rcol.to(torch.bfloat16), "wgrad operand")


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
