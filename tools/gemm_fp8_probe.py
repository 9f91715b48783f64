"""Probe of the fused forward GEMM with block-scaled FP8 operands (SPEC §5, `qproj_gemm_fwd(..., a_scale_inv=...,
w_scale_inv=...)`) at the DeepSeek-V3 query shape: K = 1536, H = 128, D = 192 (nope 128, rope 64), deepseek RoPE.

    python tools/gemm_fp8_probe.py                      # GPU: check at T = 4096, time T = 4096 and 16384
    python tools/gemm_fp8_probe.py --T 16384 --check-T 1000 --cands default,m64_s3
    python tools/gemm_fp8_probe.py --offline            # no GPU needed: compile every candidate for sm_90 and print
                                                        # registers, spills (stack bytes), shared memory, QGMMA count

GPU mode: the fused kernel against the reference at one T (codes, scales, decoded values), then per T the median
time (`triton.testing.do_bench`, inputs rotated over 3 sets) of every candidate config with bf16 and with MXFP8
(rowwise) output, next to `torch._scaled_mm` with 1x128 x 128x128 block scales (bf16 out, no RoPE) and cuBLAS bf16
`x @ w.t()`; a table of ms, TFLOP/s and ratios is printed last (also to $OUT/gemm_fp8_probe.log when $OUT is set).
FLOPs = 2·T·N·K with N = H·D. A candidate is `dataclasses.replace(default_config(T, dev, cfg, "fp8_block"), **changes)`
with the geometry's choices (ROPE_BCAST, TMA_STORE) redone for its half width HB; W' is laid out once per half width
(`prepare_fused_weight_fp8(..., hb=HB)`), and each candidate runs on the W' of its own HB.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/sass_stats.py

from mla_qproj._config import QProjConfig  # noqa: E402
from mla_qproj.kernels import qproj_gemm as qg  # noqa: E402
from mla_qproj.reference.qproj import quantize_output  # noqa: E402
from mla_qproj.reference.rope import apply_rope  # noqa: E402

K, H, P, R, D = 1536, 128, 128, 64, 192
N = H * D
BLOCK = 128
SMEM_MAX = 232448  # bytes of shared memory one sm_90 block may use (227 KB)
# launch configs to compare: changes to the fp8 default (BLOCK_K = 128 always: one scale block per step). HB = 128:
# [BLOCK_M, 256] tiles (m64_s4 was the default before HB = 64); HB = 64: [BLOCK_M, 128] tiles (the layer's layout).
# FLATTEN="auto": flattened wherever `flatten_ok` (the GPU chooser's rule for the [BLOCK_M, 256] configs)
CANDIDATES = {
    "default": {},
    "m128_hb64_s3": dict(HB=64, BLOCK_M=128, num_warps=8, num_stages=3, FLATTEN=False),
    "m128_hb64_s4": dict(HB=64, BLOCK_M=128, num_warps=8, num_stages=4, FLATTEN=False),
    "m128_hb64_s5": dict(HB=64, BLOCK_M=128, num_warps=8, num_stages=5, FLATTEN=False),
    "m128_hb64_s4_flat": dict(HB=64, BLOCK_M=128, num_warps=8, num_stages=4, FLATTEN="auto"),
    "m128_hb64_s4_ptr": dict(HB=64, BLOCK_M=128, num_warps=8, num_stages=4, FLATTEN=False, TMA_STORE=False),
    "m128_hb64_s4_g16": dict(HB=64, BLOCK_M=128, num_warps=8, num_stages=4, FLATTEN=False, GROUP_M=16),
    "m64_hb64_w4_s4": dict(HB=64, BLOCK_M=64, num_warps=4, num_stages=4, FLATTEN="auto"),
    "m64_hb64_w8_s4": dict(HB=64, BLOCK_M=64, num_warps=8, num_stages=4, FLATTEN="auto"),
    "m64_s3": dict(HB=128, BLOCK_M=64, num_warps=8, num_stages=3, FLATTEN="auto"),
    "m64_s4": dict(HB=128, BLOCK_M=64, num_warps=8, num_stages=4, FLATTEN="auto"),
    "m64_s5": dict(HB=128, BLOCK_M=64, num_warps=8, num_stages=5, FLATTEN="auto"),
    "m64_s4_ptr": dict(HB=128, BLOCK_M=64, num_warps=8, num_stages=4, TMA_STORE=False, FLATTEN=True),
    "m128_s3": dict(HB=128, BLOCK_M=128, num_warps=8, num_stages=3, FLATTEN="auto"),
    "m128_s4": dict(HB=128, BLOCK_M=128, num_warps=8, num_stages=4, FLATTEN="auto"),
    "m128_w16_s3": dict(HB=128, BLOCK_M=128, num_warps=16, num_stages=3, FLATTEN="auto"),
    "m128_w16_s4": dict(HB=128, BLOCK_M=128, num_warps=16, num_stages=4, FLATTEN="auto"),
    "m64_w4_s4": dict(HB=128, BLOCK_M=64, num_warps=4, num_stages=4, FLATTEN="auto"),
}
HALF_WIDTHS = qg.HALF_WIDTHS  # W' is laid out once per half width (every candidate runs on its own)
MODES = {"bf16": ("bf16", False), "mxfp8 row": ("mxfp8", False), "mxfp8 row+col": ("mxfp8", True)}
_log = None


def log(*args) -> None:
    msg = " ".join(str(a) for a in args)
    print(msg, flush=True)
    if _log is not None:
        _log.write(msg + "\n")
        _log.flush()


def make_cfg(fmt: str, col: bool) -> QProjConfig:
    return QProjConfig.make(K, H, P, R, D, output_format=fmt, columnwise_output=col)


def quantize_blocks(x: torch.Tensor, bm: int, bn: int, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §5 for finite x: [M, N] -> (e4m3 codes [M, N], fp32 scale_inv [ceil(M / bm), ceil(N / bn)])."""
    M, Nx = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -Nx % bn, 0, -M % bm))
    amax = xp.reshape(xp.shape[0] // bm, bm, xp.shape[1] // bn, bn).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    if pow2:
        scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    s = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :Nx]
    return (x.float() * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), 1.0 / scale


