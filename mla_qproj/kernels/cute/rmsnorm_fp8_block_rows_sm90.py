"""The inference form of the RMSNorm + 1x128 block FP8 quantize kernel (SPEC §5) for sm_90a, in CuTe DSL: rsigma fp32
[T], codes [T, K] and scale_inv M-major [K/128, T] from x [T, K] bf16 read once, with the bits of the training form
(`rmsnorm_fp8_block_sm90.py`, `columnwise=True`) for the same x: rsigma, codes and scales.

# %% Design
Without the 128x1 blocks nothing couples tokens, so a warp owns whole rows: R (= ROWS_PER_WARP, 2) rows a warp, 4 warps
(128 threads) a CTA, no cluster, no CTA barrier, no shared memory. Warps are independent: one warp's arithmetic
overlaps the others' loads. Measured at K = 1536 (BENCHMARKS.md, 2026-12-07): on an H100, recomputing xn in pass 2,
9.9 us at T = 4096 (the cluster form 11.7), 31.8 at 16384 (32.1), 107 at 65536 (108); on an H200, holding xn, 8.6 /
25.2 / 78.5 us against 9.1 / 25.6 / 79.1 recomputing it (0.71 of a device copy's rate at 16384).
- Lane l = 16 h + cg holds, of each 256-column chunk i < n = ceil(K / 256) of its R rows, the 8 columns
  256 i + 128 h + 8 cg: block 2 i + h, column group cg, the columns a training-form thread holds of that block. A
  half-warp reads a whole 1x128 block of a row (256 contiguous bytes, the warp 512). All R * n loads of 16 bytes are
  issued up front (K = 1536: 12) and x stays in registers; rows past T and the missing half of the last chunk
  (K / 128 odd) are predicated off and read as 0.
- Sum of squares: a thread's fma chain over its 8 columns (the training form's), then the same transposed butterfly
  (`RMSNormFp8BlockSm90._butterfly`, xor 8, 4, 2, 1) over S = pow2(R * n) slots (slot r n + i: row r, chunk i;
  padded with zeros) in place of 8 tokens: a slot's partial is the training form's tree over the block's 16 column
  groups, bit for bit, and ends on the lanes 16 h + (slot << (4 - log2 S)) (+ the lanes that share it when S < 16).
  Each lane then gathers the K / 128 block partials of a row in block order with index shuffles and sums them in the
  training form's rank order: rsigma = 1 / sqrt(sum / K + eps), with div.rn and sqrt.rn, the same bits.
- xn = (x * rsigma) * g (two mul.rn), computed in pass 1 and held in registers for pass 2 where R n <= 12 (K <= 1536
  at 2 rows: 96 registers, ptxas told to fit four CTAs an SM); past that, recomputed in pass 2. The norm weight is
  read per chunk and pass (16-byte loads, L1 hits) rather than held: 8 registers instead of 8 n.
- Pass 1: amax of a slot's 8 columns, the same butterfly with max.f32 (NaN ignored): the lanes holding a slot
  compute its scale by the SPEC's rule (`rmsnorm_fp8_block_sm90._scale_rule`) and the first of them stores
  scale_inv to [K/128, T]. Pass 2: each lane fetches its blocks' scales with index shuffles (R n), converts (cvt.rn.
  satfinite.e4m3x2.f32) and stores its 8 codes of a block and row as one 8-byte store (a warp: 256 contiguous bytes).
Registers (ptxas, sm_90a, K = 1536): 128 with either weight dtype, no spills (143 uncapped), four CTAs an SM (16
warps, 96 KB of loads in flight); 1352 SASS instructions a warp, against 1656 recomputing xn. Global addresses are
64-bit; T is a run-time extent (grid x = ceil(T / (4 R))). Compiled per (K, norm-weight dtype, zero-centered gamma,
block scale), the keys of the training form with `columnwise=False`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .rmsnorm_fp8_block_sm90 import (
    COLS,
    VEC,
    RMSNormFp8BlockSm90,
    _add_rn,
    _bits_f32,
    _div_rn,
    _e4m3x4,
    _hi_bf16,
    _ldg4,
    _ldg4_f32,
    _lo_bf16,
    _mul_rn_t,
    _scale_rule,
    _sqrt_rn,
    _stg2,
    _stg_f32,
    check_variant,
)
from .rope_gemm_sm90 import _absmax, _fma_rn, _fmax, _mul_rn

F32, I32, I64 = cutlass.Float32, cutlass.Int32, cutlass.Int64
WARPS = 4  # a CTA: 128 threads
ROWS_PER_WARP = 2
CTAS_PER_SM = 4  # the register cap: 128 a thread
HOLD_CHUNKS = 12  # xn is held from pass 1 to pass 2 up to 12 row-chunks a warp (K <= 1536 at 2 rows): 96 registers
CHUNK = 2 * COLS  # columns of a row a warp covers with one 16-byte load a lane: two 1x128 blocks
MASKS = (8, 4, 2, 1)  # the butterfly over a half-warp's 16 column groups


def _pred(b):
    return I32(cutlass.select_(b, I32(1), I32(0)))


def chunks(K: int) -> int:
    return -(-K // CHUNK)


def slots(K: int, rows: int) -> int:
    """S: the butterfly's slots, rows * chunks rounded up to a power of two (at most 16: K <= 2048, rows <= 2)."""
    return 1 << (rows * chunks(K) - 1).bit_length()


