"""Memory-bound kernels against the device copy bandwidth (issue: >= 80 % of a device-to-device copy).

    python -m mla_qproj.bench_kernels [--tokens 4096,16384]

For each kernel, the bytes it must move (each input read once, each output written once) over its time, and that
rate as a fraction of a device-to-device copy of the gradient's size measured the same way in the same run (bytes
read + written). Two timings: "eager" = `triton.testing.do_bench` median (host launch work included: small kernels
on a slow host are bounded by it), "graph" = the kernel calls replayed from a CUDA graph, each after an L2 flush,
minus the flushes alone (GPU time; the bandwidth figure). DeepSeek-V3 query shape: K = 1536, H = 128, D = 192.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ._constants import DEEPSEEK_V3

K, H, P, R = DEEPSEEK_V3
D = P + R
N = H * D


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


_FLUSH: list = []


def graph_ms(fn, n: int = 20) -> float:
    """GPU ms per call: a CUDA graph of n x (256 MB L2 flush, fn) minus one of n flushes, median of 7 replays."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    flush = _FLUSH[0]
    fn()  # compile, allocator warm-up
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    times = []
    for g in graphs:
        ts = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            ts.append(start.elapsed_time(end))
        times.append(sorted(ts)[3])
    return (times[0] - times[1]) / n


def rows(T: int) -> list[tuple[str, float, float, float]]:
    """(name, bytes moved, eager ms, graph ms) for the copy ceiling and each kernel at T tokens."""
    from .kernels.triton.rmsnorm_bwd import rmsnorm_bwd
    from .kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd
    from .kernels.triton.rope_quant import rope_quant

    dev = "cuda"
    src = torch.randn(T * N // 2, device=dev)  # fp32: as many bytes as the bf16 [T, N] gradient
    dst = torch.empty_like(src)
    out = [("device copy (ceiling)", 2.0 * src.numel() * 4, lambda: dst.copy_(src))]
    dq = torch.randn(T, N, device=dev).to(torch.bfloat16)
    c, s = torch.randn(T, R // 2, device=dev), torch.randn(T, R // 2, device=dev)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=P, rope_dim=R, rope_style="deepseek", inverse=True,
              scale_mode="rceil")
    out.append(("inverse RoPE + dy quant (2 bf16 images)", T * N * (2 + 2 + 2) + 2 * T * R * 2,
                lambda: rope_quant(dq, c, s, mode="mxfp8_images", columnwise=True, **kw)))
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    g = torch.rand(K, device=dev) + 0.5
    out.append(("RMSNorm + xn quant (fwd)", T * K * (2 + 2 + 1) + T * K / 32 + 4 * T,
                lambda: rmsnorm_quant_fwd(x, g, 1e-6, False, "mxfp8", "rceil")))
    from .kernels.triton.mxfp8_quant import dequantize_columnwise_bf16
    from .reference.mxfp8 import quantize_columnwise

    xcd, xcs = quantize_columnwise(torch.randn(T, K, device=dev))
    out.append(("xn columnwise -> bf16 image (bwd)", T * K * (1 + 2) + T * K / 32,
                lambda: dequantize_columnwise_bf16(xcd, xcs)))
    dxn = torch.randn(T, K, device=dev)
    rs = torch.rand(T, device=dev) + 0.5
    out.append(("RMSNorm backward", T * K * (4 + 2 + 2) + 4 * T,
                lambda: rmsnorm_bwd(dxn, x, rs, g, False)))
    # block-scaled FP8 (SPEC §5): codes 1 byte, one fp32 scale per 128 elements
    from .kernels.triton.rmsnorm_fp8_block import default_config, rmsnorm_fp8_block_fwd
    from .kernels.triton.rope_fp8_block import rope_fp8_block_bwd

    kw8 = {k: v for k, v in kw.items() if k not in ("inverse", "scale_mode")}
    out.append(("fp8_block: inverse RoPE + dy quant (1x128, 128x1)",
                T * N * (2 + 1 + 1) + 2 * T * N / 32 + 2 * T * R * 2, lambda: rope_fp8_block_bwd(dq, c, s, **kw8)))
    out.append(("fp8_block: RMSNorm + xn quant (fwd, training)", T * K * (2 + 1 + 1) + 2 * T * K / 32 + 4 * T,
                lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", True)))
    out.append(("fp8_block: RMSNorm + xn quant (inference)", T * K * (2 + 1) + T * K / 32 + 4 * T,
                lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", False)))
    # the two Triton kernels (rsigma, then quantize) that run where the CuTe DSL kernel does not, side by side
    tri_train, tri_infer = (default_config(T, K, x.device, cw) for cw in (True, False))
    out.append(("fp8_block: RMSNorm + xn quant (training, Triton)", T * K * (2 + 1 + 1) + 2 * T * K / 32 + 4 * T,
                lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", True, tri_train)))
    out.append(("fp8_block: RMSNorm + xn quant (inference, Triton)", T * K * (2 + 1) + T * K / 32 + 4 * T,
                lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", False, tri_infer)))
    return [(name, nbytes, _bench(fn), graph_ms(fn)) for name, nbytes, fn in out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_qproj.bench_kernels", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default="4096,16384", help="comma-separated T values")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_qproj.bench_kernels: no CUDA GPU found; this benchmark needs one.", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'T':>6}  {'kernel':<52}{'eager ms':>9}{'of copy':>9}{'graph ms':>9}{'GB/s':>9}{'of copy':>9}")
    for T in (int(t) for t in args.tokens.split(",")):
        res = rows(T)
        ceil_e, ceil_g = (res[0][1] / res[0][i] / 1e6 for i in (2, 3))
        for name, nbytes, ms_e, ms_g in res:
            gbs_e, gbs_g = nbytes / ms_e / 1e6, nbytes / ms_g / 1e6
            print(f"{T:>6}  {name:<52}{ms_e:>9.3f}{gbs_e / ceil_e:>9.2f}{ms_g:>9.3f}{gbs_g:>9.0f}"
                  f"{gbs_g / ceil_g:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
