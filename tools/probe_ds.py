"""Probe: epilogue and cluster options of the CuTe GEMM at DeepSeek-V3 (K = 1536, 128 heads of 192, deepseek RoPE), each
against the default kernel, timed round-robin with cuBLAS on the same operands in one process (do_bench medians, L2
flushed), the outputs compared bit for bit with the default's:
- `ds_halves`: the fp8 engine's a' / b' stored as 16-bit halves at their columns (no quad shuffles), bf16 query;
- `swz_addr`: the epilogue's shared-memory stores and table reads at addresses formed once per thread (no swizzle
  arithmetic per access), on the fp8 engine with a bf16 query (peer: cuBLAS blockwise) and on the bf16-operand
  engine with an MXFP8 query (the mxfp8 forward's GEMM; peer: cuBLAS bf16);
- `cluster_m=4` (`c4`, `mx_c4`): clusters of four CTAs on consecutive token tiles, each loading a quarter of the W
  tile and multicasting it (W's L2 -> SM bytes a quarter instead of a half: 24 KB a K block of the fp8 engine's
  [128, 256] tile instead of 32), a grid of 32 clusters (128 SMs: four-CTA clusters need not fill 132; `c4x28`: 28
  clusters, in case 32 do not fit at once).

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
# kernel family -> (precision, query, {variant: RopeGemmSm90 options}); the first variant is the default
FAMILIES = {
    "fp8": ("fp8_block", "bf16", {"shfl": {}, "halves": {"ds_halves": True}, "swz": {"swz_addr": True},
                                  "halves_swz": {"ds_halves": True, "swz_addr": True},
                                  "c4": {"cluster_m": 4, "num_sms": 128}, "c4x28": {"cluster_m": 4, "num_sms": 112}}),
    "bf16mx": ("mxfp8", "mxfp8", {"mx": {}, "mx_swz": {"swz_addr": True}, "mx_c4": {"cluster_m": 4, "num_sms": 128}}),
}


def build(out: Path, only: str = ""):
    from build_cute_kernels import compile_one, export, sass_report

    from mla_qproj._config import QProjConfig
    from mla_qproj.kernels.cute import rope_gemm

    out.mkdir(parents=True, exist_ok=True)
    for precision, query, variants in FAMILIES.values():
        cfg = QProjConfig(K, H, P, R, D, rope_style="deepseek", precision=precision, output_format=query)
        for name, opts in variants.items():
            if only and name not in only.split(","):
                continue
            with tempfile.TemporaryDirectory() as d:
                opts = dict(opts)
                fn, cubin = compile_one(cfg, opts.pop("num_sms", 132), d, **opts)
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
        ab = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        wb = (torch.randn(N, K, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
        ang = torch.rand(T, RH, device="cuda", generator=g) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        f32 = torch.zeros(1, 1, dtype=torch.float32, device="cuda")
        u8 = torch.zeros(1, 1, dtype=torch.uint8, device="cuda")
        for fam, (_, _, variants) in FAMILIES.items():
            rows, outs = {}, {}
            for name in variants:
                fn = tvm_ffi.load_module(str(out / f"{name}.so"))["qproj_rope_gemm"]
                if fam == "fp8":
                    y, s = torch.empty(T, N, dtype=torch.bfloat16, device="cuda"), u8
                    args = (a, w, sa, ws, cos, sin, y, s)
                else:
                    y = torch.empty(T, N // 2, dtype=torch.bfloat16, device="cuda")
                    s = torch.empty(T, N // 32, dtype=torch.uint8, device="cuda")
                    args = (ab, wb, f32, f32, cos, sin, y, s)
                outs[name] = (y, s)
                rows[name] = lambda f=fn, args=args: f(*args)
            peer = "cublas_blockwise" if fam == "fp8" else "cublas_bf16"
            if fam == "fp8":
                rows[peer] = lambda a=a, w=w, sa=sa, ws=ws: torch._scaled_mm(
                    a, w.t(), scale_a=sa.t(), scale_b=ws.t(), out_dtype=torch.bfloat16)
            else:
                rows[peer] = lambda ab=ab, wb=wb: ab @ wb.t()
            for f in rows.values():
                f()
            torch.cuda.synchronize()
            ref = next(iter(variants))
            for name in list(variants)[1:]:
                same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                           for x, y in zip(outs[name], outs[ref], strict=True))
                print(f"T={T} {name}: bit-identical to {ref}: {same}", flush=True)
            times = {k: [] for k in rows}
            for r in range(rounds):
                for k in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                    times[k].append(do_bench(rows[k], warmup=25, rep=100))
            for k, v in times.items():
                rp = statistics.median([x / y for x, y in zip(v, times[peer], strict=True)])
                rd = statistics.median([x / y for x, y in zip(v, times[ref], strict=True)])
                print(f"T={T} {k:>16}: median {statistics.median(v):.4f} ms  / {peer} {rp:.3f}  / {ref} {rd:.3f}"
                      "  rounds " + " ".join(f"{t:.4f}" for t in v), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["build", "run"])
    p.add_argument("out")
    p.add_argument("--tokens", default="16384,65536,4096")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="build: these variants only (comma-separated)")
    args = p.parse_args()
    build(Path(args.out), args.only) if args.mode == "build" else run(Path(args.out), args.tokens, args.rounds)
