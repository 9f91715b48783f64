"""The fused forward GEMM of the CuTe DSL engine, as the recipes call it: which configs it serves, where its kernels
come from (prebuilt or compiled here), the launcher and its custom op.

    q [T, H, D] = RoPE(A · Wᵀ)    fp8_block: A = xn's E4M3 codes [T, K] + scale_inv [K/128, T] (M-major, 1x128 along
                                  K), W = E4M3 codes [N, K] (nn.Linear row order) + scale_inv [N/128, K/128];
                                  mxfp8 / bf16: A = xn's bf16 image [T, K], W = W's bf16 image [N, K]
    the query: bf16 [T, H, D], or MXFP8 rowwise (codes [T, H, D], E8M0 bytes [T, H, D/32])

The kernel (`rope_gemm_sm90.py`) reads W in its own row order (and the fp8 scale grid as the weight cache keeps it), so
the engine needs no second copy of the weight.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from ..._config import QProjConfig
from .. import _op

log = logging.getLogger("mla_qproj")

ENV_DISABLE = "MLA_QPROJ_CUTE"  # "0": never use the engine (the Triton kernels run)
ENV_KERNELS = "MLA_QPROJ_CUTE_KERNELS"  # a directory of prebuilt kernels (tools/build_cute_kernels.py)
RUNTIME_LIB = "libcute_dsl_runtime.so"
FUNCTION = "qproj_rope_gemm"
PRECISIONS = ("fp8_block", "mxfp8", "bf16")  # the operand kinds: E4M3 codes for fp8_block, bf16 images otherwise


WIDE_N = 256  # the fp8 engine's output tile width where the heads allow (`wide_tiles`)


def wide_tiles(H: int, D: int, P: int, R: int, bn: int = WIDE_N) -> bool:
    """Whether [128, bn] tiles of the [T, H·D] query can cut across heads: whole tiles (H·D % bn == 0), every head's
    rope columns [P, P + R) inside one tile (its pairs, and deepseek's moves, stay in the tile), and at most four tile
    phases against the heads (the epilogue is compiled once per phase). (An MXFP8 query's D % 32 == 0 makes its
    heads' 32-blocks the tile's.)"""
    N = H * D
    if bn <= 0 or N % bn:
        return False
    if any((h * D + P) // bn != (h * D + P + R - 1) // bn for h in range(H)):
        return False
    return len({(n * bn) % D for n in range(N // bn)}) <= 4


def supported(cfg: QProjConfig) -> bool:
    """Geometries the kernel covers: D <= 192 (one head per [128, D] tile: two fp32 tiles of 64 x D in 240 registers
    with fp8 operands, bf16 operands need one; fp8 operands take [128, 256] tiles across heads where `wide_tiles`
    allows), 8-column groups that are all pass-through or all RoPE, R/2 % 8 == 0 (the RoPE tables' rows in shared
    memory; neox pairs in one thread); a bf16 query or a rowwise MXFP8 one (a columnwise MXFP8 query stays on the
    Triton kernel)."""
    if not isinstance(cfg, QProjConfig):
        return False
    D, P, R = cfg.q_head_dim, cfg.qk_head_dim, cfg.rope_dim
    k_ok = cfg.q_lora_rank % 128 == 0 if cfg.precision == "fp8_block" else cfg.q_lora_rank % 8 == 0
    out_ok = cfg.output_format == "bf16" or (cfg.output_format == "mxfp8" and not cfg.columnwise_output)
    return (cfg.precision in PRECISIONS and out_ok and k_ok and D % 8 == 0 and D <= 192 and P % 8 == 0
            and R % 16 == 0)


def operands(cfg: QProjConfig) -> str:
    """The kernel's operand kind for cfg's precision: "fp8_block" codes, or "bf16" images."""
    return "fp8_block" if cfg.precision == "fp8_block" else "bf16"


def key(cfg: QProjConfig, num_sms: int) -> str:
    """The name of the kernel for this config and SM count (a prebuilt file is `<key>.so`)."""
    query = "bf16" if cfg.output_format == "bf16" else f"mx{cfg.query_scale_mode}"
    return (f"rope_{operands(cfg)}_{query}_k{cfg.q_lora_rank}_h{cfg.num_heads}_d{cfg.q_head_dim}_p{cfg.qk_head_dim}_"
            f"r{cfg.rope_dim}_{cfg.rope_style}_sm{num_sms}")


def _enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1") not in ("0", "", "false", "off")


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _dsl_available() -> bool:
    try:
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libraries)
        return False
    return True


def _prebuilt_dir() -> Path | None:
    d = os.environ.get(ENV_KERNELS)
    return Path(d) if d else None


_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


def serves(cfg: QProjConfig, device: torch.device) -> bool:
    """The engine runs this config's forward on this device: sm_90, a supported geometry, a kernel to be had
    (prebuilt or the DSL to compile one), and not disabled (`MLA_QPROJ_CUTE=0`). It is the faster kernel wherever it
    runs (BENCHMARKS.md: every operand kind and query against the Triton kernel on the H200). Says once why not,
    where it matters."""
    if device.type != "cuda" or not _enabled():
        return False
    return _serves(_op.encoded(cfg), device.index if device.index is not None else torch.cuda.current_device(),
                   os.environ.get(ENV_KERNELS, ""))


_SERVES: dict[tuple, bool] = {}


@torch.compiler.assume_constant_result  # torch.compile takes its value: no file-system calls in a graph
def _serves(cfg: str, index: int, prebuilt: str) -> bool:
    """cfg: the encoded config (a constant string under torch.compile, which cannot rebuild a dataclass)."""
    got = _SERVES.get((cfg, index, prebuilt))
    if got is None:
        got = _SERVES[(cfg, index, prebuilt)] = _decide(QProjConfig.decode(cfg), index, prebuilt)
    return got


def _decide(cfg: QProjConfig, index: int, prebuilt: str) -> bool:
    if not supported(cfg) or torch.cuda.get_device_capability(index) != (9, 0):
        return False
    k = key(cfg, _num_sms(index))
    if prebuilt and (Path(prebuilt) / f"{k}.so").is_file():
        return True
    if _dsl_available():
        return True
    _say_once(f"mla_qproj: {cfg.precision} forward on the Triton kernel: the CuTe DSL engine is not installed (pip "
              "install 'mla_qproj[cute]') and no prebuilt kernel matches " + k)
    return False


@functools.cache
def _load_runtime(prebuilt: str | None) -> None:
    """Make the CuTe DSL runtime library visible to the kernels' shared objects (they link against it)."""
    for cand in ([Path(prebuilt) / RUNTIME_LIB] if prebuilt else []):
        if cand.is_file():
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            return
    from cutlass.cute.runtime import find_runtime_libraries

    for lib in find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


_KERNELS: dict[str, object] = {}


def _kernel(cfg: QProjConfig, num_sms: int):
    """The callable kernel (a tvm_ffi.Function) for cfg's geometry: the prebuilt one if present, else compiled now;
    kept for the process."""
    k = key(cfg, num_sms)
    fn = _KERNELS.get(k)
    if fn is None:
        d = _prebuilt_dir()
        if d is not None and (d / f"{k}.so").is_file():
            import tvm_ffi

            _load_runtime(str(d))
            fn = tvm_ffi.load_module(str(d / f"{k}.so"))[FUNCTION]
        else:
            fn = compile_kernel(cfg, num_sms)
        _KERNELS[k] = fn
    return fn


def compile_kernel(cfg: QProjConfig, num_sms: int, options: str = "", **schedule):
    """Compile the kernel for cfg (T symbolic) with the CuTe DSL, for sm_90a; no GPU needed. Returns the compiled
    function (callable with torch tensors, on the current stream; `.export_to_c` writes an object file). schedule:
    `RopeGemmSm90`'s other options (tile order, col_tile, ds_halves, swz_addr, ...), for tests and probes."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .rope_gemm_sm90 import RopeGemmSm90

    K, H, D = cfg.q_lora_rank, cfg.num_heads, cfg.q_head_dim
    N, RH, kb = H * D, cfg.rope_dim // 2, K // 128
    fp8, mx = cfg.precision == "fp8_block", cfg.output_format == "mxfp8"
    kern = RopeGemmSm90(K, H, D, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style, num_sms, operands=operands(cfg),
                        out=cfg.output_format, scale_mode=cfg.query_scale_mode, **schedule)
    T = cute.sym_int()
    op, f32 = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16, cutlass.Float32
    placeholder = make_fake_tensor(f32, (1, 1), (1, 1), assumed_align=16)
    args = (make_fake_tensor(op, (T, K), (K, 1), assumed_align=16),
            make_fake_tensor(op, (N, K), (K, 1), assumed_align=16),
            make_fake_tensor(f32, (kb, T), (T, 1), assumed_align=16) if fp8 else placeholder,
            make_fake_tensor(f32, (-(-N // 128), kb), (kb, 1), assumed_align=16) if fp8 else placeholder,
            make_fake_tensor(f32, (T, RH), (RH, 1), assumed_align=16),
            make_fake_tensor(f32, (T, RH), (RH, 1), assumed_align=16),
            make_fake_tensor(cutlass.BFloat16, (T, N // 2 if mx else N), (N // 2 if mx else N, 1), assumed_align=16),
            make_fake_tensor(cutlass.Uint8, (T, N // 32), (N // 32, 1)) if mx else
            make_fake_tensor(cutlass.Uint8, (1, 1), (1, 1)),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kern, *args, options=f"--gpu-arch sm_90a --enable-tvm-ffi {options}".strip())


def _table(t: torch.Tensor) -> torch.Tensor:
    """A pair table as the kernel reads it: fp32, contiguous [T, R/2] (a broadcast or strided view is copied)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


_PLACEHOLDERS: dict = {}


def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A [1, 1] tensor for an argument the kernel variant does not read."""
    t = _PLACEHOLDERS.get((device, dtype))
    if t is None:
        t = _PLACEHOLDERS[(device, dtype)] = torch.zeros(1, 1, dtype=dtype, device=device)
    return t


def rope_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor | None, w: torch.Tensor, ws: torch.Tensor | None,
              cos_h: torch.Tensor, sin_h: torch.Tensor, cfg: QProjConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query (SPEC §1.3-1.5 and §5): (bf16 [T, H, D], None), or the MXFP8 rowwise (codes [T, H, D], E8M0 bytes
    [T, H, D/32]).

    fp8_block: a float8_e4m3fn [T, K] contiguous, a_scale_inv float32 [K/128, T] contiguous (M-major), w
    float8_e4m3fn [N, K] contiguous, ws float32 [ceil(N/128), K/128] contiguous. mxfp8 / bf16: a and w bf16
    contiguous ([T, K], [N, K]), a_scale_inv and ws None. cos_h / sin_h: [T, R/2] pair tables. The caller (the
    recipe) has checked the config with `serves`."""
    T = a.shape[0]
    H, D = cfg.num_heads, cfg.q_head_dim
    mx = cfg.output_format == "mxfp8"
    if mx:
        codes = torch.empty((T, H * D), dtype=torch.float8_e4m3fn, device=a.device)
        scales = torch.empty((T, H * D // 32), dtype=torch.uint8, device=a.device)
        y, s = codes.view(torch.bfloat16), scales
    else:
        y = torch.empty((T, H * D), dtype=torch.bfloat16, device=a.device)
        s = None
    if T:
        fn = _kernel(cfg, _num_sms(a.device.index))
        if a_scale_inv is None:
            a_scale_inv = ws = _placeholder(a.device, torch.float32)
        fn(a, w, a_scale_inv, ws, _table(cos_h), _table(sin_h), y,
           s if mx else _placeholder(a.device, torch.uint8))
    if mx:
        return codes.view(T, H, D), scales.view(T, H, D // 32)
    return y.view(T, H, D), None


def _rope_gemm_list(a, a_scale_inv, w, ws, cos_h, sin_h, cfg: str) -> list[torch.Tensor]:
    """`rope_gemm` of the encoded config, as the op returns it: [q] or [codes, scale bytes]."""
    return [t for t in rope_gemm(a, a_scale_inv, w, ws, cos_h, sin_h, QProjConfig.decode(cfg)) if t is not None]


@torch.library.custom_op("mla_qproj::cute_rope_gemm", mutates_args=())
def _rope_gemm_def(a: torch.Tensor, a_scale_inv: torch.Tensor | None, w: torch.Tensor, ws: torch.Tensor | None,
                   cos_h: torch.Tensor, sin_h: torch.Tensor, cfg: str) -> list[torch.Tensor]:
    return _rope_gemm_list(a, a_scale_inv, w, ws, cos_h, sin_h, cfg)


@_rope_gemm_def.register_fake
def _(a, a_scale_inv, w, ws, cos_h, sin_h, cfg):
    c = QProjConfig.decode(cfg)
    T, H, D = a.shape[0], c.num_heads, c.q_head_dim
    if c.output_format == "mxfp8":
        return [a.new_empty((T, H, D), dtype=torch.float8_e4m3fn), a.new_empty((T, H, D // 32), dtype=torch.uint8)]
    return [a.new_empty((T, H, D), dtype=torch.bfloat16)]


# the recipes' entry point: the launcher in eager mode, the registered op while torch.compile traces; returns [q] or
# [codes, scale bytes]
rope_gemm_op = _op.eager_fast(_rope_gemm_def, _rope_gemm_list)
