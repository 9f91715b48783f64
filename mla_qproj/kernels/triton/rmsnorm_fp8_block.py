"""RMSNorm forward fused with the block-scaled FP8 quantization of xn (SPEC §5): one pass over x [T, K] after the
rsigma kernel. Per tile of 128 tokens x BLOCK_K columns, xn = x * rsigma * g in fp32 (never rounded to bf16) gives
(a) the forward GEMM's A operand: 1x128 blocks along K, codes [T, K] and scale_inv stored M-major [K/128, T] (the
    layout cuBLAS's blockwise scaled_mm and the Triton GEMM read: element [kb, t] scales token t's K-block kb);
(b) when asked (training: the backward saves it for wgrad), 128x1 blocks along T: codes stored transposed
    [K, T_pad] (T_pad = round_up(T, 16), zero codes in the padding; cuBLAS's wgrad operand layout) and scale_inv
    [ceil(T/128), K].
rsigma is `_rsigma_kernel`'s (kernels/rmsnorm_quant.py) with the same launch as rmsnorm_quant's split form, so it has
the bits of the MXFP8 path's RMSNorm; xn's op order is that of `reference.qproj.rmsnorm_fwd`. Bytes equal
`reference.fp8_block.quantize_blocks(canonical_nan(xn), ...)` for the kernel's rsigma. Two quantize kernels give
those bytes: `_rmsnorm_fp8_block_kernel` (byte-wise transposition) and `_rmsnorm_fp8_block_packed_kernel` (codes as
32-bit words; the default with the columnwise form)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._config import QProjConfig, interpreter_enabled
from ..._constants import FP8_BLOCK
from .. import _op
from . import _fp8_block
from ._common import amax, cap_on_releases, cdiv, register_cap
from ._fp8_block import (
    encode_operand,
    fp8_block_scale,
    pack_e4m3_words,
    quantize_with_scale,
    runs_of,
    widen,
    widen_lean,
)
from .rmsnorm_quant import _rsigma_kernel


@triton.jit
def _rmsnorm_fp8_block_kernel(
    x_ptr, stride_x, w_ptr, rsigma_ptr, row_data_ptr, row_sinv_ptr, col_data_ptr, col_sinv_ptr,
    T, T_pad,
    K: tl.constexpr, BLOCK_K: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    COLUMNWISE: tl.constexpr, TOKENS_ON_AXIS0: tl.constexpr, EMULATED: tl.constexpr, REVERSE_T: tl.constexpr,
):
    """Program (128 tokens, BLOCK_K columns): xn = x * rsigma * g -> 1x128 codes + M-major scale_inv, and
    (COLUMNWISE) 128x1 codes stored transposed + their scale_inv. NaN in xn is made +NaN (code 0x7F; see
    reference/fp8_block.py: the sign of a computed NaN is platform-defined)."""
    # column tiles on axis 0 by default: programs side by side cover whole rows of x
    i_t = tl.program_id(0 if TOKENS_ON_AXIS0 else 1).to(tl.int64)
    if REVERSE_T:  # the last token tiles first: those the rsigma kernel read last, likeliest still in L2
        i_t = tl.num_programs(0 if TOKENS_ON_AXIS0 else 1).to(tl.int64) - 1 - i_t
    i_k = tl.program_id(1 if TOKENS_ON_AXIS0 else 0).to(tl.int64)
    o_t = i_t * 128 + tl.arange(0, 128)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)  # K % BLOCK_K == 0: no column mask
    m_t = o_t < T
    b_rs = tl.load(rsigma_ptr + o_t, mask=m_t, other=1.0)  # [128]
    # rows past T load as NaN: ignored by the 128x1 amax, never stored
    b_x = widen(tl.load(x_ptr + o_t[:, None] * stride_x + o_k[None, :], mask=m_t[:, None],
                                other=float("nan")), EMULATED)  # [128, BLOCK_K]
    b_g = widen(tl.load(w_ptr + o_k), EMULATED)  # [BLOCK_K]
    if ZERO_CENTERED:
        b_g = b_g + 1.0
    b_xn = b_x * b_rs[:, None] * b_g[None, :]  # the reference's op order
    # (a) 1x128 along K: NB blocks per row of the tile
    NB: tl.constexpr = BLOCK_K // 128
    b_x3 = tl.reshape(b_xn, (128, NB, 128))
    b_scale, b_sinv = fp8_block_scale(amax(b_x3, 2, EMULATED), BLOCK_SCALE)  # [128, NB]
    b_q = tl.reshape(quantize_with_scale(b_x3, b_scale[:, :, None], 0, EMULATED, False, BLOCK_SCALE),
                     (128, BLOCK_K))
    tl.store(row_data_ptr + o_t[:, None] * K + o_k[None, :], b_q, mask=m_t[:, None])
    o_b = i_k * NB + tl.arange(0, NB)
    tl.store(row_sinv_ptr + o_b[None, :] * T + o_t[:, None], b_sinv, mask=m_t[:, None])  # M-major [K/128, T]
    if COLUMNWISE:
        # (b) 128x1 along T: the tile's 128 rows are one block per column
        b_cscale, b_csinv = fp8_block_scale(amax(b_xn, 0, EMULATED), BLOCK_SCALE)  # [BLOCK_K]
        b_cq = quantize_with_scale(b_xn, b_cscale[None, :], 0, EMULATED, False, BLOCK_SCALE)
        b_cq = tl.where(m_t[:, None], b_cq, 0).to(tl.uint8)  # zero codes in the padding [T, T_pad)
        # transposed [K, T_pad]: tokens contiguous in memory
        tl.store(col_data_ptr + o_k[:, None] * T_pad + o_t[None, :], tl.trans(b_cq), mask=(o_t < T_pad)[None, :])
        tl.store(col_sinv_ptr + i_t * K + o_k, b_csinv)


@triton.jit
def _rmsnorm_fp8_block_packed_kernel(
    x_ptr, stride_x, w_ptr, rsigma_ptr, row_w_ptr, row_sinv_ptr, col_w_ptr, col_sinv_ptr,
    T, T_pad,
    K: tl.constexpr, BLOCK_K: tl.constexpr, TJ: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    COLUMNWISE: tl.constexpr, TOKENS_ON_AXIS0: tl.constexpr, EMULATED: tl.constexpr, REVERSE_T: tl.constexpr,
):
    """`_rmsnorm_fp8_block_kernel`'s bytes from [TR, TJ, BLOCK_K] tiles (token = TR-index * TJ + TJ-index): every
    thread holds TJ consecutive tokens of 8 consecutive columns, so the codes are packed into 32-bit words in
    registers (4 columns of a row; 4 tokens of a column: a word of the transposed [K, T_pad] layout) and stored
    as words, with no byte shuffles; the 128x1 amax reduces each thread's TJ registers before the cross-thread step."""
    TR: tl.constexpr = 128 // TJ
    i_t = tl.program_id(0 if TOKENS_ON_AXIS0 else 1).to(tl.int64)
    if REVERSE_T:  # the last token tiles first: those the rsigma kernel read last, likeliest still in L2
        i_t = tl.num_programs(0 if TOKENS_ON_AXIS0 else 1).to(tl.int64) - 1 - i_t
    i_k = tl.program_id(1 if TOKENS_ON_AXIS0 else 0).to(tl.int64)
    o_r = tl.arange(0, TR)
    o_t = i_t * 128 + o_r[:, None] * TJ + tl.arange(0, TJ)[None, :]  # [TR, TJ]
    m_t = o_t < T
    o_k = i_k * BLOCK_K + runs_of(0, BLOCK_K, 8)  # K % BLOCK_K == 0: no column mask
    b_rs = tl.load(rsigma_ptr + o_t, mask=m_t, other=1.0)  # [TR, TJ]
    # rows past T load as NaN: ignored by the 128x1 amax, never stored
    b_x = widen_lean(tl.load(x_ptr + o_t[:, :, None] * stride_x + o_k[None, None, :], mask=m_t[:, :, None],
                                other=float("nan")), EMULATED)  # [TR, TJ, BLOCK_K]
    b_g = widen_lean(tl.load(w_ptr + o_k), EMULATED)  # [BLOCK_K]
    if ZERO_CENTERED:
        b_g = b_g + 1.0
    b_xn = b_x * b_rs[:, :, None] * b_g[None, None, :]  # the reference's op order
    # (a) 1x128 along K: NB blocks per row of the tile
    NB: tl.constexpr = BLOCK_K // 128
    b_x4 = tl.reshape(b_xn, (TR, TJ, NB, 128))
    b_scale, b_sinv = fp8_block_scale(amax(b_x4, 3, EMULATED), BLOCK_SCALE)  # [TR, TJ, NB]
    b_rw = pack_e4m3_words(
        tl.reshape(encode_operand(b_x4, b_scale[:, :, :, None], BLOCK_SCALE), (TR, TJ, BLOCK_K)),
        EMULATED)  # [.., BK/4]
    o_kw = i_k * (BLOCK_K // 4) + runs_of(0, BLOCK_K // 4, 2)
    tl.store(row_w_ptr + o_t[:, :, None] * (K // 4) + o_kw[None, None, :], b_rw, mask=m_t[:, :, None])
    o_b = i_k * NB + tl.arange(0, NB)
    tl.store(row_sinv_ptr + o_b[None, None, :] * T + o_t[:, :, None], b_sinv, mask=m_t[:, :, None])  # [K/128, T]
    if COLUMNWISE:
        # (b) 128x1 along T: the tile's 128 rows are one block per column
        b_cscale, b_csinv = fp8_block_scale(amax(amax(b_xn, 1, EMULATED), 0, EMULATED),
                                            BLOCK_SCALE)  # [BLOCK_K]
        b_cw = pack_e4m3_words(
            tl.permute(encode_operand(b_xn, b_cscale[None, None, :], BLOCK_SCALE), (0, 2, 1)),
            EMULATED)  # [TR, BK, TJ/4]
        o_tw = (i_t * 128 + o_r[:, None] * TJ) // 4 + tl.arange(0, TJ // 4)[None, :]  # [TR, TJ/4]: token words
        # zero codes in the padding rows [T, T_pad): a byte mask per word (tokens 4w .. 4w + 3), 1 op per 4 codes
        n_ok = tl.minimum(tl.maximum(T - o_tw * 4, 0), 4)
        b_cw = b_cw & tl.where(n_ok == 4, -1, (1 << (8 * n_ok)) - 1)[:, None, :]
        p_cw = col_w_ptr + o_k[None, :, None] * (T_pad // 4) + o_tw[:, None, :]
        # a thread-row's TJ tokens (TJ | 16 | T_pad) are all in [0, T_pad) or all out
        tl.store(p_cw, b_cw, mask=(i_t * 128 + o_r * TJ < T_pad)[:, None, None])  # transposed [K, T_pad] as words
        tl.store(col_sinv_ptr + i_t * K + o_k, b_csinv)


@dataclass(frozen=True)
class RMSNormFp8BlockConfig:
    """Launch parameters of the quantize kernel (block_k columns per program, num_warps, packed: the word-packed
    kernel, which needs `packed_tokens` in (4, 8, 16)) and of the rsigma kernel (rs_rows tokens per program,
    rs_block_k, rs_warps: rmsnorm_quant's split-form values, which fix rsigma's bits); maxnreg: a cap on the quantize
    kernel's registers a thread (None: ptxas's choice), which sets how many programs an SM holds; reverse_tokens:
    the quantize kernel takes the token tiles last to first (same bytes)."""

    block_k: int = 128
    num_warps: int = 8
    rs_rows: int = 4
    rs_block_k: int = 512
    rs_warps: int = 4
    packed: bool = False
    maxnreg: int | None = None
    reverse_tokens: bool = False


def packed_tokens(block_k: int, num_warps: int) -> int:
    """Consecutive tokens per thread (TJ) of the packed kernel: 8 columns per thread, min(32, block_k / 8) threads
    of a warp along the columns, the warp's other threads and the warps along the tokens."""
    return 128 * min(32, block_k // 8) // (32 * num_warps)


# Triton releases whose packed kernel fits a 168-register cap (sm_90 offline, tools/compile_sm90.py): 3.6 compiles it
# to 168 registers with no spill; 3.9 gives it 243 and spills under the cap, so it runs uncapped there
CAPPED_TRITON = ((3, 6),)
_PACKED_MAXNREG = cap_on_releases(168, CAPPED_TRITON)


def default_config(T: int, K: int, device: torch.device, columnwise: bool = True) -> RMSNormFp8BlockConfig:
    """[128 tokens, 128 columns] tiles with 4 warps; with the columnwise form the packed kernel (sm_90 offline,
    K = 1536: 0.49 warp-instructions per element, 211 registers, no spills, against 0.66 / 0.76 for the
    byte-transposing kernel with 4 / 8 warps) capped at 168 registers (3 programs an SM instead of 2), without it
    the byte-transposing kernel, which then transposes nothing (0.29 against 0.32 packed, 0.31 with 8 warps): SASS
    statistics (tools/compile_sm90.py). Both take the token tiles last to first, so that the rows the rsigma kernel
    read last are quantized first, from L2 (measured: BENCHMARKS.md). Under the
    interpreter the rsigma kernel takes 64 tokens per program: fewer (slow) program launches, and the interpreter
    sums each row alike whatever the rows per program (tests/ops/test_rmsnorm_fp8_block.py compares the bits with
    rmsnorm_quant's)."""
    cfg = RMSNormFp8BlockConfig(num_warps=4, packed=bool(columnwise), reverse_tokens=True,
                                maxnreg=_PACKED_MAXNREG if columnwise else None)
    if interpreter_enabled() or device.type != "cuda":
        cfg = dataclasses.replace(cfg, rs_rows=64)
    return cfg


def rmsnorm_fp8_block_outputs(x2d: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, ...]:
    """(rsigma fp32 [T], row codes fp8 [T, K], row scale_inv fp32 [K/128, T], col codes fp8 [K, T_pad], col
    scale_inv fp32 [ceil(T/128), K]); the columnwise pair is [K, 0] / [0, K] when not asked. Shared by the launcher
    and the fake."""
    T, K = x2d.shape
    e = x2d.new_empty
    t_pad = _fp8_block.round_up(T, _fp8_block.T_PAD) if columnwise else 0
    return (e((T,), dtype=torch.float32), e((T, K), dtype=torch.float8_e4m3fn),
            e((K // FP8_BLOCK, T), dtype=torch.float32), e((K, t_pad), dtype=torch.float8_e4m3fn),
            e((cdiv(T, FP8_BLOCK) if columnwise else 0, K), dtype=torch.float32))


def _check(x2d, norm_weight, eps):
    _fp8_block.check_float_tensor("x2d", x2d)
    _fp8_block.check_float_tensor("norm_weight", norm_weight)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [T, K], got shape {tuple(x2d.shape)}")
    T, K = x2d.shape
    if K % FP8_BLOCK or K == 0:
        raise ValueError(f"x2d's last dimension (q_lora_rank) must be a positive multiple of {FP8_BLOCK}, got {K}")
    if x2d.stride(1) != 1:
        raise ValueError(f"x2d must have a unit inner stride, got strides {x2d.stride()}")
    if tuple(norm_weight.shape) != (K,):
        raise ValueError(f"norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if norm_weight.device != x2d.device:
        raise ValueError(f"norm_weight is on {norm_weight.device}, x2d on {x2d.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def _cute_serves(x2d: torch.Tensor, norm_weight: torch.Tensor, block_scale: str) -> bool:
    """The CuTe DSL kernel (kernels/cute/rmsnorm_fp8_block.py: x read once) runs this call: sm_90, a geometry and
    dtypes it covers, a kernel to be had, `MLA_QPROJ_CUTE` not "0"."""
    if x2d.device.type != "cuda":
        return False
    from ..cute import rmsnorm_fp8_block as cute_rmsnorm

    return cute_rmsnorm.serves(x2d, norm_weight, block_scale)


def rmsnorm_fp8_block_fwd(x2d: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, zero_centered_gamma: bool,
                          block_scale: str = "pow2", columnwise: bool = True,
                          config: RMSNormFp8BlockConfig | None = None) -> tuple[torch.Tensor, ...]:
    """x2d [T, K] (K % 128 == 0, unit inner stride, any row stride; fp32 / bf16 / fp16) -> the five tensors of
    `rmsnorm_fp8_block_outputs`. columnwise=False (inference) skips the 128x1 form. norm_weight None: no RMSNorm
    (SPEC §7): x itself is quantized, as xn = x · 1 · 1 through the same kernels (rsigma returned as ones).
    config None: where the CuTe DSL kernel serves the call (`_cute_serves`), it runs instead of the two Triton
    kernels: the same bytes given its rsigma, whose fp32 summation order is its own (so its rsigma may differ from the
    MXFP8 path's in the last bits); an explicit config always runs the Triton kernels."""
    no_norm = norm_weight is None
    if no_norm:
        norm_weight, zero_centered_gamma = torch.ones(x2d.shape[-1], device=x2d.device, dtype=torch.float32), False
    _check(x2d, norm_weight, eps)
    _fp8_block.check_block_scale(block_scale)
    if config is None and not no_norm and _cute_serves(x2d, norm_weight, block_scale):
        from ..cute.rmsnorm_fp8_block import rmsnorm_fp8_block

        return rmsnorm_fp8_block(x2d, norm_weight, eps, zero_centered_gamma, block_scale, columnwise)
    outs = rmsnorm_fp8_block_outputs(x2d, columnwise)
    rsigma, rd, rs, cd, cs = outs
    T, K = x2d.shape
    if T == 0:
        return outs
    cfg = config or default_config(T, K, x2d.device, columnwise)
    if config is None and cfg.packed and x2d.stride(0) % 16:
        # a row stride Triton cannot prove 16-aligned: per-element loads, which spill in the packed kernel's
        # registers (sm_90 offline); the byte-transposing kernel instead
        cfg = dataclasses.replace(cfg, packed=False, maxnreg=None)
    nb = cfg.block_k // FP8_BLOCK
    if cfg.block_k % FP8_BLOCK or nb & (nb - 1) or K % cfg.block_k:
        raise ValueError(f"config.block_k ({cfg.block_k}) must be {FP8_BLOCK} times a power of two and divide K ({K})")
    tj = packed_tokens(cfg.block_k, cfg.num_warps)
    if cfg.packed and tj not in (4, 8, 16):
        raise ValueError(f"config {cfg}: the packed kernel needs 4, 8 or 16 tokens per thread, "
                         f"block_k {cfg.block_k} with {cfg.num_warps} warps gives {tj}")
    cap = register_cap(cfg.maxnreg)  # checked before any launch
    if no_norm:
        rsigma.fill_(1.0)
    else:
        _rsigma_kernel[(cdiv(T, cfg.rs_rows),)](x_ptr=x2d, stride_x=x2d.stride(0), rsigma_ptr=rsigma, T=T, eps=eps,
                                                K=K, ROWS=cfg.rs_rows, BLOCK_K=cfg.rs_block_k,
                                                EMULATED=_op.emulated(x2d.device), num_warps=cfg.rs_warps)
    n_t, n_k = cdiv(T, FP8_BLOCK), K // cfg.block_k
    tokens_on_axis0 = n_t > 65535  # a CUDA grid's y extent
    emulated = _op.emulated(x2d.device)
    if cfg.packed:
        # codes as int32 words: K % 128 == 0 and T_pad % 16 == 0
        _rmsnorm_fp8_block_packed_kernel[(n_t, n_k) if tokens_on_axis0 else (n_k, n_t)](
            x_ptr=x2d, stride_x=x2d.stride(0), w_ptr=norm_weight, rsigma_ptr=rsigma,
            row_w_ptr=rd.view(torch.int32), row_sinv_ptr=rs,
            # without the columnwise pair its stores are compiled out: the row outputs stand in as pointers
            col_w_ptr=(cd if columnwise else rd).view(torch.int32), col_sinv_ptr=cs if columnwise else rs,
            T=T, T_pad=cd.shape[1], K=K, BLOCK_K=cfg.block_k, TJ=tj, ZERO_CENTERED=bool(zero_centered_gamma),
            BLOCK_SCALE=_fp8_block.block_scale_code(block_scale), COLUMNWISE=bool(columnwise),
            TOKENS_ON_AXIS0=tokens_on_axis0, REVERSE_T=cfg.reverse_tokens,
            EMULATED=emulated, num_warps=cfg.num_warps, **cap,
        )
        return outs
    _rmsnorm_fp8_block_kernel[(n_t, n_k) if tokens_on_axis0 else (n_k, n_t)](
        x_ptr=x2d, stride_x=x2d.stride(0), w_ptr=norm_weight, rsigma_ptr=rsigma,
        row_data_ptr=rd.view(torch.uint8), row_sinv_ptr=rs,
        # without the columnwise pair its stores are compiled out: the row outputs stand in as pointers
        col_data_ptr=(cd if columnwise else rd).view(torch.uint8), col_sinv_ptr=cs if columnwise else rs,
        T=T, T_pad=cd.shape[1], K=K, BLOCK_K=cfg.block_k, ZERO_CENTERED=bool(zero_centered_gamma),
        BLOCK_SCALE=_fp8_block.block_scale_code(block_scale), COLUMNWISE=bool(columnwise),
        TOKENS_ON_AXIS0=tokens_on_axis0, REVERSE_T=cfg.reverse_tokens, EMULATED=_op.emulated(x2d.device),
        num_warps=cfg.num_warps,
        **cap,
    )
    return outs


# ------------------------------------------------------------------------------------------------ custom op


def _rmsnorm_fp8_block_fwd_impl(x2d: torch.Tensor, norm_weight: torch.Tensor, cfg: str, columnwise: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rmsnorm_fp8_block_fwd` with the layer's eps, gamma form and block scale from cfg (`QProjConfig.encode`)."""
    c = QProjConfig.decode(cfg)
    return rmsnorm_fp8_block_fwd(x2d, norm_weight if c.norm else None, c.eps, c.zero_centered_gamma, c.block_scale,
                                 columnwise)


def _rmsnorm_fp8_block_fwd_fake(x2d, norm_weight, cfg, columnwise):
    return rmsnorm_fp8_block_outputs(x2d, columnwise)


rmsnorm_fp8_block_fwd_op = _op.define_op("mla_qproj::rmsnorm_fp8_block_fwd", _rmsnorm_fp8_block_fwd_impl,
                                         _rmsnorm_fp8_block_fwd_fake)
