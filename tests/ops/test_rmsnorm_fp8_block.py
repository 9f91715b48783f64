"""RMSNorm + block-scaled FP8 quantize (kernels/triton/rmsnorm_fp8_block.py, SPEC §5) vs reference/fp8_block.py: rsigma
within 1e-6 and, given the kernel's rsigma, the 1x128 and 128x1 codes and scale_inv byte for byte in the kernel's
layouts (the byte-transposing and the word-packed kernels). CPU lane: Triton's interpreter at small sizes; `gpu`
tests at the DeepSeek-V3 shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_qproj.kernels.triton.rmsnorm_fp8_block import (
    RMSNormFp8BlockConfig,
    default_config,
    rmsnorm_fp8_block_fwd,
    rmsnorm_fp8_block_fwd_op,
)
from mla_qproj.kernels.triton.rmsnorm_quant import default_config as default_norm_config
from mla_qproj.kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd
from mla_qproj.reference import fp8_block as F

from _helpers import INF, NAN, assert_op_matches, make_config, special_matrix
from _tolerances import assert_bytes_equal
from conftest import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy under the interpreter
B = F.FP8_BLOCK


def rmsnorm_reference(x, w, rsigma, zc, block_scale, columnwise=True):
    """The kernel's five outputs from the reference, given the kernel's rsigma (the reductions' fp32 orders differ
    from torch's): xn = x * rsigma * g, NaN made +NaN, then the 1x128 / 128x1 blocks in the kernel's layouts."""
    T, K = x.shape
    g = w.float().cpu() + 1.0 if zc else w.float().cpu()
    xn = F.canonical_nan(x.float().cpu() * rsigma.cpu()[:, None] * g)
    rd, rs = F.quantize_blocks(xn, (1, B), block_scale)
    outs = [rd, rs.new_empty(rs.shape[::-1]).copy_(rs.t())]  # scale_inv M-major [K/128, T], standard strides
    if columnwise:
        cd, cs = F.quantize_blocks(xn, (B, 1), block_scale)
        t_pad = -(-T // 16) * 16
        cdt = torch.zeros(K, t_pad, dtype=torch.uint8)
        cdt[:, :T] = cd.view(torch.uint8).t()  # transposed [K, T_pad], zero padding
        outs += [cdt.view(torch.float8_e4m3fn), cs]
    return outs


def check_rmsnorm(x, w, zc, block_scale, columnwise=True, **kw):
    rsigma, *outs = rmsnorm_fp8_block_fwd(x, w, 1e-6, zc, block_scale, columnwise, **kw)
    _, rs_ref = F.rmsnorm_fwd(x.cpu(), w.cpu(), 1e-6, zc)
    rel = ((rsigma.cpu() - rs_ref).abs() / rs_ref.abs()).nan_to_num(0.0)  # NaN rows: NaN in both
    assert (rel <= 1e-6).all() and torch.equal(rsigma.isnan().cpu(), rs_ref.isnan()), "rsigma"
    ref = rmsnorm_reference(x, w, rsigma, zc, block_scale, columnwise)
    names = ("row codes", "row scale_inv [K/128, T]", "col codes [K, T_pad]", "col scale_inv")
    for name, a, b in zip(names, outs, ref, strict=False):
        assert_bytes_equal(a, b, f"{tuple(x.shape)} {x.dtype} zc={zc} {block_scale}: {name}")
    if not columnwise:
        assert outs[2].shape == (x.shape[1], 0) and outs[3].shape == (0, x.shape[1])
    return rsigma, outs


@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
@pytest.mark.parametrize("T,dtype", [(1, torch.bfloat16), (17, torch.float32), (129, torch.float16),
                                     (200, torch.bfloat16)])
def test_rmsnorm_fp8_block(T, dtype, block_scale):
    K = 256
    x = (torch.randn(T, K) * 3).to(dtype).to(DEVICE)
    w = torch.randn(K, device=DEVICE)
    check_rmsnorm(x, w, T % 2 == 1, block_scale)


def test_rmsnorm_fp8_block_special_values():
    """Special values reach the quantizer through x and the norm weight: NaN rows of both signs, inf, a zero row,
    huge rows (x^2 overflows: rsigma 0), bf16 subnormal rows, norm-weight columns at the E4M3 / fp32 edges."""
    T, K = 140, 256
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, K, generator=g) * 3
    x[2], x[3, 7], x[4, 9], x[5] = NAN, -NAN, INF, 0.0
    x[6] = torch.randn(K, generator=g) * 1e30
    x[7] = torch.randn(K, generator=g) * 2.0**-130  # bf16 subnormals after the cast
    x = x.to(torch.bfloat16)
    w = torch.rand(K, generator=g) * torch.exp2(torch.randint(-60, 60, (K,), generator=g).float())
    w[3], w[40], w[41], w[70] = INF, NAN, -INF, 0.0
    w[130:] = 2.0**-126  # a whole 1x128 block of tiny xn: 448 / amax overflows -> FLT_MAX
    for block_scale in F.BLOCK_SCALES:
        check_rmsnorm(x.to(DEVICE), w.to(DEVICE), False, block_scale)


def test_rmsnorm_fp8_block_layouts_and_options():
    T, K = 45, 512
    big = (torch.randn(T, K + 128) * 2).to(torch.bfloat16).to(DEVICE)
    x = big[:, 64:64 + K]  # row stride K + 128, unit inner stride
    w = torch.randn(K, device=DEVICE)
    rsigma, full = check_rmsnorm(x, w, True, "pow2", config=RMSNormFp8BlockConfig(block_k=256, num_warps=4))
    # inference: no columnwise pair; the row codes and scales are the same bytes
    rs2, *outs = rmsnorm_fp8_block_fwd(x, w, 1e-6, True, "pow2", columnwise=False)
    assert_bytes_equal(rs2, rsigma, "rsigma without columnwise")
    assert_bytes_equal(outs[0], full[0], "row codes without columnwise")
    assert outs[2].shape == (K, 0) and outs[3].shape == (0, K)
    # rsigma has the bits of the MXFP8 path's RMSNorm (rmsnorm_quant's split form: the same `_rsigma_kernel`)
    split = dataclasses.replace(default_norm_config(T, K, x.device), SPLIT=True)
    assert_bytes_equal(rsigma, rmsnorm_quant_fwd(x, w, 1e-6, True, "mxfp8", "rceil", config=split)[0], "rsigma")
    # T == 0
    outs = rmsnorm_fp8_block_fwd(x[:0], w, 1e-6, False)
    assert [tuple(o.shape) for o in outs] == [(0,), (0, K), (K // B, 0), (K, 0), (0, K)]


@pytest.mark.parametrize("block_k,num_warps,reverse", [(128, 4, True), (128, 8, False), (128, 16, False),
                                                        (256, 8, True)])
def test_rmsnorm_fp8_block_packed(block_k, num_warps, reverse):
    """The word-packed kernel with 16, 8 and 4 tokens per thread: T = 1 / 17 / 130 (a token word of 4 codes that is
    partly padding, a second 128x1 block), special values, both dtypes of note, with and without the columnwise
    pair, token tiles in either order; the same bytes as the byte-transposing kernel (tiles in order)."""
    K = 256
    g = torch.Generator().manual_seed(block_k + num_warps)
    w = torch.randn(K, generator=g)
    w[5], w[9] = INF, NAN  # padding rows times an inf / NaN weight: NaN xn, still zero codes in the padding
    cfg = RMSNormFp8BlockConfig(block_k=block_k, num_warps=num_warps, rs_rows=64, packed=True, reverse_tokens=reverse)
    for T, dtype in ((1, torch.bfloat16), (17, torch.float32), (130, torch.bfloat16)):
        x = special_matrix(T, K, dtype, T).to(DEVICE)
        for zc, bs in ((False, "pow2"), (True, "fp32")):
            rsigma, outs = check_rmsnorm(x, w.to(DEVICE), zc, bs, config=cfg)
            ref = rmsnorm_fp8_block_fwd(x, w.to(DEVICE), 1e-6, zc, bs,
                                        config=RMSNormFp8BlockConfig(rs_rows=64, reverse_tokens=not reverse))
            for a, b in zip(outs, ref[1:], strict=True):
                assert_bytes_equal(a, b, f"packed vs bytes T={T} {block_k}/{num_warps}")
        full = rmsnorm_fp8_block_fwd(x, w.to(DEVICE), 1e-6, False, "pow2", config=cfg)
        inference = rmsnorm_fp8_block_fwd(x, w.to(DEVICE), 1e-6, False, "pow2", columnwise=False, config=cfg)
        for i in range(3):  # rsigma, row codes, row scale_inv
            assert_bytes_equal(inference[i], full[i], f"packed T={T}: output {i} without the columnwise pair")


def test_rmsnorm_fp8_block_errors():
    x, w = torch.randn(4, 256, device=DEVICE), torch.randn(256, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 128"):
        rmsnorm_fp8_block_fwd(x[:, :192], w[:192], 1e-6, False)
    with pytest.raises(ValueError, match="unit inner stride"):
        rmsnorm_fp8_block_fwd(torch.randn(256, 4, device=DEVICE).t(), w, 1e-6, False)
    with pytest.raises(ValueError, match="norm_weight"):
        rmsnorm_fp8_block_fwd(x, w[:128], 1e-6, False)
    with pytest.raises(TypeError, match="x2d"):
        rmsnorm_fp8_block_fwd(x.double(), w, 1e-6, False)
    with pytest.raises(TypeError, match="norm_weight"):
        rmsnorm_fp8_block_fwd(x, w.long(), 1e-6, False)
    with pytest.raises(ValueError, match="block_scale"):
        rmsnorm_fp8_block_fwd(x, w, 1e-6, False, "e8m0")
    with pytest.raises(ValueError, match="eps"):
        rmsnorm_fp8_block_fwd(x, w, -1.0, False)
    for bad in (192, 384, 512):  # not 128 * 2^k, or not dividing K = 256
        with pytest.raises(ValueError, match="block_k"):
            rmsnorm_fp8_block_fwd(x, w, 1e-6, False, config=RMSNormFp8BlockConfig(block_k=bad))
    for bk, nw in ((128, 2), (256, 4), (128, 32)):  # 32, 32, 2 tokens per thread
        with pytest.raises(ValueError, match="tokens per thread"):
            rmsnorm_fp8_block_fwd(x, w, 1e-6, False, config=RMSNormFp8BlockConfig(block_k=bk, num_warps=nw,
                                                                                     packed=True))
    for bad in (100, 250, False, "168"):  # a register cap is a multiple of 8 in [24, 248]
        with pytest.raises(ValueError, match="maxnreg"):
            rmsnorm_fp8_block_fwd(x, w, 1e-6, False, config=RMSNormFp8BlockConfig(maxnreg=bad))


@pytest.mark.parametrize("zc,block_scale", [(False, "pow2"), (True, "fp32")])
def test_rmsnorm_op_registration(zc, block_scale):
    """The op (its schema, fake allocation) and its eager caller give the launcher's bytes for the layer config's
    eps, gamma form and block scale."""

    cfg = make_config(256, 2, 64, 64, eps=1e-5, zero_centered_gamma=zc, precision="fp8_block",
                           block_scale=block_scale)
    x, w = torch.randn(5, 256, device=DEVICE), torch.randn(256, device=DEVICE)
    for columnwise in (True, False):
        assert_op_matches(rmsnorm_fp8_block_fwd_op, (x, w, cfg.encode(), columnwise),
                          rmsnorm_fp8_block_fwd(x, w, 1e-5, zc, block_scale, columnwise))


@pytest.mark.gpu
@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
@pytest.mark.parametrize("T", [4096, 4097])
def test_rmsnorm_fp8_block_gpu(T, block_scale):
    K = 1536
    x = (torch.randn(T, K, device="cuda") * 3).to(torch.bfloat16)
    x[5], x[6, 3] = NAN, -NAN
    w = torch.randn(K, device="cuda")
    rsigma, _ = check_rmsnorm(x, w, False, block_scale)  # the defaults: token tiles last to first, packed capped
    check_rmsnorm(x, w, False, block_scale, columnwise=False)
    # compiled: the packed kernel's E4M3 conversion is inline PTX (not run by the interpreter lane); the
    # byte-transposing kernel as well
    for cfg in (RMSNormFp8BlockConfig(num_warps=8, packed=True), RMSNormFp8BlockConfig(block_k=256, packed=True),
                RMSNormFp8BlockConfig(num_warps=4), RMSNormFp8BlockConfig(),
                RMSNormFp8BlockConfig(num_warps=4, packed=True, maxnreg=128),  # a cap that trades registers away
                RMSNormFp8BlockConfig(num_warps=4, packed=True, reverse_tokens=False)):  # token tiles in order
        check_rmsnorm(x, w, True, block_scale, config=cfg)
    # the Triton form's rsigma: T >= 2048, the MXFP8 path's RMSNorm runs the same rsigma kernel with the same launch
    # (the defaults may run the CuTe kernel instead, whose rsigma has its own fp32 summation order)
    rs_triton, _ = check_rmsnorm(x, w, False, block_scale, config=default_config(T, K, x.device))
    assert_bytes_equal(rs_triton, rmsnorm_quant_fwd(x, w, 1e-6, False, "mxfp8", "rceil")[0], "rsigma vs mxfp8 path")
