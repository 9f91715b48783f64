"""RMSNorm backward from the saved x and rsigma (SPEC backward 3).

dx = rsigma * (dxhat - xhat * mean(dxhat * xhat)) with xhat = x * rsigma, dxhat = dxn * g; and
dg = sum_T dxn * xhat, reduced deterministically: each program owns a fixed run of rows and writes one
fp32 partial row; the partials are summed in a fixed order afterwards (no atomics). Custom op
`mla_qproj::rmsnorm_bwd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _op
from ._common import cdiv, next_power_of_2, widen


@triton.jit
def _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, m_t, o_k, m_k):
    """x, dxn ([rows, BLOCK_K], their own dtypes; 0 where masked) and rsigma ([rows]) of token rows o_t."""
    m = m_t[:, None] & m_k[None, :]
    b_x = tl.load(x_ptr + o_t[:, None] * stride_x + o_k[None, :], mask=m, other=0.0)
    b_dxn = tl.load(dxn_ptr + o_t[:, None] * stride_dxn + o_k[None, :], mask=m, other=0.0)
    return b_x, b_dxn, tl.load(rsigma_ptr + o_t, mask=m_t, other=0.0)


@triton.jit
def _gamma(w_ptr, o_k, m_k, ZERO_CENTERED: tl.constexpr, EMULATED: tl.constexpr):
    """The norm weight of columns o_k in fp32 (+1 for a zero-centered gamma)."""
    b_g = widen(tl.load(w_ptr + o_k, mask=m_k, other=0.0), EMULATED)
    if ZERO_CENTERED:
        b_g = b_g + 1.0
    return b_g


@triton.jit
def _chunk_terms(b_x, b_dxn, b_rs, b_g, EMULATED: tl.constexpr):
    """xhat, dxhat of a [rows, chunk] tile and its share of sum(dxhat * xhat) per row."""
    b_xhat = widen(b_x, EMULATED) * b_rs[:, None]
    b_dxhat = widen(b_dxn, EMULATED) * b_g[None, :]
    return b_xhat, b_dxhat, tl.sum(b_dxhat * b_xhat, axis=1)


@triton.jit
def _chunk_finish(dx_ptr, o_t, m_t, o_k, m_k, K: tl.constexpr, b_rs, b_c, b_xhat, b_dxhat, b_dxn, b_dw,
                  EMULATED: tl.constexpr):
    """Store the tile's dx = rsigma * (dxhat - xhat * c); return b_dw + dxn * xhat."""
    b_dx = b_rs[:, None] * (b_dxhat - b_xhat * b_c[:, None])
    tl.store(dx_ptr + o_t[:, None] * K + o_k[None, :], b_dx.to(dx_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])
    return b_dw + widen(b_dxn, EMULATED) * b_xhat


