"""Fused forward GEMM (kernels/triton/qproj_gemm.py) vs the reference: q = quantize_output(RoPE(a · Wᵀ)).

CPU lane: Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py when there is no CUDA device) at small
sizes; GPU lane: the same tests compiled, plus the DeepSeek-V3 size (`gpu` marker). The only allowed difference
from the reference is the fp32 summation order of the GEMM, so >= 99.9 % of the output codes must be identical
(in practice all of them at these sizes on the interpreter) and the rest one E4M3 step apart.

The store hint's promise (last section) is checked on the host twin of the kernel's column map.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj.reference.mxfp8 import dequantize_columnwise, dequantize_rowwise, quantize_rowwise
from mla_qproj.reference.qproj import quantize_output
from mla_qproj.reference.rope import apply_rope

from _helpers import make_config
from _tolerances import (
    MIN_CODE_MATCH,
    MIN_CODE_MATCH_FP8_TC,
    REL_ERR_BF16_ROUNDING,
    REL_ERR_SAME_QUANT,
    assert_bytes_equal,
    assert_rel_err,
    code_match_fraction,
    rel_err,
)
from conftest import examples

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from mla_qproj.kernels.triton.qproj_gemm import (  # noqa: E402  (import after the lane is decided)
    HALF_N,
    HALF_WIDTHS,
    GemmConfig,
    _column_maps,
    _seg,
    default_config,
    fused_gemm_supported,
    fused_half_width,
    fused_layout,
    fused_row_source,
    output_rows,
    prepare_fused_weight,
    prepare_fused_weight_fp8,
    qproj_gemm_fwd,
    qproj_gemm_outputs,
    tma_store_supported,
)

DEEPSEEK = dict(K=1536, H=128, P=128, R=64, D=192)


def _cfg(K, H, P, R, D, style="deepseek", fmt="mxfp8", col=False, scale_mode="rceil"):
    return make_config(K, H, P, R, D, rope_style=style, output_format=fmt, columnwise_output=col,
                            scale_mode=scale_mode)


def _case(T, cfg, device, nan_token=None, nan_rows=None):
    """Exact bf16 images of MXFP8 operands, pair tables, and the reference output tuple."""
    K, N = cfg.q_lora_rank, cfg.out_features
    x = torch.randn(T, K, device=device)
    a = dequantize_rowwise(*quantize_rowwise(x), dtype=torch.bfloat16)
    w = dequantize_rowwise(*quantize_rowwise(torch.randn(N, K, device=device) * K**-0.5), dtype=torch.bfloat16)
    ang = torch.rand(T, cfg.rope_dim // 2, device=device) * 6.0
    cos_h, sin_h = ang.cos().contiguous(), ang.sin().contiguous()
    if nan_rows is not None:
        w[nan_rows] = float("nan")
    if nan_token is not None:
        cos_h[nan_token] = float("nan")  # every rope column of that token
    y = (a.float() @ w.float().t()).reshape(T, cfg.num_heads, cfg.q_head_dim)
    y = apply_rope(y, cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style)
    return a, w, cos_h, sin_h, quantize_output(y, cfg)


def _config(T, cfg, device, **changes) -> GemmConfig:
    """The default launch config with some fields changed."""
    return dataclasses.replace(default_config(T, device, cfg), **changes)


def _check(out, ref, cfg, exact_scales=True, min_scale_match=1.0):
    assert len(out) == len(ref)
    if cfg.output_format == "bf16":
        (o,), (r,) = out, ref
        assert o.shape == r.shape and o.dtype == torch.bfloat16
        frac = (o.view(torch.int16) == r.view(torch.int16)).float().mean().item()
        assert frac >= MIN_CODE_MATCH, f"  y: {frac:.5f} identical bf16 values"
        assert rel_err(o.float(), r.float()) < 1e-3, "  y: rel err"
        return
    rd, rs, cd, cs = out
    erd, ers, ecd, ecs = ref
    assert rd.shape == erd.shape and rd.dtype == torch.float8_e4m3fn and rs.shape == ers.shape
    assert (cd is None) == (ecd is None) and (cs is None) == (ecs is None)
    pairs = [("row", rd, rs, erd, ers, dequantize_rowwise)]
    if ecd is not None:
        assert cd.shape == ecd.shape and cs.shape == ecs.shape and cs.dtype == torch.uint8
        pairs.append(("col", cd, cs, ecd, ecs, dequantize_columnwise))
    for label, d, s, ed, es, deq in pairs:
        frac = code_match_fraction(d, ed, MIN_CODE_MATCH, label)
        assert frac >= MIN_CODE_MATCH, f" {label} data: {frac:.5f} identical codes"
        if exact_scales:
            assert_bytes_equal(s, es, f"{label} scale")
        else:
            sf = code_match_fraction(s, es, min_scale_match, f"{label} scale")
            assert sf >= min_scale_match, f"{label} scale: {sf:.6f} identical"
        dq, edq = deq(d, s), deq(ed, es)
        fin = torch.isfinite(edq)
        assert torch.equal(fin, torch.isfinite(dq)), f"{label}: non-finite positions differ"
        assert rel_err(dq[fin], edq[fin]) < 2e-2, f"{label}: dequantized values differ"


STYLES = ["deepseek", "neox", "gptj"]
MODES = [("mxfp8", False, "rceil"), ("mxfp8", True, "rceil"), ("mxfp8", False, "floor"), ("mxfp8", True, "floor"),
         ("bf16", False, "rceil")]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("fmt,col,scale_mode", MODES)
def test_small_vs_reference(style, fmt, col, scale_mode, device):
    """T = 33: a partial row tile and a partial columnwise block; H = 3 heads: a partial tile of W'."""
    cfg = _cfg(64, 3, 128, 64, 192, style, fmt, col, scale_mode)
    assert fused_gemm_supported(cfg)
    a, w, c, s, ref = _case(33, cfg, device)
    out = qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, s, cfg)
    _check(out, ref, cfg)


AWKWARD = {
    "T1": dict(T=1, geo=(32, 3, 128, 64, 192)),
    "trailing_pass_R128": dict(T=40, geo=(64, 3, 64, 128, 224), style="neox"),
    "gptj_R32_trailing": dict(T=40, geo=(64, 5, 32, 32, 96), style="gptj", scale_mode="floor"),
    "no_pass_through": dict(T=40, geo=(64, 3, 0, 64, 64), style="neox"),
    "many_tiles_K96": dict(T=70, geo=(96, 5, 128, 64, 192), kw=dict(BLOCK_K=64)),
    "plain_tile_loop_knob": dict(T=70, geo=(96, 3, 128, 64, 192), kw=dict(FLATTEN=False)),
    "rope_gather": dict(T=70, geo=(96, 3, 128, 64, 192), kw=dict(ROPE_BCAST=False)),
    "block_m_64": dict(T=100, geo=(64, 3, 128, 64, 192), style="neox", kw=dict(BLOCK_M=64)),
}


