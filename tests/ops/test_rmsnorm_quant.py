"""RMSNorm + MXFP8 quantize (kernels/triton/rmsnorm_quant.py) vs the reference: rsigma within 1e-6 and, given the
kernel's rsigma, the A image and the columnwise xn byte for byte, in both launch forms (an rsigma kernel then the
quantize kernel, or one kernel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_qproj.kernels.triton import rmsnorm_quant as RN
from mla_qproj.kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd
from mla_qproj.reference import mxfp8 as RM
from mla_qproj.reference import qproj as RQ

from _helpers import _same_bytes_or_both_nan, bf16_subnormal_heavy
from _tolerances import assert_bytes_equal, assert_rel_err
from conftest import DEVICE


def norm_config(T: int, K: int, split: bool) -> RN.RMSNormQuantConfig:
    """The default RMSNorm + quantize launch at [T, K] with the two-launch (split) or one-kernel form forced."""
    return dataclasses.replace(RN.default_config(T, K, DEVICE), SPLIT=split)


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