@triton.jit
def _rmsnorm_bwd_kernel(
    dxn_ptr, stride_dxn, x_ptr, stride_x, rsigma_ptr, w_ptr, dx_ptr, dw_part_ptr,
    T,
    ROWS_PER_PROG: tl.constexpr, K: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_K2: tl.constexpr, EMULATED: tl.constexpr,
):
    """Program i_p: rows [i_p * ROWS_PER_PROG, (i_p + 1) * ROWS_PER_PROG), one [1, BLOCK_K] row per step; dw
    partial = fixed-order sum over its rows. BLOCK_K2 > 0: a row is two power-of-two chunks, columns [0, BLOCK_K)
    and [BLOCK_K, BLOCK_K + BLOCK_K2) (K = 1536 as 1024 + 512 instead of one 2048-wide tile with a quarter of its
    lanes masked)."""
    i_p = tl.program_id(0).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_g = _gamma(w_ptr, o_k, m_k, ZERO_CENTERED, EMULATED)
    b_dw = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    if BLOCK_K2 > 0:
        o_k2 = BLOCK_K + tl.arange(0, BLOCK_K2)
        m_k2 = o_k2 < K
        b_g2 = _gamma(w_ptr, o_k2, m_k2, ZERO_CENTERED, EMULATED)
        b_dw2 = tl.zeros([1, BLOCK_K2], dtype=tl.float32)
    # the next row's x / dxn / rsigma are loaded before this row's reduction and store (a register double buffer:
    # Triton pipelines no loads outside dot loops, and each step waits on a reduction)
    o_t = i_p * ROWS_PER_PROG + tl.arange(0, 1)
    b_x, b_dxn, b_rs = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, o_t < T, o_k, m_k)
    if BLOCK_K2 > 0:
        b_x2, b_dxn2, _ = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, o_t < T, o_k2, m_k2)
    for r in range(0, ROWS_PER_PROG):
        m_t = o_t < T
        o_n = o_t + 1
        m_n = (o_n < T) & (r + 1 < ROWS_PER_PROG)
        b_x_n, b_dxn_n, b_rs_n = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_n, m_n, o_k, m_k)
        if BLOCK_K2 > 0:
            b_x2_n, b_dxn2_n, _ = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_n, m_n, o_k2, m_k2)
        b_xhat, b_dxhat, b_dot = _chunk_terms(b_x, b_dxn, b_rs, b_g, EMULATED)  # b_dot [1]
        if BLOCK_K2 > 0:
            b_xhat2, b_dxhat2, b_dot2 = _chunk_terms(b_x2, b_dxn2, b_rs, b_g2, EMULATED)
            b_dot += b_dot2
        b_c = b_dot / K
        b_dw = _chunk_finish(dx_ptr, o_t, m_t, o_k, m_k, K, b_rs, b_c, b_xhat, b_dxhat, b_dxn, b_dw, EMULATED)
        if BLOCK_K2 > 0:
            b_dw2 = _chunk_finish(dx_ptr, o_t, m_t, o_k2, m_k2, K, b_rs, b_c, b_xhat2, b_dxhat2, b_dxn2, b_dw2,
                                  EMULATED)
        b_x, b_dxn, b_rs = b_x_n, b_dxn_n, b_rs_n
        if BLOCK_K2 > 0:
            b_x2, b_dxn2 = b_x2_n, b_dxn2_n
        o_t = o_t + 1
    tl.store(dw_part_ptr + i_p * K + o_k, tl.sum(b_dw, axis=0), mask=m_k)
    if BLOCK_K2 > 0:
        tl.store(dw_part_ptr + i_p * K + o_k2, tl.sum(b_dw2, axis=0), mask=m_k2)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, n_part, K: tl.constexpr, MAX_P: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """out[k] = sum over the n_part (<= MAX_P, a power of two: constexpr loop bounds, few variants) partial rows of
    part[:, k] (fp32, a fixed order: deterministic), cast to out's dtype: the dnorm_weight reduction and cast in one
    launch."""
    o_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_acc = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    for p0 in tl.static_range(0, MAX_P, BLOCK_P):  # unrolled: every step's loads are in flight at once
        o_p = p0 + tl.arange(0, BLOCK_P)
        m = (o_p < n_part)[:, None] & m_k[None, :]
        b_acc += tl.load(part_ptr + o_p[:, None].to(tl.int64) * K + o_k[None, :], mask=m, other=0.0)
    tl.store(out_ptr + o_k, tl.sum(b_acc, axis=0).to(out_ptr.dtype.element_ty), mask=m_k)


@dataclass(frozen=True)
class RMSNormBwdConfig:
    """Launch parameters of `rmsnorm_bwd`. num_warps: the main kernel's warps; progs_per_sm: about this many programs
    per SM of a 132-SM H200 (`program_rows`); SUM_BLOCK_P x SUM_BLOCK_K: the partial sum's step (`sum_partials`),
    sum_num_warps its warps. The dnorm_weight reduction order depends on T and this config only (deterministic)."""

    num_warps: int
    progs_per_sm: int = 4
    SUM_BLOCK_P: int = 256
    SUM_BLOCK_K: int = 16
    sum_num_warps: int = 8


_DEFAULT_CONFIGS: dict[int, RMSNormBwdConfig] = {}


def default_config(K: int, device: torch.device) -> RMSNormBwdConfig:
    """One row per step with 4 warps (8 above K = 2048), 4 programs per SM, the partials summed in [256, 16] steps with
    8 warps (figures: BENCHMARKS.md); the same on every device, kept by K (building one costs host time)."""
    config = _DEFAULT_CONFIGS.get(K)
    if config is None:
        config = _DEFAULT_CONFIGS[K] = RMSNormBwdConfig(num_warps=8 if K > 2048 else 4)
    return config


