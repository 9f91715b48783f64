"""Probe: the fp8 engine's deepseek epilogue with a bf16 query, a' / b' stored as 16-bit halves at their columns
(`ds_halves`, no shuffles) against the quad-shuffled 32-bit words, at DeepSeek-V3 (K = 1536, 128 heads of 192), timed
round-robin with cuBLAS blockwise on the same operands in one process (do_bench medians, L2 flushed); the queries
compared bit for bit.

    python tools/probe_ds.py build OUT          # CPU: compile the variants, export OUT/<name>.so
    python tools/probe_ds.py run OUT [--tokens 16384,65536,4096] [--rounds 5]   # GPU (runtime library: OUT/../kernels)
"""
import argparse
import ctypes
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K, H, D, P, R = 1536, 128, 192, 128, 64
N, RH = H * D, R // 2
VARIANTS = {"shfl": {"ds_halves": False}, "halves": {"ds_halves": True}}


def build(out: Path):
    from build_cute_kernels import compile_one, export, sass_report

    from mla_qproj._config import QProjConfig
    from mla_qproj.kernels.cute import rope_gemm

    out.mkdir(parents=True, exist_ok=True)
    cfg = QProjConfig(K, H, P, R, D, rope_style="deepseek", precision="fp8_block")
    for name, opts in VARIANTS.items():
        with tempfile.TemporaryDirectory() as d:
            fn, cubin = compile_one(cfg, 132, d, **opts)
            r = sass_report(cubin)
            print(name, len(r.pop("sass").splitlines()), "SASS lines", r, flush=True)
            export(fn, out, name)
    (out / rope_gemm.RUNTIME_LIB).unlink(missing_ok=True)  # (the kernels folder has it)


def run(out: Path, tokens: str, rounds: int):
    import torch
    import tvm_ffi
    from triton.testing import do_bench

    ctypes.CDLL(str(out.parent / "kernels" / "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in [int(t) for t in tokens.split(",")]:
        a = (torch.randn(T, K, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(N, K, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = torch.exp2(torch.randint(-12, -4, (K // 128, T), device="cuda", generator=g).float())
        ws = torch.exp2(torch.randint(-12, -4, (N // 128, K // 128), device="cuda", generator=g).float())
        ang = torch.rand(T, RH, device="cuda", generator=g) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        u8 = torch.zeros(1, 1, dtype=torch.uint8, device="cuda")
        rows, ys = {}, {}
        for name in VARIANTS:
            fn = tvm_ffi.load_module(str(out / f"{name}.so"))["qproj_rope_gemm"]
            ys[name] = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
            args = (a, w, sa, ws, cos, sin, ys[name], u8)
            rows[name] = lambda f=fn, args=args: f(*args)
        rows["cublas_blockwise"] = lambda a=a, w=w, sa=sa, ws=ws: torch._scaled_mm(
            a, w.t(), scale_a=sa.t(), scale_b=ws.t(), out_dtype=torch.bfloat16)
        for f in rows.values():
            f()
        torch.cuda.synchronize()
        print(f"T={T}: halves bit-identical to shfl:",
              torch.equal(ys["halves"].view(torch.int16), ys["shfl"].view(torch.int16)), flush=True)
        times = {k: [] for k in rows}
        for r in range(rounds):
            for k in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                times[k].append(do_bench(rows[k], warmup=25, rep=100))
        for k, v in times.items():
            rc = statistics.median([x / y for x, y in zip(v, times["cublas_blockwise"], strict=True)])
            rs = statistics.median([x / y for x, y in zip(v, times["shfl"], strict=True)])
            print(f"T={T} {k:>16}: median {statistics.median(v):.4f} ms  / cuBLAS blockwise {rc:.3f}  / shfl {rs:.3f}"
                  "  rounds " + " ".join(f"{t:.4f}" for t in v), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["build", "run"])
    p.add_argument("out")
    p.add_argument("--tokens", default="16384,65536,4096")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    build(Path(args.out)) if args.mode == "build" else run(Path(args.out), args.tokens, args.rounds)
