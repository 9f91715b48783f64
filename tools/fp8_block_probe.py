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
    """(style, RopeFp8BlockConfig) and RMSNormFp8BlockConfig launch candidates: the byte-transposing kernels (the
    previous defaults: rope 8 warps, rmsnorm 4 / 8 warps), the word-packed kernels (packed=True; 4 / 8 warps for rope,
    16 / 8 / 4 tokens per thread for rmsnorm), the rope gather kernel."""
    from mla_qproj.kernels.rmsnorm_fp8_block import RMSNormFp8BlockConfig
    from mla_qproj.kernels.rope_fp8_block import RopeFp8BlockConfig, fast_unit

    rope = []
    for style in STYLES:
        w = fast_unit(NOPE, ROPE, D, style)
        rope += [(style, RopeFp8BlockConfig(w, False, nw, packed)) for packed, nw in
                 ((False, 8), (False, 4), (True, 4), (True, 8))]
        rope.append((style, RopeFp8BlockConfig(32, True, 16)))
    rms = [RMSNormFp8BlockConfig(block_k=bk, num_warps=nw, packed=pk) for bk, nw, pk in
           ((128, 4, False), (128, 8, False), (128, 4, True), (128, 8, True), (128, 16, True), (256, 8, True),
            (256, 16, True))]
    return rope, rms


