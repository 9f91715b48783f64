"""Compile every project kernel for sm_90 on a machine without a GPU, through the launchers themselves, and report
per kernel: compiled or the error, registers, spill stack, shared memory, and SASS instruction counts (wgmma:
HGMMA / QGMMA, TMA: UTMALDG / UTMASTG, global / shared / local memory, barriers, shuffles, the conversions and
the amax / scale arithmetic). Spills, scalar gathers and instructions per element show before a kernel ever runs.
Run it under each Triton the project supports to compare versions:

    python tools/compile_sm90.py                 # DeepSeek-V3 shape, the launchers' GPU defaults
    python tools/compile_sm90.py --sass DIR      # also write each kernel's SASS / PTX to DIR (for diffs)

How: a stand-in Triton driver reports an sm_90 target with no device behind it, and every launch made while it is
active compiles (`warmup`) instead of running. The launchers run on CPU tensors (never read: outputs are allocated
but not touched) with the launch knobs their GPU default choosers give for a CUDA device, so the signatures,
specializations (alignment, ints equal to 1) and constexprs are the ones a GPU call at that shape compiles
(`kernels._op.emulated` is replaced meanwhile, so the launchers pick the GPU form although their tensors are CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret (before triton is imported)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)
CUDA = torch.device("cuda", 0)  # only passed to the launch-knob choosers, never used for an allocation
KEEP = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR", "SHFL", "F2FP",
        "FMUL", "FMNMX")


class _OfflineDriver:
    """What Triton's JIT asks of a driver up to (not including) a launch: an sm_90 target on device 0."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_active_torch_device(self) -> torch.device:
        return CUDA

    def get_device_interface(self):
        return torch.cuda


@contextlib.contextmanager
def offline_sm90(compiled: list):
    """While active, `kernel[grid](...)` compiles for sm_90 and appends (kernel name, CompiledKernel) to compiled."""
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, k))
        return k

    from mla_qproj.kernels import _op

    emulated = _op.emulated
    previous = driver._active  # None until something asked for the driver (and on a machine without one)
    driver.set_active(_OfflineDriver())
    JITFunction.run = compile_only
    _op.emulated = lambda device: False  # the GPU form, although the launchers see CPU tensors
    try:
        yield compiled
    finally:
        _op.emulated = emulated
        JITFunction.run = run
        driver.set_active(previous)


