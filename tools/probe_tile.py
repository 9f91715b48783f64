"""Probe: fp8 engine kernels of the same operand shapes (A [T, 1536], W [24576, 1536], block scales, y [T, 24576])
timed round-robin with cuBLAS's blockwise FP8 GEMM in one process (do_bench medians, L2 flushed), and the cuBLAS
kernel's name (its tile) from the profiler.

    python tools/probe_tile.py RUNTIME_DIR name=path.so ... [--tokens 16384,65536] [--rounds 5]
"""
import argparse
import ctypes
import statistics
from pathlib import Path

import torch
import tvm_ffi
from triton.testing import do_bench

K, N, RH = 1536, 24576, 32


def run_rows(fns, ops, ys, u8):
    a, w, sa, ws, cos, sin = ops
    rows = {name: (lambda f=f, y=ys[name]: f(a, w, sa, ws, cos, sin, y, u8)) for name, f in fns.items()}
    rows["cublas_blockwise"] = lambda: torch._scaled_mm(a, w.t(), scale_a=sa.t(), scale_b=ws.t(),
                                                         out_dtype=torch.bfloat16)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runtime")
    p.add_argument("kernels", nargs="+")
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    ctypes.CDLL(str(Path(args.runtime) / "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    fns = {}
    for spec in args.kernels:
        name, path = spec.split("=")
        fns[name] = tvm_ffi.load_module(path)["qproj_rope_gemm"]
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in [int(t) for t in args.tokens.split(",")]:
        a = (torch.randn(T, K, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(N, K, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = torch.exp2(torch.randint(-12, -4, (K // 128, T), device="cuda", generator=g).float())
        ws = torch.exp2(torch.randint(-12, -4, (N // 128, K // 128), device="cuda", generator=g).float())
        ang = torch.rand(T, RH, device="cuda", generator=g) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        u8 = torch.zeros(1, 1, dtype=torch.uint8, device="cuda")
        ys = {name: torch.empty(T, N, dtype=torch.bfloat16, device="cuda") for name in fns}
        rows = run_rows(fns, (a, w, sa, ws, cos, sin), ys, u8)
        for name in fns:
            rows[name]()
        first = next(iter(fns))
        print(f"T={T}: bit-identical to {first}:",
              {name: torch.equal(ys[name].view(torch.int16), ys[first].view(torch.int16)) for name in fns})
        if T == int(args.tokens.split(",")[0]):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                rows["cublas_blockwise"]()
                torch.cuda.synchronize()
            print("cuBLAS kernels:", sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"}))
        times = {k: [] for k in rows}
        for r in range(args.rounds):
            order = list(rows) if r % 2 == 0 else list(rows)[::-1]
            for k in order:
                times[k].append(do_bench(rows[k], warmup=25, rep=100))
        base = "cublas_blockwise"
        for k, v in times.items():
            rat = statistics.median([x / y for x, y in zip(v, times[base], strict=True)])
            print(f"T={T} {k:>18}: median {statistics.median(v):.4f} ms  / cuBLAS blockwise {rat:.3f}   rounds "
                  + " ".join(f"{t:.4f}" for t in v))


if __name__ == "__main__":
    main()