def _short(cfg) -> str:
    """A config's fields that differ from its dataclass defaults, compactly."""
    import dataclasses

    d = type(cfg)()
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != getattr(d, f.name)) or "(defaults)"


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
    rope, rms = _candidates()
    for style in STYLES:
        for bs in ("pow2", "fp32"):
            cfg = QProjConfig(K, H, NOPE, ROPE, D, rope_style=style, precision="fp8_block")
            rd, rs, cd, cs = F.grad_operands_fp8_block(dq, c, s, cfg, bs)
            for rc in [None] + [rc for st, rc in rope if st == style]:
                out = rope_fp8_block_bwd(dq, c, s, num_heads=H, head_dim=D, qk_head_dim=NOPE, rope_dim=ROPE,
                                         rope_style=style, block_scale=bs, config=rc)
                ok = [same(out[0], rd), same(out[1], rs.t()), same(out[2][:, :T], cd.t()), same(out[3], cs)]
                name = "default" if rc is None else _short(rc)
                print(f"bytes rope {style:<8} {bs} {name}: {'ok' if all(ok) else f'MISMATCH {ok}'}")
    x = (torch.randn(T, K, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(K, device="cuda") + 0.5
    for bs in ("pow2", "fp32"):
        for rc in [None] + rms:
            rsig, rd, rs, cd, cs = rmsnorm_fp8_block_fwd(x, w, 1e-6, False, bs, config=rc)
            xn = F.canonical_nan(x.float() * rsig[:, None] * w)
            ed, es = F.quantize_blocks(xn, (1, 128), bs)
            fd, fs = F.quantize_blocks(xn, (128, 1), bs)
            ok = [same(rd, ed), same(rs, es.t()), same(cd[:, :T], fd.t()), same(cs, fs)]
            name = "default" if rc is None else _short(rc)
            print(f"bytes rmsnorm {bs} {name}: {'ok' if all(ok) else f'MISMATCH {ok}'}")


def rows(T: int):
    from mla_qproj.bench_kernels import _bench, graph_ms
    from mla_qproj.kernels.fp8_block_quant import fp8_block_quantize_2d
    from mla_qproj.kernels.rmsnorm_fp8_block import RMSNormFp8BlockConfig, rmsnorm_fp8_block_fwd
    from mla_qproj.kernels.rmsnorm_quant import _rsigma_kernel
    from mla_qproj.kernels.rope_fp8_block import rope_fp8_block_bwd

    rope, rms = _candidates()
    src = torch.randn(T * N // 2, device="cuda")  # as many bytes as the bf16 [T, N] gradient
    dst = torch.empty_like(src)
    out = [("device copy (ceiling)", 2.0 * src.numel() * 4, lambda: dst.copy_(src))]
    dq = torch.randn(T, N, device="cuda").to(torch.bfloat16)
    c, s = torch.randn(T, ROPE // 2, device="cuda"), torch.randn(T, ROPE // 2, device="cuda")
    rope_bytes = T * N * (2 + 1 + 1) + 4 * (T * -(-N // 128) + -(-T // 128) * N) + 2 * T * ROPE // 2 * 4
    for style, cfg in rope:
        out.append((f"rope {style} {_short(cfg)}", rope_bytes,
                    lambda style=style, cfg=cfg: rope_fp8_block_bwd(
                        dq, c, s, num_heads=H, head_dim=D, qk_head_dim=NOPE, rope_dim=ROPE, rope_style=style,
                        config=cfg)))
    x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    g = torch.rand(K, device="cuda") + 0.5
    for col in (True, False):
        # both passes: the rsigma kernel's read of x is not counted (the row below times it alone)
        nbytes = T * K * (2 + 1 + col) + 4 * T + 4 * (T * K // 128 + col * -(-T // 128) * K)
        for cfg in rms:
            out.append((f"rmsnorm col={col} {_short(cfg)}", nbytes,
                        lambda col=col, cfg=cfg: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", col, cfg)))
    rc = RMSNormFp8BlockConfig()
    rsig = torch.empty(T, device="cuda")
    out.append(("rmsnorm's rsigma pass alone (read x, write rsigma)", T * K * 2 + 4 * T,
                lambda: _rsigma_kernel[(-(-T // rc.rs_rows),)](
                    x_ptr=x, stride_x=x.stride(0), rsigma_ptr=rsig, T=T, eps=1e-6, K=K, ROWS=rc.rs_rows,
                    BLOCK_K=rc.rs_block_k, EMULATED=False, num_warps=rc.rs_warps)))
    out.append(("quantize [T, N] bf16 1x128", T * N * (2 + 1) + 4 * T * N // 128,
                lambda: fp8_block_quantize_2d(dq, (1, 128))))
    return [(name, nbytes, _bench(fn), graph_ms(fn)) for name, nbytes, fn in out]


def sass() -> None:
    """Every candidate compiled for sm_90 offline at the V3 shape: registers, spill (stack) bytes, shared memory,
    SASS counts, and warp-instructions per element (static count x warps / elements per program: the kernels are
    straight-line code per program, except the byte-transposing rope kernel, whose count holds both sides of its
    rope / pass-through branch per run, about 1.2x what one program runs)."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(__file__))
    from sass_stats import report, stats

    from mla_qproj.kernels.rmsnorm_fp8_block import (
        _rmsnorm_fp8_block_kernel,
        _rmsnorm_fp8_block_packed_kernel,
        packed_tokens,
    )
    from mla_qproj.kernels.rope_fp8_block import _rope_fp8_block_kernel, _rope_fp8_block_packed_kernel, period_blocks

    rope, rms = _candidates()
    sig = dict(dq_ptr="*bf16", stride_dq="i32", cos_ptr="*fp32", sin_ptr="*fp32", stride_cs="i32",
               row_data_ptr="*u8", row_sinv_ptr="*fp32", col_data_ptr="*u8", col_sinv_ptr="*fp32", T="i32",
               T_pad="i32")
    psig = {("row_w_ptr" if k == "row_data_ptr" else "col_w_ptr" if k == "col_data_ptr" else k):
            ("*i32" if k.endswith("data_ptr") else v) for k, v in sig.items()}
    for style, cfg in rope:
        cx = dict(H=H, D=D, NOPE=NOPE, R=ROPE, STYLE=style, W=cfg.unit, POW2=True, TOKENS_ON_AXIS0=False,
                  EMULATED=False)
        if cfg.packed:
            cx.update(TJ=32 // cfg.num_warps, BLOCKS=period_blocks(D))
            st = stats(_rope_fp8_block_packed_kernel, psig, cx, tuple(psig), num_warps=cfg.num_warps,
                       enable_fp_fusion=False)
            elems = 128 * 128 * cx["BLOCKS"]
        else:
            cx.update(GATHER=cfg.gather)
            st = stats(_rope_fp8_block_kernel, sig, cx, tuple(sig), num_warps=cfg.num_warps, enable_fp_fusion=False)
            elems = 128 * 128
        report(f"rope {style} {_short(cfg)}", st)
        print(f"    warp-instr per element: {st['total'] * cfg.num_warps / elems:.3f}")
    sig = dict(x_ptr="*bf16", stride_x="i32", w_ptr="*fp32", rsigma_ptr="*fp32", row_data_ptr="*u8",
               row_sinv_ptr="*fp32", col_data_ptr="*u8", col_sinv_ptr="*fp32", T="i32", T_pad="i32")
    psig = {("row_w_ptr" if k == "row_data_ptr" else "col_w_ptr" if k == "col_data_ptr" else k):
            ("*i32" if k.endswith("data_ptr") else v) for k, v in sig.items()}
    for cfg in rms:
        for col in (True, False):
            cx = dict(K=K, BLOCK_K=cfg.block_k, ZERO_CENTERED=False, POW2=True, COLUMNWISE=col, TOKENS_ON_AXIS0=False,
                      EMULATED=False)
            if cfg.packed:
                cx.update(TJ=packed_tokens(cfg.block_k, cfg.num_warps))
                st = stats(_rmsnorm_fp8_block_packed_kernel, psig, cx, tuple(psig), num_warps=cfg.num_warps)
            else:
                st = stats(_rmsnorm_fp8_block_kernel, sig, cx, tuple(sig), num_warps=cfg.num_warps)
            report(f"rmsnorm col={col} {_short(cfg)}", st)
            print(f"    warp-instr per element: {st['total'] * cfg.num_warps / (128 * cfg.block_k):.3f}")


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
    print(f"{'T':>6}  {'kernel':<60}{'eager ms':>9}{'of copy':>8}{'graph ms':>9}{'GB/s':>7}{'of copy':>8}")
    for T in (int(t) for t in args.tokens.split(",")):
        res = rows(T)
        ceil_e, ceil_g = (res[0][1] / res[0][i] / 1e6 for i in (2, 3))
        for name, nbytes, ms_e, ms_g in res:
            gbs_e, gbs_g = nbytes / ms_e / 1e6, nbytes / ms_g / 1e6
            print(f"{T:>6}  {name:<60}{ms_e:>9.3f}{gbs_e / ceil_e:>8.2f}{ms_g:>9.3f}{gbs_g:>7.0f}"
                  f"{gbs_g / ceil_g:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