class RMSNormFp8BlockRowsSm90:
    """rsigma, xn's 1x128 codes and M-major scale_inv from x [T, K] bf16 read once; a warp per `rows` rows."""

    def __init__(self, K: int, zero_centered: bool, block_scale: str = "pow2", w_dtype=cutlass.Float32,
                 rows: int = ROWS_PER_WARP):
        check_variant(K, block_scale, w_dtype)
        if rows not in (1, 2):
            raise ValueError(f"unsupported rows={rows}: 1 or 2 a warp")
        self.K, self.C, self.n, self.R = K, K // COLS, chunks(K), rows
        self.S = slots(K, rows)
        self.shift = 4 - (self.S.bit_length() - 1)  # slot s ends on the lanes 16 h + (s << shift) ...
        self.hold = rows * self.n <= HOLD_CHUNKS  # pass 2 reuses pass 1's xn (8 R n registers)
        self.zero_centered = bool(zero_centered)
        self.pow2 = block_scale == "pow2"
        self.w_f32 = w_dtype == cutlass.Float32

    # ------------------------------------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mRs: cute.Tensor, mRowQ: cute.Tensor, mRowS: cute.Tensor,
                 mColQ: cute.Tensor, mColS: cute.Tensor, eps: cutlass.Float32, stream: cuda.CUstream):
        """The training form's arguments; mColQ / mColS are placeholders, not touched."""
        T = mX.shape[0]
        rows_cta = WARPS * self.R
        # holding xn, ptxas is told to fit CTAS_PER_SM CTAs an SM (128 registers: it would take 143 at K = 1536); the
        # carveout spares the DSL asking the device for its shared memory size, so that it compiles offline
        cap = (dict(min_blocks_per_mp=CTAS_PER_SM, max_number_threads=[WARPS * 32, 1, 1], preferred_smem_carveout=0)
               if self.hold else {})
        self.kernel(mX, mW, mRs, mRowQ, mRowS, eps, T).launch(
            grid=[(T + rows_cta - 1) // rows_cta, 1, 1], block=[WARPS * 32, 1, 1], stream=stream, **cap)

    # ---------------------------------------------------------------------------------------------- device

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mRs: cute.Tensor, mRowQ: cute.Tensor, mRowS: cute.Tensor,
               eps: cutlass.Float32, T: cutlass.Int32):
        K, n, R = self.K, self.n, self.R
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        h = lane >> 4  # which block of a chunk
        cg = lane & 15  # column group: the lane's 8 columns of the block
        row0 = (bid * WARPS + warp) * R
        # ---- x: R n loads of 16 bytes, issued together
        x_base = mX.iterator.toint()
        xw = [[_ldg4(x_base + (I64(row0 + r) * K + I64(self._col(i, h, cg))) * 2,
                     _pred(self._ok(r, i, row0, T, h))) for i in range(n)] for r in range(R)]
        self._rows(xw, row0, T, lane, eps, mW.iterator.toint(), mRs.iterator.toint(), mRowQ.iterator.toint(),
                   mRowS.iterator.toint())

    def _col(self, i, h, cg):
        """The lane's first column in chunk i (the h = 0 block's where the chunk has one block)."""
        return CHUNK * i + COLS * h + VEC * cg if 2 * i + 1 < self.C else CHUNK * i + VEC * cg

    def _ok(self, r, i, row0, T, h):
        """Whether the lane's 8 columns of chunk i exist in row r."""
        return (row0 + r) < T if 2 * i + 1 < self.C else ((row0 + r) < T) & (h == 0)

    def _rows(self, xw, row0, T, lane, eps, w_base, rs_base, rq_base, sc_base):
        """Everything after the loads, for the warp's R rows from row0 (xw: the lanes' words of x, R x n x 4). Plain
        Python (unrolled as it runs): the kernels call it inside their staged code."""
        K, C, n, R, S, shift = self.K, self.C, self.n, self.R, self.S, self.shift
        h = lane >> 4
        cg = lane & 15

        def col(i):
            return self._col(i, h, cg)

        def row_ok(r):
            return (row0 + r) < T

        def ok(r, i):
            return self._ok(r, i, row0, T, h)

        def xval(r, i, c, tag):  # x[row r, column col(i) + c], fp32 (tag: the pass)
            wd = xw[r][i][c // 2]
            return _lo_bf16(wd, tag) if c % 2 == 0 else _hi_bf16(wd, tag)

        def gvals(i, tag):  # the norm weight of the lane's 8 columns of chunk i, fp32 (+ 1 where zero-centered)
            g = []
            if self.w_f32:
                for q in range(2):
                    g += [_bits_f32(wd) for wd in _ldg4_f32(w_base + I64(col(i) + 4 * q) * 4, tag)]
            else:
                for wd in _ldg4_f32(w_base + I64(col(i)) * 2, tag):
                    g += [_lo_bf16(wd, tag), _hi_bf16(wd, tag)]
            if self.zero_centered:
                g = [_add_rn(v, F32(1.0)) for v in g]
            return g

        pad = [F32(0.0)] * (S - R * n)
        # ---- sum of squares: per slot over the lane's 8 columns, then over the block's 16 column groups
        ss = []
        for r in range(R):
            for i in range(n):
                s = F32(0.0)
                for c in range(VEC):
                    v = xval(r, i, c, 0)
                    s = _fma_rn(v, v, s)
                ss.append(s)
        part = RMSNormFp8BlockSm90._butterfly(ss + pad, lane, MASKS, _add_rn)[0]
        # ---- rsigma of each row: its K / 128 block partials in block order (the training form's rank order)
        rsv = []
        for r in range(R):
            tot = None
            for b in range(C):
                p = cute.arch.shuffle_sync(part, 16 * (b % 2) + ((r * n + b // 2) << shift))
                tot = p if tot is None else _add_rn(tot, p)
            rs = _div_rn(F32(1.0), _sqrt_rn(_add_rn(_div_rn(tot, F32(float(K))), eps)))
            rsv.append(rs)
            _stg_f32(rs_base + I64(row0 + r) * 4, rs, _pred((lane == r) & row_ok(r)))

        def xn(r, i, c, g, tag):  # (x * rsigma) * g, the reference's op order
            return _mul_rn_t(_mul_rn_t(xval(r, i, c, tag), rsv[r], tag), g[c], tag)

        # ---- pass 1: amax of each slot, its scale on the lanes holding it; scale_inv stored by the first
        am = [[None] * n for _ in range(R)]
        xnv = {}  # xn of (row, chunk, column); pass 2 reads it where held (else dead after this pass)
        for i in range(n):
            g = gvals(i, 1)
            for r in range(R):
                a = F32(0.0)
                for c in range(VEC):
                    xnv[(r, i, c)] = xn(r, i, c, g, 1)
                    a = _absmax(a, xnv[(r, i, c)])
                am[r][i] = a
        a_slot = RMSNormFp8BlockSm90._butterfly([a for rr in am for a in rr] + pad, lane, MASKS, _fmax)[0]
        scale, sinv = _scale_rule(a_slot, self.pow2)
        s_own = cg >> shift  # the lane's slot: row s // n, chunk s % n, block 2 (s % n) + h
        r_own, i_own = s_own // n, s_own % n
        b_own, t_own = 2 * i_own + h, row0 + r_own
        first = (cg & ((1 << shift) - 1)) == 0
        _stg_f32(sc_base + (I64(b_own) * T + I64(t_own)) * 4, sinv,
                 _pred(first & (s_own < R * n) & (b_own < C) & (t_own < T)))

        # ---- pass 2: codes, 8 bytes a lane per block and row
        for i in range(n):
            g = None if self.hold else gvals(i, 2)
            for r in range(R):
                sc = cute.arch.shuffle_sync(scale, 16 * h + ((r * n + i) << shift))
                v = [_mul_rn(xnv[(r, i, c)] if self.hold else xn(r, i, c, g, 2), sc) for c in range(VEC)]
                _stg2(rq_base + I64(row0 + r) * K + I64(col(i)), _e4m3x4(*v[0:4]), _e4m3x4(*v[4:8]),
                      _pred(ok(r, i)))
