"""Where the time goes (GPU): host vs wall time and the kernel table of fwd+bwd at T = 4096, the kernel table at
T = 16384, host time per forward at T = 1024 / 4096; for each precision given.

    python tools/profile_layer.py [--precision mxfp8,fp8_block]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mla_qproj import FusedMLAQUpProjection
from mla_qproj._constants import DEEPSEEK_V3

K, H, NOPE, ROPE = DEEPSEEK_V3


def make(T, **kw):
    """(layer, x [T, K] requiring grad, positions, HF cos/sin [T, R] fp32 built from the layer's frequencies)."""
    layer = FusedMLAQUpProjection(K, H, NOPE, ROPE, device="cuda", dtype=torch.bfloat16, **kw)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(T, device="cuda")
    ang = pos.float()[:, None] * layer.inv_freq
    emb = torch.cat([ang, ang], -1)  # HF layout, as bench.py
    return layer, x, pos, emb.cos(), emb.sin()


def host_and_wall_ms(fn, n: int = 20, warmup: int = 3) -> tuple[float, float]:
    """(host ms per call: the launch loop without a sync, wall ms per call: until the GPU is done)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (t1 - t0) / n, 1e3 * (time.perf_counter() - t0) / n


def backward_4096(**kw):
    """The T = 4096 fwd+bwd: host vs wall time per call, the wgrad GEMM alone (bf16 written by cuBLAS or cast from
    fp32) and the kernel table."""
    from triton.testing import do_bench

    from mla_qproj.recipes._gemm import mm_into_dtype

    T = 4096
    layer, x, _, cos, sin = make(T, **kw)
    dy = torch.randn(T, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x, cos, sin).backward(dy)

    host, wall = host_and_wall_ms(step)
    ms = do_bench(step, warmup=10, rep=50, return_mode="median")
    print(f"T={T} fwd+bwd: host {host:.3f} ms/call, wall {wall:.3f} ms/call, do_bench {ms:.3f} ms")
    a = torch.randn(T, H * (NOPE + ROPE), device="cuda").to(torch.bfloat16).t()
    b = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    out = torch.empty(a.shape[0], K, device="cuda", dtype=torch.bfloat16)
    forms = {"fp32 out + cast": lambda: torch.mm(a, b, out_dtype=torch.float32).to(torch.bfloat16),
             "bf16 out (mm_into_dtype)": lambda: mm_into_dtype(out, a, b)}
    for name, fn in forms.items():
        host, _ = host_and_wall_ms(fn, n=100, warmup=1)
        gpu = do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"T={T} wgrad GEMM {name}: {gpu:.3f} ms GPU, host {host:.3f} ms/call")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"=== T={T} fwd+bwd, 5 iterations: GPU kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))
    print(f"=== T={T} fwd+bwd, 5 iterations: host (self CPU)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def profile_precision(precision: str) -> None:
    kw = dict(precision=precision, output_format="bf16" if precision == "fp8_block" else "mxfp8")
    print(f"######## precision={precision}, output_format={kw['output_format']}")
    backward_4096(**kw)
    for T in (16384,):
        layer, x, pos, _, _ = make(T, **kw)
        dy = torch.randn(T, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            layer(x, position_ids=pos).backward(dy)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                layer(x, position_ids=pos).backward(dy)
            torch.cuda.synchronize()
        print(f"=== T={T} fwd+bwd, 5 iterations")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    for T in (1024, 4096):
        layer, x, pos, cos, sin = make(T, **kw)
        for name, call in (("position_ids", lambda: layer(x, position_ids=pos)),  # noqa: B023
                           ("cos/sin [T, 64] fp32", lambda: layer(x, cos, sin))):  # noqa: B023
            with torch.no_grad():
                host, wall = host_and_wall_ms(call, n=50, warmup=5)
            print(f"T={T} forward ({name}): host {host:.3f} ms/call, wall {wall:.3f} ms/call")
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                layer(x, cos, sin)
            torch.cuda.synchronize()
        print(f"=== T={T} forward (cos/sin given), 10 calls: GPU kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="mxfp8,fp8_block", help="comma-separated (default: mxfp8,fp8_block)")
    args = ap.parse_args()
    for precision in args.precision.split(","):
        profile_precision(precision)


if __name__ == "__main__":
    main()
