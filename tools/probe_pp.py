"""Probe: the bf16-operand engine's ping-pong tiles, [128, D] a warpgroup (head tiles) against [64, 256] across heads,
at DeepSeek-V3 (K = 1536, 128 heads of 192), bf16 and MXFP8 queries, timed round-robin with cuBLAS's bf16 GEMM on the
same operands in one process (do_bench medians, L2 flushed); every variant's query compared bit for bit with the
head tiles'.

    python tools/probe_pp.py build OUT          # CPU: compile the variants, export OUT/<name>.so
    python tools/probe_pp.py run OUT [--tokens 16384,65536,4096] [--rounds 5]   # GPU
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
VARIANTS = {  # name: RopeGemmSm90 options
    "heads": {"col_tile": 0},
    "wide": {},
    "wide_c1": {"cluster_m": 1},
}


def build(out: Path):
    from build_cute_kernels import export, sass_report

    from mla_qproj._config import QProjConfig
    from mla_qproj.kernels.cute import rope_gemm

    out.mkdir(parents=True, exist_ok=True)
    for q in ("bf16", "mxfp8"):
        cfg = QProjConfig(K, H, P, R, D, rope_style="deepseek", precision="mxfp8", output_format=q)
        for name, opts in VARIANTS.items():
            with tempfile.TemporaryDirectory() as d:
                fn = rope_gemm.compile_kernel(cfg, 132, options=f"--keep-cubin --dump-dir={d}", **opts)
                r = sass_report(fn.__cubin__)
                r.pop("sass")
                print(q, name, r, flush=True)
                export(fn, out, f"{q}_{name}")


def run(out: Path, tokens: str, rounds: int):
    import torch
    import tvm_ffi
    from triton.testing import do_bench

    ctypes.CDLL(str(out.parent / "kernels" / "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in [int(t) for t in tokens.split(",")]:
        for kind in ("mxfp8 images", "random bf16"):
            def operand(rows):
                x = torch.randn(rows, K, device="cuda", generator=g)
                if kind == "random bf16":
                    return x.to(torch.bfloat16)
                # the bf16 image of an MXFP8 tensor: E4M3 codes times a power of two per 32-block
                e = torch.randint(-6, 2, (rows, K // 32), device="cuda", generator=g).float()
                return ((x * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                        * torch.exp2(e).repeat_interleave(32, 1)).to(torch.bfloat16)
            a, w = operand(T), operand(N)
            ang = torch.rand(T, RH, device="cuda", generator=g) * 6.28
            cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
            ph = torch.zeros(1, 1, device="cuda")
            rows, outs = {}, {}
            for q in ("bf16", "mxfp8"):
                y = torch.empty(T, N // 2 if q == "mxfp8" else N, dtype=torch.bfloat16, device="cuda")
                s = torch.empty(T, N // 32, dtype=torch.uint8, device="cuda") if q == "mxfp8" else \
                    torch.zeros(1, 1, dtype=torch.uint8, device="cuda")
                for name in VARIANTS:
                    fn = tvm_ffi.load_module(str(out / f"{q}_{name}.so"))["qproj_rope_gemm"]
                    yv, sv = torch.empty_like(y), torch.empty_like(s)
                    rows[f"{q}_{name}"] = (lambda f=fn, yv=yv, sv=sv: f(a, w, ph, ph, cos, sin, yv, sv))
                    outs[f"{q}_{name}"] = (yv, sv)
            rows["cublas_bf16"] = lambda: torch.mm(a, w.t())
            for f in rows.values():
                f()
            torch.cuda.synchronize()
            same = {k: torch.equal(outs[k][0].view(torch.int16), outs[k.split("_")[0] + "_heads"][0].view(torch.int16))
                    and torch.equal(outs[k][1], outs[k.split("_")[0] + "_heads"][1]) for k in outs}
            print(f"T={T} {kind}: bit-identical to the head tiles: {same}", flush=True)
            times = {k: [] for k in rows}
            for r in range(rounds):
                order = list(rows) if r % 2 == 0 else list(rows)[::-1]
                for k in order:
                    times[k].append(do_bench(rows[k], warmup=25, rep=100))
            for k, v in times.items():
                rat = statistics.median([x / y for x, y in zip(v, times["cublas_bf16"], strict=True)])
                hk = k.split("_")[0] + "_heads"
                rh = statistics.median([x / y for x, y in zip(v, times[hk], strict=True)]) if hk in times else 1.0
                print(f"T={T} {kind:>12} {k:>14}: median {statistics.median(v):.4f} ms  / cuBLAS bf16 {rat:.3f}  "
                      f"/ heads {rh:.3f}  rounds " + " ".join(f"{t:.4f}" for t in v), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["build", "run"])
    p.add_argument("out")
    p.add_argument("--tokens", default="16384,65536,4096")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    build(Path(args.out)) if args.mode == "build" else run(Path(args.out), args.tokens, args.rounds)
