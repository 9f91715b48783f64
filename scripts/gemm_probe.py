"""GPU probe of the fused forward GEMM (mla_qproj/kernels/qproj_gemm.py): correctness at full size against the
reference, then timings against cuBLAS bf16 `a @ w.t()`; prints a short table last.

    PYTHONUNBUFFERED=1 python3 scripts/gemm_probe.py                 # table: T = 4096, 16384; row, row+col, bf16
    PYTHONUNBUFFERED=1 python3 scripts/gemm_probe.py --variants      # also launch-knob variants at T = 16384
    PYTHONUNBUFFERED=1 python3 scripts/gemm_probe.py --variants short  # num_stages=4
    PYTHONUNBUFFERED=1 python3 scripts/gemm_probe.py --small         # also small awkward shapes vs the reference

Geometry: DeepSeek-V3 q up-projection, K = 1536, H = 128, D = 192 (nope 128, rope 64), deepseek RoPE layout.
FLOPs = 2·T·N·K with N = H·D. Full logs go to $OUT/gemm_probe.log when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mla_qproj._config import QProjConfig  # noqa: E402
from mla_qproj.kernels import qproj_gemm as qg  # noqa: E402
from mla_qproj.reference.mxfp8 import dequantize_rowwise, quantize_rowwise  # noqa: E402
from mla_qproj.reference.qproj import quantize_output  # noqa: E402
from mla_qproj.reference.rope import apply_rope  # noqa: E402

K, H, P, R, D = 1536, 128, 128, 64, 192
MODES = {"mxfp8 row": ("mxfp8", False), "mxfp8 row+col": ("mxfp8", True), "bf16": ("bf16", False)}
_log = None


def log(*args):
    msg = " ".join(str(a) for a in args)
    print(msg, flush=True)
    if _log is not None:
        _log.write(msg + "\n")
        _log.flush()


def make_cfg(fmt, col, style="deepseek", scale_mode="rceil", k=K, h=H, p=P, r=R, d=D):
    return QProjConfig.make(k, h, p, r, d, rope_style=style, output_format=fmt, columnwise_output=col,
                            scale_mode=scale_mode)


def make_inputs(T, cfg, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    kk, n = cfg.q_lora_rank, cfg.out_features
    x = torch.randn(T, kk, device=dev, generator=g)
    a = dequantize_rowwise(*quantize_rowwise(x), dtype=torch.bfloat16)
    w = torch.randn(n, kk, device=dev, generator=g) * kk**-0.5
    w = dequantize_rowwise(*quantize_rowwise(w), dtype=torch.bfloat16)
    ang = torch.rand(T, cfg.rope_dim // 2, device=dev, generator=g) * 100.0
    return a, w, ang.cos().contiguous(), ang.sin().contiguous()


def reference(a, w, c, s, cfg):
    T = a.shape[0]
    y = (a.float() @ w.float().t()).reshape(T, cfg.num_heads, cfg.q_head_dim)
    return quantize_output(apply_rope(y, c, s, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style), cfg)


def compare(out, ref):
    """'row 1.000000/1.000000 ...': identical-code fraction / identical-scale fraction per orientation."""
    parts = []
    if len(ref) == 1:
        o, r = out[0], ref[0]
        same = (o.view(torch.int16) == r.view(torch.int16)).float().mean().item()
        rel = ((o.float() - r.float()).norm() / r.float().norm()).item()
        return f"bf16 identical {same:.6f} rel_err {rel:.2e}", same
    worst = 1.0
    for label, (d, sc), (ed, es) in (("row", out[0:2], ref[0:2]), ("col", out[2:4], ref[2:4])):
        if ed is None:
            continue
        fd = (d.view(torch.uint8) == ed.view(torch.uint8)).float().mean().item()
        fs = (sc == es).float().mean().item()
        worst = min(worst, fd)
        parts.append(f"{label} codes {fd:.6f} scales {fs:.6f}")
    return "  ".join(parts), worst


def kernel_stats():
    """Registers / spills / shared memory of every compiled variant of the kernel (best effort)."""
    rows = []
    try:
        for cache in qg._qproj_gemm_fwd_kernel.device_caches.values():
            for k in cache[0].values():
                md = k.metadata
                rows.append(f"regs {k.n_regs} spills {k.n_spills} smem {md.shared} warps {md.num_warps} "
                            f"stages {md.num_stages}")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        rows.append(f"(no stats: {e!r})")
    return rows


def bench(fn):
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def run_variants(T, variants, dev, table):
    """Time each (mode, GemmConfig changes) at T next to cuBLAS; True when every variant's bytes equal the
    default's."""
    flops = 2.0 * T * H * D * K
    ok = True
    a, w, c, s = make_inputs(T, make_cfg("bf16", False), dev, seed=1)
    t_cublas = bench(lambda: a @ w.t())
    for mode, ov in variants:
        cfg = make_cfg(*MODES[mode])
        wp = qg.prepare_fused_weight(w, cfg)
        base = qg.qproj_gemm_fwd(a, wp, c, s, cfg)
        try:
            config = dataclasses.replace(qg.default_config(T, dev, cfg), **ov)
            out = qg.qproj_gemm_fwd(a, wp, c, s, cfg, config=config)
            same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                       for x, y in zip(out, base, strict=True) if x is not None)
            t = bench(lambda: qg.qproj_gemm_fwd(a, wp, c, s, cfg, config=config))  # noqa: B023
            table.append((T, f"{mode} {ov}", t, flops / t * 1e-9, t_cublas / t))
            log(f"variant T={T} {mode} {ov}: {t:.3f} ms, bytes equal to default: {same}")
            ok &= bool(same)
        except Exception as e:  # noqa: BLE001 - keep probing the other variants
            log(f"variant T={T} {mode} {ov}: FAILED {type(e).__name__}: {str(e)[:300]}")
    torch.cuda.empty_cache()
    return ok


