"""Launch-config sweep of the memory-bound kernels on the GPU (one device call): every variant is checked against the
default's bytes, then timed; GB/s counts the bytes each kernel must move, "of copy" is against a device copy.

    python scripts/kernel_sweep.py [--tokens 4096,16384]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mla_qproj.bench_kernels import graph_ms  # noqa: E402
from mla_qproj.kernels import rmsnorm_bwd as rb  # noqa: E402
from mla_qproj.kernels import rope_quant as rq  # noqa: E402
from mla_qproj.kernels.mxfp8_quant import dequantize_columnwise_bf16  # noqa: E402
from mla_qproj.kernels.rmsnorm_bwd import program_rows, rmsnorm_bwd, sum_partials  # noqa: E402
from mla_qproj.kernels.rmsnorm_quant import RMSNormQuantConfig, rmsnorm_quant_fwd  # noqa: E402
from mla_qproj.kernels.rope_quant import RopeQuantConfig, rope_quant  # noqa: E402
from mla_qproj.reference.mxfp8 import (  # noqa: E402
    dequantize_columnwise,
    dequantize_rowwise,
    quantize_columnwise,
    quantize_rowwise,
)

K, H, P, R = 1536, 128, 128, 64
D = P + R
N = H * D


@triton.jit
def _read1_write2_kernel(x_ptr, o1_ptr, o2_ptr, T, N: tl.constexpr, W: tl.constexpr):
    """The gradient kernel's traffic without its math: read a [32, W] bf16 tile once, write it to two outputs."""
    o_t = tl.program_id(1).to(tl.int64) * 32 + tl.arange(0, 32)
    o = o_t[:, None] * N + tl.program_id(0) * W + tl.arange(0, W)[None, :]
    m = (o_t < T)[:, None]
    b_x = tl.load(x_ptr + o, mask=m)
    tl.store(o1_ptr + o, b_x, mask=m)
    tl.store(o2_ptr + o, b_x, mask=m)


