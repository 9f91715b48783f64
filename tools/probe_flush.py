"""Probe: how the L2 flush before each call moves the memory-bound figures of `mla_qproj.bench_kernels`.

    python tools/probe_flush.py build    # CPU with the DSL: .cute/tma/<form>_<variant>.so (tools/rows_tma_sm90.py)
    python tools/probe_flush.py          # GPU (MLA_QPROJ_CUTE_KERNELS set): bytes of the TMA forms, then the times

`bench_kernels.graph_ms` zeroes a 256 MB buffer before each call: the call then starts with the L2 full of dirty
lines, whose write-back it pays, where the flush-only graph's next flush paid it. A 1.6 GB copy barely notices; a
75 MB kernel may. Times the fp8_block RMSNorm + quantize (inference and training forms) and two copies (the gradient's
size, the ceiling bench_kernels uses; and one moving the kernel's own bytes) under a write flush (zero_) and a read
flush (a reduction over the same buffer: clean lines), three rounds, T = 4096, 16384, 65536.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from mla_qproj.bench_kernels import K, N

sys.path.insert(0, str(Path(__file__).resolve().parent))
OUT = Path(".cute/tma")
# (stages, CTAs, warps a CTA, min CTAs an SM)
FORMS = {"t2x528": (2, 528, 4, 4), "t3x396": (3, 396, 4, 3), "t2x396": (2, 396, 4, 3), "t4x264": (4, 264, 4, 2)}
VARIANTS = [(1536, torch.float32, False, "pow2"), (1536, torch.bfloat16, True, "fp32"),
            (512, torch.float32, False, "pow2")]


def name(form, v):
    K, w, zc, bs = v
    return f"{form}_k{K}_{'f32' if w == torch.float32 else 'bf16'}_{'zc' if zc else 'g'}_{bs}"


def build():
    import build_cute_kernels as b
    from rows_tma_sm90 import RowsTmaSm90

    import mla_qproj.kernels.cute.rmsnorm_fp8_block_rows_sm90 as rows_mod
    from mla_qproj.kernels.cute import rmsnorm_fp8_block as cr

    orig = rows_mod.RMSNormFp8BlockRowsSm90
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        for v in VARIANTS:
            for form, knobs in FORMS.items():
                rows_mod.RMSNormFp8BlockRowsSm90 = lambda K, zc, bs, wdt, r, knobs=knobs: RowsTmaSm90(
                    K, zc, bs, wdt, r, *knobs)
                with tempfile.TemporaryDirectory() as d:
                    fn = cr.compile_kernel(v[0], False, v[1], v[2], v[3], options=f"--keep-cubin --dump-dir={d}")
                rep = b.rms_sass_report(fn.__cubin__, 32 * knobs[2])
                print(name(form, v), {k: rep[k] for k in ("REG", "STACK", "CTAS_PER_SM_BY_REG", "LDS.128", "SHFL")},
                      "instr", len(re.findall(r"^\s*/\*[0-9a-f]+\*/", rep["sass"], re.M)))
                print(b.export(fn, OUT, name(form, v), cr.FUNCTION))
    finally:
        rows_mod.RMSNormFp8BlockRowsSm90 = orig
    (OUT / "libcute_dsl_runtime.so").unlink(missing_ok=True)


def tma_forms():
    """{(form, variant): callable} of the built forms (empty where not built)."""
    if not OUT.is_dir():
        return {}
    import tvm_ffi

    from mla_qproj.kernels.cute import rmsnorm_fp8_block as cr
    from mla_qproj.kernels.cute import rope_gemm

    rope_gemm._load_runtime(os.environ["MLA_QPROJ_CUTE_KERNELS"])
    return {(f, v): tvm_ffi.load_module(str(OUT / f"{name(f, v)}.so"))[cr.FUNCTION] for f in FORMS for v in VARIANTS
            if (OUT / f"{name(f, v)}.so").is_file()}


def check_bytes(fns) -> None:
    """Each TMA form's rsigma, codes and scale_inv against the library's inference kernel (= the training form's)."""
    from mla_qproj.kernels.cute.rmsnorm_fp8_block import _placeholders
    from mla_qproj.kernels.triton.rmsnorm_fp8_block import rmsnorm_fp8_block_fwd, rmsnorm_fp8_block_outputs

    for (form, v), fn in fns.items():
        K, wdt, zc, bs = v
        bad = []
        for T in (1, 2, 3, 7, 8, 9, 127, 1000, 4113, 16384, 70001):
            x = (torch.randn(T, K, device="cuda") * 3).to(torch.bfloat16)
            x[T // 2, : K // 2] = 0
            w = (torch.rand(K, device="cuda") + 0.5).to(wdt)
            ref = rmsnorm_fp8_block_fwd(x, w, 1e-6, zc, bs, False)
            outs = rmsnorm_fp8_block_outputs(x, False)
            fn(x, w, outs[0], outs[1], outs[2], *_placeholders(x.device), 1e-6)
            for i in (0, 1, 2):
                if not torch.equal(ref[i].view(torch.uint8), outs[i].view(torch.uint8)):
                    bad.append((T, i))
        print(f"bytes {name(form, v)}: {'equal' if not bad else f'DIFFER {bad[:6]}'}", flush=True)


def graph_ms(fn, flush, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush()
                if with_fn:
                    fn()
        graphs.append(g)
    times = []
    for g in graphs:
        ts = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        times.append(sorted(ts)[3])
    return (times[0] - times[1]) / n


def main() -> None:
    from mla_qproj.kernels.cute.rmsnorm_fp8_block import _placeholders
    from mla_qproj.kernels.triton.rmsnorm_fp8_block import rmsnorm_fp8_block_fwd, rmsnorm_fp8_block_outputs

    print(torch.cuda.get_device_name(), torch.__version__)
    fns = tma_forms()
    check_bytes(fns)
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    buf32 = buf.view(torch.float32)
    sink = torch.empty((), device="cuda")
    flushes = {"write": lambda: buf.zero_(), "read": lambda: torch.amax(buf32, dim=0, out=sink)}
    for T in (4096, 16384, 65536):
        x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
        g = torch.rand(K, device="cuda") + 0.5
        nb_inf = T * K * (2 + 1) + T * K / 32 + 4 * T
        nb_trn = T * K * (2 + 1 + 1) + 2 * T * K / 32 + 4 * T
        big = torch.randn(T * N // 2, device="cuda")
        big_d = torch.empty_like(big)
        own = torch.randn(int(nb_inf // 8), device="cuda")  # fp32: read + written = the inference kernel's bytes
        own_d = torch.empty_like(own)
        for rnd in range(3):
            for fname, fl in flushes.items():
                t_big = graph_ms(lambda: big_d.copy_(big), fl)
                t_own = graph_ms(lambda: own_d.copy_(own), fl)
                t_inf = graph_ms(lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", False), fl)
                t_trn = graph_ms(lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", True), fl)
                tma = []
                for (form, v), fn in fns.items():
                    if v == VARIANTS[0]:
                        o = rmsnorm_fp8_block_outputs(x, False)
                        t = graph_ms(lambda fn=fn, o=o: fn(x, g, o[0], o[1], o[2], *_placeholders(x.device), 1e-6),
                                     fl)
                        tma.append(f"{form} {t * 1e3:.1f} us")
                bw_big = big.numel() * 8 / t_big / 1e9
                bw_own = own.numel() * 8 / t_own / 1e9
                bw_inf, bw_trn = nb_inf / t_inf / 1e9, nb_trn / t_trn / 1e9
                print(f"T={T:>6} r{rnd} {fname:>5}: copy(grad) {t_big * 1e3:7.1f} us {bw_big:5.2f} TB/s | "
                      f"copy(own) {t_own * 1e3:6.1f} us {bw_own:5.2f} | inference {t_inf * 1e3:6.1f} us "
                      f"{bw_inf:5.2f} = {bw_inf / bw_big:.3f} of copy(grad), {bw_inf / bw_own:.3f} of copy(own) | "
                      f"training {t_trn * 1e3:6.1f} us {bw_trn / bw_big:.3f} / {bw_trn / bw_own:.3f} | "
                      + ", ".join(tma), flush=True)


if __name__ == "__main__":
    build() if sys.argv[1:] == ["build"] else main()
