"""RMSNorm + block-scaled FP8 quantize of the CuTe DSL engine (SPEC §5): which calls it serves, where its kernels come
from (prebuilt or compiled here: `rope_gemm`'s runtime loading), the launcher.

    x2d [T, K] bf16 -> rsigma fp32 [T], row codes [T, K] + scale_inv [K/128, T], (training) col codes [K, T_pad] +
                       scale_inv [ceil(T/128), K]

the five tensors of `kernels.triton.rmsnorm_fp8_block.rmsnorm_fp8_block_fwd`, with its bytes given this kernel's rsigma
(`rmsnorm_fp8_block_sm90.py`: x read once, clusters of K/128 CTAs per 128 tokens). The Triton launcher calls
`serves` and hands the call here when it is True.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import rope_gemm
from .rope_gemm import (  # noqa: F401 (ENV_DISABLE, RUNTIME_LIB: re-exported for the tests and tools)
    ENV_DISABLE,
    ENV_KERNELS,
    RUNTIME_LIB,
    _dsl_available,
    _enabled,
    _load_runtime,
    _say_once,
)

FUNCTION = "rmsnorm_fp8_block"
BLOCK_SCALES = ("pow2", "fp32")  # "deepseek" stays on the Triton kernels
COLS = 128  # columns per CTA (rmsnorm_fp8_block_sm90.COLS, without importing the DSL)
MAX_CLUSTER = 16
MAX_TILES = 65535  # a CUDA grid's y extent: 128-token tiles


def supported(K: int, x_dtype: torch.dtype, w_dtype: torch.dtype, block_scale: str) -> bool:
    """Calls the kernel covers: bf16 x, fp32 or bf16 norm weight, K a multiple of 128 up to 2048 (a whole 1x128 block
    per CTA, at most 16 CTAs a cluster), "pow2" or "fp32" scales."""
    return (isinstance(K, int) and K > 0 and K % COLS == 0 and K // COLS <= MAX_CLUSTER
            and x_dtype == torch.bfloat16 and w_dtype in (torch.float32, torch.bfloat16)
            and block_scale in BLOCK_SCALES)


def key(K: int, columnwise: bool, w_dtype: torch.dtype, zero_centered: bool, block_scale: str) -> str:
    """The name of the kernel for this variant (a prebuilt file is `<key>.so`)."""
    w = "f32" if w_dtype == torch.float32 else "bf16"
    return (f"rmsnorm_fp8_block_{'train' if columnwise else 'infer'}_k{K}_w{w}_{'zc' if zero_centered else 'g'}_"
            f"{block_scale}")


def serves(x2d: torch.Tensor, norm_weight: torch.Tensor, block_scale: str) -> bool:
    """The CuTe kernel runs this call: a CUDA device of capability (9, 0), `MLA_QPROJ_CUTE` not "0", a supported
    geometry and dtypes, x2d contiguous ([T, K] with strides (K, 1)), 16-byte aligned data pointers, T within the
    grid, and a kernel to be had (prebuilt, or the DSL to compile one). Never raises."""
    try:
        if x2d.device.type != "cuda" or not _enabled() or x2d.dim() != 2 or norm_weight.dim() != 1:
            return False
        T, K = x2d.shape
        if not supported(K, x2d.dtype, norm_weight.dtype, block_scale):
            return False
        if x2d.stride(1) != 1 or x2d.stride(0) != K or norm_weight.shape[0] != K:
            return False
        if norm_weight.stride(0) != 1 or norm_weight.device != x2d.device:
            return False
        if x2d.data_ptr() % 16 or norm_weight.data_ptr() % 16 or -(-T // 128) > MAX_TILES:
            return False
        index = x2d.device.index if x2d.device.index is not None else torch.cuda.current_device()
        return _serves(index, os.environ.get(ENV_KERNELS, ""), K, str(norm_weight.dtype), block_scale)
    except Exception:  # a broken install or device query: the Triton kernels run
        return False


_SERVES: dict[tuple, bool] = {}


@torch.compiler.assume_constant_result  # no file-system calls in a graph
def _serves(index: int, prebuilt: str, K: int, w_dtype: str, block_scale: str) -> bool:
    """sm_90 and a kernel source for every variant the call may ask for (training and inference, both gamma forms:
    the Triton launcher asks before it knows them): the prebuilt files, or the DSL. Decided once per key."""
    k = (index, prebuilt, K, w_dtype, block_scale)
    got = _SERVES.get(k)
    if got is None:
        got = _SERVES[k] = _decide(*k)
    return got


def _decide(index: int, prebuilt: str, K: int, w_dtype: str, block_scale: str) -> bool:
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    wdt = torch.float32 if w_dtype == str(torch.float32) else torch.bfloat16
    names = [key(K, cw, wdt, zc, block_scale) for cw in (True, False) for zc in (True, False)]
    if prebuilt and all((Path(prebuilt) / f"{n}.so").is_file() for n in names):
        return True
    if _dsl_available():
        return True
    _say_once("mla_qproj: fp8_block RMSNorm + quantize on the Triton kernels: the CuTe DSL engine is not installed "
              f"(pip install 'mla_qproj[cute]') and {ENV_KERNELS}={prebuilt!r} lacks some of " + ", ".join(names))
    return False


_KERNELS: dict[str, object] = {}


def _kernel(K: int, columnwise: bool, w_dtype: torch.dtype, zero_centered: bool, block_scale: str):
    """The callable kernel (a tvm_ffi.Function): the prebuilt one if present, else compiled now; kept."""
    k = key(K, columnwise, w_dtype, zero_centered, block_scale)
    fn = _KERNELS.get(k)
    if fn is None:
        d = rope_gemm._prebuilt_dir()
        if d is not None and (d / f"{k}.so").is_file():
            import tvm_ffi

            _load_runtime(str(d))
            fn = tvm_ffi.load_module(str(d / f"{k}.so"))[FUNCTION]
        else:
            fn = compile_kernel(K, columnwise, w_dtype, zero_centered, block_scale)
        _KERNELS[k] = fn
    return fn


def compile_kernel(K: int, columnwise: bool, w_dtype: torch.dtype, zero_centered: bool, block_scale: str = "pow2",
                   options: str = "", rows: int = 2):
    """Compile the kernel (T symbolic) with the CuTe DSL for sm_90a; no GPU needed. Returns the compiled function
    (callable with torch tensors on the current stream; `.export_to_c` writes an object file). The training form
    (`columnwise`) is `rmsnorm_fp8_block_sm90`'s, the inference form `rmsnorm_fp8_block_rows_sm90`'s (`rows`: rows a
    warp)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .rmsnorm_fp8_block_rows_sm90 import RMSNormFp8BlockRowsSm90
    from .rmsnorm_fp8_block_sm90 import RMSNormFp8BlockSm90

    wdt = cutlass.Float32 if w_dtype == torch.float32 else cutlass.BFloat16
    if columnwise:  # clusters of K/128 CTAs per 128 tokens (the 128x1 blocks couple the tokens)
        kern = RMSNormFp8BlockSm90(K, zero_centered, block_scale, wdt)
    else:  # a warp per `rows` rows
        kern = RMSNormFp8BlockRowsSm90(K, zero_centered, block_scale, wdt, rows)
    T, t_pad, n_tiles = cute.sym_int(), cute.sym_int(), cute.sym_int()
    f32, e4m3 = cutlass.Float32, cutlass.Float8E4M3FN
    args = (make_fake_tensor(cutlass.BFloat16, (T, K), (K, 1), assumed_align=16),
            make_fake_tensor(wdt, (K,), (1,), assumed_align=16),
            make_fake_tensor(f32, (T,), (1,), assumed_align=4),
            make_fake_tensor(e4m3, (T, K), (K, 1), assumed_align=16),
            make_fake_tensor(f32, (K // 128, T), (T, 1), assumed_align=4),
            # training: [K, T_pad] codes and [ceil(T/128), K] scale_inv; inference: [1, 1] placeholders, not touched
            make_fake_tensor(e4m3, (K, t_pad), (t_pad, 1), assumed_align=16) if columnwise else
            make_fake_tensor(e4m3, (1, 1), (1, 1), assumed_align=16),
            make_fake_tensor(f32, (n_tiles, K), (K, 1), assumed_align=16) if columnwise else
            make_fake_tensor(f32, (1, 1), (1, 1), assumed_align=16),
            cutlass.Float32(1e-6),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kern, *args, options=f"--gpu-arch sm_90a --enable-tvm-ffi {options}".strip())


_PLACEHOLDERS: dict = {}


def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, 1] stand-ins for the columnwise pair of an inference kernel (not read or written)."""
    got = _PLACEHOLDERS.get(device)
    if got is None:
        got = _PLACEHOLDERS[device] = (torch.zeros(1, 1, dtype=torch.float8_e4m3fn, device=device),
                                       torch.zeros(1, 1, dtype=torch.float32, device=device))
    return got


def rmsnorm_fp8_block(x2d: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centered_gamma: bool,
                      block_scale: str = "pow2", columnwise: bool = True) -> tuple[torch.Tensor, ...]:
    """(rsigma, row codes, row scale_inv [K/128, T], col codes [K, T_pad], col scale_inv [ceil(T/128), K]) as
    `rmsnorm_fp8_block_fwd` returns them (the columnwise pair [K, 0] / [0, K] when not asked). The caller has checked
    the call with `serves`."""
    from ..triton.rmsnorm_fp8_block import rmsnorm_fp8_block_outputs

    outs = rmsnorm_fp8_block_outputs(x2d, columnwise)
    T, K = x2d.shape
    if T == 0:
        return outs
    rsigma, rd, rs, cd, cs = outs
    fn = _kernel(K, columnwise, norm_weight.dtype, bool(zero_centered_gamma), block_scale)
    if not columnwise:
        cd, cs = _placeholders(x2d.device)
    fn(x2d, norm_weight, rsigma, rd, rs, cd, cs, float(eps))
    return outs
