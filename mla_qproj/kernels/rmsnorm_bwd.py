"""RMSNorm backward from the saved x and rsigma (SPEC backward 3).

dx = rsigma * (dxhat - xhat * mean(dxhat * xhat)) with xhat = x * rsigma, dxhat = dxn * g; and
dg = sum_T dxn * xhat, reduced deterministically: each program owns a fixed run of rows and writes one
fp32 partial row; the partials are summed in a fixed order afterwards (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._config import interpreter_enabled
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
    ROWS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_K2: tl.constexpr, EMULATED: tl.constexpr,
):
    """Program i_p: rows [i_p * ROWS_PER_PROG, (i_p + 1) * ROWS_PER_PROG) as [ROWS, BLOCK_K] tiles (ROWS rows in
    flight per step: the loop is latency-bound with one); dw partial = fixed-order sum over its rows.
    BLOCK_K2 > 0: a row is two power-of-two chunks, columns [0, BLOCK_K) and [BLOCK_K, BLOCK_K + BLOCK_K2)
    (K = 1536 as 1024 + 512 instead of one 2048-wide tile with a quarter of its lanes masked)."""
    i_p = tl.program_id(0).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_g = _gamma(w_ptr, o_k, m_k, ZERO_CENTERED, EMULATED)
    b_dw = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    if BLOCK_K2 > 0:
        o_k2 = BLOCK_K + tl.arange(0, BLOCK_K2)
        m_k2 = o_k2 < K
        b_g2 = _gamma(w_ptr, o_k2, m_k2, ZERO_CENTERED, EMULATED)
        b_dw2 = tl.zeros([ROWS, BLOCK_K2], dtype=tl.float32)
    # PREFETCH: the next step's x / dxn / rsigma are loaded before this step's reduction and store (a register
    # double buffer: Triton pipelines no loads outside dot loops, and each step waits on a reduction)
    o_t = i_p * ROWS_PER_PROG + tl.arange(0, ROWS)
    if PREFETCH:
        b_x, b_dxn, b_rs = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, o_t < T, o_k, m_k)
        if BLOCK_K2 > 0:
            b_x2, b_dxn2, _ = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, o_t < T, o_k2, m_k2)
    for r in range(0, ROWS_PER_PROG, ROWS):
        m_t = o_t < T
        if PREFETCH:
            o_n = o_t + ROWS
            m_n = (o_n < T) & (r + ROWS < ROWS_PER_PROG)
            b_x_n, b_dxn_n, b_rs_n = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_n, m_n, o_k, m_k)
            if BLOCK_K2 > 0:
                b_x2_n, b_dxn2_n, _ = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_n, m_n, o_k2,
                                                 m_k2)
        else:
            b_x, b_dxn, b_rs = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, m_t, o_k, m_k)
            if BLOCK_K2 > 0:
                b_x2, b_dxn2, _ = _load_rows(x_ptr, stride_x, dxn_ptr, stride_dxn, rsigma_ptr, o_t, m_t, o_k2, m_k2)
        b_xhat, b_dxhat, b_dot = _chunk_terms(b_x, b_dxn, b_rs, b_g, EMULATED)  # b_dot [ROWS]
        if BLOCK_K2 > 0:
            b_xhat2, b_dxhat2, b_dot2 = _chunk_terms(b_x2, b_dxn2, b_rs, b_g2, EMULATED)
            b_dot += b_dot2
        b_c = b_dot / K
        b_dw = _chunk_finish(dx_ptr, o_t, m_t, o_k, m_k, K, b_rs, b_c, b_xhat, b_dxhat, b_dxn, b_dw, EMULATED)
        if BLOCK_K2 > 0:
            b_dw2 = _chunk_finish(dx_ptr, o_t, m_t, o_k2, m_k2, K, b_rs, b_c, b_xhat2, b_dxhat2, b_dxn2, b_dw2,
                                  EMULATED)
        if PREFETCH:
            b_x, b_dxn, b_rs = b_x_n, b_dxn_n, b_rs_n
            if BLOCK_K2 > 0:
                b_x2, b_dxn2 = b_x2_n, b_dxn2_n
        o_t = o_t + ROWS
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


def rmsnorm_bwd(dxn: torch.Tensor, x2d: torch.Tensor, rsigma: torch.Tensor, norm_weight: torch.Tensor,
                zero_centered_gamma: bool, **knobs):
    """Returns (dx [T, K] in x's dtype, dnorm_weight [K] in the parameter's dtype). knobs: ROWS, num_warps,
    PROGS_PER_SM, PREFETCH, and SUM_BLOCK_P, SUM_BLOCK_K, SUM_num_warps for `sum_partials` (benchmarks; the
    reduction order depends on T and these knobs only)."""
    T, K = x2d.shape
    dev = x2d.device
    dx = torch.empty((T, K), dtype=x2d.dtype, device=dev)
    if T == 0:
        return dx, torch.zeros_like(norm_weight)
    # a fixed number of programs for a given T: the reduction order depends on T only (deterministic)
    # (rows per program is a power of two: few compiled variants across sequence lengths)
    # H200 (2026-11-30, scripts/kernel_sweep.py): one row per step and 4 warps beat [2-16, K] steps and 8 warps;
    # 2026-12-01: K as two chunks and the [256, 16]-step partial sum (8 warps): 0.059 -> 0.058 ms at T = 16384
    # (0.80 -> 0.82 of copy), 0.020 -> 0.019 ms at 4096 (the partial sum alone 6 -> 4 us)
    conf = dict(ROWS=1, num_warps=8 if K > 2048 else 4, PROGS_PER_SM=4, PREFETCH=True, TWO_CHUNKS=True)
    sum_knobs = {k[4:]: knobs.pop(k) for k in list(knobs) if k.startswith("SUM_")}  # SUM_BLOCK_P, SUM_BLOCK_K, ...
    conf.update(knobs)
    rows, n_prog = program_rows(T, conf.pop("PROGS_PER_SM"))
    block_k, block_k2 = next_power_of_2(K), 0
    if conf.pop("TWO_CHUNKS") and block_k != K:  # K = 2^a + (at most 2^b, b < a): two chunks, fewer masked lanes
        block_k = block_k // 2
        block_k2 = next_power_of_2(K - block_k)
    conf["ROWS"] = min(conf["ROWS"], rows)  # a program's step never reaches into the next program's rows
    part = torch.empty((n_prog, K), dtype=torch.float32, device=dev)
    _rmsnorm_bwd_kernel[(n_prog,)](
        dxn_ptr=dxn, stride_dxn=dxn.stride(0), x_ptr=x2d, stride_x=x2d.stride(0), rsigma_ptr=rsigma,
        w_ptr=norm_weight, dx_ptr=dx, dw_part_ptr=part, T=T, ROWS_PER_PROG=rows, K=K,
        ZERO_CENTERED=zero_centered_gamma, BLOCK_K=block_k, BLOCK_K2=block_k2,
        EMULATED=interpreter_enabled() or dev.type != "cuda", **conf,
    )
    dg = torch.empty(K, dtype=norm_weight.dtype, device=dev)
    sum_partials(part, dg, **sum_knobs)
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
