"""Standalone block-scaled FP8 quantize kernel (SPEC §5) behind `fp8_block_quantize`: one read of a 2-D [M, N] view
(any strides; fp32 / bf16 / fp16) gives the E4M3 codes [M, N] and the fp32 scale_inv [ceil(M/bm), ceil(N/bn)] of
one block shape (bm, bn) in (1, 128), (128, 1), (128, 128). Bytes equal `reference.fp8_block.quantize_blocks`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._config import check_block_shape
from ..._constants import FP8_BLOCK
from .. import _op
from . import _fp8_block
from ._common import amax, cdiv
from ._fp8_block import (
    block_amax,
    check_block_scale,
    check_float_tensor,
    fp8_block_scale,
    nan_sign,
    quantize_with_scale,
    widen,
)


@triton.jit
def _fp8_block_quant_kernel(
    x_ptr, stride_m, stride_n, data_ptr, sinv_ptr,
    M, N, NB_N,
    BM: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SCALE: tl.constexpr, EMULATED: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile holding whole (bm, bn) blocks: amax per block (NaN-ignoring; elements outside the
    tensor load as NaN, so a partial block's amax is over the elements that exist), scale, codes."""
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    m = m_m[:, None] & m_n[None, :]
    b_raw = tl.load(x_ptr + o_m[:, None] * stride_m + o_n[None, :] * stride_n, mask=m, other=float("nan"))
    b_x = widen(b_raw, EMULATED)  # [BLOCK_M, BLOCK_N]
    b_sign = nan_sign(b_raw)  # the input's NaN signs are kept (SPEC §2 element rules)
    if BM == 1:
        tl.static_assert(BN == BLOCK_N)  # 1x128 along N: one block per row of the tile
        b_scale, b_sinv = fp8_block_scale(amax(b_x, 1, EMULATED), BLOCK_SCALE)  # [BLOCK_M]
        b_q = quantize_with_scale(b_x, b_scale[:, None], b_sign, EMULATED, True, BLOCK_SCALE)
        tl.store(sinv_ptr + o_m * NB_N + i_n, b_sinv, mask=m_m)
    elif BN == 1:
        tl.static_assert(BM == BLOCK_M)  # 128x1 along M: one block per column of the tile
        b_scale, b_sinv = fp8_block_scale(amax(b_x, 0, EMULATED), BLOCK_SCALE)  # [BLOCK_N]
        b_q = quantize_with_scale(b_x, b_scale[None, :], b_sign, EMULATED, True, BLOCK_SCALE)
        tl.store(sinv_ptr + i_m * N + o_n, b_sinv, mask=m_n)
    else:
        tl.static_assert((BM == BLOCK_M) & (BN == BLOCK_N))  # the tile is one 128x128 block
        b_scale, b_sinv = fp8_block_scale(block_amax(b_x, EMULATED), BLOCK_SCALE)  # scalar
        b_q = quantize_with_scale(b_x, b_scale, b_sign, EMULATED, True, BLOCK_SCALE)
        tl.store(sinv_ptr + i_m * NB_N + i_n, b_sinv)
    tl.store(data_ptr + o_m[:, None] * N + o_n[None, :], b_q, mask=m)  # codes as uint8 (a view of the fp8 output)


@dataclass(frozen=True)
class Fp8BlockQuantConfig:
    """Launch parameters: the tile [block_m, block_n] (whole blocks) and warps."""

    block_m: int
    block_n: int
    num_warps: int


def default_config(block_shape: tuple[int, int], device: torch.device) -> Fp8BlockQuantConfig:
    """[128, 128] tiles (64 fp32 values per thread with 8 warps) for the 128-row block shapes; 1x128 blocks are
    independent rows, so [64, 128] tiles with 4 warps."""
    if block_shape == (1, FP8_BLOCK):
        return Fp8BlockQuantConfig(64, FP8_BLOCK, 4)
    return Fp8BlockQuantConfig(FP8_BLOCK, FP8_BLOCK, 8)


def fp8_block_quant_outputs(x2d: torch.Tensor, block_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's outputs (shared by the launcher and the fake): codes fp8 [M, N], scale_inv fp32 [ceil(M/bm),
    ceil(N/bn)], both contiguous."""
    M, N = x2d.shape
    bm, bn = block_shape
    return (x2d.new_empty((M, N), dtype=torch.float8_e4m3fn),
            x2d.new_empty((cdiv(M, bm), cdiv(N, bn)), dtype=torch.float32))


def fp8_block_quantize_2d(x2d: torch.Tensor, block_shape=(1, FP8_BLOCK), block_scale: str = "pow2",
                          config: Fp8BlockQuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x2d [M, N] (any strides; fp32 / bf16 / fp16) in blocks of block_shape. Returns (data
    float8_e4m3fn [M, N], scale_inv fp32 [ceil(M/bm), ceil(N/bn)])."""
    check_float_tensor("x2d", x2d)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D, got shape {tuple(x2d.shape)}")
    bs = check_block_shape(block_shape)
    check_block_scale(block_scale)
    data, sinv = fp8_block_quant_outputs(x2d, bs)
    M, N = x2d.shape
    if M == 0 or N == 0:
        return data, sinv
    cfg = config or default_config(bs, x2d.device)
    bm, bn = bs
    if (bn != 1 and cfg.block_n != bn) or (bm != 1 and cfg.block_m != bm):
        raise ValueError(f"config tile [{cfg.block_m}, {cfg.block_n}] must hold whole {bs} blocks along the blocked "
                         f"dimensions")
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
    _fp8_block_quant_kernel[grid](
        x_ptr=x2d, stride_m=x2d.stride(0), stride_n=x2d.stride(1), data_ptr=data.view(torch.uint8), sinv_ptr=sinv,
        M=M, N=N, NB_N=cdiv(N, bn), BM=bm, BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_SCALE=_fp8_block.block_scale_code(block_scale), EMULATED=_op.emulated(x2d.device),
        num_warps=cfg.num_warps,
    )
    return data, sinv


# ------------------------------------------------------------------------------------------------ custom op


def _fp8_block_quantize_impl(x2d: torch.Tensor, block_rows: int, block_cols: int,
                             block_scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_block_quantize_2d` on the op's arguments (traceable by torch.compile; no host syncs)."""
    return fp8_block_quantize_2d(x2d, (block_rows, block_cols), block_scale)


def _fp8_block_quantize_fake(x2d, block_rows, block_cols, block_scale):
    return fp8_block_quant_outputs(x2d, (block_rows, block_cols))


fp8_block_quantize_op = _op.define_op("mla_qproj::fp8_block_quantize", _fp8_block_quantize_impl,
                                      _fp8_block_quantize_fake)
