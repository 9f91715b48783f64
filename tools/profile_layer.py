"""Where the time goes: torch.profiler kernel table for ours fwd+bwd (T=16384) and host time per call (T=1024).

    python tools/profile_layer.py
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from mla_qproj import FusedMLAQUpProjection

K, H, NOPE, ROPE = 1536, 128, 128, 64


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


def backward_4096():
    """The T = 4096 backward: host vs wall time per fwd+bwd, dW written in bf16 by cuBLAS or cast from fp32, the
    wgrad GEMM alone in three forms, and the kernel table."""
    from triton.testing import do_bench

    from mla_qproj import backend

    T = 4096
    layer, x, _, cos, sin = make(T)
    dy = torch.randn(T, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x, cos, sin).backward(dy)

    for direct in (False, True, False, True):  # twice each, alternating: order effects show
        backend.DW_BF16_DIRECT = direct
        host, wall = host_and_wall_ms(step)
        ms = do_bench(step, warmup=10, rep=50, return_mode="median")
        print(f"T={T} fwd+bwd dW_bf16_direct={direct}: host {host:.3f} ms/call, wall {wall:.3f} ms/call, "
              f"do_bench {ms:.3f} ms")
    backend.DW_BF16_DIRECT = True
    a = torch.randn(T, H * (NOPE + ROPE), device="cuda").to(torch.bfloat16).t()
    b = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    out = torch.empty(a.shape[0], K, device="cuda", dtype=torch.bfloat16)
    m = torch.backends.cuda.matmul
    forms = {"fp32 out + cast": lambda: torch.mm(a, b, out_dtype=torch.float32).to(torch.bfloat16),
             "bf16 out, reduced-precision reduction off": lambda: backend._mm_into_dtype(out, a, b)}
    m.allow_bf16_reduced_precision_reduction = True
    forms["bf16 out, torch default flags"] = lambda: torch.mm(a, b, out=out)
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


def main():
    backward_4096()
    for T in (16384,):
        layer, x, pos, _, _ = make(T)
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
        layer, x, pos, cos, sin = make(T)
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
    layer, x, pos, _, _ = make(1024)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            layer(x, position_ids=pos)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