@pytest.mark.parametrize("style", ["deepseek", "neox"])
@pytest.mark.parametrize("fmt,col", [("mxfp8", False), ("mxfp8", True), ("bf16", False)])
@pytest.mark.parametrize("P", [128, 0])
def test_tma_store_epilogue(style, fmt, col, P, device):
    """TMA_STORE (outputs stored through [T, H, D] tensor descriptors): the same bytes as the pointer stores,
    and the reference's codes; T not a multiple of the tile (clipped rows)."""
    cfg = _cfg(64, 3, P, 64, P + 64, style=style, fmt=fmt, col=col)
    assert tma_store_supported(cfg)
    a, w, cos_h, sin_h, ref = _case(45, cfg, device)
    wp = prepare_fused_weight(w, cfg)
    # Triton 3.6 rejects the flattened loop with bf16 TMA stores
    config = _config(45, cfg, device, TMA_STORE=True, FLATTEN=fmt != "bf16")
    out = qproj_gemm_fwd(a, wp, cos_h, sin_h, cfg, config=config)
    for i, (o, b) in enumerate(zip(out, qproj_gemm_fwd(a, wp, cos_h, sin_h, cfg), strict=True)):
        if b is not None:
            assert_bytes_equal(o, b, f"TMA_STORE output {i}")
    _check(out, ref, cfg)
    assert not tma_store_supported(_cfg(64, 3, 96, 64, 160))  # pass-through halves would straddle heads
    assert not tma_store_supported(_cfg(64, 3, 128, 64, 192, style="gptj", fmt="bf16"))  # interleaved halves


@pytest.mark.parametrize("name", list(AWKWARD))
def test_awkward_cases(name, device):
    case = AWKWARD[name]
    cfg = _cfg(*case["geo"], case.get("style", "deepseek"), "mxfp8", True, case.get("scale_mode", "rceil"))
    a, w, c, s, ref = _case(case["T"], cfg, device)
    config = _config(case["T"], cfg, device, **case.get("kw", {}))
    out = qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, s, cfg, config=config)
    _check(out, ref, cfg)


@pytest.mark.parametrize("style", STYLES)
def test_bf16_odd_geometry(style, device):
    """bf16 output covers any geometry: P = 24, R = 20 (R/2 = 10, not a power of two), D = 50."""
    cfg = _cfg(64, 3, 24, 20, 50, style, "bf16")
    assert fused_gemm_supported(cfg)
    a, w, c, s, ref = _case(37, cfg, device)
    _check(qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, s, cfg), ref, cfg)


@pytest.mark.parametrize("style", ["deepseek", "gptj"])
@pytest.mark.parametrize("where", ["rope_token", "weight_rows"])
def test_nan_inputs(style, where, device):
    """rope_token: NaN rope columns of one token, so its rope rowwise blocks are all NaN (scale 0xFF) while the
    columnwise amax ignores the NaN (fmax semantics). weight_rows: output columns 0..15 of head 0 are NaN for
    every token, so for gptj one half of an MX block is all NaN and the combined amax must ignore it."""
    cfg = _cfg(64, 2, 128, 64, 192, style, "mxfp8", True)
    kw = dict(nan_token=33) if where == "rope_token" else dict(nan_rows=slice(0, 16))
    a, w, c, s, ref = _case(35, cfg, device, **kw)
    rd, rs, cd, cs = qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, s, cfg)
    assert ((rs == 0xFF) if where == "rope_token" else (cs == 0xFF)).any()
    for label, scale, escale in (("row", rs, ref[1]), ("col", cs, ref[3])):
        assert_bytes_equal(scale, escale, f"{label} scale")
    for label, d, ed in (("row", rd, ref[0]), ("col", cd, ref[2])):
        # NaN codes: 0x7F / 0xFF; their sign depends on how the hardware makes the NaN, so compare without it
        db, eb = d.view(torch.uint8).cpu(), ed.view(torch.uint8).cpu()
        nan, enan = (db & 0x7F) == 0x7F, (eb & 0x7F) == 0x7F
        assert torch.equal(nan, enan), f"{label}: NaN positions differ"
        assert code_match_fraction(db[~nan], eb[~enan]) >= MIN_CODE_MATCH, f"{label} data"


def test_empty_T(device):
    cfg = _cfg(64, 2, 128, 64, 192, "deepseek", "mxfp8", True)
    w = torch.randn(cfg.out_features, 64, device=device).bfloat16()
    a = torch.empty(0, 64, device=device, dtype=torch.bfloat16)
    c = torch.empty(0, 32, device=device)
    rd, rs, cd, cs = qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, c, cfg)
    assert rd.shape == (0, 2, 192) and rs.shape == (0, 2, 6) and cd.shape == (0, 2, 192) and cs.shape == (0, 2, 192)


