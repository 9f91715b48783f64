"""Block-scaled FP8 memory-bound kernels (SPEC §5) at the DeepSeek-V3 shape: bytes check against the reference, then
the rate against a device copy (the target: >= 80 % of copy), for the launch-config candidates. One call on a GPU:

    python scripts/fp8_block_probe.py [--tokens 4096,16384]
    python scripts/fp8_block_probe.py --sass          # no GPU needed: sm_90 registers / spills / instructions

Timings reuse mla_qproj.bench_kernels (eager: do_bench median; graph: CUDA-graph replays after an L2 flush, minus the
flushes). Bytes moved: each input read once, each output written once.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

K, H, NOPE, ROPE = 1536, 128, 128, 64
D = NOPE + ROPE
N = H * D
STYLES = ("deepseek", "neox", "gptj")


def _candidates():
    from mla_qproj.kernels.rmsnorm_fp8_block import RMSNormFp8BlockConfig
    from mla_qproj.kernels.rope_fp8_block import RopeFp8BlockConfig, fast_unit

    rope = []
    for style in STYLES:
        w = fast_unit(NOPE, ROPE, D, style)
        rope += [(style, RopeFp8BlockConfig(w, False, nw)) for nw in (4, 8, 16)]
        rope.append((style, RopeFp8BlockConfig(32, True, 16)))
    rms = [RMSNormFp8BlockConfig(block_k=bk, num_warps=nw) for bk, nw in ((128, 4), (128, 8), (256, 8), (256, 16))]
    return rope, rms


def check_bytes(T: int) -> None:
    """One call of each kernel against the reference (pow2 and fp32 scales), on the GPU."""
    from mla_qproj._config import QProjConfig
    from mla_qproj.kernels.rmsnorm_fp8_block import rmsnorm_fp8_block_fwd
    from mla_qproj.kernels.rope_fp8_block import rope_fp8_block_bwd
    from mla_qproj.reference import fp8_block as F

    def same(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    dq = (torch.randn(T, N, device="cuda") * 3).to(torch.bfloat16)
    ang = torch.rand(T, ROPE // 2, device="cuda") * 6.3
    c, s = ang.cos(), ang.sin()
    for style in STYLES:
        for bs in ("pow2", "fp32"):
            cfg = QProjConfig(K, H, NOPE, ROPE, D, rope_style=style, precision="fp8_block")
            rd, rs, cd, cs = F.grad_operands_fp8_block(dq, c, s, cfg, bs)
            out = rope_fp8_block_bwd(dq, c, s, num_heads=H, head_dim=D, qk_head_dim=NOPE, rope_dim=ROPE,
                                     rope_style=style, block_scale=bs)
            ok = [same(out[0], rd), same(out[1], rs.t()), same(out[2][:, :T], cd.t()), same(out[3], cs)]
            print(f"bytes rope {style:<8} {bs}: {'ok' if all(ok) else f'MISMATCH {ok}'}")
    x = (torch.randn(T, K, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(K, device="cuda") + 0.5
    for bs in ("pow2", "fp32"):
        rsig, rd, rs, cd, cs = rmsnorm_fp8_block_fwd(x, w, 1e-6, False, bs)
        xn = F.canonical_nan(x.float() * rsig[:, None] * w)
        ed, es = F.quantize_blocks(xn, (1, 128), bs)
        fd, fs = F.quantize_blocks(xn, (128, 1), bs)
        ok = [same(rd, ed), same(rs, es.t()), same(cd[:, :T], fd.t()), same(cs, fs)]
        print(f"bytes rmsnorm {bs}: {'ok' if all(ok) else f'MISMATCH {ok}'}")


def rows(T: int):
    from mla_qproj.bench_kernels import _bench, graph_ms
    from mla_qproj.kernels.fp8_block_quant import fp8_block_quantize_2d
    from mla_qproj.kernels.rmsnorm_fp8_block import rmsnorm_fp8_block_fwd
    from mla_qproj.kernels.rope_fp8_block import rope_fp8_block_bwd

    rope, rms = _candidates()
    src = torch.randn(T * N // 2, device="cuda")  # as many bytes as the bf16 [T, N] gradient
    dst = torch.empty_like(src)
    out = [("device copy (ceiling)", 2.0 * src.numel() * 4, lambda: dst.copy_(src))]
    dq = torch.randn(T, N, device="cuda").to(torch.bfloat16)
    c, s = torch.randn(T, ROPE // 2, device="cuda"), torch.randn(T, ROPE // 2, device="cuda")
    rope_bytes = T * N * (2 + 1 + 1) + 4 * (T * -(-N // 128) + -(-T // 128) * N) + 2 * T * ROPE // 2 * 4
    for style, cfg in rope:
        out.append((f"rope {style} {cfg}", rope_bytes,
                    lambda style=style, cfg=cfg: rope_fp8_block_bwd(
                        dq, c, s, num_heads=H, head_dim=D, qk_head_dim=NOPE, rope_dim=ROPE, rope_style=style,
                        config=cfg)))
    x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    g = torch.rand(K, device="cuda") + 0.5
    for col in (True, False):
        nbytes = T * K * (2 + 1 + col) + 4 * T + 4 * (T * K // 128 + col * -(-T // 128) * K)
        for cfg in rms:
            out.append((f"rmsnorm col={col} {cfg}", nbytes,
                        lambda col=col, cfg=cfg: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", col, cfg)))
    out.append(("quantize [T, N] bf16 1x128", T * N * (2 + 1) + 4 * T * N // 128,
                lambda: fp8_block_quantize_2d(dq, (1, 128))))
    return [(name, nbytes, _bench(fn), graph_ms(fn)) for name, nbytes, fn in out]


def sass() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(__file__))
    from sass_stats import report, stats

    from mla_qproj.kernels.rmsnorm_fp8_block import _rmsnorm_fp8_block_kernel
    from mla_qproj.kernels.rope_fp8_block import _rope_fp8_block_kernel

    rope, rms = _candidates()
    sig = dict(dq_ptr="*bf16", stride_dq="i32", cos_ptr="*fp32", sin_ptr="*fp32", stride_cs="i32",
               row_data_ptr="*u8", row_sinv_ptr="*fp32", col_data_ptr="*u8", col_sinv_ptr="*fp32", T="i32",
               T_pad="i32")
    for style, cfg in rope:
        cx = dict(H=H, D=D, NOPE=NOPE, R=ROPE, STYLE=style, W=cfg.unit, GATHER=cfg.gather, POW2=True,
                  TOKENS_ON_AXIS0=False, EMULATED=False)
        st = stats(_rope_fp8_block_kernel, sig, cx, tuple(sig), num_warps=cfg.num_warps, enable_fp_fusion=False)
        report(f"rope {style} W={cfg.unit} gather={cfg.gather} w{cfg.num_warps}", st)
    sig = dict(x_ptr="*bf16", stride_x="i32", w_ptr="*fp32", rsigma_ptr="*fp32", row_data_ptr="*u8",
               row_sinv_ptr="*fp32", col_data_ptr="*u8", col_sinv_ptr="*fp32", T="i32", T_pad="i32")
    for cfg in rms:
        cx = dict(K=K, BLOCK_K=cfg.block_k, ZERO_CENTERED=False, POW2=True, COLUMNWISE=True, TOKENS_ON_AXIS0=False,
                  EMULATED=False)
        report(f"rmsnorm block_k={cfg.block_k} w{cfg.num_warps}",
               stats(_rmsnorm_fp8_block_kernel, sig, cx, tuple(sig), num_warps=cfg.num_warps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--sass", action="store_true", help="offline sm_90 statistics (no GPU)")
    args = p.parse_args(argv)
    if args.sass:
        sass()
        return 0
    if not torch.cuda.is_available():
        print("fp8_block_probe: needs a CUDA GPU (or --sass)")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    check_bytes(4096 + 5)
    print(f"{'T':>6}  {'kernel':<84}{'eager ms':>9}{'of copy':>8}{'graph ms':>9}{'GB/s':>7}{'of copy':>8}")
    for T in (int(t) for t in args.tokens.split(",")):
        res = rows(T)
        ceil_e, ceil_g = (res[0][1] / res[0][i] / 1e6 for i in (2, 3))
        for name, nbytes, ms_e, ms_g in res:
            gbs_e, gbs_g = nbytes / ms_e / 1e6, nbytes / ms_g / 1e6
            print(f"{T:>6}  {name:<84}{ms_e:>9.3f}{gbs_e / ceil_e:>8.2f}{ms_g:>9.3f}{gbs_g:>7.0f}"
                  f"{gbs_g / ceil_g:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
