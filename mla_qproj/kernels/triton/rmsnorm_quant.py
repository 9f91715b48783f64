"""RMSNorm forward fused with the GEMM-input quantization (SPEC §1.1-1.2): rsigma per token, then per [32 tokens,
BLOCK_K] tile xn = x * rsigma * g in fp32 -> the exact bf16 image of the rowwise MXFP8 xn (the forward GEMM's A
operand) and the columnwise MXFP8 xn (saved for wgrad). xn is never rounded to bf16 before quantization;
precision='bf16' writes xn rounded once to bf16 instead. Two launch forms (`RMSNormQuantConfig.SPLIT`): a small
rsigma kernel, then one tile per program; or one kernel whose programs compute rsigma themselves (x read twice, from
L2 the second time). Custom op `mla_qproj::rmsnorm_quant_fwd`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._config import QProjConfig
from ..._constants import MX_BLOCK
from .. import _op
from ._common import cdiv, mx_image, mx_quantize, to_bf16, widen


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
            b_img = mx_image(tl.reshape(b_xn, (32, NB, 32)), 2, SCALE_MODE, EMULATED, True)  # [32, NB, 32]
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


@dataclass(frozen=True)
class RMSNormQuantConfig:
    """Launch parameters of `rmsnorm_quant_fwd`; every config gives the same bytes. Upper-case fields are kernel
    constexprs, lower-case ones launch options.

    SPLIT: rsigma by `_rsigma_kernel` first (RS_ROWS tokens per program in [RS_ROWS, RS_BLOCK_K] steps,
    rs_num_warps), then one [32, BLOCK_K] tile per program; else one kernel, a program per 32 tokens reducing its
    rsigma and walking the whole row in [32, BLOCK_K] steps. num_warps: the quantize kernel's warps."""

    SPLIT: bool
    BLOCK_K: int
    num_warps: int
    RS_ROWS: int = 4
    RS_BLOCK_K: int = 512
    rs_num_warps: int = 4


SPLIT_MIN_T = 2048  # below this the call is host-bound: one launch


def _default_config(T: int, K: int) -> RMSNormQuantConfig:
    """From SPLIT_MIN_T tokens two launches with [32, 64] tiles and one warp (no serial loop in the quantize kernel);
    below it the one-kernel form, [32, 128] steps with 4 warps (figures: BENCHMARKS.md)."""
    block_k = 128 if K >= 128 else 64 if K >= 64 else 32
    if T >= SPLIT_MIN_T:
        return RMSNormQuantConfig(SPLIT=True, BLOCK_K=min(block_k, 64), num_warps=1)
    return RMSNormQuantConfig(SPLIT=False, BLOCK_K=block_k, num_warps=4)


_DEFAULT_CONFIGS: dict[tuple, RMSNormQuantConfig] = {}


def default_config(T: int, K: int, device: torch.device) -> RMSNormQuantConfig:
    """The config `rmsnorm_quant_fwd` uses for [T, K] on device (the same on every device; kept by (T bucket, K):
    building one costs microseconds of the launch's host time)."""
    key = (T >= SPLIT_MIN_T, K)
    config = _DEFAULT_CONFIGS.get(key)
    if config is None:
        config = _DEFAULT_CONFIGS[key] = _default_config(T, K)
    return config


