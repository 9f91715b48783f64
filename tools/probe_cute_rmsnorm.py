"""The CuTe DSL RMSNorm + fp8_block quantize on a GPU: its bytes against the Triton kernels', then its bandwidth.

    python tools/probe_cute_rmsnorm.py [--tokens 4096,16384,65536] [--check-tokens 1,129,4113]

Builds nothing: the kernels come from MLA_QPROJ_CUTE_KERNELS (tools/build_cute_kernels.py --out) or the DSL.
1. Bytes, K = 1536, bf16 x, fp32 g (and a bf16 g, zero-centered), training and inference: rsigma's relative
   difference to the Triton kernels' (printed), and the codes / scale_inv against `reference.fp8_block` given the
   CuTe rsigma (byte for byte), and against the Triton kernels' on the tokens whose rsigma bits agree.
2. Time, `mla_qproj.bench_kernels.graph_ms` (CUDA graph, 256 MB L2 flush before each call, flushes subtracted) at
   each T: the CuTe kernel (training, inference), the Triton kernels (an explicit config: the two-kernel form), and
   the device copy of bench_kernels (a [T * N / 2] fp32 buffer, N = H * D, bytes = read + written), printing ms,
   GB/s and the fraction of the copy's bandwidth with bench_kernels' byte counts: training T*K*(2+1+1) + 2*T*K/32 +
   4*T, inference T*K*(2+1) + T*K/32 + 4*T.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_qproj.bench_kernels import N, graph_ms  # noqa: E402
from mla_qproj.kernels.cute import rmsnorm_fp8_block as cute_rms  # noqa: E402
from mla_qproj.kernels.triton import rmsnorm_fp8_block as tri  # noqa: E402
from mla_qproj.reference import fp8_block as F  # noqa: E402

K = 1536


def _reference(x, w, rsigma, zc, columnwise):
    T = x.shape[0]
    g = w.float().cpu() + 1.0 if zc else w.float().cpu()
    xn = F.canonical_nan(x.float().cpu() * rsigma.cpu()[:, None] * g)
    rd, rs = F.quantize_blocks(xn, (1, 128), "pow2")
    outs = [rd, rs.t().contiguous()]
    if columnwise:
        cd, cs = F.quantize_blocks(xn, (128, 1), "pow2")
        cdt = torch.zeros(K, -(-T // 16) * 16, dtype=torch.uint8)
        cdt[:, :T] = cd.view(torch.uint8).t()
        outs += [cdt.view(torch.float8_e4m3fn), cs]
    return outs


def _bytes_eq(a, b) -> int:
    """Number of differing bytes."""
    def u8(t):  # standard strides (a size-1 dimension's odd stride survives `.contiguous()`)
        return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).view(torch.uint8)

    return int((u8(a) != u8(b)).sum())


def check(T: int) -> bool:
    ok = True
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, K, generator=g) * 3).to(torch.bfloat16).cuda()
    if T > 8:
        x[3], x[5, 7], x[6, 9] = 0.0, float("nan"), float("inf")
    for w_dtype, zc in ((torch.float32, False), (torch.bfloat16, True)):
        w = (torch.randn(K, generator=g) * 0.3 + (0.0 if zc else 1.0)).to(w_dtype).cuda()
        if not cute_rms.serves(x, w, "pow2"):
            print(f"T={T} w {w_dtype}: the CuTe kernel does not serve this call here")
            return False
        for cw in (True, False):
            got = cute_rms.rmsnorm_fp8_block(x, w, 1e-6, zc, "pow2", cw)
            torch.cuda.synchronize()
            want = tri.rmsnorm_fp8_block_fwd(x, w, 1e-6, zc, "pow2", cw, tri.default_config(T, K, x.device, cw))
            fin = torch.isfinite(want[0]) & (want[0] != 0)
            rel = ((got[0] - want[0]).abs() / want[0].abs())[fin].max().item() if fin.any() else 0.0
            same = got[0].view(torch.int32) == want[0].view(torch.int32)
            ref = _reference(x, w, got[0], zc, cw)
            bad_ref = [_bytes_eq(a, b) for a, b in zip(got[1:], ref, strict=False)]
            bad_tri = [_bytes_eq(got[1].view(torch.uint8)[same], want[1].view(torch.uint8)[same]),
                       _bytes_eq(got[2][:, same], want[2][:, same])]
            nan_ok = torch.equal(got[0].isnan(), want[0].isnan())
            line_ok = sum(bad_ref) == 0 and sum(bad_tri) == 0 and rel <= 2e-6 and nan_ok
            ok &= line_ok
            print(f"T={T:>6} w {str(w_dtype):<15} zc={zc!s:<5} {'train' if cw else 'infer'}: rsigma rel diff vs "
                  f"Triton {rel:.2e} (bits equal on {same.float().mean().item():.3f} of tokens, NaN rows "
                  f"{'same' if nan_ok else 'DIFFER'}); bytes differing vs reference {bad_ref}, vs Triton (equal "
                  f"rsigma) {bad_tri} -> {'OK' if line_ok else 'FAIL'}")
    return ok


def bench(T: int) -> None:
    x = (torch.randn(T, K, device="cuda") * 3).to(torch.bfloat16)
    w = torch.randn(K, device="cuda")
    src = torch.randn(T * N // 2, device="cuda")
    dst = torch.empty_like(src)
    rows = [("device copy (bench_kernels' ceiling)", 2.0 * src.numel() * 4, lambda: dst.copy_(src))]
    train_b, infer_b = T * K * (2 + 1 + 1) + 2 * T * K / 32 + 4 * T, T * K * (2 + 1) + T * K / 32 + 4 * T
    cfg_t, cfg_i = (tri.default_config(T, K, x.device, cw) for cw in (True, False))
    src_t = torch.randn(int(train_b // 8), device="cuda")  # a copy moving the training kernel's bytes
    dst_t = torch.empty_like(src_t)
    rows += [("device copy of the training kernel's bytes", 8.0 * src_t.numel(), lambda: dst_t.copy_(src_t)),
             ("CuTe RMSNorm + quant (training)", train_b,
              lambda: cute_rms.rmsnorm_fp8_block(x, w, 1e-6, False, "pow2", True)),
             ("CuTe RMSNorm + quant (inference)", infer_b,
              lambda: cute_rms.rmsnorm_fp8_block(x, w, 1e-6, False, "pow2", False)),
             ("Triton RMSNorm + quant (training)", train_b,
              lambda: tri.rmsnorm_fp8_block_fwd(x, w, 1e-6, False, "pow2", True, cfg_t)),
             ("Triton RMSNorm + quant (inference)", infer_b,
              lambda: tri.rmsnorm_fp8_block_fwd(x, w, 1e-6, False, "pow2", False, cfg_i)),
             ("launcher default (training)", train_b,
              lambda: tri.rmsnorm_fp8_block_fwd(x, w, 1e-6, False, "pow2", True))]
    res = [(name, nb, graph_ms(fn)) for name, nb, fn in rows]
    ceil = res[0][1] / res[0][2] / 1e6
    for name, nb, ms in res:
        gbs = nb / ms / 1e6
        print(f"{T:>6}  {name:<40}{ms:>9.4f} ms{gbs:>9.0f} GB/s{gbs / ceil:>7.2f} of copy  ({nb / 1e6:.1f} MB)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,16384,65536")
    p.add_argument("--check-tokens", default="1,127,128,129,1000,4113,16384")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "prebuilt:", cute_rms.os.environ.get(cute_rms.ENV_KERNELS, "(none: the DSL compiles)"))
    ok = all([check(int(t)) for t in args.check_tokens.split(",")])
    print("bytes:", "OK" if ok else "FAIL")
    for T in (int(t) for t in args.tokens.split(",")):
        bench(T)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