@pytest.mark.parametrize("hb", HALF_WIDTHS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("geo", [(64, 3, 128, 64, 192), (64, 5, 32, 32, 96), (64, 3, 24, 20, 50)])
def test_column_maps_are_permutations(style, geo, hb):
    """W' rows are an exact permutation of W's rows (plus zero padding) in tiles of 2·hb rows, and the outputs a
    permutation of columns; a rope tile's halves hold the two members of the same pairs."""
    fmt = "bf16" if geo[4] % 32 or (style != "gptj" and geo[3] % 64) else "mxfp8"
    cfg = _cfg(*geo, style, fmt)
    src, out = _column_maps(cfg, hb)
    N, (H, P, R, D) = cfg.out_features, geo[1:]
    for label, m in (("src", src), ("out", out)):
        v = m[m >= 0]
        assert torch.equal(v.sort().values, torch.arange(N)), f"{label} map is not a permutation"
    nt_pass, nt_rope, rows = fused_layout(cfg, hb)
    assert torch.equal(src < 0, out < 0) and src.numel() == rows == (nt_pass + nt_rope) * 2 * hb
    assert nt_pass == -(-H * (D - R) // (2 * hb)) and nt_rope == -(-H * (R // 2) // hb)
    lo, hi = src.reshape(-1, 2, hb)[nt_pass:].unbind(1)  # rope tiles' halves: same head, same pair
    real = lo >= 0
    a, b = lo[real] % D - P, hi[real] % D - P
    assert torch.equal(lo[real] // D, hi[real] // D)
    assert torch.equal(b - a, torch.full_like(a, R // 2)) if style == "neox" else torch.equal(b - a, a * 0 + 1)
    assert torch.equal(fused_row_source(cfg, "bf16", hb), src)
    w = torch.randn(N, 64).bfloat16()
    wp = prepare_fused_weight(w, cfg, hb=hb)
    assert torch.equal(wp[src >= 0], w[src[src >= 0]])
    assert (wp[src < 0] == 0).all()
    assert_bytes_equal(prepare_fused_weight(w, cfg, src=src), wp, "W' from a precomputed src")


def test_prepare_fused_weight_traces_without_cache(device):
    """The layer prepares W' inside its graph under torch.compile: the layout helpers carry no functools cache
    (dynamo warns on each one and traces through it), and the compiled W' is the eager one."""
    cfg = _cfg(64, 3, 128, 64, 192)
    w = torch.randn(cfg.out_features, 64, device=device).bfloat16()
    fn = torch.compile(lambda t: prepare_fused_weight(t, cfg), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        wp = fn(w)
    assert not [r for r in rec if "lru_cache" in str(r.message)], [str(r.message)[:200] for r in rec]
    assert_bytes_equal(wp, prepare_fused_weight(w, cfg), "compiled W'")


def test_supported_geometries():
    assert fused_gemm_supported(_cfg(1536, 128, 128, 64, 192))
    assert fused_gemm_supported(_cfg(64, 3, 32, 32, 96, "gptj"))  # gptj: R/2 % 16 == 0 suffices
    assert fused_gemm_supported(_cfg(64, 3, 24, 20, 64, "deepseek", "bf16"))
    # MXFP8 out needs every MX block to be one run of kernel columns:
    assert not fused_gemm_supported(_cfg(64, 3, 16, 64, 96))  # pass-through 16 columns: P % 32 != 0
    assert not fused_gemm_supported(_cfg(64, 3, 128, 32, 192))  # deepseek R/2 = 16
    assert not fused_gemm_supported(_cfg(64, 3, 128, 32, 192, "neox"))  # neox R/2 = 16
    assert not fused_gemm_supported(_cfg(64, 3, 128, 16, 160, "gptj"))  # gptj R/2 = 8
    assert not fused_gemm_supported(_cfg(64, 3, 120, 8, 128, "gptj", "mxfp8"))
    assert not fused_gemm_supported(None)


def test_input_errors(device):
    cfg = _cfg(64, 2, 128, 64, 192)
    w = torch.randn(cfg.out_features, 64, device=device).bfloat16()
    wp = prepare_fused_weight(w, cfg)
    a = torch.randn(8, 64, device=device).bfloat16()
    c = torch.randn(8, 32, device=device)
    with pytest.raises(TypeError, match="a must be"):
        qproj_gemm_fwd(a.float(), wp, c, c, cfg)
    with pytest.raises(TypeError, match="cos_h"):
        qproj_gemm_fwd(a, wp, c.double(), c, cfg)
    with pytest.raises(ValueError, match="w_prepared"):
        qproj_gemm_fwd(a, w, c, c, cfg)
    with pytest.raises(ValueError, match="sin_h"):
        qproj_gemm_fwd(a, wp, c, c[:4], cfg)
    with pytest.raises(ValueError, match="does not cover"):
        bad = _cfg(64, 2, 16, 64, 96)
        qproj_gemm_fwd(a, wp, c, c, bad)
    with pytest.raises(TypeError, match="config must be a GemmConfig"):
        qproj_gemm_fwd(a, wp, c, c, cfg, config=dict(BLOCK_M=32))
    with pytest.raises(ValueError, match="TMA_STORE does not cover"):  # gptj interleaves the halves
        gptj = _cfg(64, 2, 128, 64, 192, "gptj")
        qproj_gemm_fwd(a, prepare_fused_weight(w, gptj), c, c, gptj, config=_config(8, gptj, device, TMA_STORE=True))
    with pytest.raises(ValueError, match="ROPE_BCAST"):  # R/2 = 48 does not divide the 128-wide half
        r96 = _cfg(64, 2, 64, 96, 160, "deepseek", "bf16")
        c48 = torch.randn(8, 48, device=device)
        qproj_gemm_fwd(a, prepare_fused_weight(w[:320], r96), c48, c48, r96, config=_config(8, r96, device,
                                                                                          ROPE_BCAST=True))
    with pytest.raises(ValueError, match="w_bf16 must have shape"):
        prepare_fused_weight(w[:-1], cfg)
    with pytest.raises(TypeError, match="bfloat16"):
        prepare_fused_weight(w.float(), cfg)


# ------------------------------------------------------------------------------ fp8_block operands (SPEC §5)

F8 = torch.float8_e4m3fn


def _fp8_blocks(x: torch.Tensor, bm: int, bn: int, block_scale: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §5 for a finite x [M, N] (this test's own quantizer): amax per [bm, bn] block, scale = fp32(448 / amax)
    (1 for amax 0; FLT_MAX on overflow), rounded down to a power of two for "pow2"; codes = E4M3 RNE of x·scale.
    Returns (codes [M, N], scale_inv fp32 [ceil(M / bm), ceil(N / bn)])."""
    M, N = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -N % bn, 0, -M % bm))
    amax = xp.reshape(xp.shape[0] // bm, bm, xp.shape[1] // bn, bn).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, torch.tensor(448.0) / amax, torch.ones_like(amax))
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    if block_scale == "pow2":
        scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    s = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :N]
    return (x.float() * s).clamp(-448.0, 448.0).to(F8), 1.0 / scale


def _fp8_case(T, cfg, device, block_scale="pow2", nan_token=None, other_hb=None):
    """Kernel operands from random x (1x128 blocks) and W (128x128 tiles), and the reference output tuple:
    y = sum over K blocks of (A_kb · W_kbᵀ) · sa · sw in fp32, then RoPE and `quantize_output`. W' has the default
    half width; other_hb: also return the same operands with W' laid out for that half width, as a 4th entry."""
    K, N = cfg.q_lora_rank, cfg.out_features
    a, sa = _fp8_blocks(torch.randn(T, K, device=device), 1, 128, block_scale)  # sa [T, K/128]
    if nan_token is not None:
        a.view(torch.uint8)[nan_token, 5] = 0x7F  # one NaN code: the token's whole output row is NaN
    w, sw = _fp8_blocks(torch.randn(N, K, device=device) * K**-0.5, 128, 128, block_scale)  # sw [N/128, K/128]
    sw_rows = sw.repeat_interleave(128, 0)[:N]  # [N, K/128]
    y = torch.zeros(T, N, device=device)
    for kb in range(K // 128):
        ks = slice(kb * 128, (kb + 1) * 128)
        y += (a[:, ks].float() @ w[:, ks].float().t()) * sa[:, kb, None] * sw_rows[None, :, kb]
    ang = torch.rand(T, cfg.rope_dim // 2, device=device) * 6.0
    cos_h, sin_h = ang.cos().contiguous(), ang.sin().contiguous()
    y = apply_rope(y.reshape(T, cfg.num_heads, cfg.q_head_dim), cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim,
                   cfg.rope_style)
    wp, wps = prepare_fused_weight_fp8(w, sw, cfg)
    args = (a, wp, cos_h, sin_h, cfg)
    case = args, dict(a_scale_inv=sa.t().contiguous(), w_scale_inv=wps), quantize_output(y, cfg)
    if other_hb is None:
        return case
    wp2, wps2 = prepare_fused_weight_fp8(w, sw, cfg, hb=other_hb)
    return *case, ((a, wp2, cos_h, sin_h, cfg), dict(case[1], w_scale_inv=wps2))


def _check_fp8(out, ref, cfg, min_codes=None, bf16_bound=REL_ERR_BF16_ROUNDING):
    """Same quantization as the reference, different summation inside each 128-block: the tolerance policy's
    same-quantization bounds (MXFP8: `assert_mxfp8_close`), bf16 output: relative error. Compiled, the FP8 tensor
    cores accumulate each block in reduced precision: `MIN_CODE_MATCH_FP8_TC` identical codes."""
    if min_codes is None:
        min_codes = MIN_CODE_MATCH_FP8_TC if out[0].is_cuda else MIN_CODE_MATCH
    assert len(out) == len(ref)
    if cfg.output_format == "bf16":
        assert out[0].dtype == torch.bfloat16 and out[0].shape == ref[0].shape
        e = rel_err(out[0].float(), ref[0].float())
        assert e <= bf16_bound, f"  y: rel err {e:.3g} > {bf16_bound}"
        return
    pairs = [("row", 0, dequantize_rowwise)] + ([("col", 2, dequantize_columnwise)] if ref[2] is not None else [])
    assert (out[2] is None) == (ref[2] is None)
    for label, i, deq in pairs:
        (d, sc), (ed, es) = out[i:i + 2], ref[i:i + 2]
        assert d.shape == ed.shape and d.dtype == F8 and sc.shape == es.shape and sc.dtype == torch.uint8
        codes = code_match_fraction(d, ed, min_codes, f"{label} codes")
        scales = code_match_fraction(sc, es, min(min_codes, MIN_CODE_MATCH), f"{label} scale bytes")
        assert codes >= min_codes, f"{label}: only {codes:.5f} of the codes identical"
        # a block's scale follows its amax, which the FP8 tensor cores' accumulation moves as well
        assert scales >= min(min_codes, MIN_CODE_MATCH), f"{label}: only {scales:.5f} of the scale bytes identical"
        assert_rel_err(deq(d, sc), deq(ed, es), REL_ERR_SAME_QUANT, f"{label} decoded")


OUT_MODES = [("bf16", False), ("mxfp8", False), ("mxfp8", True)]
FP8_AWKWARD = {  # T, K, (H, P, R, D), style, (fmt, col), scale_mode, block_scale
    "T1_K128_floor": (1, 128, (3, 128, 64, 192), "deepseek", ("mxfp8", True), "floor", "pow2"),
    "T100_K128_fp32_scales": (100, 128, (3, 128, 64, 192), "neox", ("mxfp8", False), "rceil", "fp32"),
    "trailing_pass_R128": (40, 128, (3, 64, 128, 224), "neox", ("mxfp8", True), "rceil", "pow2"),
    "gptj_R32_trailing": (40, 128, (5, 32, 32, 96), "gptj", ("mxfp8", True), "floor", "fp32"),
    "no_pass_through": (40, 128, (3, 0, 64, 64), "neox", ("mxfp8", True), "rceil", "pow2"),
    "bf16_odd_geometry": (37, 128, (3, 24, 20, 50), "gptj", ("bf16", False), "rceil", "fp32"),
    "rope_gather_R256": (20, 128, (2, 64, 256, 320), "deepseek", ("mxfp8", True), "rceil", "pow2"),  # R/2 > HB
}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("fmt,col", OUT_MODES)
def test_fp8_vs_reference(style, fmt, col, device):
    """T = 33 (a partial row tile and columnwise block), K = 256 (two scale blocks), H = 3 (a partial W' tile);
    pow2 scales for deepseek, DeepSeek-V3's fp32 scales for the others."""
    cfg = _cfg(256, 3, 128, 64, 192, style, fmt, col)
    args, scales, ref = _fp8_case(33, cfg, device, "pow2" if style == "deepseek" else "fp32")
    _check_fp8(qproj_gemm_fwd(*args, **scales), ref, cfg)


@pytest.mark.parametrize("name", list(FP8_AWKWARD))
def test_fp8_awkward_cases(name, device):
    T, K, (H, P, R, D), style, (fmt, col), scale_mode, block_scale = FP8_AWKWARD[name]
    cfg = _cfg(K, H, P, R, D, style, fmt, col, scale_mode)
    args, scales, ref = _fp8_case(T, cfg, device, block_scale)
    _check_fp8(qproj_gemm_fwd(*args, **scales), ref, cfg)


def test_fp8_configs_same_bytes(device):
    """Launch configs change nothing in the bytes: TMA stores, the plain tile loop, gathered pair tables, [64, 256]
    and [128, 256] tiles, and HB = 64 ([128, 128] tiles, on a W' laid out for it), against the default
    (HB = 128; T = 40: partial tiles either way)."""
    cfg = _cfg(128, 3, 128, 64, 192, "deepseek", "mxfp8", True)
    args, scales, ref, (args64, scales64) = _fp8_case(40, cfg, device, other_hb=64)
    base = qproj_gemm_fwd(*args, **scales)
    _check_fp8(base, ref, cfg)
    assert default_config(40, device, cfg, "fp8_block").HB == fused_half_width(cfg, "fp8_block") == 128
    for changes in (dict(TMA_STORE=True), dict(FLATTEN=False, ROPE_BCAST=False), dict(BLOCK_M=64, num_warps=8),
                    dict(BLOCK_M=128), dict(HB=64), dict(HB=64, BLOCK_M=128, TMA_STORE=True)):
        a, sc = (args64, scales64) if changes.get("HB") == 64 else (args, scales)
        out = qproj_gemm_fwd(*a, **sc, config=_fp8_config(40, cfg, device, **changes))
        for i, (o, b) in enumerate(zip(out, base, strict=True)):
            assert_bytes_equal(o, b, f"{changes} output {i}")


def _fp8_config(T, cfg, device, **changes) -> GemmConfig:
    return dataclasses.replace(default_config(T, device, cfg, "fp8_block"), **changes)


@pytest.mark.parametrize("style", STYLES)
def test_fp8_half_width_64(style, device):
    """HB = 64 ([BLOCK_M, 128] tiles, selectable; the default is 128) on a W' laid out for it: the reference's
    output, and the same bytes as the default HB = 128 (T = 45: partial tiles; H = 5: a partial rope tile at
    HB = 128 and several at 64)."""
    cfg = _cfg(128, 5, 32, 64, 128, style, "mxfp8", True, "floor")
    args, scales, ref, (args64, scales64) = _fp8_case(45, cfg, device, "fp32", other_hb=64)
    assert fused_layout(cfg, 128)[2] != fused_layout(cfg, 64)[2]  # the layouts differ: W' rows 1280 vs 768
    assert default_config(45, device, cfg, "fp8_block").HB == 128
    out = qproj_gemm_fwd(*args64, **scales64, config=_fp8_config(45, cfg, device, HB=64))
    _check_fp8(out, ref, cfg)
    for i, (o, b) in enumerate(zip(out, qproj_gemm_fwd(*args, **scales), strict=True)):
        assert_bytes_equal(o, b, f"HB = 64 vs 128 output {i}")


@pytest.mark.parametrize("style", STYLES)
def test_bf16_operands_half_width_64(style, device):
    """The bf16-operand kernel with HB = 64 (not its default) on a W' laid out for it: the reference's output and
    the default (HB = 128) bytes; BLOCK_M = 64 and the TMA stores where the geometry has them."""
    cfg = _cfg(64, 3, 64, 64, 128, style, "mxfp8", True)
    a, w, c, s, ref = _case(37, cfg, device)
    config = _config(37, cfg, device, HB=64, BLOCK_M=64, TMA_STORE=style != "gptj", FLATTEN=True)
    assert tma_store_supported(cfg, 64) == (style != "gptj") and default_config(37, device, cfg).HB == 128
    out = qproj_gemm_fwd(a, prepare_fused_weight(w, cfg, hb=64), c, s, cfg, config=config)
    _check(out, ref, cfg)
    for i, (o, b) in enumerate(zip(out, qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, s, cfg), strict=True)):
        assert_bytes_equal(o, b, f"HB = 64 vs 128 output {i}")


def test_half_width_layout_and_errors(device, monkeypatch):
    """The half width is fixed per (geometry, operands) and every layout helper and check follows it."""
    from mla_qproj.kernels.triton import qproj_gemm

    monkeypatch.setattr(qproj_gemm, "_num_sms", lambda index: 132)  # the GPU chooser, without a GPU
    monkeypatch.setattr(qproj_gemm, "_DEFAULT_CONFIGS", {})
    cfg = _cfg(128, 2, 128, 64, 192)  # N = 384: W' has 512 rows at HB = 128, 384 at HB = 64
    assert fused_half_width(cfg) == 128 and fused_half_width(cfg, "fp8_block") == 128
    assert [fused_layout(cfg, hb) for hb in (128, 64)] == [(1, 1, 512), (2, 1, 384)]
    for T in (1, 64, 65, 20000):  # every T bucket: the same half width (the layer lays W' out once)
        for operands in ("bf16", "fp8_block"):
            for dev in (device, torch.device("cuda")):
                assert default_config(T, dev, cfg, operands).HB == fused_half_width(cfg, operands)
    with pytest.raises(ValueError, match="operands must be one of"):
        fused_half_width(cfg, "fp8")
    with pytest.raises(ValueError, match="half width must be one of"):
        fused_row_source(cfg, "fp8_block", 96)
    p64 = _cfg(128, 2, 64, 64, 128)  # TMA stores: a pass-through half must not straddle a head's P columns
    assert tma_store_supported(p64, 64) and not tma_store_supported(p64, 128)
    args, scales, _, (args64, scales64) = _fp8_case(8, cfg, device, other_hb=64)
    with pytest.raises(ValueError, match=r"w_prepared must be \[512, 128\] \(from prepare_fused_weight_fp8 with half"):
        qproj_gemm_fwd(*args64, **scales64)  # a W' for HB = 64 with the default config (HB = 128)
    with pytest.raises(ValueError, match=r"w_prepared must be \[384, 128\]"):
        qproj_gemm_fwd(*args, **scales, config=_fp8_config(8, cfg, device, HB=64))
    with pytest.raises(ValueError, match="config.HB must be one of"):
        qproj_gemm_fwd(*args, **scales, config=_fp8_config(8, cfg, device, HB=32))
    with pytest.raises(ValueError, match="config.BLOCK_M must be a multiple of 32"):
        qproj_gemm_fwd(*args, **scales, config=_fp8_config(8, cfg, device, BLOCK_M=16))
    (a, _, c, s, _), w = args, torch.randn(p64.out_features, 128, device=device).bfloat16()
    with pytest.raises(ValueError, match="TMA_STORE does not cover this geometry with HB = 128"):
        qproj_gemm_fwd(a.float().bfloat16(), prepare_fused_weight(w, p64), c, s, p64,
                       config=_config(8, p64, device, TMA_STORE=True))
    r256 = _cfg(128, 2, 64, 256, 320)  # R/2 = 128 divides the default HB = 128, not HB = 64 (config checked first)
    assert default_config(8, device, r256, "fp8_block").ROPE_BCAST
    with pytest.raises(ValueError, match="ROPE_BCAST needs R/2 a power of two dividing 64"):
        qproj_gemm_fwd(*args[:4], r256, **scales, config=_fp8_config(8, r256, device, ROPE_BCAST=True, HB=64))


def test_fp8_nan_code(device):
    """A NaN code in a token's A row makes that token's outputs NaN (rowwise scale 0xFF); the columnwise amax of its
    32-token blocks ignores it. Under the interpreter the codes' decode must keep NaN (its cast gives 480)."""
    cfg = _cfg(128, 2, 128, 64, 192, "deepseek", "mxfp8", True)
    args, scales, ref = _fp8_case(35, cfg, device, nan_token=3)
    rd, rs, cd, cs = qproj_gemm_fwd(*args, **scales)
    assert (rs[3] == 0xFF).all() and (ref[1][3] == 0xFF).all()
    for label, scale, escale in (("row", rs, ref[1]), ("col", cs, ref[3])):
        assert_bytes_equal(scale, escale, f"{label} scale")
    for label, d, ed in (("row", rd, ref[0]), ("col", cd, ref[2])):
        db, eb = d.view(torch.uint8).cpu(), ed.view(torch.uint8).cpu()
        nan, enan = (db & 0x7F) == 0x7F, (eb & 0x7F) == 0x7F
        assert torch.equal(nan, enan) and nan[3].all(), f"{label}: NaN positions differ"
        min_codes = MIN_CODE_MATCH_FP8_TC if d.is_cuda else MIN_CODE_MATCH
        assert code_match_fraction(db[~nan], eb[~enan]) >= min_codes, f"{label} data"


@pytest.mark.parametrize("hb", [None, *HALF_WIDTHS])
@pytest.mark.parametrize("style,geo", [("deepseek", (3, 128, 64, 192)), ("gptj", (5, 32, 32, 96)),
                                       ("neox", (3, 0, 64, 64))])
def test_prepare_fused_weight_fp8_exact(style, geo, hb, device):
    """W' codes and scale_inv against a direct gather: within each 2·hb-row tile of the bf16 order, rows
    [lo 0:hb/2 | lo hb/2:hb | hi 0:hb/2 | hi hb/2:hb] become [lo 0:hb/2 | hi 0:hb/2 | lo hb/2:hb | hi hb/2:hb]; the
    scale_inv of row r for K block kb is W's tile scale_inv [src(r) // 128, kb]; padding rows code 0, scale 0.
    hb None: the default, 128 for fp8_block operands."""
    H, P, R, D = geo
    cfg = _cfg(256, H, P, R, D, style)
    N = cfg.out_features
    w = (torch.randn(N, 256, device=device) * 40).to(F8)
    sw = torch.rand(-(-N // 128), 2, device=device) + 0.5
    wp, wps = prepare_fused_weight_fp8(w, sw, cfg, hb=hb)
    hb = 128 if hb is None else hb
    src16 = _column_maps(cfg, hb)[0]
    assert src16.numel() == fused_layout(cfg, hb)[2] == wp.shape[0]
    r = torch.arange(src16.numel())
    tile, g, h, j = r // (2 * hb), (r // hb) % 2, (r // (hb // 2)) % 2, r % (hb // 2)
    src = src16[tile * 2 * hb + h * hb + g * (hb // 2) + j].to(device)  # W row of W' row r
    valid = src >= 0
    exp_codes = torch.zeros(src.numel(), 256, dtype=torch.uint8, device=device)
    exp_codes[valid] = w.view(torch.uint8)[src[valid]]
    exp_s = torch.zeros(2, src.numel(), device=device)
    exp_s[:, valid] = sw[src[valid] // 128].t()
    assert wp.dtype == F8 and wps.dtype == torch.float32 and wps.is_contiguous() and wp.is_contiguous()
    assert_bytes_equal(wp.view(torch.uint8), exp_codes, "W' codes")
    assert_bytes_equal(wps, exp_s, "W' scale_inv")
    assert torch.equal(fused_row_source(cfg, "fp8_block", hb).to(device), src)
    for o, e in zip(prepare_fused_weight_fp8(w, sw, cfg, src=src), (wp, wps), strict=True):
        assert_bytes_equal(o, e, "W' from a precomputed src")


def test_fp8_input_errors(device):
    cfg = _cfg(128, 2, 128, 64, 192)
    args, scales, _ = _fp8_case(8, cfg, device)
    a, wp, c, s, _ = args
    sa, sw = scales["a_scale_inv"], scales["w_scale_inv"]
    with pytest.raises(TypeError, match="a must be"):
        qproj_gemm_fwd(a.float(), wp, c, s, cfg, **scales)
    with pytest.raises(TypeError, match="w_prepared must be"):  # bf16 W' with fp8 A
        qproj_gemm_fwd(a, wp.float().bfloat16(), c, s, cfg, **scales)
    with pytest.raises(TypeError, match="a_scale_inv"):
        qproj_gemm_fwd(a, wp, c, s, cfg, a_scale_inv=None, w_scale_inv=sw)
    with pytest.raises(ValueError, match=r"a_scale_inv must be \[1, 8\]"):  # [T, K/128] instead of [K/128, T]
        qproj_gemm_fwd(a, wp, c, s, cfg, a_scale_inv=sa.t().contiguous(), w_scale_inv=sw)
    with pytest.raises(ValueError, match="a_scale_inv must be contiguous"):
        strided = torch.zeros(1, 16, device=device)[:, ::2]
        qproj_gemm_fwd(a, wp, c, s, cfg, a_scale_inv=strided, w_scale_inv=sw)
    with pytest.raises(ValueError, match="w_scale_inv must be"):
        qproj_gemm_fwd(a, wp, c, s, cfg, a_scale_inv=sa, w_scale_inv=sw[:, :-1])
    with pytest.raises(ValueError, match="BLOCK_K must be 128"):
        qproj_gemm_fwd(a, wp, c, s, cfg, **scales, config=_fp8_config(8, cfg, device, BLOCK_K=64))
    with pytest.raises(ValueError, match="operands must be one of"):
        default_config(8, device, cfg, "fp8")
    k96 = _cfg(96, 2, 128, 64, 192)
    with pytest.raises(ValueError, match="multiple of 128"):
        prepare_fused_weight_fp8(torch.zeros(k96.out_features, 96, dtype=F8), torch.ones(3, 1), k96)
    w = torch.zeros(cfg.out_features, 128, dtype=F8, device=device)
    with pytest.raises(TypeError, match="w_data must be a float8_e4m3fn"):
        prepare_fused_weight_fp8(w.float(), torch.ones(3, 1, device=device), cfg)
    with pytest.raises(TypeError, match="w_scale_inv must be a float32"):
        prepare_fused_weight_fp8(w, torch.ones(3, 1, device=device).double(), cfg)
    with pytest.raises(ValueError, match="w_scale_inv must have shape"):
        prepare_fused_weight_fp8(w, torch.ones(2, 1, device=device), cfg)
    with pytest.raises(ValueError, match="w_data must have shape"):
        prepare_fused_weight_fp8(w[:-1], torch.ones(3, 1, device=device), cfg)


@pytest.mark.parametrize("operands,fmt,col", [("bf16", "mxfp8", False), ("fp8_block", "mxfp8", True),
                                              ("fp8_block", "bf16", False)])
def test_gemm_custom_ops(operands, fmt, col, device):
    """`mla_qproj::qproj_gemm_fwd` / `qproj_gemm_fp8_fwd`: the launcher's bytes in eager mode (None for absent
    outputs) and through the registered op (empty tensors), and opcheck's schema and fake-tensor tests (the fake is
    the launcher's allocation)."""
    from mla_qproj.kernels.triton.qproj_gemm import qproj_gemm_fp8_fwd_op, qproj_gemm_fwd_op

    cfg = _cfg(128, 2, 128, 64, 192, "neox", fmt, col)
    if operands == "fp8_block":
        cfg = dataclasses.replace(cfg, precision="fp8_block")
    enc = cfg.encode()
    if operands == "fp8_block":
        (a, wp, c, s, _), scales, _ = _fp8_case(5, cfg, device)
        direct = qproj_gemm_fwd(a, wp, c, s, cfg, **scales)
        op, op_args = qproj_gemm_fp8_fwd_op, (a, scales["a_scale_inv"], wp, scales["w_scale_inv"], c, s, enc)
    else:
        a, w, c, s, _ = _case(5, cfg, device)
        wp = prepare_fused_weight(w, cfg)
        direct = qproj_gemm_fwd(a, wp, c, s, cfg)
        op, op_args = qproj_gemm_fwd_op, (a, wp, c, s, enc)
    eager, traced = op(*op_args), op.op(*op_args)
    for i in range(4):
        d = direct[i] if i < len(direct) else None
        if d is None:
            assert eager[i] is None and traced[i].numel() == 0, f"absent output {i}"
        else:
            assert_bytes_equal(eager[i], d, f"eager output {i}")
            assert_bytes_equal(traced[i], d, f"op output {i}")
    # test_schema compares the inputs before and after arithmetically, which torch does not do for fp8 on the CPU
    utils = ("test_faketensor",) if operands == "fp8_block" else ("test_schema", "test_faketensor")
    torch.library.opcheck(op.op, op_args, test_utils=utils)


# ------------------------------------------------------------------ writing row slices (the overlapped SP forward)


OUT_ROWS = [("bf16", "mxfp8", True), ("bf16", "bf16", False), ("fp8_block", "mxfp8", True),
            ("fp8_block", "mxfp8", False), ("fp8_block", "bf16", False)]


def _check_out_rows(operands, fmt, col, device, T, geo, style):
    """Launches over four token ranges written into `output_rows` of one preallocated output, in the order the
    overlapped sequence-parallel forward uses (a middle range first, then the others; the last range shorter when
    T is not a multiple of 4 · 32, and ending in a partial block), with the whole T's config: the bytes of one launch
    over all T."""
    q = -(-T // 128) * 32  # a quarter of T rounded up to whole 32-token blocks
    edges = [(q, 2 * q), (0, q), (2 * q, 3 * q), (3 * q, T)]
    assert all(t0 < t1 for t0, t1 in edges), edges
    cfg = _cfg(*geo, style, fmt, col)
    if operands == "bf16":
        a, w, c, s, _ = _case(T, cfg, device)
        wp, scales = prepare_fused_weight(w, cfg), {}
    else:
        (a, wp, c, s, _), scales, _ = _fp8_case(T, cfg, device)
    whole = qproj_gemm_fwd(a, wp, c, s, cfg, **scales)
    config = default_config(T, device, cfg, operands)
    out = qproj_gemm_outputs(T, cfg, a)
    for t0, t1 in edges:
        sc = {} if not scales else dict(scales, a_scale_inv=scales["a_scale_inv"][:, t0:t1].contiguous())
        rows = output_rows(out, t0, t1)
        assert qproj_gemm_fwd(a[t0:t1], wp, c[t0:t1], s[t0:t1], cfg, **sc, config=config, out=rows) is rows
    assert len(out) == len(whole)
    for i, (o, w_) in enumerate(zip(out, whole, strict=True)):
        if w_ is None:
            assert o is None
        else:
            assert_bytes_equal(o, w_, f"output {i}")


@pytest.mark.parametrize("operands,fmt,col", OUT_ROWS)
def test_out_rows_same_bytes(operands, fmt, col, device):
    """`_check_out_rows` at T = 112 (ranges of 32, 32, 32, 16 tokens); gptj pairs for bf16 operands."""
    geo = (64 if operands == "bf16" else 128, 3, 128, 64, 192)
    _check_out_rows(operands, fmt, col, device, 112, geo, "gptj" if operands == "bf16" else "deepseek")


def test_out_errors(device):
    cfg = _cfg(64, 2, 128, 64, 192, "deepseek", "mxfp8", True)
    a, w, c, s, _ = _case(64, cfg, device)
    wp = prepare_fused_weight(w, cfg)
    out = qproj_gemm_outputs(64, cfg, a)
    with pytest.raises(ValueError, match="multiples of 32"):
        output_rows(out, 16, 48)
    with pytest.raises(ValueError, match=r"out\[0\] must be \[32, 2, 192\]"):
        qproj_gemm_fwd(a[:32], wp, c[:32], s[:32], cfg, out=out)
    with pytest.raises(TypeError, match="tuple of 4"):
        qproj_gemm_fwd(a, wp, c, s, cfg, out=out[:1])
    no_col = _cfg(64, 2, 128, 64, 192, "deepseek", "mxfp8", False)
    with pytest.raises(ValueError, match=r"out\[2\] must be None"):
        qproj_gemm_fwd(a, prepare_fused_weight(w, no_col), c, s, no_col, out=out)
    with pytest.raises(ValueError, match="contiguous"):
        qproj_gemm_fwd(a, wp, c, s, cfg, out=(out[0].transpose(0, 1).contiguous().transpose(0, 1), *out[1:]))


# --------------------------------------------------------------------------------------------- GPU lane


@pytest.mark.gpu
@pytest.mark.parametrize("operands,fmt,col", OUT_ROWS)
def test_out_rows_same_bytes_deepseek_v3(operands, fmt, col, device):
    """`_check_out_rows` at the DeepSeek-V3 geometry and T = 16384 (the config of T >= TMA_STORE_MIN_T:
    TMA stores into the row ranges where the geometry has them)."""
    _check_out_rows(operands, fmt, col, device, 16384, tuple(DEEPSEEK.values()), "deepseek")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,col", [("mxfp8", False), ("mxfp8", True), ("bf16", False)])
@pytest.mark.parametrize("T", [4096 + 17])
def test_deepseek_v3_size(fmt, col, T, device):
    """DeepSeek-V3 geometry (K=1536, H=128, D=192, rope 64) compiled for the GPU. fp32 summation order differs
    from the reference GEMM here, so a few amaxes may cross a power of two: scales >= 99.99 % identical."""
    cfg = _cfg(**DEEPSEEK, fmt=fmt, col=col)
    a, w, c, s, ref = _case(T, cfg, device)
    out = qproj_gemm_fwd(a, prepare_fused_weight(w, cfg), c, s, cfg)
    torch.cuda.synchronize()
    _check(out, ref, cfg, exact_scales=False, min_scale_match=0.9999)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,col", OUT_MODES)
@pytest.mark.parametrize("T", [4096 + 17])
def test_fp8_deepseek_v3_size(fmt, col, T, device):
    """DeepSeek-V3 geometry, fp8_block operands, compiled. The tensor core accumulates each 128-block's products in
    its own reduced precision (SPEC §5 / DeepSeek-V3: ~14 bits, promoted to fp32 once per block), so a few output
    codes land one step from the fp32 reference's: >= 99 % identical codes (a relative accumulation error near 2^-12
    flips ~0.4-0.8 % of E4M3 roundings), >= 99.9 % identical scales, decoded values within the same-quantization
    bound; bf16 output within bf16 rounding."""
    cfg = _cfg(**DEEPSEEK, fmt=fmt, col=col)
    args, scales, ref = _fp8_case(T, cfg, device)
    out = qproj_gemm_fwd(*args, **scales)
    torch.cuda.synchronize()
    _check_fp8(out, ref, cfg, min_codes=0.99)
    if fmt == "mxfp8":
        for i in (1, 3) if col else (1,):
            sf = code_match_fraction(out[i], ref[i], MIN_CODE_MATCH, "scales")
            assert sf >= MIN_CODE_MATCH, f"scales: {sf:.5f} identical"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,col", OUT_MODES)
def test_fp8_configs_same_bytes_gpu(fmt, col, device):
    """Pipeline depth, the store path and the tile shape change no arithmetic: the same bytes as the default config
    ([128, 128] tiles, HB = 64) at T = 16384 (TMA stores on by default there) with 3 stages, with pointer stores and
    the flattened loop, with the small-T [64, 128] tile on one warpgroup, and with HB = 128 ([64, 256] tiles on a W'
    laid out for it). The tensor core's rounding inside a 128-block must not depend on the wgmma's N (128 vs 256)."""
    T = 16384
    cfg = _cfg(**DEEPSEEK, fmt=fmt, col=col)
    args, scales, _, (args128, scales128) = _fp8_case(T, cfg, device, other_hb=128)
    base = qproj_gemm_fwd(*args, **scales)
    for changes in (dict(num_stages=3), dict(TMA_STORE=False, FLATTEN=True), dict(BLOCK_M=64, num_warps=4),
                    dict(HB=128, BLOCK_M=64, num_warps=8, FLATTEN=fmt != "bf16")):  # Triton 3.6: bf16 TMA
        a, sc = (args128, scales128) if changes.get("HB") == 128 else (args, scales)
        out = qproj_gemm_fwd(*a, **sc, config=_fp8_config(T, cfg, device, **changes))
        for i, (o, b) in enumerate(zip(out, base, strict=True)):
            if b is not None:
                assert_bytes_equal(o, b, f"{changes} output {i}")


# ----------------------------------------------------------------------------- the store hint (`_store_half`)
# The fused GEMM's store hint (kernels/triton/qproj_gemm.py, `_store_half`): for deepseek / neox it tells the compiler
# that every aligned run of V = min(SEG, HB) kernel columns of a half lands on V contiguous output columns starting at
# a multiple of V. The compiled stores are vectorized on that promise (the interpreter ignores hints, so no CPU test
# of the kernel's bytes can catch a wrong one); this checks the promise itself on the host twin of the kernel's column
# map (`_column_maps`, whose agreement with the kernel the GEMM tests establish) over many geometries.


def _check_runs(out: torch.Tensor, v: int) -> int:
    """Every aligned run of v entries of out (-1 = padding) is start + [0, v) on its real entries, with start a
    multiple of v. Returns the number of runs that held real columns."""
    runs = out.reshape(-1, v)
    idx = torch.arange(v)
    checked = 0
    for run in runs:
        real = run >= 0
        if not real.any():
            continue
        start = run[real][0] - idx[real][0]
        assert start % v == 0, f"run {run.tolist()} starts at {start.item()}, not a multiple of {v}"
        assert torch.equal(run[real], start + idx[real]), f"run {run.tolist()} is not contiguous"
        checked += 1
    return checked


def _hint_case(style, fmt, H, P, RH, tail, hb=HALF_N):
    D = P + 2 * RH + tail
    cfg = make_config(64, H, P, 2 * RH, D, rope_style=style, output_format=fmt)
    assert fused_gemm_supported(cfg)
    _, out = _column_maps(cfg, hb)
    v = min(_seg(cfg), hb)
    assert _check_runs(out, v) > 0
    return v


def test_deepseek_v3_runs_are_32_wide():
    """DeepSeek-V3 (128 + 64, 128 heads), default tiles: runs of 32 output columns (one MX block each)."""
    assert _hint_case("deepseek", "mxfp8", 128, 128, 32, 0) == 32
    assert _hint_case("neox", "bf16", 128, 128, 32, 0) == 32
    assert _hint_case("deepseek", "mxfp8", 128, 128, 32, 0, hb=64) == 32  # the fp8_block operands' half width


def test_check_runs_catches_a_broken_map():
    """The checker itself: a gptj-like stride-2 run, a shifted run and a permuted run are rejected."""
    for bad in ([0, 2, 4, 6], [1, 2, 3, 4], [0, 1, 3, 2]):
        try:
            _check_runs(torch.tensor(bad), 4)
        except AssertionError:
            continue
        raise AssertionError(f"{bad} passed the run check")
    assert _check_runs(torch.tensor([4, 5, -1, -1, -1, -1, -1, -1]), 4) == 1


@settings(deadline=None, max_examples=examples(60))
@given(style=st.sampled_from(["deepseek", "neox"]), mx=st.booleans(), H=st.integers(1, 6),
       p=st.integers(0, 8), rh=st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32]), tail=st.integers(0, 4),
       hb=st.sampled_from(HALF_WIDTHS))
def test_output_runs_are_contiguous_and_aligned(style, mx, H, p, rh, tail, hb):
    """Geometries the fused GEMM covers: MXFP8 output (P, R/2, tail multiples of 32) and bf16 output (any multiples
    of 8 here; SEG is then as small as their lowest common power of two)."""
    if mx:
        P, RH, T_ = 32 * p, 32 * ((rh + 7) // 8), 32 * tail
    else:
        P, RH, T_ = 16 * p, 8 * rh, 8 * tail
    _hint_case(style, "mxfp8" if mx else "bf16", H, P, RH, T_, hb)
