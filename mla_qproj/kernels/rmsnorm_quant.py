"""RMSNorm forward fused with the GEMM-input quantization (SPEC §1.1-1.2): rsigma per token, then per [32 tokens,
BLOCK_K] tile xn = x * rsigma * g in fp32 -> the exact bf16 image of the rowwise MXFP8 xn (the forward GEMM's A
operand) and the columnwise MXFP8 xn (saved for wgrad). xn is never rounded to bf16 before quantization;
precision='bf16' writes xn rounded once to bf16 instead. Default launch (SPLIT): a small rsigma kernel, then one
tile per program; SPLIT=False computes rsigma inside each program (x read twice, from L2 the second time)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._config import interpreter_enabled
from .._constants import MX_BLOCK
from ._common import cdiv, dequantize_e4m3, mx_quantize, to_bf16, widen


@triton.jit(do_not_specialize=["store_col"])  # one compiled kernel for 0 and 1 (Triton specializes ints == 1)
def _rmsnorm_quant_fwd_kernel(
    x_ptr, stride_x, w_ptr, rsigma_ptr, a_ptr, col_data_ptr, col_scale_ptr,
    T, eps, store_col, K: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, PRECISION: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr, EMULATED: tl.constexpr, RSIGMA_GIVEN: tl.constexpr, COLWISE: tl.constexpr,
):
    """Program (32 tokens, column chunk): rsigma = 1/sqrt(mean(x^2) + eps) over the whole row (every chunk's
    program computes it the same way; chunk 0 stores it), then for the chunk's columns xn = x * rsigma * g (fp32)
    -> A = dequant(quant_row(xn)) as bf16 and (COLWISE: saved for backward) the columnwise MXFP8 of xn, stored
    when store_col != 0 (a runtime flag: the one-kernel form computes it either way, so that its rsigma reduction is
    compiled, and rounded, the same with and without it)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_t = i_t * 32 + tl.arange(0, 32)
    m_t = o_t < T
    if RSIGMA_GIVEN:  # computed by _rsigma_kernel
        b_rsigma = tl.load(rsigma_ptr + o_t, mask=m_t, other=1.0)
    else:
        b_ss = tl.zeros([32, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_x = widen(tl.load(x_ptr + o_t[:, None] * stride_x + o_k[None, :], mask=m, other=0.0), EMULATED)
            b_ss += b_x * b_x
        # correctly rounded sqrt and division (tl.rsqrt is approximate on the GPU)
        b_rsigma = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(b_ss, axis=1), K) + eps))  # [32]
        tl.store(rsigma_ptr + o_t, b_rsigma, mask=m_t)  # one program per row block
    NB: tl.constexpr = BLOCK_K // 32
    for kk in range(0, CHUNK_K, BLOCK_K):  # constexpr bounds (the interpreter's range takes no tensors)
        o_k = i_c * CHUNK_K + kk + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        m = m_t[:, None] & m_k[None, :]
        # rows past T load as NaN so the columnwise amax ignores them (partial last block)
        b_x = widen(tl.load(x_ptr + o_t[:, None] * stride_x + o_k[None, :], mask=m, other=float("nan")), EMULATED)
        b_g = widen(tl.load(w_ptr + o_k, mask=m_k, other=0.0), EMULATED)
        if ZERO_CENTERED:
            b_g = b_g + 1.0
        b_xn = b_x * b_rsigma[:, None] * b_g[None, :]  # [32, BLOCK_K], same op order as the reference
        p_a = a_ptr + o_t[:, None] * K + o_k[None, :]
        if PRECISION == "mxfp8":
            b_xr = tl.reshape(b_xn, (32, NB, 32))
            b_q, b_byte = mx_quantize(b_xr, 2, SCALE_MODE, EMULATED, True)  # b_byte [32, NB]
            b_img = dequantize_e4m3(b_q, b_byte[:, :, None], b_xr, EMULATED)
            tl.store(p_a, tl.reshape(b_img, (32, BLOCK_K)).to(tl.bfloat16), mask=m)  # exact image
            if COLWISE:
                b_cq, b_cbyte = mx_quantize(b_xn, 0, SCALE_MODE, EMULATED, True)  # b_cbyte [BLOCK_K]
                # store_col != 0 as a boolean made by a select (compiled, it folds to the comparison): Triton 3.9's
                # interpreter gives a comparison's result its operands' integer dtype, so the bare comparison
                # broadcast into the masks below made integer masks, which its stores reject
                f_col = tl.where(store_col != 0, True, False)
                tl.store(col_data_ptr + o_t[:, None] * K + o_k[None, :], b_cq, mask=m & f_col)
                tl.store(col_scale_ptr + i_t * K + o_k, b_cbyte.to(tl.uint8), mask=m_k & f_col)
        else:
            tl.static_assert(PRECISION == "bf16")
            tl.store(p_a, to_bf16(b_xn, EMULATED), mask=m)


