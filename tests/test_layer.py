"""FusedMLAQUpProjection numerics (SPEC §1, §3): Triton vs PyTorch backends, an fp64 oracle of the unquantized
math (Hypothesis over layouts, geometry and modes), RoPE identities, equivalence with an HF DeepseekV3-style
composition (position_ids, YaRN), T == 0, main_grad, determinism. CPU lane: Triton's interpreter (conftest);
`gpu` variants run at the DeepSeek-V3 shape (K=1536, H=128, D=128+64, T=4096)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor
from mla_qproj.kernels.triton.rope_quant import rope_quant
from mla_qproj.reference.mxfp8 import dequantize_columnwise
from mla_qproj.reference.rope import apply_rope, apply_rope_inverse

from _helpers import layer_kwargs, rope_oracle
from _tolerances import (
    MIN_CODE_MATCH,
    MIN_CODE_MATCH_FP8_TC,
    REL_ERR_BF16_ROUNDING,
    REL_ERR_FP8_TC_ORDER,
    REL_ERR_REDUCTION_ORDER,
    REL_ERR_SAME_QUANT,
    assert_mxfp8_close,
    assert_rel_err,
    rel_err_bound,
)
from conftest import examples

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HYP = settings(max_examples=examples(25), deadline=None)
GRADS = ("dx", "dnorm_weight", "dweight")
V3 = {"K": 1536, "H": 128, "nope": 128, "R": 64}


def make_layer(K, H, nope, R, D=None, dtype=torch.float32, zero_centered_gamma=False, **kw):
    layer = FusedMLAQUpProjection(K, H, nope, R, q_head_dim=D, zero_centered_gamma=zero_centered_gamma,
                                  device=DEV, dtype=dtype, **layer_kwargs(kw))
    with torch.no_grad():  # a non-trivial gamma, so dnorm_weight and the g factor are exercised
        layer.norm_weight.copy_(0.2 * torch.randn(K) + (0.0 if zero_centered_gamma else 1.0))
    return layer


def hf_tables(pos, R, theta=10000.0, inv_freq=None, scaling=1.0):
    """HF DeepseekV3RotaryEmbedding: inv_freq = 1/theta^(arange(0,R,2)/R), freqs = pos*inv_freq, cat(freqs, freqs)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R))
    freqs = pos.float()[..., None] * inv_freq.to(pos.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def run(layer, x, cos=None, sin=None, pos=None, dy=None):
    """Forward + backward with a random upstream gradient: (q, dense fp32 q, {grad name: grad}, dy)."""
    x = x.detach().requires_grad_()
    q = layer(x, cos, sin, position_ids=pos)
    qd = q.float()
    dy = torch.randn_like(qd) if dy is None else dy
    grads = torch.autograd.grad(qd, (x, layer.norm_weight, layer.weight), dy)
    return q, qd.detach(), dict(zip(GRADS, grads, strict=True)), dy


def oracle(layer, x, cos, sin, dy, H, nope, R, style, eps=1e-6, zc=False):
    """fp64 autograd of the unquantized math: RMSNorm -> x @ W^T -> RoPE (the test's own `rope_oracle`) -> dense."""
    x64 = x.detach().double().requires_grad_()
    nw = layer.norm_weight.detach().double().requires_grad_()
    w = layer.weight.detach().double().requires_grad_()
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (nw + 1 if zc else nw)
    y = (xn @ w.t()).unflatten(-1, (H, -1))
    q = rope_oracle(y, cos[..., : R // 2].double(), sin[..., : R // 2].double(), nope, R, style)
    grads = torch.autograd.grad(q, (x64, nw, w), dy.double())
    return q.detach(), dict(zip(GRADS, grads, strict=True))


def check_oracle(layer, x, cos, sin, H, nope, R, style, precision, output_format, tag, **kw):
    _, qd, grads, dy = run(layer, x, cos, sin)
    q64, g64 = oracle(layer, x, cos, sin, dy, H, nope, R, style, **kw)
    assert_rel_err(qd, q64, rel_err_bound(precision, output_format), f"{tag} q")
    for k in GRADS:  # quantization of the output is straight-through: gradients see only `precision`
        assert grads[k].shape == g64[k].shape, f"{tag} {k}: shape {grads[k].shape} vs {g64[k].shape}"
        assert_rel_err(grads[k], g64[k], rel_err_bound(precision), f"{tag} {k}")


# ------------------------------------------------------------------------- 1. Triton vs torch backend


def check_backends_agree(K, H, nope, R, T, precision, output_format, columnwise, scale_mode="rceil",
                         block_scale="pow2"):
    kw = dict(precision=precision, output_format=output_format, columnwise_output=columnwise, scale_mode=scale_mode,
              block_scale=block_scale)
    lt = make_layer(K, H, nope, R, backend="triton", **kw)
    lr = make_layer(K, H, nope, R, backend="torch", **kw)
    lr.load_state_dict(lt.state_dict())
    x = torch.randn(T // 2, 2, K, device=DEV)  # [s, b]
    cos, sin = hf_tables(torch.arange(T // 2, device=DEV)[:, None], R)
    qt, dt, gt, dy = run(lt, x, cos, sin)
    qr, dr, gr, _ = run(lr, x, cos, sin, dy=dy)
    assert type(qt) is type(qr) and qt.shape == qr.shape == (T // 2, 2, H, nope + R)
    # compiled fp8_block runs on FP8 tensor cores (reduced-precision accumulation inside each 128-block)
    min_codes = MIN_CODE_MATCH_FP8_TC if precision == "fp8_block" and DEV.type == "cuda" else MIN_CODE_MATCH
    if output_format == "mxfp8":
        assert isinstance(qt, MXFP8Tensor)
        assert_mxfp8_close(qt.rowwise_data, qt.rowwise_scale, dt, qr.rowwise_data, qr.rowwise_scale, dr, "rowwise",
                           min_codes)
        if columnwise:
            ct = dequantize_columnwise(qt.columnwise_data, qt.columnwise_scale)
            cr = dequantize_columnwise(qr.columnwise_data, qr.columnwise_scale)
            assert_mxfp8_close(qt.columnwise_data, qt.columnwise_scale, ct, qr.columnwise_data,
                               qr.columnwise_scale, cr, "columnwise", min_codes)
        else:
            assert qt.columnwise_data is None and qr.columnwise_data is None
    else:
        assert qt.dtype == qr.dtype == torch.bfloat16
        assert_rel_err(dt, dr, REL_ERR_SAME_QUANT, "bf16 q")
    for k in GRADS:
        assert_rel_err(gt[k], gr[k], REL_ERR_SAME_QUANT, f"{k} triton vs torch")


@pytest.mark.parametrize("precision,output_format,columnwise,scale_mode", [
    ("mxfp8", "mxfp8", False, "rceil"), ("mxfp8", "mxfp8", True, "rceil"), ("mxfp8", "mxfp8", True, "floor"),
    ("mxfp8", "bf16", False, "rceil"), ("bf16", "mxfp8", True, "rceil"), ("bf16", "bf16", False, "rceil"),
    ("fp8_block", "bf16", False, "pow2"), ("fp8_block", "mxfp8", True, "fp32"),
    ("fp8_block", "bf16", False, "deepseek")])
def test_backends_agree(precision, output_format, columnwise, scale_mode):
    # (for fp8_block the last field is block_scale)
    if precision == "fp8_block":
        check_backends_agree(128, 2, 32, 32, 70, precision, output_format, columnwise, block_scale=scale_mode)
    else:
        check_backends_agree(64, 2, 32, 32, 70, precision, output_format, columnwise, scale_mode)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,output_format", [("mxfp8", "mxfp8"), ("bf16", "bf16"), ("fp8_block", "bf16"),
                                                     ("fp8_block", "mxfp8")])
def test_backends_agree_gpu(precision, output_format):
    columnwise = output_format == "mxfp8"
    check_backends_agree(V3["K"], V3["H"], V3["nope"], V3["R"], 4096, precision, output_format, columnwise)


# --------------------------------------------------------- 2. properties against the fp64 unquantized math

# (H, qk_head_dim, rope, q_head_dim): trailing pass-through, nope = 0, and q_head_dim % 32 != 0 (bf16 out only)
GEOMS = [(2, 32, 32, 64), (1, 0, 32, 32), (2, 16, 16, 64), (3, 64, 32, 96), (4, 0, 64, 96), (2, 16, 8, 40)]
LAYOUTS = ["flat", "sb", "bs_transposed", "rows_strided", "cols_strided"]


def make_x(layout, T, K, dtype, scale):
    """x with T leading elements in the given layout; scaled and cast *before* slicing (keeps the strides)."""
    b = next(d for d in (3, 2, 1) if T % d == 0)
    s = T // b

    def rnd(*shape):
        return (torch.randn(*shape, device=DEV) * scale).to(dtype)

    if layout == "flat":
        return rnd(T, K)
    if layout == "sb":
        return rnd(s, b, K)
    if layout == "bs_transposed":  # [b, s, K] view of an [s, b, K] tensor: non-contiguous
        return rnd(s, b, K).transpose(0, 1)
    if layout == "rows_strided":  # [b, s, K] every other row: unit inner stride, row stride 2K
        return rnd(b, 2 * s, K)[:, ::2]
    return rnd(T, 2 * K)[:, ::2]  # cols_strided: inner stride 2


def tables_for(layout, x, R, half):
    lead = x.shape[:-1]
    if layout == "sb":
        pos = torch.randint(0, 4096, (lead[0], 1), device=DEV)  # broadcast over b
    elif len(lead) == 2:
        pos = torch.randint(0, 4096, (lead[1],), device=DEV)  # [s] broadcast against [b, s]
    else:
        pos = torch.randint(0, 4096, lead, device=DEV)
    cos, sin = hf_tables(pos, R)
    return (cos[..., : R // 2], sin[..., : R // 2]) if half else (cos, sin)


@HYP
@given(layout=st.sampled_from(LAYOUTS), T=st.integers(1, 80), K=st.integers(1, 4).map(lambda v: 32 * v),
       geom=st.sampled_from(GEOMS), style=st.sampled_from(["deepseek", "neox", "gptj"]), k=st.integers(-8, 8),
       precision=st.sampled_from(["mxfp8", "bf16", "fp8_block"]), output_format=st.sampled_from(["mxfp8", "bf16"]),
       columnwise=st.booleans(), scale_mode=st.sampled_from(["rceil", "floor"]), zc=st.booleans(),
       x_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       w_dtype=st.sampled_from([torch.float32, torch.bfloat16]), half=st.booleans(),
       backend=st.sampled_from(["auto", "auto", "torch"]), seed=st.integers(0, 2**16))
def test_matches_fp64_oracle(layout, T, K, geom, style, k, precision, output_format, columnwise, scale_mode, zc,
                             x_dtype, w_dtype, half, backend, seed):
    torch.manual_seed(seed)
    H, nope, R, D = geom
    if D % 32:
        output_format = "bf16"  # q_head_dim % 32 != 0 is only allowed with bf16 output
    if precision == "fp8_block":
        K = 128  # 1x128 blocks along K
    columnwise = columnwise and output_format == "mxfp8"
    layer = make_layer(K, H, nope, R, D, w_dtype, zc, rope_style=style, precision=precision,
                       output_format=output_format, columnwise_output=columnwise, scale_mode=scale_mode,
                       block_scale=("pow2", "fp32", "deepseek")[seed % 3], backend=backend)
    x = make_x(layout, T, K, x_dtype, 2.0**k)
    cos, sin = tables_for(layout, x, R, half)
    tag = f"[{layout} T={T} K={K} geom={geom} {style} 2^{k} {precision}/{output_format} {x_dtype} {backend}]"
    check_oracle(layer, x, cos, sin, H, nope, R, style, precision, output_format, tag, zc=zc)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,output_format", [("mxfp8", "mxfp8"), ("mxfp8", "bf16"), ("bf16", "bf16"),
                                                     ("fp8_block", "bf16"), ("fp8_block", "mxfp8")])
@pytest.mark.parametrize("style", ["deepseek", "neox"])
def test_matches_fp64_oracle_gpu(precision, output_format, style):
    layer = make_layer(V3["K"], V3["H"], V3["nope"], V3["R"], rope_style=style, precision=precision,
                       output_format=output_format, columnwise_output=output_format == "mxfp8")
    x = make_x("bs_transposed", 4096, V3["K"], torch.bfloat16, 1.0)
    cos, sin = tables_for("bs_transposed", x, V3["R"], False)
    check_oracle(layer, x, cos, sin, V3["H"], V3["nope"], V3["R"], style, precision, output_format, "[V3]")


# -------------------------------------------------------------------------------- 3. RoPE identities

ROPE_GEOMS = [(2, 64, 32, 32), (1, 32, 0, 32), (3, 96, 16, 64), (2, 40, 8, 16)]  # (H, D, nope, R)


@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("H,D,nope,R", ROPE_GEOMS)
def test_rope_inverse_and_transpose(style, H, D, nope, R):
    T = 33
    ang = torch.rand(T, R // 2, dtype=torch.float64, device=DEV) * 20
    c64, s64 = ang.cos(), ang.sin()
    a, b = (torch.randn(T, H, D, dtype=torch.float64, device=DEV) for _ in range(2))
    fwd, inv = apply_rope(a, c64, s64, nope, R, style), apply_rope_inverse(b, c64, s64, nope, R, style)
    torch.testing.assert_close(apply_rope_inverse(fwd, c64, s64, nope, R, style), a, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"reference inverse(forward) != id: {m}")
    assert abs((fwd * b).sum() - (a * inv).sum()) <= 1e-10 * a.norm() * b.norm(), "reference <rope a, b>"
    # pass-through columns are untouched
    keep = torch.cat([torch.arange(nope), torch.arange(nope + R, D)]).to(DEV)
    assert torch.equal(fwd[..., keep], a[..., keep]), "forward changed pass-through columns"
    # the layer's kernel, fp32 mode, both directions
    c32, s32 = c64.float(), s64.float()
    kw = {"num_heads": H, "head_dim": D, "qk_head_dim": nope, "rope_dim": R, "rope_style": style, "mode": "fp32",
          "columnwise": False, "scale_mode": "rceil"}
    a32, b32 = a.float().reshape(T, H * D), b.float().reshape(T, H * D)
    kf = rope_quant(a32, c32, s32, inverse=False, **kw)[0]
    ki = rope_quant(b32, c32, s32, inverse=True, **kw)[0]
    ref_f = apply_rope(a32.view(T, H, D), c32, s32, nope, R, style).reshape(T, H * D)
    ref_i = apply_rope_inverse(b32.view(T, H, D), c32, s32, nope, R, style).reshape(T, H * D)
    torch.testing.assert_close(kf, ref_f, rtol=1e-6, atol=1e-6, msg=lambda m: f"kernel forward vs ref: {m}")
    torch.testing.assert_close(ki, ref_i, rtol=1e-6, atol=1e-6, msg=lambda m: f"kernel inverse vs ref: {m}")
    back = rope_quant(kf.contiguous(), c32, s32, inverse=True, **kw)[0]
    torch.testing.assert_close(back, a32, rtol=1e-5, atol=1e-5, msg=lambda m: f"kernel inverse(forward): {m}")
    lhs, rhs = (kf.double() * b32.double()).sum(), (a32.double() * ki.double()).sum()
    assert abs(lhs - rhs) <= 1e-5 * a32.norm() * b32.norm(), f"kernel <rope a, b> {lhs} != <a, rope^T b> {rhs}"


# ------------------------------------------------------------- 4. HF DeepseekV3-style composition


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_query(norm, linear, x, cos, sin, H, nope, R, interleave=True):
    """RMSNorm -> Linear -> view [.., H, D] -> split -> HF RoPE (rope_interleave de-interleaves first) -> cat."""
    q = linear(norm(x)).view(*x.shape[:-1], H, -1)
    q_nope, q_pe = q.split([nope, R], dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    if interleave:
        *lead, h, d = q_pe.shape
        q_pe = q_pe.reshape(*lead, h, d // 2, 2).transpose(-1, -2).reshape(*lead, h, d)
    return torch.cat([q_nope, q_pe * c + rotate_half(q_pe) * s], dim=-1)


def check_hf(K, H, nope, R, b, s, precision, output_format, interleave):
    norm = nn.RMSNorm(K, eps=1e-6, device=DEV)
    linear = nn.Linear(K, H * (nope + R), bias=False, device=DEV)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(K))
    norm64, linear64 = copy.deepcopy(norm).double(), copy.deepcopy(linear).double()
    layer = FusedMLAQUpProjection.from_modules(norm, linear, num_heads=H, qk_head_dim=nope, qk_pos_emb_head_dim=R,
                                               rope_style="deepseek" if interleave else "neox",
                                               precision=precision, output_format=output_format)
    x = torch.randn(b, s, K, device=DEV)
    pos = torch.arange(s, device=DEV).expand(b, s) + torch.randint(0, 1000, (b, 1), device=DEV)
    cos, sin = hf_tables(pos, R)
    _, qd, grads, dy = run(layer, x, cos, sin)
    x64 = x.double().requires_grad_()
    ref = hf_query(norm64, linear64, x64, cos.double(), sin.double(), H, nope, R, interleave)
    rx, rn, rw = torch.autograd.grad(ref, (x64, norm64.weight, linear64.weight), dy.double())
    assert_rel_err(qd, ref, rel_err_bound(precision, output_format), "q vs HF")
    for k, r in zip(GRADS, (rx, rn, rw), strict=True):
        assert_rel_err(grads[k], r, rel_err_bound(precision), f"{k} vs HF")
    if precision == output_format == "bf16":  # tight: the same bf16 roundings emulated on the HF composition
        with torch.no_grad():
            xn = norm(x).bfloat16().float()
            y = (xn @ linear.weight.bfloat16().float().t()).view(b, s, H, -1)
            q_nope, q_pe = y.split([nope, R], dim=-1)
            if interleave:
                q_pe = q_pe.reshape(b, s, H, R // 2, 2).transpose(-1, -2).reshape(b, s, H, R)
            emu = torch.cat([q_nope, q_pe * cos[:, :, None] + rotate_half(q_pe) * sin[:, :, None]], -1)
        assert_rel_err(qd, emu.bfloat16().float(), REL_ERR_BF16_ROUNDING, "q vs HF with bf16 roundings")
    # the same result through the built-in tables (position_ids) as through HF's tables
    q_pos = layer(x, position_ids=pos).float()
    assert torch.equal(q_pos, qd), f"position_ids vs HF tables: max diff {(q_pos - qd).abs().max()}"


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("precision,output_format", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("mxfp8", "bf16")])
def test_hf_deepseek_v3_equivalence(precision, output_format, interleave):
    check_hf(64, 2, 32, 32, 2, 35, precision, output_format, interleave)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,output_format", [("bf16", "bf16"), ("mxfp8", "mxfp8")])
def test_hf_deepseek_v3_equivalence_gpu(precision, output_format):
    check_hf(V3["K"], V3["H"], V3["nope"], V3["R"], 2, 2048, precision, output_format, True)


def hf_yarn(dim, base, rs):
    """HF transformers `_compute_yarn_parameters`, written out: (inv_freq, attention_factor)."""
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    else:
        attention_factor = get_mscale(factor)

    def find_correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(rs.get("beta_fast") or 32)), 0)
    high = min(math.ceil(find_correction_dim(rs.get("beta_slow") or 1)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, attention_factor


@pytest.mark.parametrize("mscale", [1.0, 0.707])  # 0.707: an attention factor != 1 folded into cos/sin
def test_yarn_tables(mscale):
    K, H, nope, R = 64, 1, 0, 64
    params = {"factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
              "mscale": mscale, "mscale_all_dim": 1.0}
    kw = {"precision": "bf16", "output_format": "bf16"}
    hf = make_layer(K, H, nope, R, rope_scaling={"rope_type": "yarn", **params}, **kw)
    ds = make_layer(K, H, nope, R, rope_scaling={"type": "yarn", **params}, **kw)
    plain = make_layer(K, H, nope, R, **kw)
    ds.load_state_dict(hf.state_dict())
    plain.load_state_dict(hf.state_dict())
    x = torch.randn(70, K, device=DEV)
    pos = torch.cat([torch.arange(40), torch.randint(4096, 16384, (30,))]).to(DEV)
    q_hf, q_ds = hf(x, position_ids=pos), ds(x, position_ids=pos)
    assert torch.equal(q_hf, q_ds), "rope_type='yarn' and type='yarn' dicts differ"
    inv_freq, att = hf_yarn(R, 10000.0, params)
    cos, sin = hf_tables(pos, R, inv_freq=inv_freq, scaling=att)
    assert_rel_err(q_hf.float(), plain(x, cos, sin).float(), 5e-3, "YaRN tables vs independent HF math")
    assert rel_err(q_hf.float(), plain(x, position_ids=pos).float()) > 0.1, "YaRN had no effect"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------------- 5.-7. T == 0, main_grad, determinism


@pytest.mark.parametrize("lead", [(0,), (0, 3), (2, 0)])
@pytest.mark.parametrize("output_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_empty_input(lead, output_format, backend):
    K, H, nope, R = 64, 2, 32, 32
    layer = make_layer(K, H, nope, R, output_format=output_format, columnwise_output=output_format == "mxfp8",
                       backend=backend)
    x = torch.randn(*lead, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.ones(*lead, R, device=DEV)
    for q in (layer(x, cos, cos * 0), layer(x, position_ids=torch.zeros(lead, dtype=torch.long, device=DEV))):
        assert q.shape == lead + (H, nope + R)
        if output_format == "mxfp8":
            assert type(q) is MXFP8Tensor and q.dtype == torch.bfloat16 and q.columnwise_scale.shape == (0, H, 64)
        else:
            assert type(q) is torch.Tensor and q.dtype == torch.bfloat16
        qd = q.float()
        qd.backward(torch.randn_like(qd))
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype, "dx"
    assert layer.weight.grad.shape == layer.weight.shape and not layer.weight.grad.any(), "dweight"
    assert layer.norm_weight.grad.shape == (K,) and not layer.norm_weight.grad.any(), "dnorm_weight"


@pytest.mark.parametrize("precision", ["mxfp8", "bf16", "fp8_block"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_main_grad_accumulates(precision, backend):
    layer = make_layer(128 if precision == "fp8_block" else 64, 2, 32, 32, precision=precision, backend=backend)
    ref = copy.deepcopy(layer)
    x = torch.randn(33, layer.cfg.q_lora_rank, device=DEV)
    cos, sin = hf_tables(torch.arange(33, device=DEV), 32)
    _, _, g, dy = run(ref, x, cos, sin)
    layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    for _ in range(2):
        xx = x.clone().requires_grad_()
        layer(xx, cos, sin).float().backward(dy)
        assert torch.equal(xx.grad, g["dx"]), "dx with main_grad"
    assert layer.weight.grad is None, "weight.grad must stay None when main_grad exists"
    torch.testing.assert_close(layer.weight.main_grad, 2 * g["dweight"].float(), rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"main_grad after two backwards != 2 * dweight: {m}")
    torch.testing.assert_close(layer.norm_weight.grad, 2 * g["dnorm_weight"], msg=lambda m: f"dnorm_weight: {m}")


def check_deterministic(K, H, nope, R, T, precision="mxfp8"):
    layer = make_layer(K, H, nope, R, columnwise_output=True, precision=precision)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    cos, sin = hf_tables(torch.arange(T, device=DEV), R)
    q1, d1, g1, dy = run(layer, x, cos, sin)
    q2, d2, g2, _ = run(layer, x, cos, sin, dy=dy)
    for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
        assert torch.equal(getattr(q1, f).view(torch.uint8), getattr(q2, f).view(torch.uint8)), f
    for k in GRADS:
        assert torch.equal(g1[k], g2[k]), f"{k} differs between two identical backward runs"


@pytest.mark.gpu  # run to run only compiled kernels can differ (the interpreter is serial)
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_deterministic(precision):
    check_deterministic(128, 2, 32, 32, 70, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_deterministic_gpu(precision):
    check_deterministic(V3["K"], V3["H"], V3["nope"], V3["R"], 4096, precision)


@pytest.mark.parametrize("precision", ["mxfp8", "bf16", "fp8_block"])
@pytest.mark.parametrize("use_main_grad", [False, True])
def test_backward_head_groups(precision, use_main_grad, monkeypatch):
    """The backward walked in head groups (GROUP_ELEMENTS lowered: 4 groups) against one group: each dW row block is
    the same GEMM (bitwise equal); dxn is summed over the groups (fp32 summation order only)."""
    from mla_qproj import backend

    T, K = 40, 128
    # contiguous-tile RoPE geometry; fp8_block: D = 128, so every group edge is a 128-column block edge
    layer = make_layer(K, 4, 32, 64, 128 if precision == "fp8_block" else None, precision=precision)
    x = torch.randn(T, K, device=DEV)
    cos, sin = hf_tables(torch.arange(T, device=DEV), 64)
    _, _, g1, dy = run(layer, x, cos, sin)
    assert backend.head_groups(T, layer.cfg) == 1
    monkeypatch.setattr(backend, "GROUP_ELEMENTS", 1)
    assert backend.head_groups(T, layer.cfg) == 4
    if use_main_grad:
        layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
        xx = x.clone().requires_grad_()
        layer(xx, cos, sin).float().backward(dy)
        g4 = {"dx": xx.grad, "dnorm_weight": layer.norm_weight.grad, "dweight": layer.weight.main_grad}
    else:
        _, _, g4, _ = run(layer, x, cos, sin, dy=dy)
    assert torch.equal(g4["dweight"].float(), g1["dweight"].float()), "dW row blocks must not depend on grouping"
    # fp32 summation order only; compiled fp8_block also splits the FP8 dgrad GEMM differently
    bound = REL_ERR_FP8_TC_ORDER if precision == "fp8_block" and DEV.type == "cuda" else REL_ERR_REDUCTION_ORDER
    assert_rel_err(g4["dx"], g1["dx"], bound, "dx grouped vs ungrouped")
    assert_rel_err(g4["dnorm_weight"], g1["dnorm_weight"], bound, "dnorm_weight grouped vs ungrouped")


@pytest.mark.parametrize("output_format", ["mxfp8", "bf16"])
def test_no_grad_call_matches_autograd_call(output_format):
    """Inference calls skip the autograd Function (host time); the query must be the same bytes."""
    layer = make_layer(64, 2, 32, 32, output_format=output_format)
    x = torch.randn(33, 64, device=DEV)
    cos, sin = hf_tables(torch.arange(33, device=DEV), 32)
    q1 = layer(x, cos, sin)
    assert q1.requires_grad
    with torch.no_grad():
        q0 = layer(x, cos, sin)
    assert not q0.requires_grad
    if output_format == "bf16":
        assert torch.equal(q0, q1.detach())
    else:
        for f in ("rowwise_data", "rowwise_scale"):
            assert torch.equal(getattr(q0, f).view(torch.uint8), getattr(q1, f).view(torch.uint8)), f


def check_dw_bf16_direct(N, T, K):
    """dW for a bf16 weight is written by the GEMM in bf16: the fp32 sum rounded once, as the fp32 product cast to
    bf16 (up to cuBLAS's fp32 summation order: at most one bf16 ulp apart); the reduction flag is restored."""
    from mla_qproj.recipes import _gemm

    a = torch.randn(T, N, device=DEV).to(torch.bfloat16).t()  # dy_col^T: a transposed view, as in backward
    b = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    out = torch.empty(N, K, device=DEV, dtype=torch.bfloat16)
    _gemm.mm_into_dtype(out, a, b)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == flag, "global flag not restored"
    ref = _gemm.mm_fp32(a, b)
    cast = ref.to(torch.bfloat16)
    if DEV.type == "cpu":
        assert torch.equal(out, cast)
        return
    ulp = (cast.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -126)
    assert ((out.float() - ref).abs() <= ulp).all(), "bf16 dW more than one ulp from the fp32 product"
    assert (out == cast).float().mean() > 0.99, "bf16 dW differs from the cast fp32 product in > 1 % of elements"


@pytest.mark.gpu  # the direct bf16 write is cuBLAS's; on the CPU both sides are the same expression
def test_dw_bf16_direct():
    check_dw_bf16_direct(96, 70, 64)


@pytest.mark.gpu
def test_dw_bf16_direct_gpu():
    check_dw_bf16_direct(128 * 192, 4096, V3["K"])


@pytest.mark.parametrize("precision,output_format", [("mxfp8", "mxfp8"), ("fp8_block", "bf16"), ("bf16", "bf16")])
def test_activation_checkpointing_gives_identical_gradients(precision, output_format):
    """torch.utils.checkpoint re-runs the forward in the backward: the gradients equal the plain run's bit for bit
    (the recomputed forward is the same computation)."""
    from torch.utils.checkpoint import checkpoint

    layer = make_layer(128, 2, 32, 32, precision=precision, output_format=output_format)
    x = torch.randn(40, 128, device=DEV)
    cos, sin = hf_tables(torch.arange(40, device=DEV), 32)
    _, qd, g_plain, dy = run(layer, x, cos, sin)
    xx = x.clone().requires_grad_()
    q = checkpoint(lambda t: layer(t, cos, sin).float(), xx, use_reentrant=False)
    g = dict(zip(GRADS, torch.autograd.grad(q, (xx, layer.norm_weight, layer.weight), dy), strict=True))
    assert torch.equal(q.detach(), qd), "checkpointed forward"
    for k in GRADS:
        assert torch.equal(g[k], g_plain[k]), f"{k} under activation checkpointing"


@pytest.mark.parametrize("precision", ["mxfp8", "bf16", "fp8_block"])
def test_module_holds_parameters_and_a_weight_cache_only(precision):
    """The module sees its parameters, the RoPE frequencies and a prepared-weight cache, nothing of a kernel's
    layout: the fused GEMM's row order belongs to the kernel recipe, computed once per config and device (a second
    layer of the same config gets the same tensor); the state dict holds the parameters only."""
    from mla_qproj.kernels.cute import rope_gemm as cute_gemm
    from mla_qproj.kernels.triton import qproj_gemm
    from mla_qproj.recipes import get_recipe

    layers = [make_layer(128, 2, 64, 64, precision=precision, backend="triton") for _ in range(2)]
    x = torch.randn(5, 128, device=DEV)
    cos, sin = hf_tables(torch.arange(5, device=DEV), 64)
    for layer in layers:
        assert [n for n, _ in layer.named_buffers()] == ["inv_freq"]
        assert sorted(layer.state_dict()) == ["norm_weight", "weight"]
        layer(x, cos, sin)
    kernels = get_recipe(precision, True)
    a, b = (kernels.fused_rows(layer.cfg, x.device) for layer in layers)
    assert a is b and a.device == x.device
    assert torch.equal(a.cpu(), qproj_gemm.fused_row_source(layers[0].cfg, kernels.fused_operands))
    cute = cute_gemm.serves(layers[0].cfg, x.device)  # the CuTe engine: W as it is
    assert all((layer._wcache.get("fused") is not None) != cute for layer in layers)
