"""Inverse RoPE + the gradient's two block-scaled FP8 quantizations (kernels/triton/rope_fp8_block.py, SPEC §5) vs
reference/fp8_block.py `grad_operands_fp8_block`, byte for byte in the kernel's layouts: the gather and
contiguous-run kernels over geometries, styles, dtypes, strides and table layouts. CPU lane: Triton's interpreter at
small sizes; `gpu` tests at the DeepSeek-V3 shape."""

from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj._config import QProjConfig
from mla_qproj.kernels.triton.rope_fp8_block import (
    RopeFp8BlockConfig,
    fast_unit,
    packed_tokens,
    rope_fp8_block_bwd,
    rope_fp8_block_bwd_op,
)
from mla_qproj.kernels.triton.rope_fp8_block import default_config as default_rope_config
from mla_qproj.reference import fp8_block as F

from _helpers import INF, assert_op_matches, make_config, set_nan
from _tolerances import assert_bytes_equal
from conftest import DEVICE, examples

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy under the interpreter
B = F.FP8_BLOCK

GEOMS = [(2, 128, 64, 192), (3, 0, 32, 32), (3, 16, 16, 48), (2, 32, 64, 128)]  # (H, nope, R, D)
STYLES = ["deepseek", "neox", "gptj"]


def _cfg(H, nope, R, D, style):
    return QProjConfig(q_lora_rank=B, num_heads=H, qk_head_dim=nope, rope_dim=R, q_head_dim=D, rope_style=style,
                       precision="fp8_block")