def sass_stats(k) -> dict:
    """Registers, spill stack, shared memory and instruction counts of a CompiledKernel (bundled cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)  # spilled registers live in the stack frame (LOCAL stays 0)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)
    count = {key: sum(1 for o in ops if o == key) for key in KEEP}
    return dict(regs=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                shared=k.metadata.shared, instr=len(ops), **count, sass=sass)


def _cases(T: int):
    """(name, thunk) per launch at the DeepSeek-V3 shape (K = 1536, 128 heads of 128 + 64), GPU default knobs;
    the GEMM also with the other RoPE styles (neox bf16 out; gptj MXFP8 out, whose MX blocks pair two halves),
    then the fp8_block recipe's kernels."""
    from mla_qproj._config import QProjConfig
    from mla_qproj._constants import DEEPSEEK_V3
    from mla_qproj.kernels.triton import (
        fp8_block_quant,
        qproj_gemm,
        rmsnorm_fp8_block,
        rmsnorm_quant,
        rope_fp8_block,
        rope_quant,
    )
    from mla_qproj.kernels.triton.mxfp8_quant import dequantize_columnwise_bf16, mxfp8_quant_2d
    from mla_qproj.kernels.triton.rmsnorm_bwd import rmsnorm_bwd

    K, H, P, R = DEEPSEEK_V3
    D, N = P + R, H * (P + R)
    bf = torch.bfloat16
    e = torch.empty
    x = e(T, K, dtype=bf)
    g = e(K, dtype=bf)
    cos, sin = e(T, R // 2), e(T, R // 2)
    qproj_gemm._num_sms = lambda index: 132  # H200 SMs (the launcher asks torch.cuda otherwise)

    def norm(columnwise, t=T):
        return lambda: rmsnorm_quant.rmsnorm_quant_fwd(x[:t], g, 1e-6, False, "mxfp8", "rceil", columnwise)

    def rope(fast, mode, inverse, columnwise):
        config = None if fast else rope_quant.RopeQuantConfig(FAST=False)
        y = e(T, N, dtype=bf if inverse else torch.float32)
        return lambda: rope_quant.rope_quant(y, cos, sin, num_heads=H, head_dim=D, qk_head_dim=P, rope_dim=R,
                                             rope_style="deepseek", inverse=inverse, mode=mode,
                                             columnwise=columnwise, scale_mode="rceil", config=config)

    def gemm(t, output_format="mxfp8", columnwise=False, style="deepseek"):
        cfg = QProjConfig(K, H, P, R, P + R, output_format=output_format, columnwise_output=columnwise,
                          rope_style=style, precision="mxfp8")
        w = qproj_gemm.prepare_fused_weight(e(N, K, dtype=bf), cfg)
        config = qproj_gemm.default_config(t, CUDA, cfg)
        return lambda: qproj_gemm.qproj_gemm_fwd(x[:t], w, cos[:t], sin[:t], cfg, config=config)

    small = 1024  # below the RMSNorm + quantize split threshold: the one-kernel form
    yield f"rmsnorm_quant T={T} (split, train)", norm(True)
    yield f"rmsnorm_quant T={T} (split, inference)", norm(False)
    yield f"rmsnorm_quant T={small} (one kernel)", norm(True, small)
    yield "rope_quant fast (bwd images, col)", rope(True, "mxfp8_images", True, True)
    yield "rope_quant fast (fwd mxfp8)", rope(True, "mxfp8", False, False)
    yield "rope_quant general (bwd images, col)", rope(False, "mxfp8_images", True, True)
    yield "rope_quant general (fwd mxfp8)", rope(False, "mxfp8", False, False)
    yield "rmsnorm_bwd", lambda: rmsnorm_bwd(e(T, K), x, e(T), g, False)
    yield "mxfp8_quant (row + col)", lambda: mxfp8_quant_2d(x, True, True, "rceil")
    yield "dequant_colwise", lambda: dequantize_columnwise_bf16(e(T, K, dtype=torch.float8_e4m3fn),
                                                              e(T // 32, K, dtype=torch.uint8))
    yield "qproj_gemm T=64 (mxfp8)", gemm(64)
    yield "qproj_gemm T=4096 (mxfp8)", gemm(4096)
    yield f"qproj_gemm T={T} (mxfp8, TMA store)", gemm(T)
    yield f"qproj_gemm T={T} (mxfp8 + col, TMA store)", gemm(T, columnwise=True)
    yield "qproj_gemm T=4096 (bf16)", gemm(4096, "bf16")
    yield f"qproj_gemm T={T} (bf16, TMA store)", gemm(T, "bf16")
    yield "qproj_gemm T=4096 (neox bf16)", gemm(4096, "bf16", style="neox")
    yield "qproj_gemm T=4096 (gptj mxfp8)", gemm(4096, style="gptj")

    def gemm_fp8(t, output_format="bf16"):
        cfg = QProjConfig.make(K, H, P, R, output_format=output_format, precision="fp8_block")
        src = qproj_gemm.fused_row_source(cfg, "fp8_block")
        w, w_sinv = qproj_gemm.prepare_fused_weight_fp8(torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                                                         torch.ones(N // 128, K // 128), cfg, src)
        a = e(t, K, dtype=torch.float8_e4m3fn)
        return lambda: qproj_gemm.qproj_gemm_fwd(a, w, cos[:t], sin[:t], cfg, a_scale_inv=e(K // 128, t),
                                                 w_scale_inv=w_sinv, config=qproj_gemm.default_config(
                                                     t, CUDA, cfg, "fp8_block"))

    def rope8(gather):
        config = rope_fp8_block.RopeFp8BlockConfig(unit=32, gather=True, num_warps=16) if gather else None
        return lambda: rope_fp8_block.rope_fp8_block_bwd(e(T, N, dtype=bf), cos, sin, num_heads=H, head_dim=D,
                                                         qk_head_dim=P, rope_dim=R, rope_style="deepseek",
                                                         config=config)

    def norm8(columnwise):
        config = rmsnorm_fp8_block.default_config(T, K, CUDA, columnwise)
        return lambda: rmsnorm_fp8_block.rmsnorm_fp8_block_fwd(x, g, 1e-6, False, columnwise=columnwise,
                                                               config=config)

    yield f"rmsnorm_fp8_block T={T} (train)", norm8(True)
    yield f"rmsnorm_fp8_block T={T} (inference)", norm8(False)
    yield "rope_fp8_block (default)", rope8(False)
    yield "rope_fp8_block (gather)", rope8(True)
    yield "fp8_block_quantize (128x128 weight)", lambda: fp8_block_quant.fp8_block_quantize_2d(
        e(N, K, dtype=bf), (128, 128))
    yield "qproj_gemm fp8_block T=4096 (bf16)", gemm_fp8(4096)
    yield f"qproj_gemm fp8_block T={T} (bf16)", gemm_fp8(T)
    yield f"qproj_gemm fp8_block T={T} (mxfp8)", gemm_fp8(T, "mxfp8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=16384, help="tokens of the large-T cases (default 16384)")
    ap.add_argument("--sass", help="directory for each kernel's SASS and PTX")
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, torch {torch.__version__}: offline sm_90 compile")
    failed = 0
    for name, thunk in _cases(args.T):
        if args.k not in name:
            continue
        compiled: list = []
        try:
            with offline_sm90(compiled):
                thunk()
        except Exception as exc:  # report and go on: one kernel failing must not hide the others
            failed += 1
            msg = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
            print(f"{name:<44} FAILED: {msg[-1][:300]}")
            continue
        for kname, k in compiled:
            st = sass_stats(k)
            sass = st.pop("sass")
            print(f"{name:<44} {kname:<28} " + " ".join(f"{a}={b}" for a, b in st.items()))
            if args.sass:
                os.makedirs(args.sass, exist_ok=True)
                stem = re.sub(r"[^A-Za-z0-9]+", "_", f"{name}_{kname}").strip("_")
                with open(os.path.join(args.sass, stem + ".sass"), "w") as f:
                    f.write(sass)
                with open(os.path.join(args.sass, stem + ".ptx"), "w") as f:
                    f.write(k.asm["ptx"])
    print(f"{failed} case(s) failed to compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
