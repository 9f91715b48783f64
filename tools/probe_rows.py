"""Probe: the inference RMSNorm + fp8_block quantize, persistent forms (`rows_persistent_sm90.py`: each warp loads its
next rows while it works on the current ones; CTAs capped at `persistent`) against the default (a warp per 2 rows).

    python tools/probe_rows.py build   # CPU with the DSL: .cute/rows/<form>_<variant>.so
    python tools/probe_rows.py run     # GPU: bytes against the training form, graph times against a device copy

`run` needs MLA_QPROJ_CUTE_KERNELS (the training kernels and the runtime library, tools/build_cute_kernels.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
OUT = Path(".cute/rows")
VARIANTS = [(1536, torch.float32, False, "pow2"), (1536, torch.bfloat16, True, "fp32"),
            (512, torch.float32, False, "pow2")]
FORMS = {"rows2": (2, 0, "", 4, 0, False), "p1x396": (1, 0, "", 4, 396, False), "p1x264": (1, 0, "", 4, 264, False),
         "p1m4x528": (1, 4, "", 4, 528, False), "p2x264": (2, 0, "", 4, 264, False),
         "p1hx396": (1, 0, "", 4, 396, True), "rows1h": (1, 0, "", 4, 0, True), "rows2h": (2, 0, "", 4, 0, True),
         "rows2hm4": (2, 4, "", 4, 0, True)}


def name(form, v):
    K, w, zc, bs = v
    return f"{form}_k{K}_{'f32' if w == torch.float32 else 'bf16'}_{'zc' if zc else 'g'}_{bs}"


def build():
    import build_cute_kernels as b
    from rows_persistent_sm90 import RMSNormFp8BlockRowsSm90 as Pers

    import mla_qproj.kernels.cute.rmsnorm_fp8_block_rows_sm90 as rows_mod
    from mla_qproj.kernels.cute import rmsnorm_fp8_block as cr

    orig = rows_mod.RMSNormFp8BlockRowsSm90
    OUT.mkdir(parents=True, exist_ok=True)
    for v in VARIANTS:
        for form, (r, *knobs) in FORMS.items():
            rows_mod.RMSNormFp8BlockRowsSm90 = lambda K, zc, bs, wdt, r, knobs=tuple(knobs): (
                orig(K, zc, bs, wdt, r) if knobs == (0, "", 4, 0, False) else Pers(K, zc, bs, wdt, r, *knobs))
            fn = cr.compile_kernel(v[0], False, v[1], v[2], v[3], rows=r)
            print(b.export(fn, OUT, name(form, v), cr.FUNCTION))
    (OUT / "libcute_dsl_runtime.so").unlink(missing_ok=True)


def run():
    import tvm_ffi

    from mla_qproj.bench_kernels import graph_ms
    from mla_qproj.kernels.cute import rmsnorm_fp8_block as cr
    from mla_qproj.kernels.cute import rope_gemm
    from mla_qproj.kernels.triton.rmsnorm_fp8_block import rmsnorm_fp8_block_outputs

    rope_gemm._load_runtime(os.environ["MLA_QPROJ_CUTE_KERNELS"])
    fns = {(f, v): tvm_ffi.load_module(str(OUT / f"{name(f, v)}.so"))[cr.FUNCTION] for f in FORMS for v in VARIANTS}
    print(torch.cuda.get_device_name())

    def call(fn, x, w):
        rs, rd, rsc, _, _ = rmsnorm_fp8_block_outputs(x, False)
        cd, cs = cr._placeholders(x.device)
        fn(x, w, rs, rd, rsc, cd, cs, 1e-6)
        return rs, rd, rsc

    bad = 0
    for T in (1, 7, 8, 9, 127, 1000, 4096 + 17, 16384):
        for v in VARIANTS:
            K, wdt, zc, bs = v
            gen = torch.Generator(device="cuda").manual_seed(T + K)
            x = torch.randn(T, K, device="cuda", generator=gen) * torch.exp(
                4 * torch.randn(T, 1, device="cuda", generator=gen))
            x = x.bfloat16()
            w = (torch.rand(K, device="cuda", generator=gen) + 0.5 - (1.0 if zc else 0.0)).to(wdt)
            train = cr.rmsnorm_fp8_block(x, w, 1e-6, zc, bs, columnwise=True)[:3]
            for f in FORMS:
                got = call(fns[(f, v)], x, w)
                for i, (a, b) in enumerate(zip(got, train, strict=True)):
                    n = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
                    if n:
                        bad += 1
                        print(f"MISMATCH T={T} {name(f, v)} output {i}: {n} bytes")
    print("bytes:", "all equal to the training form" if bad == 0 else f"{bad} mismatches")
    K, H, D = 1536, 128, 192
    for T in (4096, 16384, 65536):
        v = VARIANTS[0]
        x = torch.randn(T, K, device="cuda").bfloat16()
        w = torch.rand(K, device="cuda") + 0.5
        src = torch.randn(T * H * D // 2, device="cuda")
        dst = torch.empty_like(src)
        outs = rmsnorm_fp8_block_outputs(x, False)
        cd, cs = cr._placeholders(x.device)
        nb = T * K * 3 + T * K / 32 + 4 * T
        for rnd in range(3):
            t_copy = graph_ms(lambda d=dst, s=src: d.copy_(s))
            line = [f"T={T} round {rnd}: copy {t_copy * 1e3:.1f} us"]
            for f in FORMS:
                fn = fns[(f, v)]
                t = graph_ms(lambda fn=fn, x=x, w=w, o=outs, p=(cd, cs): fn(x, w, *o[:3], *p, 1e-6))
                frac = (nb / t) / (src.numel() * 8 / t_copy)
                line.append(f"{f} {t * 1e3:.1f} us {frac:.3f} of copy")
            print("; ".join(line))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]]()