def rope_reference(dq, cos_h, sin_h, cfg, block_scale):
    """The kernel's four outputs from `grad_operands_fp8_block`, in the kernel's layouts."""
    rd, rs, cd, cs = F.grad_operands_fp8_block(dq.cpu(), cos_h.cpu().float(), sin_h.cpu().float(), cfg, block_scale)
    T, N = rd.shape
    cdt = torch.zeros(N, -(-T // 16) * 16, dtype=torch.uint8)
    cdt[:, :T] = cd.view(torch.uint8).t()
    return rd, rs.new_empty(rs.shape[::-1]).copy_(rs.t()), cdt.view(torch.float8_e4m3fn), cs


def rope_inputs(T, H, D, R, dtype, seed, lo=-30, hi=30):
    """dq with random magnitudes and special values (NaN of both signs, inf, zeros, tiny values), angle tables."""
    g = torch.Generator().manual_seed(seed)
    dq = torch.randn(T, H * D, generator=g) * torch.exp2(torch.randint(lo, hi, (T, H * D), generator=g).float())
    if T > 4:
        dq[1] = 0.0
        dq[2] = torch.randn(H * D, generator=g) * 2.0**-125  # 1x128 blocks of tiny values: FLT_MAX scales
        dq[3, 3], dq[4, H * D - 1] = INF, -INF
    dq = dq.to(dtype)
    if T > 5:
        set_nan(dq[5, ::7], negative=True)
        set_nan(dq[:, H * D // 2], negative=False)
    ang = torch.rand(T, R // 2, generator=g) * 6.3
    return dq, ang.cos(), ang.sin()


def check_rope(dq, cos_h, sin_h, H, nope, R, D, style, block_scale, config=None):
    outs = rope_fp8_block_bwd(dq, cos_h, sin_h, num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R,
                              rope_style=style, block_scale=block_scale, config=config)
    ref = rope_reference(dq, cos_h, sin_h, _cfg(H, nope, R, D, style), block_scale)
    names = ("row codes [T, N]", "row scale_inv [ceil(N/128), T]", "col codes [N, T_pad]", "col scale_inv")
    tag = f"T={dq.shape[0]} {(H, nope, R, D)} {style} {dq.dtype} {block_scale} {config}"
    for name, a, b in zip(names, outs, ref, strict=True):
        assert_bytes_equal(a, b, f"{tag}: {name}")
    return outs


def contiguous_configs(w):
    """The contiguous-run kernel's configs for run width w: the warp counts that give 4, 8 or 16 tokens per thread,
    uncapped (the default caps 4 warps at 168 registers, so the two forms are compared wherever the default is)."""
    return [RopeFp8BlockConfig(w, False, nw) for nw in (2, 4, 8) if packed_tokens(w, nw) in (4, 8, 16)]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("geom", GEOMS, ids=[str(g) for g in GEOMS])
def test_rope_fp8_block(geom, style):
    """Both run kinds where the geometry allows contiguous runs (DeepSeek: 64 / 32 wide), the gather runs always."""
    H, nope, R, D = geom
    dq, c, s = rope_inputs(100, H, D, R, torch.bfloat16, 7)
    block_scale = F.BLOCK_SCALES[STYLES.index(style) % 2]
    configs = {default_rope_config(nope, R, D, style, DEVICE), RopeFp8BlockConfig(32, True, 16)}
    if fast_unit(nope, R, D, style):  # contiguous runs with every warp count, as well as the default's 4
        configs.update(contiguous_configs(fast_unit(nope, R, D, style)))
    for cfg in configs:
        check_rope(dq.to(DEVICE), c.to(DEVICE), s.to(DEVICE), H, nope, R, D, style, block_scale, cfg)
    if geom == (2, 128, 64, 192):  # DeepSeek-V3's head: contiguous runs in every style
        assert fast_unit(nope, R, D, style) == (32 if style == "neox" else 64)
        cap = 168 if triton.__version__.startswith("3.6.") else None  # the release the cap was measured on
        assert default_rope_config(nope, R, D, style, DEVICE) == RopeFp8BlockConfig(fast_unit(nope, R, D, style),
                                                                                     False, 4, maxnreg=cap)


@settings(max_examples=examples(8), deadline=None)
@given(T=st.sampled_from([1, 17, 129, 200]), geom=st.sampled_from(GEOMS), style=st.sampled_from(STYLES),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), block_scale=st.sampled_from(F.BLOCK_SCALES),
       row_pad=st.sampled_from([0, 40]), tables=st.sampled_from(["fp32", "bf16", "broadcast", "wide"]),
       kernel=st.sampled_from(["default", "contiguous", "gather"]), seed=st.integers(0, 1000))
def test_rope_fp8_block_property(T, geom, style, dtype, block_scale, row_pad, tables, kernel, seed):
    H, nope, R, D = geom
    dq, c, s = rope_inputs(T, H, D, R, dtype, seed, -100, 100)
    if row_pad:  # any row stride: dq is a column slice of a wider buffer
        buf = torch.zeros(T, H * D + row_pad, dtype=dtype)
        buf[:, 8:8 + H * D] = dq
        dq = buf[:, 8:8 + H * D]
    if tables == "bf16":
        c, s = c.to(torch.bfloat16), s.to(torch.bfloat16)
    elif tables == "broadcast":  # one row for every token (row stride 0)
        c, s = c[:1].expand(T, -1), s[:1].expand(T, -1)
    elif tables == "wide":  # the half of a full-width HF table: row stride R
        c, s = torch.cat([c, c], -1)[:, : R // 2], torch.cat([s, s], -1)[:, : R // 2]
    w = fast_unit(nope, R, D, style)
    cfg = contiguous_configs(w)[seed % len(contiguous_configs(w))] if w and kernel == "contiguous" else None
    if kernel == "gather" or not w:
        cfg = RopeFp8BlockConfig(32, True, 16)
    check_rope(dq.to(DEVICE), c.to(DEVICE), s.to(DEVICE), H, nope, R, D, style, block_scale, cfg)


def test_rope_fp8_block_nan_and_padding():
    # NaN of either sign in dq encodes 0x7F in both forms (canonical: reference/fp8_block.py); the transposed
    # columnwise codes are zero in the padding [T, T_pad); T == 0 gives empty outputs of the same layouts
    H, nope, R, D = 2, 128, 64, 192
    dq, c, s = rope_inputs(17, H, D, R, torch.bfloat16, 3)
    rd, rs, cd, cs = check_rope(dq.to(DEVICE), c.to(DEVICE), s.to(DEVICE), H, nope, R, D, "deepseek", "pow2")
    assert rd.view(torch.uint8)[5, 0].item() == 0x7F and cd.view(torch.uint8)[0, 5].item() == 0x7F
    assert cd.shape == (H * D, 32) and (cd.view(torch.uint8)[:, 17:] == 0).all()
    outs = rope_fp8_block_bwd(dq[:0].to(DEVICE), c[:0].to(DEVICE), s[:0].to(DEVICE), num_heads=H, head_dim=D,
                              qk_head_dim=nope, rope_dim=R, rope_style="gptj")
    assert [tuple(o.shape) for o in outs] == [(0, H * D), (3, 0), (H * D, 0), (0, H * D)]


def test_rope_fp8_block_errors():
    H, nope, R, D = 2, 16, 16, 48
    dq, c, s = rope_inputs(9, H, D, R, torch.bfloat16, 1)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R, rope_style="neox")
    with pytest.raises(ValueError, match="dq2d must be"):
        rope_fp8_block_bwd(dq[:, :-1], c, s, **kw)
    with pytest.raises(ValueError, match="unit inner stride"):
        rope_fp8_block_bwd(dq.t().contiguous().t(), c, s, **kw)
    with pytest.raises(TypeError, match="dq2d"):
        rope_fp8_block_bwd(dq.long(), c, s, **kw)
    with pytest.raises(ValueError, match="cos_h / sin_h must be"):
        rope_fp8_block_bwd(dq, c[:, :4], s[:, :4], **kw)
    with pytest.raises(ValueError, match="rope_style"):
        rope_fp8_block_bwd(dq, c, s, **dict(kw, rope_style="llama"))
    with pytest.raises(ValueError, match="head_dim"):
        rope_fp8_block_bwd(dq, c, s, **dict(kw, qk_head_dim=40))
    with pytest.raises(ValueError, match="block_scale"):
        rope_fp8_block_bwd(dq, c, s, block_scale="ue8m0", **kw)
    for bad in (RopeFp8BlockConfig(32, False), RopeFp8BlockConfig(16, True)):  # 32 does not divide 16 / 48
        with pytest.raises(ValueError, match="config"):
            rope_fp8_block_bwd(dq, c, s, config=bad, **kw)
    for bad in (100, 250, 16, True, 168.0):  # a register cap is a multiple of 8 in [24, 248]
        with pytest.raises(ValueError, match="maxnreg"):
            rope_fp8_block_bwd(dq, c, s, config=RopeFp8BlockConfig(16, True, 4, maxnreg=bad), **kw)
    dq, c, s = rope_inputs(9, 2, 192, 64, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="gives 2"):
        rope_fp8_block_bwd(dq, c, s, num_heads=2, head_dim=192, qk_head_dim=128, rope_dim=64, rope_style="neox",
                           config=RopeFp8BlockConfig(32, False, 8))


@pytest.mark.parametrize("style,block_scale", [("gptj", "pow2"), ("neox", "fp32")])
def test_rope_op_registration(style, block_scale):
    """The op (its schema, fake allocation) and its eager caller give the launcher's bytes for the layer config's
    geometry, rope style and block scale."""
    dq, c, s = rope_inputs(4, 2, 48, 16, torch.bfloat16, 2)  # finite (opcheck compares outputs with NaN != NaN)
    dq, c, s = dq.to(DEVICE), c.to(DEVICE), s.to(DEVICE)
    cfg = make_config(128, 2, 16, 16, 48, rope_style=style, precision="fp8_block", block_scale=block_scale,
                           output_format="bf16")
    assert_op_matches(rope_fp8_block_bwd_op, (dq, c, s, cfg.encode()),
                      rope_fp8_block_bwd(dq, c, s, num_heads=2, head_dim=48, qk_head_dim=16, rope_dim=16,
                                         rope_style=style, block_scale=block_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
@pytest.mark.parametrize("style", STYLES)
def test_rope_fp8_block_gpu_v3(style, block_scale):
    H, nope, R, D = 128, 128, 64, 192
    dq, c, s = rope_inputs(4096 + 5, H, D, R, torch.bfloat16, 11)
    w = fast_unit(nope, R, D, style)
    for cfg in (None, RopeFp8BlockConfig(32, True, 16), *contiguous_configs(w)):
        check_rope(dq.cuda(), c.cuda(), s.cuda(), H, nope, R, D, style, block_scale, cfg)
    for T in (1, 2, 17, 130):  # the transposed layout's zero padding (a word-packed form once wrote codes there)
        dq, c, s = rope_inputs(T, H, D, R, torch.bfloat16, 13 + T)
        for cfg in contiguous_configs(w):
            check_rope(dq.cuda(), c.cuda(), s.cuda(), H, nope, R, D, style, block_scale, cfg)
    # a partial last period (H = 127) and fp32 dq
    dq, c, s = rope_inputs(300, 127, D, R, torch.float32, 12)
    check_rope(dq.cuda(), c.cuda(), s.cuda(), 127, nope, R, D, style, block_scale)