def rmsnorm_quant_outputs(x2d: torch.Tensor, precision: str, columnwise: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of `rmsnorm_quant_fwd` (also the op's fake): rsigma fp32 [T], A bf16 [T, K], col data fp8 [T, K],
    col scale uint8 [ceil(T/32), K]; the columnwise pair is empty unless precision='mxfp8' and columnwise."""
    T, K = x2d.shape
    mx = precision == "mxfp8" and columnwise
    e = x2d.new_empty
    return (e((T,), dtype=torch.float32), e((T, K), dtype=torch.bfloat16),
            e((T, K) if mx else (0,), dtype=torch.float8_e4m3fn),
            e((cdiv(T, MX_BLOCK), K) if mx else (0,), dtype=torch.uint8))


def rmsnorm_quant_fwd(x2d: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, zero_centered_gamma: bool,
                      precision: str, scale_mode: str, columnwise: bool = True,
                      config: RMSNormQuantConfig | None = None) -> tuple[
                          torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2d [T, K] (unit inner stride) -> (rsigma [T] fp32, A [T, K] bf16, col_data [T, K] fp8,
    col_scale [ceil(T/32), K] uint8); the columnwise pair (what the backward saves) is empty for precision='bf16'
    or columnwise=False (inference: nothing is saved). config: `default_config` unless given. norm_weight None: no
    RMSNorm (SPEC §7): x itself is quantized, as xn = x · 1 · 1 through the same kernel (rsigma returned as ones)."""
    T, K = x2d.shape
    rsigma, a, cd, cs = rmsnorm_quant_outputs(x2d, precision, columnwise)
    if T == 0:
        return rsigma, a, cd, cs
    conf = default_config(T, K, x2d.device) if config is None else config
    mx = precision == "mxfp8" and columnwise
    split = conf.SPLIT
    emulated = _op.emulated(x2d.device)
    if norm_weight is None:  # rsigma and gamma are 1: the tiled form, which reads rsigma
        rsigma.fill_(1.0)
        norm_weight, zero_centered_gamma, split = torch.ones(K, device=x2d.device, dtype=x2d.dtype), False, True
    elif split:
        _rsigma_kernel[(cdiv(T, conf.RS_ROWS),)](x_ptr=x2d, stride_x=x2d.stride(0), rsigma_ptr=rsigma, T=T, eps=eps,
                                                 K=K, ROWS=conf.RS_ROWS, BLOCK_K=conf.RS_BLOCK_K, EMULATED=emulated,
                                                 num_warps=conf.rs_num_warps)
    chunk_k = conf.BLOCK_K if split else K  # columns per program: one tile, or the whole row
    _rmsnorm_quant_fwd_kernel[(cdiv(T, 32), cdiv(K, chunk_k))](
        x_ptr=x2d, stride_x=x2d.stride(0), w_ptr=norm_weight, rsigma_ptr=rsigma, a_ptr=a,
        col_data_ptr=cd if mx or split else cd.new_empty(1), col_scale_ptr=cs if mx or split else cs.new_empty(1),
        T=T, K=K, eps=eps, store_col=int(mx),
        ZERO_CENTERED=zero_centered_gamma, PRECISION=precision, SCALE_MODE=scale_mode, BLOCK_K=conf.BLOCK_K,
        CHUNK_K=chunk_k, EMULATED=emulated, RSIGMA_GIVEN=split,
        # the rsigma kernel's bits do not depend on the quantize kernel: its columnwise part can be compiled out;
        # the one-kernel form reduces rsigma itself, in an order its compiled layout decides: always compiled in
        COLWISE=mx or (not split and precision == "mxfp8"), num_warps=conf.num_warps,
    )
    return rsigma, a, cd, cs


# ------------------------------------------------------------------------------------------------ custom op


def _rmsnorm_quant_fwd_impl(x2d: torch.Tensor, norm_weight: torch.Tensor, cfg: str, columnwise: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rmsnorm_quant_fwd` with the layer's eps, gamma form, precision and scale mode from cfg
    (`QProjConfig.encode`)."""
    c = QProjConfig.decode(cfg)
    return rmsnorm_quant_fwd(x2d, norm_weight if c.norm else None, c.eps, c.zero_centered_gamma, c.precision,
                             c.scale_mode, columnwise)


def _rmsnorm_quant_fwd_fake(x2d, norm_weight, cfg, columnwise):
    return rmsnorm_quant_outputs(x2d, QProjConfig.decode(cfg).precision, columnwise)


rmsnorm_quant_fwd_op = _op.define_op("mla_qproj::rmsnorm_quant_fwd", _rmsnorm_quant_fwd_impl, _rmsnorm_quant_fwd_fake)
