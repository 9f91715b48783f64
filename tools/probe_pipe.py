"""Probe: the fp8 engine's K loop software-pipelined (RopeGemmSm90(pipelined=True)) against the loop form, in one
process: the two prebuilt kernels of DeepSeek-V3's fp8_block / bf16-query geometry (dirs A and B), their outputs
compared bit for bit (the promotion's arithmetic is the same, only its place in the schedule moves), then timed
round-robin with cuBLAS's blockwise FP8 GEMM on the same operands (do_bench medians, L2 flushed).

    python tools/probe_pipe.py DIR_A DIR_B [--tokens 4096,16384,65536] [--rounds 5]
"""
import argparse
import ctypes
import statistics
from pathlib import Path

import torch
import tvm_ffi
from triton.testing import do_bench

K, H, D, RH = 1536, 128, 192, 32
N = H * D
NAME = "rope_fp8_block_bf16_k1536_h128_d192_p128_r64_deepseek_sm{}"


def load(d: Path, sms: int):
    ctypes.CDLL(str(d / "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi.load_module(str(d / (NAME.format(sms) + ".so")))["qproj_rope_gemm"]


def make_rows(fa, fb, ops, ya, yb, u8):
    a, w, sa, ws, cos, sin = ops
    return {
        "A": lambda: fa(a, w, sa, ws, cos, sin, ya, u8),
        "B": lambda: fb(a, w, sa, ws, cos, sin, yb, u8),
        "cublas_blockwise": lambda: torch._scaled_mm(a, w.t(), scale_a=sa.t(), scale_b=ws.t(),
                                                     out_dtype=torch.bfloat16),
    }


def ratio(times, x, y):
    return statistics.median([p / q for p, q in zip(times[x], times[y], strict=True)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tokens", default="4096,16384,65536")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fa, fb = load(Path(args.a), sms), load(Path(args.b), sms)
    print(torch.cuda.get_device_name(0), "sms", sms, "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in [int(t) for t in args.tokens.split(",")]:
        a = (torch.randn(T, K, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(N, K, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = torch.exp2(torch.randint(-12, -4, (K // 128, T), device="cuda", generator=g).float())
        ws = torch.exp2(torch.randint(-12, -4, (N // 128, K // 128), device="cuda", generator=g).float())
        ang = torch.rand(T, RH, device="cuda", generator=g) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        u8 = torch.zeros(1, 1, dtype=torch.uint8, device="cuda")
        ya = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
        yb = torch.empty_like(ya)
        fa(a, w, sa, ws, cos, sin, ya, u8)
        fb(a, w, sa, ws, cos, sin, yb, u8)
        torch.cuda.synchronize()
        same = torch.equal(ya.view(torch.int16), yb.view(torch.int16))
        diff = (ya.view(torch.int16) != yb.view(torch.int16)).sum().item()
        # the plain GEMM part (pass-through columns) against cuBLAS blockwise: a sanity bound for both
        ref = torch._scaled_mm(a, w.t(), scale_a=sa.t(), scale_b=ws.t(), out_dtype=torch.bfloat16).float().view(T, H, D)
        err = ((yb.view(T, H, D)[..., :128].float() - ref[..., :128]).norm() / ref[..., :128].norm()).item()
        print(f"T={T}: A and B bit-identical: {same} (words differing: {diff}); B pass-through vs cuBLAS fp32 rel err "
              f"{err:.2e}")
        rows = make_rows(fa, fb, (a, w, sa, ws, cos, sin), ya, yb, u8)
        times = {k: [] for k in rows}
        for r in range(args.rounds):
            order = list(rows) if r % 2 == 0 else list(rows)[::-1]
            for k in order:
                times[k].append(do_bench(rows[k], warmup=25, rep=100))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"T={T}: ms median A {med['A']:.4f}  B {med['B']:.4f}  cublas_blockwise {med['cublas_blockwise']:.4f}"
              f" | B/A {ratio(times, 'B', 'A'):.3f}  A/blockwise {ratio(times, 'A', 'cublas_blockwise'):.3f}  "
              f"B/blockwise {ratio(times, 'B', 'cublas_blockwise'):.3f}")
        print("   rounds A", " ".join(f"{t:.4f}" for t in times["A"]), "| B", " ".join(f"{t:.4f}" for t in times["B"]),
              "| blk", " ".join(f"{t:.4f}" for t in times["cublas_blockwise"]))


if __name__ == "__main__":
    main()
