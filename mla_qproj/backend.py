"""Backend choice and the two implementations of the layer's forward/backward (same signatures).

GEMM map (T tokens, K = q_lora_rank, N = num_heads * q_head_dim); every operand is the exact bf16 image of
its MXFP8 quantization (E4M3 * 2^k is exact in bf16), so a bf16 GEMM with fp32 accumulation computes the
MXFP8 product up to the fp32 summation order:
    forward  y   [T, N] = xn_q(rowwise, along K) @ W_q(rowwise, along K)^T
    dgrad    dxn [T, K] = dy_q(rowwise, along N) @ W_q(columnwise, along N)
    wgrad    dW  [N, K] = dy_q(columnwise, along T)^T @ xn_q(columnwise, along T)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ._config import QProjConfig, interpreter_enabled
from .reference import qproj as ref
from .reference.mxfp8 import dequantize_columnwise, dequantize_rowwise


def resolve_backend(backend: str, device: torch.device) -> bool:
    """True when the Triton kernels run: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    triton_ok = device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())
    if backend == "torch":
        return False
    if backend == "triton" and not triton_ok:
        raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (got device {device})")
    return triton_ok


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 accumulation and fp32 result (cuBLAS bf16 -> fp32 on CUDA)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _mm_accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in fp32 without a separate product buffer where cuBLAS allows it."""
    if a.is_cuda:
        try:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError):
            pass
    out.add_(_mm_fp32(a, b))


@dataclass
class PreparedWeight:
    """What the GEMMs consume of W, derived once per weight version: the forward operand (maybe rearranged
    for the fused kernel) and the dgrad operand (columnwise along N)."""

    key: tuple
    fwd: torch.Tensor | None  # [N, K] bf16 image; None when the fused kernel's `fused` replaces it
    bwd: torch.Tensor  # [N, K] bf16 image
    fused: torch.Tensor | None = None  # rearranged forward operand for the fused GEMM kernel


def prepare_weight(weight: torch.Tensor, cfg: QProjConfig, use_triton: bool, key: tuple) -> PreparedWeight:
    w = weight.detach()
    if not use_triton:
        return PreparedWeight(key, *ref.prepare_weight(w, cfg))
    if cfg.precision == "bf16":
        fwd = bwd = w.to(torch.bfloat16)
    else:
        from .ops import mxfp8_quantize_2d_op

        rd, rs, cd, cs = mxfp8_quantize_2d_op(w, True, True, cfg.scale_mode)
        fwd = dequantize_rowwise(rd, rs, torch.bfloat16)
        bwd = dequantize_columnwise(cd, cs, torch.bfloat16)
    fused = None
    gemm = _fused_gemm()
    # the fused kernel is built for sm_90 (TMA descriptors, wgmma-sized tiles); older GPUs take the general path
    hopper = (w.device.type == "cuda" and torch.cuda.get_device_capability(w.device)[0] >= 9) or w.device.type == "cpu"
    if gemm is not None and hopper and gemm.fused_gemm_supported(cfg):
        from .ops import prepare_fused_weight_op

        fused = prepare_fused_weight_op(fwd, cfg.num_heads, cfg.qk_head_dim, cfg.rope_dim, cfg.q_head_dim,
                                        cfg.rope_style, cfg.output_format)
        fwd = None  # only the rearranged copy is read: don't keep both (N*K*2 bytes)
    return PreparedWeight(key, fwd, bwd, fused)


def _fused_gemm():
    try:
        from .kernels import qproj_gemm
    except ImportError:  # pragma: no cover - the fused kernel is optional
        return None
    return qproj_gemm


# ------------------------------------------------------------------------------------------------ forward


def forward(x2d, norm_weight, pw: PreparedWeight, cos_h, sin_h, cfg: QProjConfig, use_triton: bool,
            save: bool = True):
    """Returns (outputs as reference.qproj.quantize_output, rsigma, xn_saved). save=False (inference): the Triton
    path skips xn's columnwise MXFP8 (xn_saved is then empty), which only the backward reads."""
    if not use_triton:
        return ref.qproj_fwd(x2d, norm_weight, pw.fwd, cos_h, sin_h, cfg)
    from .ops import rmsnorm_quant_fwd_op, rope_quant_op

    rsigma, a, xcd, xcs = rmsnorm_quant_fwd_op(x2d, norm_weight, cfg.eps, cfg.zero_centered_gamma, cfg.precision,
                                               cfg.scale_mode, save)
    xn_saved = (xcd, xcs) if cfg.precision == "mxfp8" else a
    T, H, D = x2d.shape[0], cfg.num_heads, cfg.q_head_dim
    if pw.fused is not None:
        from .ops import qproj_gemm_fwd_op

        outs = qproj_gemm_fwd_op(a, pw.fused, cos_h, sin_h, H, cfg.qk_head_dim, cfg.rope_dim, D, cfg.rope_style,
                                 cfg.output_format, cfg.columnwise_output, cfg.scale_mode)
    else:
        y = _mm_fp32(a, pw.fwd.t())
        outs = rope_quant_op(y, cos_h, sin_h, H, D, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style, False,
                             cfg.output_format, cfg.columnwise_output, cfg.scale_mode)
    return _query_outputs(*outs, T, cfg), rsigma, xn_saved


