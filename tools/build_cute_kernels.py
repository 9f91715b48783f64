"""Compile the CuTe DSL engine's kernels for sm_90a without a GPU, report their SASS, and optionally export them.

    python tools/build_cute_kernels.py [--geometry K,H,P,R,D,style[,precision[,query]] ...] [--num-sms 132] [--out DIR]
                                       [--preset tests] [--rmsnorm K ...] [--rmsnorm-only]

For each geometry (default: DeepSeek-V3's query, 1536,128,128,64,192,deepseek, with FP8 and bf16 operands and a bf16
and an MXFP8 query: four kernels; precision fp8_block / mxfp8 / bf16, query bf16 / mxfp8 / mxfp8floor name one):
compile the fused forward kernel (T symbolic), print registers, stack and instruction counts of its SASS (QGMMA and
HGMMA: FP8 and bf16 WGMMAs, TMA loads and stores, register
reallocation, local-memory loads and stores: any LDL / STL is a spill; LOOP_LDL_STL counts those in the main loop,
between the first WGMMA and the last wait on one, where they would cost every K block). With --out, export each
kernel as a shared object `<key>.so` (the file `mla_qproj.kernels.cute.rope_gemm` loads from
`MLA_QPROJ_CUTE_KERNELS=DIR`) and copy the CuTe DSL runtime library beside them, so that a machine with only
`apache-tvm-ffi` installed can run them.

The RMSNorm + block-scaled FP8 quantize kernels (`rmsnorm_fp8_block_sm90.py`, training; `_rows_sm90.py`, inference):
--rmsnorm K builds them for these K
(training and inference, fp32 and bf16 norm weights, both gamma forms, pow2 scales); --preset tests adds the GPU lane's
(tests/ops/test_cute_rmsnorm_fp8_block.py); --rmsnorm-only skips the GEMM kernels. Its report: registers, stack,
LDL / STL, cluster barriers (UCGABAR_ARV / _WAIT), the partial sums' 16-byte stores to the cluster's shared memory
(STAS.128: st.async), generic loads (LD.E: none; a pull through ld.shared::cluster would show here), 16-byte global
loads (LDG.E.128), E4M3 conversions (F2FP ... E4M3), 8- and 16-byte code stores, CTA barriers, shuffles (xor / index).

Needs `nvidia-cutlass-dsl`, `apache-tvm-ffi` and (for the SASS) `nvidia-cuda-cuobjdump`; --out also needs a C
compiler (`c++`) to link the shared objects.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_qproj._config import QProjConfig  # noqa: E402
from mla_qproj.kernels.cute import rmsnorm_fp8_block, rope_gemm  # noqa: E402

V3 = "1536,128,128,64,192,deepseek"
VARIANTS = (("fp8_block", "bf16"), ("fp8_block", "mxfp8"), ("mxfp8", "bf16"), ("mxfp8", "mxfp8"))
# --preset tests: what the GPU lane asks the engine for (tests/ops/test_cute_rope_gemm.py): DeepSeek-V3 in the three
# RoPE styles and the small geometries, every variant and the floor scale rule
TEST_GEOMETRIES = [f"1536,128,128,64,192,{s}" for s in ("deepseek", "neox", "gptj")] + [
    "256,4,128,64,192,deepseek", "512,8,96,64,192,gptj", "640,4,128,64,192,deepseek", "128,4,128,64,192,neox",
    "384,4,64,64,128,deepseek", "256,4,48,64,128,deepseek"]
# --preset tests: the RMSNorm kernels the GPU lane asks for, every variant of each K (the launcher serves a K only with
# all four training / inference x gamma forms at hand): DeepSeek-V3's K = 1536 (clusters of 12), 512 (4), 2048 (16),
# 384 (3: an odd count of blocks, the inference form's half-empty last chunk)
RMS_TEST_K = (1536, 512, 2048, 384)
RMS_COUNTED = ("LDL", "STL", "UCGABAR_ARV", "UCGABAR_WAIT", "LDG.E.128", "STG.E.128", "STG.E.64", "SHFL")
COUNTED = ("QGMMA", "HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "LDL", "STL", "FFMA", "FMUL", "FADD", "STS", "LDG")


def parse_geometry(s: str) -> list[QProjConfig]:
    """The configs a --geometry names: K,H,P,R,D,style, then optionally precision and query (else every variant)."""
    K, H, P, R, D, style, *rest = s.split(",")
    variants = VARIANTS if not rest else [(rest[0], rest[1] if len(rest) > 1 else "bf16")]
    cfgs = []
    for precision, query in variants:
        fmt = "mxfp8" if query.startswith("mxfp8") else query
        scale = "floor" if query == "mxfp8floor" else "rceil"
        cfgs.append(QProjConfig(int(K), int(H), int(P), int(R), int(D), rope_style=style, precision=precision,
                                output_format=fmt, query_scale_mode=scale))
    return cfgs


def cuobjdump() -> str:
    """A cuobjdump: the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia.cu13  # nvidia-cuda-cuobjdump 13.x installs here
        for base in nvidia.cu13.__path__:
            cand = Path(base) / "bin" / "cuobjdump"
            if cand.is_file():
                return str(cand)
    except ImportError:
        pass
    raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def sass_report(cubin: bytes) -> dict:
    """Registers, stack bytes and instruction counts of a cubin's SASS."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        exe = cuobjdump()
        res = subprocess.run([exe, "-res-usage", str(f)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([exe, "-sass", str(f)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    counts = {op: len(re.findall(rf"\b{op}[A-Z0-9._]*", sass)) for op in COUNTED}
    # the main loop: from the first WGMMA to the last wait on WGMMAs (local memory there costs every K block)
    lines = sass.splitlines()
    mma = [i for i, ln in enumerate(lines) if "GMMA" in ln or "WARPGROUP.DEPBAR" in ln]
    loop = "\n".join(lines[mma[0]:mma[-1] + 1]) if mma else ""
    spills = len(re.findall(r"\b(LDL|STL)\b", loop))
    return {"REG": int(m.group(1)), "STACK": int(m.group(2)), **counts, "LOOP_LDL_STL": spills, "sass": sass}


def rms_variants(K: int) -> list[tuple]:
    """The RMSNorm kernels built for K (`compile_kernel`'s arguments): training and inference x fp32 / bf16 norm
    weight x gamma forms x pow2 / fp32 scales, 16 kernels."""
    return [(K, cw, w, zc, bs) for bs in ("pow2", "fp32") for cw in (True, False)
            for w in (torch.float32, torch.bfloat16) for zc in (False, True)]


def rms_sass_report(cubin: bytes, threads: int = 256) -> dict:
    """Registers, stack and the RMSNorm kernel's instruction counts (module docstring), and CTAs of `threads` (256:
    the training form, 128: the inference form) an SM by registers."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        exe = cuobjdump()
        res = subprocess.run([exe, "-res-usage", str(f)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([exe, "-sass", str(f)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    reg = int(m.group(1))
    counts = {op: len(re.findall(rf"\b{re.escape(op)}(?![A-Z0-9_.])", sass)) for op in RMS_COUNTED}
    counts["LDL"] = len(re.findall(r"\bLDL\b", sass))
    counts["STL"] = len(re.findall(r"\bSTL\b", sass))
    counts["SHFL"] = len(re.findall(r"\bSHFL\.", sass))
    counts["LDG.E.128"] = len(re.findall(r"\bLDG\.E\.128\b", sass))  # (.CONSTANT: the non-coherent path)
    counts["DSMEM_LD"] = len(re.findall(r"\bLD\.E\b", sass))
    counts["STAS.128"] = len(re.findall(r"\bSTAS\.128\b", sass))
    counts["LDGSTS.128"] = len(re.findall(r"\bLDGSTS\.[A-Z0-9_.]*128\b", sass))  # cp.async of 16 bytes (x)
    counts["F2FP_E4M3"] = len(re.findall(r"\bF2FP\.[A-Z0-9_.]*E4M3", sass))
    counts["STS.32"] = len(re.findall(r"\bSTS\s", sass))  # shared stores of 4 bytes
    counts["LDS.128"] = len(re.findall(r"\bLDS\.128\b", sass))
    counts["BAR"] = len(re.findall(r"\bBAR\.", sass))  # CTA barriers
    counts["SHFL.BFLY"] = len(re.findall(r"\bSHFL\.BFLY\b", sass))
    counts["SHFL.IDX"] = len(re.findall(r"\bSHFL\.IDX\b", sass))
    ctas = 65536 // (threads * -(-reg // 8) * 8)  # registers allocated in units of 8 a thread
    return {"REG": reg, "STACK": int(m.group(2)), "CTAS_PER_SM_BY_REG": ctas, **counts, "sass": sass}


def compile_one(cfg: QProjConfig, num_sms: int, dump_dir: str, **options):
    """(compiled function, cubin bytes); options: `RopeGemmSm90`'s (the defaults where not given)."""
    fn = rope_gemm.compile_kernel(cfg, num_sms, options=f"--keep-cubin --dump-dir={dump_dir}", **options)
    cubin = fn.__cubin__
    if not isinstance(cubin, bytes):
        raise RuntimeError("the compile kept no cubin")
    return fn, cubin


def compile_rms(variant: tuple, dump_dir: str):
    """(compiled RMSNorm function, cubin bytes) of a `rms_variants` entry."""
    fn = rmsnorm_fp8_block.compile_kernel(*variant, options=f"--keep-cubin --dump-dir={dump_dir}")
    cubin = fn.__cubin__
    if not isinstance(cubin, bytes):
        raise RuntimeError("the compile kept no cubin")
    return fn, cubin


def export(fn, out: Path, name: str, function: str = rope_gemm.FUNCTION) -> Path:
    """Write out/<name>.so: the compiled function as a TVM-FFI shared object, linked against the CuTe DSL runtime."""
    import tvm_ffi
    from cutlass.cute.runtime import find_runtime_libraries

    obj = out / f"{name}.o"
    fn.export_to_c(str(obj), function_name=function)
    runtime = Path(find_runtime_libraries(enable_tvm_ffi=False)[0])
    tvm_lib = Path(tvm_ffi.__file__).parent / "lib"
    so = out / f"{name}.so"
    subprocess.run([os.environ.get("CXX", "c++"), "-shared", "-o", str(so), str(obj), f"-L{runtime.parent}",
                    "-lcute_dsl_runtime", f"-L{tvm_lib}", "-ltvm_ffi", "-Wl,-rpath,$ORIGIN"], check=True)
    obj.unlink()
    if not (out / rope_gemm.RUNTIME_LIB).exists():
        shutil.copy(runtime, out / rope_gemm.RUNTIME_LIB)
    return so


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", nargs="*", default=[V3],
                   help="K,H,P,R,D,style[,precision[,query]] (P = qk_head_dim, R = rope dim; without precision: every "
                        "variant)")
    p.add_argument("--preset", choices=["tests"], help="the GPU lane's configs (instead of --geometry)")
    p.add_argument("--num-sms", type=int, default=132, help="SM count the persistent grid is sized for (H100/H200 SXM)")
    p.add_argument("--out", default="", help="export <key>.so files and the runtime library here")
    p.add_argument("--sass", default="", help="write each kernel's SASS to this folder")
    p.add_argument("--rmsnorm", nargs="*", type=int, default=[],
                   help="also build the RMSNorm + fp8_block quantize kernels for these K")
    p.add_argument("--rmsnorm-only", action="store_true", help="build no GEMM kernel (only the RMSNorm ones)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    ok = True
    with tempfile.TemporaryDirectory() as dump:
        cfgs = [c for g in args.geometry for c in parse_geometry(g)]
        if args.preset == "tests":
            cfgs = [c for g in TEST_GEOMETRIES for c in parse_geometry(g) + parse_geometry(g + ",mxfp8,mxfp8floor")]
        rms_k = list(dict.fromkeys(list(args.rmsnorm) + (list(RMS_TEST_K) if args.preset == "tests" else [])))
        if args.rmsnorm_only:
            cfgs = []
        for cfg in cfgs:
            name = rope_gemm.key(cfg, args.num_sms)
            if not rope_gemm.supported(cfg):
                print(f"{name}: not a config the engine covers")
                ok = False
                continue
            fn, cubin = compile_one(cfg, args.num_sms, dump)
            rep = sass_report(cubin)
            if args.sass:
                Path(args.sass).mkdir(parents=True, exist_ok=True)
                (Path(args.sass) / f"{name}.sass").write_text(rep["sass"])
            print(f"{name}: " + " ".join(f"{k}={v}" for k, v in rep.items() if k != "sass"))
            ok &= rep["QGMMA"] + rep["HGMMA"] > 0 and rep["LOOP_LDL_STL"] == 0 and rep["USETMAXREG"] >= 2
            if out:
                print("  ->", export(fn, out, name))
        for variant in (v for K in rms_k for v in rms_variants(K)):
            name = rmsnorm_fp8_block.key(*variant)
            if not rmsnorm_fp8_block.supported(variant[0], torch.bfloat16, variant[2], variant[4]):
                print(f"{name}: not a geometry the RMSNorm kernel covers")
                ok = False
                continue
            fn, cubin = compile_rms(variant, dump)
            rep = rms_sass_report(cubin, 256 if variant[1] else 128)
            if args.sass:
                Path(args.sass).mkdir(parents=True, exist_ok=True)
                (Path(args.sass) / f"{name}.sass").write_text(rep["sass"])
            print(f"{name}: " + " ".join(f"{k}={v}" for k, v in rep.items() if k != "sass"))
            ok &= rep["STACK"] == 0 and rep["LDL"] + rep["STL"] == 0 and rep["F2FP_E4M3"] > 0
            if variant[1]:  # training: a cluster exchanging partial sums, x's 8 loads + the weight's
                ok &= rep["UCGABAR_ARV"] >= 1 and rep["STAS.128"] >= 1 and rep["LDG.E.128"] >= 9
            else:  # inference: independent warps, no barrier of any kind, no shared memory
                ok &= rep["BAR"] + rep["UCGABAR_ARV"] + rep["STAS.128"] + rep["STS.32"] == 0 and rep["SHFL.IDX"] > 0
            if out:
                print("  ->", export(fn, out, name, rmsnorm_fp8_block.FUNCTION))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