def main():
    global _log
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--variants", nargs="?", const="all", choices=["short", "all", "tma", "occ2"],
                    help="launch-config variants at the largest T (short: num_stages=4)")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if os.environ.get("OUT"):
        _log = open(os.path.join(os.environ["OUT"], "gemm_probe.log"), "w")
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 reference GEMM in full fp32
    log(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  triton {triton.__version__}")
    ok = True
    table = []

    for T in args.T:
        n = H * D
        flops = 2.0 * T * n * K
        cfg0 = make_cfg("bf16", False)
        a, w, c, s = make_inputs(T, cfg0, dev)
        t_cublas = bench(lambda: a @ w.t())  # noqa: B023
        table.append((T, "cuBLAS bf16 a@w.t()", t_cublas, flops / t_cublas * 1e-9, 1.0))
        for mode, (fmt, col) in MODES.items():
            cfg = make_cfg(fmt, col)
            wp = qg.prepare_fused_weight(w, cfg)
            t0 = time.time()
            out = qg.qproj_gemm_fwd(a, wp, c, s, cfg)
            torch.cuda.synchronize()
            t_first = time.time() - t0
            ref = reference(a, w, c, s, cfg)
            msg, worst = compare(out, ref)
            ok &= worst >= 0.999
            log(f"T={T} {mode}: first call {t_first:.1f}s  {msg}")
            del ref
            t = bench(lambda: qg.qproj_gemm_fwd(a, wp, c, s, cfg))  # noqa: B023
            table.append((T, f"fused {mode}", t, flops / t * 1e-9, t_cublas / t))
        del a, w, c, s
        torch.cuda.empty_cache()

    # launch configs at the largest T, each checked byte-for-byte against the default launch
    for T in args.T[-1:] if args.variants else ():
        variants = [("mxfp8 row", dict(num_stages=4)), ("bf16", dict(num_stages=4))]
        if args.variants == "tma":  # epilogue stores through tensor descriptors (TMA, asynchronous)
            variants = [("mxfp8 row", dict(TMA_STORE=True)),
                        ("mxfp8 row", dict(TMA_STORE=True, num_stages=4)), ("mxfp8 row+col", dict(TMA_STORE=True)),
                        ("bf16", dict(TMA_STORE=True, FLATTEN=False)), ("mxfp8 row", dict(TMA_STORE=True, GROUP_M=16))]
        if args.variants == "occ2":  # [64, 256] tiles, one warpgroup, two programs per SM: one's epilogue can run
            # while the other's MMAs do (the overlap a single [128, 256] program per SM cannot have on sm_90)
            n2 = 2 * torch.cuda.get_device_properties(dev).multi_processor_count
            o2 = dict(BLOCK_M=64, num_warps=4, NUM_SMS=n2, TMA_STORE=True)
            variants = [("mxfp8 row", dict(TMA_STORE=True)), ("mxfp8 row", dict(o2, num_stages=2)),
                        ("mxfp8 row", dict(o2, num_stages=3, BLOCK_K=32)), ("mxfp8 row", dict(o2, num_stages=4,
                                                                                              BLOCK_K=32)),
                        ("mxfp8 row", dict(o2, num_stages=4, NUM_SMS=n2 // 2)), ("bf16", dict(o2, num_stages=2,
                                                                                             FLATTEN=False))]
        if args.variants == "all":
            variants += [("mxfp8 row", dict(FLATTEN=False)), ("mxfp8 row", dict(BLOCK_K=128, num_stages=2)),
                         ("mxfp8 row", dict(GROUP_M=4)), ("mxfp8 row+col", dict(FLATTEN=False)),
                         ("bf16", dict(FLATTEN=False))]
        ok &= run_variants(T, variants, dev, table)

    if args.small:
        cases = [("neox", "mxfp8", True, "rceil", 33), ("gptj", "mxfp8", True, "floor", 33),
                 ("deepseek", "mxfp8", True, "floor", 1000), ("gptj", "bf16", False, "rceil", 33)]
        for style, fmt, col, sm, T in cases:
            cfg = make_cfg(fmt, col, style, sm, k=256, h=8)
            a, w, c, s = make_inputs(T, cfg, dev, seed=2)
            out = qg.qproj_gemm_fwd(a, qg.prepare_fused_weight(w, cfg), c, s, cfg)
            msg, worst = compare(out, reference(a, w, c, s, cfg))
            ok &= worst >= 0.999
            log(f"small {style} {fmt} col={col} {sm} T={T}: {msg}")

    for row in kernel_stats():
        log("kernel:", row)
    log("")
    log(f"{'T':>6} | {'provider':<52} | {'ms':>7} | {'TFLOP/s':>7} | {'vs cuBLAS':>9}")
    for T, name, t, tf, ratio in table:
        log(f"{T:>6} | {name:<52} | {t:7.3f} | {tf:7.1f} | {ratio:9.3f}")
    log("correctness:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