def make_operands(T: int, cfg: QProjConfig, dev: torch.device, seed: int = 0) -> dict:
    """Random x [T, K] in 1x128 blocks (pow2 scales), W [N, K] in 128x128 tiles, pair tables; kernel operands."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, K, device=dev, generator=g)
    w = torch.randn(N, K, device=dev, generator=g) * K**-0.5
    a, a_sinv = quantize_blocks(x, 1, BLOCK)  # a_sinv [T, K/128]
    w_data, w_sinv = quantize_blocks(w, BLOCK, BLOCK)  # w_sinv [N/128, K/128]
    ang = torch.rand(T, R // 2, device=dev, generator=g) * 100.0
    w_prep = {hb: qg.prepare_fused_weight_fp8(w_data, w_sinv, cfg, hb=hb) for hb in HALF_WIDTHS}  # (codes, sinv)
    return dict(a=a, a_sinv_kt=a_sinv.t().contiguous(), w_data=w_data, w_sinv=w_sinv, w_prep=w_prep,
                cos=ang.cos().contiguous(), sin=ang.sin().contiguous())


def reference_y(ops: dict) -> torch.Tensor:
    """y [T, N] fp32 = sum over K blocks of (A_kb · W_kbᵀ) · sa · sw (SPEC §5), no RoPE."""
    a, w = ops["a"].float(), ops["w_data"].float()
    sa = ops["a_sinv_kt"]  # [K/128, T]
    sw = ops["w_sinv"].repeat_interleave(BLOCK, 0)[:N]  # [N, K/128]
    y = torch.zeros(a.shape[0], N, device=a.device)
    for kb in range(K // BLOCK):
        ks = slice(kb * BLOCK, (kb + 1) * BLOCK)
        y += (a[:, ks] @ w[:, ks].t()) * sa[kb][:, None] * sw[:, kb][None, :]
    return y


def fused(ops: dict, cfg: QProjConfig, config=None) -> tuple:
    """The fused kernel on the W' of the config's half width (default config: the layer's)."""
    hb = qg.fused_half_width(cfg, "fp8_block") if config is None else config.HB
    w_prep, w_prep_sinv = ops["w_prep"][hb]
    return qg.qproj_gemm_fwd(ops["a"], w_prep, ops["cos"], ops["sin"], cfg, a_scale_inv=ops["a_sinv_kt"],
                             w_scale_inv=w_prep_sinv, config=config)


def compare(out: tuple, ref: tuple) -> tuple[str, bool]:
    """Identical-code / identical-scale fractions and the decoded relative error, per output."""
    from mla_qproj.reference.mxfp8 import dequantize_columnwise, dequantize_rowwise

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    if len(ref) == 1:
        same = (out[0].view(torch.int16) == ref[0].view(torch.int16)).float().mean().item()
        e = rel(out[0].float(), ref[0].float())
        return f"bf16 identical {same:.6f} rel_err {e:.2e}", e < 1e-2
    parts, ok = [], True
    for label, (d, s), (ed, es), deq in (("row", out[0:2], ref[0:2], dequantize_rowwise),
                                         ("col", out[2:4], ref[2:4], dequantize_columnwise)):
        if ed is None:
            continue
        fd = (d.view(torch.uint8) == ed.view(torch.uint8)).float().mean().item()
        fs = (s == es).float().mean().item()
        e = rel(deq(d, s), deq(ed, es))
        ok &= e < 1e-2
        parts.append(f"{label} codes {fd:.6f} scales {fs:.6f} rel_err {e:.2e}")
    return "  ".join(parts), ok


def candidate(name: str, T: int, dev: torch.device, cfg: QProjConfig) -> qg.GemmConfig:
    """The fp8 default with the candidate's changes; a candidate with another half width than the default gets
    the geometry's ROPE_BCAST / TMA_STORE for its own HB (unless it sets them); FLATTEN="auto": `flatten_ok`."""
    base = qg.default_config(T, dev, cfg, "fp8_block")
    changes = dict(CANDIDATES[name])
    hb = changes.get("HB", base.HB)
    if hb != base.HB:
        changes.setdefault("ROPE_BCAST", qg._rope_bcast_ok(cfg, hb))
        changes.setdefault("TMA_STORE", base.TMA_STORE and qg.tma_store_supported(cfg, hb))
    if changes.get("FLATTEN") == "auto":
        changes["FLATTEN"] = qg.flatten_ok(cfg, changes.get("TMA_STORE", base.TMA_STORE))
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------------------------------------------- offline


class _Capture:
    """Stands in for the kernel: records the launch's keyword arguments instead of launching."""

    kwargs: dict = {}

    def __getitem__(self, grid):
        def run(**kwargs):
            _Capture.kwargs = kwargs

        return run


def compile_stats(T: int, cfg: QProjConfig, config: qg.GemmConfig, operands: str = "fp8_block") -> dict:
    """The launcher's exact arguments (captured from a CPU call) compiled for sm_90: `sass_stats.stats`."""
    from sass_stats import stats
    from triton.runtime.jit import mangle_type

    rows = qg.fused_layout(cfg, config.HB)[2]
    dt = torch.float8_e4m3fn if operands == "fp8_block" else torch.bfloat16
    a, wp, c = torch.zeros(T, K, dtype=dt), torch.zeros(rows, K, dtype=dt), torch.zeros(T, R // 2)
    sc = dict(a_scale_inv=torch.zeros(K // BLOCK, T), w_scale_inv=torch.zeros(K // BLOCK, rows)) \
        if operands == "fp8_block" else {}
    kernel = qg._qproj_gemm_fwd_kernel
    qg._qproj_gemm_fwd_kernel = _Capture()
    try:
        qg.qproj_gemm_fwd(a, wp, c, c, cfg, config=config, **sc)
    finally:
        qg._qproj_gemm_fwd_kernel = kernel
    kw = dict(_Capture.kwargs, EMULATED=False)  # the CPU call asked for the interpreter's rounding
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg") if k in kw}
    names = list(kernel.arg_names)
    constexpr_names = {names[i] for i in kernel.constexprs}
    sig, constexprs, aligned = {}, {}, []
    for name in names:
        v = kw[name]
        if name in constexpr_names or v is None:
            constexprs[name] = v
            continue
        sig[name] = mangle_type(v)
        if isinstance(v, torch.Tensor) or (type(v) is int and v % 16 == 0):
            aligned.append(name)  # the runtime specializes 16-aligned pointers and ints the same way
    return stats(kernel, sig, constexprs, tuple(aligned), **options)


def run_offline(Ts: list[int], cands: list[str], modes: list[str]) -> int:
    import triton

    os.environ.pop("TRITON_INTERPRET", None)
    qg._num_sms = lambda index: 132  # H100 / H200 SXM
    cuda = torch.device("cuda")  # only a label for the config chooser: nothing runs on it
    log(f"# offline sm_90 compile, triton {triton.__version__}; shared memory limit {SMEM_MAX} bytes")
    bad = 0
    for T in Ts:
        for mode in modes:
            cfg = make_cfg(*MODES[mode])
            rows = [("bf16 operands default", qg.default_config(T, cuda, cfg, "bf16"), "bf16")]
            rows += [(name, candidate(name, T, cuda, cfg), "fp8_block") for name in cands]
            for name, config, operands in rows:
                try:
                    st = compile_stats(T, cfg, config, operands)
                except Exception as e:  # noqa: BLE001 - report and keep compiling the others
                    log(f"T={T:<6} {mode:<14} {name:<22} FAILED {type(e).__name__}: {str(e)[:200]}")
                    bad += 1
                    continue
                flags = ("  SPILLS" if st["local"] > 0 else "") + ("  SMEM>MAX" if st["shared"] > SMEM_MAX else "")
                log(f"T={T:<6} {mode:<14} {name:<22} regs {st['regs']:>3} stack {st['local']:>4} smem "
                    f"{st['shared']:>6} QGMMA {st['QGMMA']} HGMMA {st['HGMMA']} STL {st['STL']:>3} "
                    f"instr {st['total']:>5}  [M{config.BLOCK_M} HB{config.HB} K{config.BLOCK_K} w{config.num_warps} "
                    f"s{config.num_stages} tma={config.TMA_STORE} flat={config.FLATTEN}]{flags}")
                bad += name == "default" and (st["local"] > 0 or st["shared"] > SMEM_MAX)
    return 0 if bad == 0 else 1


# ------------------------------------------------------------------------------------------------------ GPU


def bench_rotating(fns: list) -> float:
    """Median ms of do_bench over calls that cycle through fns (one per input set)."""
    from triton.testing import do_bench

    i = [0]

    def step():
        fns[i[0] % len(fns)]()
        i[0] += 1

    return do_bench(step, warmup=50, rep=300, return_mode="median")


def scaled_mm_blockwise(ops: dict) -> torch.Tensor:
    """torch._scaled_mm with A in 1x128 blocks and B = W viewed [K, N] column-major in 128x128 tiles, bf16 out.
    Scale layouts as torch's `_scaled_block1x128_block128x128` checks them: scale_a [T, K/128] with strides (1, T)
    (our M-major [K/128, T] transposed), scale_b [round_up(K/128, 4), N/128] with strides (1, round_up(K/128, 4))."""
    kb = K // BLOCK
    kb4 = -(-kb // 4) * 4
    sb = torch.zeros(ops["w_sinv"].shape[0], kb4, device=ops["a"].device)
    sb[:, :kb] = ops["w_sinv"]
    return torch._scaled_mm(ops["a"], ops["w_data"].t(), scale_a=ops["a_sinv_kt"].t(), scale_b=sb.t(),
                            out_dtype=torch.bfloat16)


def compiled_stats() -> list[str]:
    """Registers / spills / shared memory of every variant of the kernel compiled in this process."""
    rows = []
    try:
        for cache in qg._qproj_gemm_fwd_kernel.device_caches.values():
            for k in cache[0].values():
                md = k.metadata
                rows.append(f"regs {k.n_regs} spills {k.n_spills} smem {md.shared} warps {md.num_warps} "
                            f"stages {md.num_stages}")
    except Exception as e:  # noqa: BLE001 - diagnostics only (Triton's cache layout is internal)
        rows.append(f"(no stats: {e!r})")
    return rows


def run_gpu(Ts: list[int], check_T: int, cands: list[str], modes: list[str]) -> int:
    import triton

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference GEMM in full fp32
    log(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  triton {triton.__version__}")
    ok = True
    ops = make_operands(check_T, make_cfg("bf16", False), dev, seed=7)
    y = reference_y(ops)
    try:
        e = ((scaled_mm_blockwise(ops).double() - y.double()).norm() / y.double().norm()).item()
        log(f"check T={check_T} torch._scaled_mm blockwise vs reference y: rel_err {e:.2e}")
    except Exception as exc:  # noqa: BLE001 - the baseline is optional (torch / CUDA version)
        log(f"check T={check_T} torch._scaled_mm blockwise: FAILED {type(exc).__name__}: {str(exc)[:300]}")
    for mode in modes:
        cfg = make_cfg(*MODES[mode])
        ref = quantize_output(apply_rope(y.reshape(check_T, H, D), ops["cos"], ops["sin"], P, R, "deepseek"), cfg)
        base = fused(ops, cfg)
        msg, good = compare(base, ref)
        ok &= good
        log(f"check T={check_T} {mode} default vs reference: {msg}")
        for name in cands:
            try:
                out = fused(ops, cfg, candidate(name, check_T, dev, cfg))
                same = all(torch.equal(o.view(torch.uint8), b.view(torch.uint8))
                           for o, b in zip(out, base, strict=True) if o is not None)
                log(f"check T={check_T} {mode} {name}: bytes equal to default: {same}")
            except Exception as exc:  # noqa: BLE001 - a config may not fit (shared memory): report, go on
                log(f"check T={check_T} {mode} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
    del ops, y
    torch.cuda.empty_cache()

    table = []
    for T in Ts:
        flops = 2.0 * T * N * K
        sets = [make_operands(T, make_cfg("bf16", False), dev, seed=s) for s in range(3)]
        xb = [torch.randn(T, K, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        wb = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        t_bf16 = bench_rotating([lambda x=x, w=w: x @ w.t() for x, w in zip(xb, wb, strict=True)])
        table.append((T, "cuBLAS bf16 x @ w.t()", t_bf16, flops))
        try:
            t_smm = bench_rotating([lambda o=o: scaled_mm_blockwise(o) for o in sets])
            table.append((T, "torch._scaled_mm 1x128 x 128x128 bf16", t_smm, flops))
        except Exception as exc:  # noqa: BLE001
            log(f"T={T} torch._scaled_mm blockwise: FAILED {type(exc).__name__}: {str(exc)[:200]}")
        for mode in modes:
            cfg = make_cfg(*MODES[mode])
            for name in cands:
                config = candidate(name, T, dev, cfg)
                try:
                    t = bench_rotating([lambda o=o, cfg=cfg, config=config: fused(o, cfg, config) for o in sets])
                except Exception as exc:  # noqa: BLE001
                    log(f"T={T} {mode} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                label = (f"fused fp8 {mode} {name} [M{config.BLOCK_M}x{2 * config.HB} w{config.num_warps} "
                         f"s{config.num_stages}"
                         f"{' tma' if config.TMA_STORE else ''}]")
                table.append((T, label, t, flops))
        del sets, xb, wb
        torch.cuda.empty_cache()

    for row in compiled_stats():
        log("kernel:", row)
    log("")
    log(f"{'T':>6} | {'provider':<58} | {'ms':>7} | {'TFLOP/s':>7} | {'vs bf16':>7} | {'vs _scaled_mm':>13}")
    for T, name, t, flops in table:
        base = {n: tt for TT, n, tt, _ in table if TT == T}
        smm = base.get("torch._scaled_mm 1x128 x 128x128 bf16")
        vs_smm = f"{smm / t:13.3f}" if smm else f"{'-':>13}"
        log(f"{T:>6} | {name:<58} | {t:7.3f} | {flops / t * 1e-9:7.1f} | "
            f"{base['cuBLAS bf16 x @ w.t()'] / t:7.3f} | {vs_smm}")
    log("ratios: the provider's speed relative to the baseline (> 1: faster)")
    log("correctness:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    global _log
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--check-T", type=int, default=4096 + 17, help="T of the correctness check (GPU)")
    ap.add_argument("--cands", default=",".join(CANDIDATES), help="comma list of " + ",".join(CANDIDATES))
    ap.add_argument("--modes", default="bf16,mxfp8 row", help="comma list of " + ",".join(MODES))
    ap.add_argument("--offline", action="store_true", help="compile for sm_90 without a GPU and print statistics")
    args = ap.parse_args()
    cands, modes = args.cands.split(","), args.modes.split(",")
    for c in cands:
        if c not in CANDIDATES:
            ap.error(f"unknown candidate {c!r}")
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}")
    if os.environ.get("OUT"):
        _log = open(os.path.join(os.environ["OUT"], "gemm_fp8_probe.log"), "w")
    if args.offline:
        return run_offline(args.T, cands, modes)
    return run_gpu(args.T, args.check_T, cands, modes)


if __name__ == "__main__":
    sys.exit(main())