@triton.jit
def _rsigma_kernel(x_ptr, stride_x, rsigma_ptr, T, eps, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                   EMULATED: tl.constexpr):
    """rsigma = 1/sqrt(mean(x^2) + eps) for ROWS tokens per program (the SPLIT launch's first kernel)."""
    o_t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_t = o_t < T
    b_ss = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_x = widen(tl.load(x_ptr + o_t[:, None] * stride_x + o_k[None, :], mask=m, other=0.0), EMULATED)
        b_ss += b_x * b_x
    b_rsigma = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(b_ss, axis=1), K) + eps))
    tl.store(rsigma_ptr + o_t, b_rsigma, mask=m_t)


def _launch_conf(T: int, K: int, device: torch.device, **knobs) -> dict:
    """Launch knobs (defaults measured on an H200, see BENCHMARKS.md); knobs override (benchmarks, tests)."""
    block_k = 128 if K >= 128 else 64 if K >= 64 else 32
    # SPLIT: rsigma by its own kernel (ROWS tokens per program), then one [32, BLOCK_K] tile per program: no serial
    # loops in the quantize kernel. H200, 2026-11-30, GPU time (CUDA-graph replays, scripts/kernel_sweep.py): one
    # program per 32 tokens 0.037 / 0.089 ms at T = 4096 / 16384; two launches with [32, 64] tiles and one warp
    # 0.019 / 0.063 ms ([32, 128], 2 warps: 0.023 / 0.079). Below 2048 tokens the call is host-bound: one launch.
    split = T >= 2048
    conf = dict(BLOCK_K=min(block_k, 64) if split else block_k, num_warps=1 if split else 4, SPLIT=split, ROWS=4,
                RS_BLOCK_K=512, RS_WARPS=4, EMULATED=interpreter_enabled() or device.type != "cuda")
    conf.update(knobs)
    conf["CHUNK_K"] = conf["BLOCK_K"] if conf["SPLIT"] else K  # columns per program: one tile, or the whole row
    return conf


def rmsnorm_quant_fwd(x2d: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centered_gamma: bool,
                      precision: str, scale_mode: str, columnwise: bool = True, **knobs):
    """x2d [T, K] (unit inner stride) -> (rsigma [T] fp32, A [T, K] bf16, col_data [T, K] fp8,
    col_scale [ceil(T/32), K] uint8); the columnwise pair (what the backward saves) is empty for precision='bf16'
    or columnwise=False (inference: nothing is saved)."""
    T, K = x2d.shape
    dev = x2d.device
    mx = precision == "mxfp8" and columnwise
    rsigma = torch.empty(T, dtype=torch.float32, device=dev)
    a = torch.empty((T, K), dtype=torch.bfloat16, device=dev)
    cd = torch.empty((T, K) if mx else (0,), dtype=torch.float8_e4m3fn, device=dev)
    cs = torch.empty((cdiv(T, MX_BLOCK), K) if mx else (0,), dtype=torch.uint8, device=dev)
    if T == 0:
        return rsigma, a, cd, cs
    conf = _launch_conf(T, K, x2d.device, **knobs)
    split, rows, rs_block_k, rs_warps = (conf.pop(k) for k in ("SPLIT", "ROWS", "RS_BLOCK_K", "RS_WARPS"))
    if split:
        _rsigma_kernel[(cdiv(T, rows),)](x_ptr=x2d, stride_x=x2d.stride(0), rsigma_ptr=rsigma, T=T, eps=eps, K=K,
                                         ROWS=rows, BLOCK_K=rs_block_k, EMULATED=conf["EMULATED"],
                                         num_warps=rs_warps)
    _rmsnorm_quant_fwd_kernel[(cdiv(T, 32), cdiv(K, conf["CHUNK_K"]))](
        x_ptr=x2d, stride_x=x2d.stride(0), w_ptr=norm_weight, rsigma_ptr=rsigma, a_ptr=a,
        col_data_ptr=cd if mx or split else cd.new_empty(1), col_scale_ptr=cs if mx or split else cs.new_empty(1),
        T=T, K=K, eps=eps, store_col=int(mx),
        ZERO_CENTERED=zero_centered_gamma, PRECISION=precision, SCALE_MODE=scale_mode, RSIGMA_GIVEN=split,
        # the rsigma kernel's bits do not depend on the quantize kernel: its columnwise part can be compiled out;
        # the one-kernel form reduces rsigma itself, in an order its compiled layout decides: always compiled in
        COLWISE=mx or (not split and precision == "mxfp8"), **conf,
    )
    return rsigma, a, cd, cs
