"""Memory-bound kernels against the device copy bandwidth (issue: >= 80 % of a device-to-device copy).

    python -m mla_qproj.bench_kernels [--tokens 4096,16384]

For each kernel, the bytes it must move (each input read once, each output written once) over its median time
(`triton.testing.do_bench`), and that rate as a fraction of a large device-to-device copy measured in the same
run (bytes read + written). DeepSeek-V3 query shape: K = 1536, H = 128, D = 192 (nope 128, rope 64).
"""

from __future__ import annotations

import argparse

import torch

K, H, NOPE, ROPE = 1536, 128, 128, 64
D = NOPE + ROPE
N = H * D


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rows(T: int) -> list[tuple[str, float, float]]:
    """(name, bytes moved, ms) for the copy ceiling and each kernel at T tokens."""
    from .kernels.rmsnorm_bwd import rmsnorm_bwd
    from .kernels.rmsnorm_quant import rmsnorm_quant_fwd
    from .kernels.rope_quant import rope_quant

    dev = "cuda"
    src = torch.randn(T * N // 2, device=dev)  # fp32: as many bytes as the bf16 [T, N] gradient
    dst = torch.empty_like(src)
    out = [("device copy (ceiling)", 2.0 * src.numel() * 4, _bench(lambda: dst.copy_(src)))]
    dq = torch.randn(T, N, device=dev).to(torch.bfloat16)
    c, s = torch.randn(T, ROPE // 2, device=dev), torch.randn(T, ROPE // 2, device=dev)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=NOPE, rope_dim=ROPE, rope_style="deepseek", inverse=True,
              scale_mode="rceil")
    out.append(("inverse RoPE + dy quant (2 bf16 images)", T * N * (2 + 2 + 2) + 2 * T * ROPE * 2,
                _bench(lambda: rope_quant(dq, c, s, mode="mxfp8_images", columnwise=True, **kw))))
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    g = torch.rand(K, device=dev) + 0.5
    out.append(("RMSNorm + xn quant (fwd)", T * K * (2 + 2 + 1) + T * K / 32 + 4 * T,
                _bench(lambda: rmsnorm_quant_fwd(x, g, 1e-6, False, "mxfp8", "rceil"))))
    from .kernels.mxfp8_quant import dequantize_columnwise_bf16
    from .reference.mxfp8 import quantize_columnwise

    xcd, xcs = quantize_columnwise(torch.randn(T, K, device=dev))
    out.append(("xn columnwise -> bf16 image (bwd)", T * K * (1 + 2) + T * K / 32,
                _bench(lambda: dequantize_columnwise_bf16(xcd, xcs))))
    dxn = torch.randn(T, K, device=dev)
    rs = torch.rand(T, device=dev) + 0.5
    out.append(("RMSNorm backward", T * K * (4 + 2 + 2) + 4 * T,
                _bench(lambda: rmsnorm_bwd(dxn, x, rs, g, False))))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_qproj.bench_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,16384")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_qproj.bench_kernels: no CUDA GPU found; this benchmark needs one. Nothing to do.")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'T':>6}  {'kernel':<42}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    for T in (int(t) for t in args.tokens.split(",")):
        res = rows(T)
        ceiling = res[0][1] / res[0][2] / 1e6
        for name, nbytes, ms in res:
            gbs = nbytes / ms / 1e6
            print(f"{T:>6}  {name:<42}{ms:>9.3f}{gbs:>9.0f}{gbs / ceiling:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