def _query_outputs(rd, rs, cd, cs, T: int, cfg: QProjConfig) -> tuple:
    """The ops' four outputs (absent ones empty) in `reference.qproj.quantize_output`'s form and shapes."""
    H, D = cfg.num_heads, cfg.q_head_dim
    if cfg.output_format == "bf16":
        return (rd.view(T, H, D),)
    cols = (cd.view(T, H, D), cs.view(-1, H, D)) if cfg.columnwise_output else (None, None)
    return (rd.view(T, H, D), rs.view(T, H, D // 32), *cols)


# ----------------------------------------------------------------------------------------------- backward


def _grad_operands_triton(dq2d, cos_h, sin_h, cfg: QProjConfig, num_heads: int):
    """Inverse RoPE + the dgrad (rowwise along N) and wgrad (columnwise along T) operands as bf16 images, for
    dq2d [T, num_heads * D] (a run of whole heads; any row stride)."""
    from .ops import mxfp8_quantize_2d_op, rope_quant_op

    args = (cos_h, sin_h, num_heads, cfg.q_head_dim, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style, True)
    if cfg.precision == "bf16":
        g = rope_quant_op(dq2d, *args, "bf16", False, cfg.scale_mode)[0]
        return g, g
    if cfg.q_head_dim % 32 == 0:  # the N-blocks stay inside a head: one fused pass
        row, _, col, _ = rope_quant_op(dq2d, *args, "mxfp8_images", True, cfg.scale_mode)
        return row, col
    # general geometry: N-blocks cross heads (partial last block): rotate, then quantize the [T, N] tensor
    g = rope_quant_op(dq2d, *args, "fp32", False, cfg.scale_mode)[0]
    _, _, cdt, cst = mxfp8_quantize_2d_op(g.t(), False, True, cfg.scale_mode)  # along N == columnwise of g^T
    _, _, cd, cs = mxfp8_quantize_2d_op(g, False, True, cfg.scale_mode)
    row = dequantize_columnwise(cdt, cst, torch.bfloat16).t()
    return row, dequantize_columnwise(cd, cs, torch.bfloat16)


# T * N at or above which the backward walks the heads in groups (2, then 4 past 4x this): the [T, N] gradient
# images of one group at a time, so the peak holds a fraction of them (T = 16384 at DeepSeek-V3: 2 groups).
GROUP_ELEMENTS = 1 << 28


def head_groups(T: int, cfg: QProjConfig) -> int:
    """How many head groups the Triton backward uses (1 when the rowwise N-blocks could cross a group edge)."""
    n = T * cfg.out_features
    groups = 4 if n >= 4 * GROUP_ELEMENTS else 2 if n >= GROUP_ELEMENTS else 1
    while groups > 1 and (cfg.num_heads % groups or (cfg.precision == "mxfp8" and cfg.q_head_dim % 32)):
        groups //= 2
    return groups


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32, contiguous) = a @ b with fp32 accumulation, written in place."""
    if a.is_cuda:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError):
            pass
    out.copy_(_mm_fp32(a, b))


@contextlib.contextmanager
def _fp32_reductions():
    """cuBLAS bf16-output GEMMs keep fp32 partial sums (split-K included): the only rounding is the final one to
    bf16, as if the fp32 product were cast (torch's default allows reduced-precision split-K reductions)."""
    m = torch.backends.cuda.matmul
    old = m.allow_bf16_reduced_precision_reduction
    if not old:
        yield
        return
    try:
        old_split_k = m.allow_bf16_reduced_precision_reduction_split_k
    except AttributeError:  # older torch: one flag
        old_split_k = None
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = old if old_split_k is None else (old, old_split_k)


# bf16 weights: dW written in bf16 by cuBLAS (False: an fp32 product, then a cast; the benchmark knob)
DW_BF16_DIRECT = True


def _mm_into_dtype(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (contiguous rows, any float dtype) = a @ b with fp32 accumulation and one final rounding to out's dtype.
    bf16 on CUDA: cuBLAS writes bf16 directly (saves the fp32 [N, K] buffer and a cast pass); under torch.compile
    the fp32 product is cast (the reduction flag is a Python-side global the compiled graph would not keep)."""
    if out.dtype == torch.float32:
        _mm_into(out, a, b)
    elif (DW_BF16_DIRECT and a.is_cuda and out.dtype == torch.bfloat16 and a.dtype == torch.bfloat16
          and not torch.compiler.is_compiling()):
        with _fp32_reductions():
            torch.mm(a, b, out=out)
    else:
        out.copy_(_mm_fp32(a, b))


def backward(dq2d, x2d, rsigma, xn_saved, norm_weight, pw: PreparedWeight, cos_h, sin_h, cfg: QProjConfig,
             use_triton: bool, main_grad: torch.Tensor | None = None, dw_dtype: torch.dtype = torch.float32):
    """Returns (dx, dnorm_weight, dW in dw_dtype (rounded once from the fp32 sum), or None when accumulated into
    main_grad).

    Triton path, per head group g (columns C_g of N): dy_row, dy_col = inverse RoPE + quantize(dq[:, C_g]);
    dxn += dy_row @ W_bwd[C_g] (fp32); dW[C_g] = dy_col^T @ xn (or main_grad[C_g] += ...). With one group this is
    the plain two-GEMM backward; more groups change only the fp32 summation order of dxn."""
    if not use_triton:
        dx, dg, dw = ref.qproj_bwd(dq2d, x2d, rsigma, xn_saved, norm_weight, pw.bwd, cos_h, sin_h, cfg)
        if main_grad is not None:
            main_grad.add_(dw)
            dw = None
        return dx, dg, dw if dw is None else dw.to(dw_dtype)
    from .ops import dequantize_columnwise_bf16_op, rmsnorm_bwd_op

    T, N = dq2d.shape
    groups = head_groups(T, cfg)
    ng = N // groups
    xn_img = dequantize_columnwise_bf16_op(*xn_saved) if cfg.precision == "mxfp8" else xn_saved
    dw = None
    dxn = None
    for g in range(groups):
        cols = slice(g * ng, (g + 1) * ng)
        dy_row, dy_col = _grad_operands_triton(dq2d[:, cols], cos_h, sin_h, cfg, cfg.num_heads // groups)
        if dxn is None:
            dxn = _mm_fp32(dy_row, pw.bwd[cols])
        else:
            _mm_accumulate(dxn, dy_row, pw.bwd[cols])
        del dy_row  # [T, N / groups]: free it before the wgrad (lower peak memory)
        if main_grad is not None:
            _mm_accumulate(main_grad[cols], dy_col.t(), xn_img)
        else:
            if dw is None:  # allocated once dy_row is freed: not part of the peak
                dw = torch.empty(N, cfg.q_lora_rank, dtype=dw_dtype, device=dq2d.device)
            _mm_into_dtype(dw[cols], dy_col.t(), xn_img)
        del dy_col
    dx, dg = rmsnorm_bwd_op(dxn, x2d, rsigma, norm_weight, cfg.zero_centered_gamma)
    return dx, dg, dw