def rmsnorm_bwd_outputs(x2d: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of `rmsnorm_bwd` (also the op's fake): dx [T, K] in x's dtype, dnorm_weight [K] in the
    parameter's dtype, both contiguous."""
    return x2d.new_empty(tuple(x2d.shape)), norm_weight.new_empty(tuple(norm_weight.shape))


def rmsnorm_bwd(dxn: torch.Tensor, x2d: torch.Tensor, rsigma: torch.Tensor, norm_weight: torch.Tensor,
                zero_centered_gamma: bool, config: RMSNormBwdConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx [T, K] in x's dtype, dnorm_weight [K] in the parameter's dtype). config: `default_config` unless
    given."""
    T, K = x2d.shape
    dev = x2d.device
    dx, dg = rmsnorm_bwd_outputs(x2d, norm_weight)
    if T == 0:
        return dx, dg.zero_()
    conf = default_config(K, dev) if config is None else config
    # a fixed number of programs for a given T: the reduction order depends on T only (deterministic)
    # (rows per program is a power of two: few compiled variants across sequence lengths)
    rows, n_prog = program_rows(T, conf.progs_per_sm)
    block_k, block_k2 = next_power_of_2(K), 0
    if block_k != K:  # K = 2^a + (at most 2^b, b < a): two chunks, fewer masked lanes
        block_k = block_k // 2
        block_k2 = next_power_of_2(K - block_k)
    part = torch.empty((n_prog, K), dtype=torch.float32, device=dev)
    _rmsnorm_bwd_kernel[(n_prog,)](
        dxn_ptr=dxn, stride_dxn=dxn.stride(0), x_ptr=x2d, stride_x=x2d.stride(0), rsigma_ptr=rsigma,
        w_ptr=norm_weight, dx_ptr=dx, dw_part_ptr=part, T=T, ROWS_PER_PROG=rows, K=K,
        ZERO_CENTERED=zero_centered_gamma, BLOCK_K=block_k, BLOCK_K2=block_k2, EMULATED=_op.emulated(dev),
        num_warps=conf.num_warps,
    )
    sum_partials(part, dg, BLOCK_P=conf.SUM_BLOCK_P, BLOCK_K=conf.SUM_BLOCK_K, num_warps=conf.sum_num_warps)
    return dx, dg


def program_rows(T: int, progs_per_sm: int) -> tuple[int, int]:
    """(rows per program, programs) of `rmsnorm_bwd` at T tokens: a power of two of rows, about progs_per_sm
    programs per SM of a 132-SM H200 — fixed for a given T, so the dnorm_weight partials are summed in one order."""
    rows = next_power_of_2(cdiv(T, progs_per_sm * 132))
    return rows, cdiv(T, rows)


def sum_partials(part: torch.Tensor, out: torch.Tensor, BLOCK_P: int = 256, BLOCK_K: int = 16, num_warps: int = 8):
    """out = part.sum(0) in a fixed order (fp32), cast to out's dtype: the partials of `rmsnorm_bwd`.
    [BLOCK_P partials, BLOCK_K columns] per step, steps unrolled, K / BLOCK_K programs."""
    n_part, K = part.shape
    max_p = next_power_of_2(n_part)
    _sum_partials_kernel[(cdiv(K, BLOCK_K),)](part, out, n_part, K=K, MAX_P=max_p, BLOCK_P=min(BLOCK_P, max_p),
                                              BLOCK_K=BLOCK_K, num_warps=num_warps)


# ------------------------------------------------------------------------------------------------ custom op


def _rmsnorm_bwd_impl(dxn: torch.Tensor, x2d: torch.Tensor, rsigma: torch.Tensor, norm_weight: torch.Tensor,
                      zero_centered_gamma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return rmsnorm_bwd(dxn, x2d, rsigma, norm_weight, zero_centered_gamma)


def _rmsnorm_bwd_fake(dxn, x2d, rsigma, norm_weight, zero_centered_gamma):
    return rmsnorm_bwd_outputs(x2d, norm_weight)


rmsnorm_bwd_op = _op.define_op("mla_qproj::rmsnorm_bwd", _rmsnorm_bwd_impl, _rmsnorm_bwd_fake)
