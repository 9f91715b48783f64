"""Compile a Triton kernel for sm_90 on a machine without a GPU and report registers, spills, shared memory and a
SASS instruction histogram (Triton's bundled ptxas / cuobjdump). Saves device time: spills, scalar gathers
(LDG counts), barriers and instruction counts per element are visible before a kernel is ever run.

    python tools/sass_stats.py            # the project's memory-bound kernels at the DeepSeek-V3 shape
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.pop("TRITON_INTERPRET", None)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KEEP = ("LDG", "STG", "LDS", "STS", "BAR", "SHFL", "F2FP", "FMUL", "FMNMX", "LDL", "STL", "HGMMA", "QGMMA")


def stats(fn, sig: dict, constexprs: dict, aligned: tuple = (), **options) -> dict:
    """sig: {arg: triton type}; constexprs: {arg: value}; aligned: pointer/int args known divisible by 16."""
    full = dict(sig)
    full.update({k: "constexpr" for k in constexprs})
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature=full, constexprs=constexprs, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"STACK:(\d+)", res)  # spilled registers live in the stack frame (LOCAL stays 0 for spills)
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    return dict(regs=int(regs.group(1)) if regs else -1, local=int(local.group(1)) if local else -1,
                shared=c.metadata.shared, total=sum(ops.values()), **{k: ops.get(k, 0) for k in KEEP})


def report(name: str, st: dict, elements: int | None = None) -> None:
    per = f"  instr/elem/thread-group {st['total'] / elements:.1f}" if elements else ""
    print(f"{name:<44} " + " ".join(f"{k}={v}" for k, v in st.items()) + per)


def main() -> None:
    from mla_qproj.kernels.rope_quant import _rope_quant_fast_kernel, _rope_quant_kernel

    rq_sig = dict(y_ptr="*bf16", stride_y="i32", cos_ptr="*fp32", sin_ptr="*fp32", stride_cs="i32", out_ptr="*bf16",
                  row_scale_ptr="*u8", col_data_ptr="*bf16", col_scale_ptr="*u8", T="i32")
    al = ("y_ptr", "stride_y", "cos_ptr", "sin_ptr", "out_ptr", "col_data_ptr")
    base = dict(H=128, D=192, P=128, R=64, STYLE="deepseek", INVERSE=True, MODE="mxfp8_images", COLUMNWISE=True,
                SCALE_MODE="rceil")
    st = stats(_rope_quant_kernel, rq_sig, base, al, num_warps=4, enable_fp_fusion=False)
    report("rope_quant general (1 head)", st)
    for nw in (1, 2, 4):
        cx = dict(base, PASS_W=64, EMULATED=False, HEAD_MAJOR=True)
        st = stats(_rope_quant_fast_kernel, rq_sig, cx, al, num_warps=nw, enable_fp_fusion=False)
        # warp-instructions per [32 x 32] element tile: total * warps / 6 tiles (one head per program)
        report(f"rope_quant fast warps={nw}", st)
        print(f"    warp-instr per 1024 elements: {st['total'] * nw / 6:.0f}")


if __name__ == "__main__":
    main()
