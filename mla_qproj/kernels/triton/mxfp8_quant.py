"""Standalone MXFP8 quantize kernel behind `mxfp8_quantize` (SPEC §2): one read of a [T, N] view gives the
rowwise (32-blocks along N) and/or columnwise (32-blocks along T, last block partial) encodings; and the bf16 image
of a columnwise MXFP8 tensor (the wgrad operand of the saved xn). Custom ops `mla_qproj::mxfp8_quantize_2d`,
`mla_qproj::dequantize_columnwise_bf16`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._constants import MX_BLOCK
from .. import _op
from ._common import cdiv, e8m0_to_fp32, mx_quantize, widen
from ._fp8_block import nan_sign

Tensor = torch.Tensor


@triton.jit
def _mxfp8_quant_kernel(
    x_ptr, stride_xt, stride_xn,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    T, N,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATED: tl.constexpr,
):
    """One [32, BLOCK_N] tile: amax per 32-block (NaN-ignoring), E8M0 byte, elements rounded onto E4M3."""
    i_t, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * 32 + tl.arange(0, 32)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_t, m_n = o_t < T, o_n < N
    m = m_t[:, None] & m_n[None, :]
    # rows/cols outside the tensor load as NaN: the amax ignores them (partial columnwise block)
    b_raw = tl.load(x_ptr + o_t[:, None] * stride_xt + o_n[None, :] * stride_xn, mask=m, other=float("nan"))
    b_x = widen(b_raw, EMULATED)  # [32, BLOCK_N]
    if b_raw.dtype == tl.float16:  # the GPU's fp16 -> fp32 conversion makes NaN +NaN: its sign from the raw bits
        b_nan = ((nan_sign(b_raw) << 24) | 0x7FC00000).to(tl.float32, bitcast=True)
        b_x = tl.where(b_x == b_x, b_x, b_nan)
    if ROWWISE:
        NB: tl.constexpr = BLOCK_N // 32
        b_q, b_byte = mx_quantize(tl.reshape(b_x, (32, NB, 32)), 2, SCALE_MODE, EMULATED, True)  # b_byte [32, NB]
        b_q = tl.reshape(b_q, (32, BLOCK_N))
        tl.store(row_data_ptr + o_t[:, None] * N + o_n[None, :], b_q, mask=m)
        o_b = i_n * NB + tl.arange(0, NB)
        m_b = m_t[:, None] & (o_b < N // 32)[None, :]
        tl.store(row_scale_ptr + o_t[:, None] * (N // 32) + o_b[None, :], b_byte.to(tl.uint8), mask=m_b)
    if COLUMNWISE:
        b_q, b_byte = mx_quantize(b_x, 0, SCALE_MODE, EMULATED, True)  # b_byte [BLOCK_N]
        tl.store(col_data_ptr + o_t[:, None] * N + o_n[None, :], b_q, mask=m)
        tl.store(col_scale_ptr + i_t * N + o_n, b_byte.to(tl.uint8), mask=m_n)


def mxfp8_quant_outputs(x2d: Tensor, rowwise: bool, columnwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The outputs of `mxfp8_quant_2d` (also the op's fake): row data fp8 [T, N], row scale uint8 [T, N/32], col data
    fp8 [T, N], col scale uint8 [ceil(T/32), N]; an absent orientation's pair is empty."""
    T, N = x2d.shape
    e, f8, u8 = x2d.new_empty, torch.float8_e4m3fn, torch.uint8
    return (e((T, N) if rowwise else (0,), dtype=f8), e((T, N // MX_BLOCK) if rowwise else (0,), dtype=u8),
            e((T, N) if columnwise else (0,), dtype=f8), e((cdiv(T, MX_BLOCK), N) if columnwise else (0,), dtype=u8))


def mxfp8_quant_2d(x2d: Tensor, rowwise: bool, columnwise: bool, scale_mode: str) -> tuple[
        Tensor, Tensor, Tensor, Tensor]:
    """Quantize a 2-D view [T, N] (any strides). Returns (row_data, row_scale, col_data, col_scale); absent
    orientations are empty tensors. Rowwise needs N % 32 == 0 (checked by the caller)."""
    T, N = x2d.shape
    rd, rs, cd, cs = mxfp8_quant_outputs(x2d, rowwise, columnwise)
    if T == 0 or N == 0:
        return rd, rs, cd, cs
    BLOCK_N = 128 if N >= 128 else 64 if N >= 64 else 32

    def grid(meta):
        return (cdiv(T, MX_BLOCK), cdiv(N, meta["BLOCK_N"]))

    _mxfp8_quant_kernel[grid](
        x_ptr=x2d, stride_xt=x2d.stride(0), stride_xn=x2d.stride(1),
        row_data_ptr=rd, row_scale_ptr=rs, col_data_ptr=cd, col_scale_ptr=cs,
        T=T, N=N, ROWWISE=rowwise, COLUMNWISE=columnwise, SCALE_MODE=scale_mode, BLOCK_N=BLOCK_N,
        EMULATED=_op.emulated(x2d.device), num_warps=4,
    )
    return rd, rs, cd, cs


@triton.jit
def _dequant_colwise_kernel(data_ptr, scale_ptr, out_ptr, T, N, BLOCK_N: tl.constexpr):
    """bf16 image of a columnwise MXFP8 [T, N]: one [32, BLOCK_N] tile (one scale row) per program."""
    i_t, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * 32 + tl.arange(0, 32)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    m = (o_t < T)[:, None] & m_n[None, :]
    b_q = tl.load(data_ptr + o_t[:, None] * N + o_n[None, :], mask=m, other=0.0)
    b_byte = tl.load(scale_ptr + i_t * N + o_n, mask=m_n, other=127).to(tl.int32)
    # 2^(byte - 127), NaN for byte 0xFF (SPEC §2); byte 0 decodes to the subnormal 2^-127
    b_s = tl.where(b_byte == 0xFF, float("nan"), e8m0_to_fp32(b_byte))
    b_v = b_q.to(tl.float32) * b_s[None, :]
    # the interpreter decodes the E4M3 NaN code as 480: keep NaN a NaN (with its sign) explicitly
    b_code = b_q.to(tl.uint8, bitcast=True)
    b_v = tl.where((b_code & 0x7F) == 0x7F, tl.where(b_code >= 0x80, -float("nan"), float("nan")), b_v)
    tl.store(out_ptr + o_t[:, None] * N + o_n[None, :], b_v.to(tl.bfloat16), mask=m)


def dequantize_columnwise_outputs(data: Tensor) -> Tensor:
    """The output of `dequantize_columnwise_bf16` (also the op's fake): bf16 [T, N], contiguous."""
    return data.new_empty(tuple(data.shape), dtype=torch.bfloat16)


def dequantize_columnwise_bf16(data: Tensor, scale: Tensor) -> Tensor:
    """data fp8 [T, N] contiguous, scale uint8 [ceil(T/32), N] -> the exact bf16 image [T, N] (one pass)."""
    T, N = data.shape
    out = dequantize_columnwise_outputs(data)
    if T and N:
        BLOCK_N = 128 if N >= 128 else 64 if N >= 64 else 32
        _dequant_colwise_kernel[(cdiv(T, MX_BLOCK), cdiv(N, BLOCK_N))](
            data_ptr=data, scale_ptr=scale, out_ptr=out, T=T, N=N, BLOCK_N=BLOCK_N, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------ custom ops


def _mxfp8_quantize_2d_fake(x2d, rowwise, columnwise, scale_mode):
    return mxfp8_quant_outputs(x2d, rowwise, columnwise)


mxfp8_quantize_2d_op = _op.define_op("mla_qproj::mxfp8_quantize_2d", mxfp8_quant_2d, _mxfp8_quantize_2d_fake)


def _dequantize_columnwise_bf16_fake(data, scale):
    return dequantize_columnwise_outputs(data)


dequantize_columnwise_bf16_op = _op.define_op("mla_qproj::dequantize_columnwise_bf16", dequantize_columnwise_bf16,
                                              _dequantize_columnwise_bf16_fake)