def read1_write2(x, o1, o2, W, num_warps):
    T, n = x.shape
    _read1_write2_kernel[(n // W, triton.cdiv(T, 32))](x, o1, o2, T, N=n, W=W, num_warps=num_warps)


def bench(fn) -> float:
    """GPU time per call (CUDA graph replay after an L2 flush, flushes subtracted): config choices by kernel time, not
    by the host's launch speed, which differs between machines."""
    return graph_ms(fn)


def same(a, b) -> bool:
    for x, y in zip(a, b, strict=True):
        if x.dtype in (torch.bfloat16, torch.float32):
            if not torch.equal(x.isnan(), y.isnan()) or not torch.equal(x.nan_to_num(), y.nan_to_num()):
                return False
        elif not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="4096,16384")
    args = p.parse_args()
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        src = torch.randn(T * N // 2, device="cuda")
        dst = torch.empty_like(src)
        copy_gbs = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e6  # noqa: B023
        rows.append((T, "device copy", "", 0.0, copy_gbs))
        # inverse RoPE + dy quantize (backward operands)
        dq = (torch.randn(T, N, device="cuda") * 3).to(torch.bfloat16)
        c, s = torch.randn(T, R // 2, device="cuda"), torch.randn(T, R // 2, device="cuda")
        kw = dict(num_heads=H, head_dim=D, qk_head_dim=P, rope_dim=R, rope_style="deepseek", inverse=True,
                  mode="mxfp8_images", columnwise=True, scale_mode="rceil")
        nbytes = T * N * 6 + 2 * T * R * 2
        gather = RopeQuantConfig(FAST=False)
        ref = rope_quant(dq, c, s, config=gather, **kw)
        fast = rq.default_config(T, P, R, D, dq.device)
        variants = [("general (gather)", gather), ("fast default", fast)]
        variants.append(("fast warps=2", dataclasses.replace(fast, num_warps=2)))
        variants.append(("fast pass_w=128", dataclasses.replace(fast, PASS_W=128)))
        variants.append(("fast pass_w=32", dataclasses.replace(fast, PASS_W=32)))
        o1, o2 = torch.empty_like(dq), torch.empty_like(dq)
        for w_, nw in ((64, 2), (64, 4), (128, 4)):  # the same traffic without the math: the practical ceiling
            ms = bench(lambda: read1_write2(dq, o1, o2, w_, nw))  # noqa: B023
            rows.append((T, f"read once, write twice (no math) W={w_} warps={nw}", "", ms, T * N * 6 / ms / 1e6))
        for name, conf in variants:
            try:
                out = rope_quant(dq, c, s, config=conf, **kw)
                ok = same(out, ref)
                ms = bench(lambda: rope_quant(dq, c, s, config=conf, **kw))  # noqa: B023
                rows.append((T, "rope_bwd " + name, "ok" if ok else "MISMATCH", ms, nbytes / ms / 1e6))
            except Exception as e:  # report and go on
                rows.append((T, "rope_bwd " + name, f"ERROR {type(e).__name__}: {str(e)[:60]}", 0.0, 0.0))
        # RMSNorm + quantize (forward)
        x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
        g = (torch.rand(K, device="cuda") + 0.5).to(torch.bfloat16)
        nbytes = T * K * (2 + 2 + 1) + T * K / 32 + 4 * T
        variants = [{}, dict(config=RMSNormQuantConfig(SPLIT=True, BLOCK_K=128, num_warps=1)),
                    dict(config=RMSNormQuantConfig(SPLIT=True, BLOCK_K=128, num_warps=2)),
                    dict(config=RMSNormQuantConfig(SPLIT=False, BLOCK_K=128, num_warps=4)),
                    dict(config=RMSNormQuantConfig(SPLIT=True, BLOCK_K=64, num_warps=1, RS_ROWS=8)),
                    dict(columnwise=False)]  # inference
        for kn in variants:
            name = "rmsnorm_quant " + (" ".join(f"{k.lower()}={v}" for k, v in kn.items()) or "default")
            try:
                out = rmsnorm_quant_fwd(x, g, 1e-6, False, "mxfp8", "rceil", **kn)
                # bytes given the same rsigma: compare against the reference quantization of this run's xn
                xn = x.float() * out[0][:, None] * g.float()
                rd = dequantize_rowwise(*quantize_rowwise(xn), dtype=torch.bfloat16)
                ok = same(out[1:], (rd, *quantize_columnwise(xn))) if kn.get("columnwise", True) else same(
                    out[1:2], (rd,))
                ms = bench(lambda: rmsnorm_quant_fwd(x, g, 1e-6, False, "mxfp8", "rceil", **kn))  # noqa: B023
                rows.append((T, name, "ok" if ok else "MISMATCH", ms, nbytes / ms / 1e6))
            except Exception as e:
                rows.append((T, name, f"ERROR {type(e).__name__}: {str(e)[:60]}", 0.0, 0.0))
        # RMSNorm backward: warps, programs per SM, the partial sum's steps (dg's reduction order depends on the
        # programs per SM: checked within tolerance)
        dxn = torch.randn(T, K, device="cuda")
        rs = torch.rand(T, device="cuda") + 0.5
        nbytes = T * K * (4 + 2 + 2) + 4 * T
        ref_dx, ref_dg = rmsnorm_bwd(dxn, x, rs, g, False)
        base = rb.default_config(K, x.device)
        s128 = dict(SUM_BLOCK_P=128, SUM_BLOCK_K=32, sum_num_warps=4)  # [128, 32]-step partial sum
        for kn in [{}, s128, dict(num_warps=8), dict(SUM_BLOCK_P=512, SUM_BLOCK_K=8), dict(progs_per_sm=8)]:
            name = "rmsnorm_bwd " + (" ".join(f"{k.lower()}={v}" for k, v in kn.items()) or "default")
            conf = dataclasses.replace(base, **kn)
            try:
                dx_, dg_ = rmsnorm_bwd(dxn, x, rs, g, False, config=conf)
                ok = all(torch.allclose(u.float(), v.float(), rtol=1e-2, atol=1e-2)
                         for u, v in ((dx_, ref_dx), (dg_, ref_dg)))
                ms = bench(lambda: rmsnorm_bwd(dxn, x, rs, g, False, config=conf))  # noqa: B023
                rows.append((T, name, "ok" if ok else "MISMATCH", ms, nbytes / ms / 1e6))
            except Exception as e:
                rows.append((T, name, f"ERROR {type(e).__name__}: {str(e)[:60]}", 0.0, 0.0))
        # the same bytes through a copy kernel: what a kernel of this size reaches (launch, ramp-up and tail included)
        src = torch.empty(nbytes // 8, device="cuda")
        dst = torch.empty_like(src)
        ms = bench(lambda: dst.copy_(src))  # noqa: B023
        rows.append((T, "device copy of the RMSNorm backward's bytes", "", ms, 2 * src.numel() * 4 / ms / 1e6))
        for pps, sk in ((4, {}), (4, s128)):  # the partial sum alone: its share of the two launches
            part = torch.randn(program_rows(T, pps)[1], K, device="cuda")
            dg = torch.empty(K, device="cuda", dtype=torch.bfloat16)
            sum_kw = {k.removeprefix("SUM_").removeprefix("sum_"): v for k, v in sk.items()}
            ms = bench(lambda: sum_partials(part, dg, **sum_kw))  # noqa: B023
            rows.append((T, f"rmsnorm_bwd partial sum alone {part.shape[0]} rows {sk}", "", ms,
                         part.numel() * 4 / ms / 1e6))
        # columnwise xn -> bf16 image (backward)
        cd, cs = quantize_columnwise(torch.randn(T, K, device="cuda"))
        img = dequantize_columnwise_bf16(cd, cs)
        ok = same((img,), (dequantize_columnwise(cd, cs, torch.bfloat16),))
        nbytes = T * K * 3 + T * K / 32
        ms = bench(lambda: dequantize_columnwise_bf16(cd, cs))  # noqa: B023
        rows.append((T, "xn columnwise -> bf16 image (triton)", "ok" if ok else "MISMATCH", ms, nbytes / ms / 1e6))
        ms = bench(lambda: dequantize_columnwise(cd, cs, torch.bfloat16))  # noqa: B023
        rows.append((T, "xn columnwise -> bf16 image (torch ops)", "", ms, nbytes / ms / 1e6))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'T':>6}  {'kernel':<52}{'check':<10}{'ms':>8}{'GB/s':>8}{'of copy':>8}")
    copy = {}
    for T, name, chk, ms, gbs in rows:
        if name == "device copy":
            copy[T] = gbs
        print(f"{T:>6}  {name:<52}{chk:<10}{ms:>8.3f}{gbs:>8.0f}{gbs / copy[T]:>8.2f}")


if __name__ == "__main__":
    main()
