"""The two MXFP8-path tests that cover several ops in one function: the torch.library registrations (schemas and
fake implementations torch.compile relies on) of the quantizer, its columnwise dequantize, RMSNorm + quantize, RoPE +
quantize and the RMSNorm backward; and the full-size GPU run of RMSNorm + quantize then RoPE + quantize. Each op's
own tests: tests/ops/test_<op>.py."""

from __future__ import annotations

import pytest
import torch

from mla_qproj.kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd
from mla_qproj.kernels.triton.rope_quant import rope_quant
from mla_qproj.reference import mxfp8 as RM
from mla_qproj.reference import qproj as RQ
from mla_qproj.reference import rope as RR

from _helpers import make_config
from _tolerances import assert_bytes_equal
from conftest import DEVICE


def test_custom_ops_opcheck():
    """The torch.library registrations (schemas, fake implementations) that torch.compile relies on."""
    from mla_qproj.kernels.triton.mxfp8_quant import dequantize_columnwise_bf16_op, mxfp8_quantize_2d_op
    from mla_qproj.kernels.triton.rmsnorm_bwd import rmsnorm_bwd_op
    from mla_qproj.kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd_op
    from mla_qproj.kernels.triton.rope_quant import rope_quant_op

    T, H, D, K = 33, 2, 64, 64
    x = torch.randn(T, K, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(K, device=DEVICE)
    y = torch.randn(T, H * D, device=DEVICE)
    c, s = torch.randn(T, 16, device=DEVICE), torch.randn(T, 16, device=DEVICE)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(mxfp8_quantize_2d_op.op, (y, True, True, "rceil"), test_utils=tests)
    for precision in ("mxfp8", "bf16"):
        cfg = make_config(K, H, 16, 32, D, precision=precision).encode()
        for colwise in (True, False):
            torch.library.opcheck(rmsnorm_quant_fwd_op.op, (x, w, cfg, colwise), test_utils=tests)
    cfg = make_config(K, H, 16, 32, D).encode()
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
    cfg = make_config(K, H, nope, R, D, columnwise_output=True)
    rd, rsc, cdd, csc = rope_quant(y, c, s, num_heads=H, head_dim=D, qk_head_dim=nope, rope_dim=R,
                                   rope_style="deepseek", inverse=False, mode="mxfp8", columnwise=True,
                                   scale_mode="rceil")
    ref = RQ.quantize_output(RR.apply_rope(y.view(T, H, D), c, s, nope, R, "deepseek"), cfg)
    assert_bytes_equal(rd.view(T, H, D), ref[0], "q rowwise data")
    assert_bytes_equal(cdd.view(T, H, D), ref[2], "q columnwise data")
