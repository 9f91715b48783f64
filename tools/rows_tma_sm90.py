"""Probe (tools/probe_flush.py): the inference RMSNorm + 1x128 quantize of `rmsnorm_fp8_block_rows_sm90.py`, persistent,
with x staged through shared memory by bulk copies (cp.async.bulk, one per row group, completing on an mbarrier) that
run `stages` groups ahead of each warp's arithmetic. The question: does decoupling the loads from the registers take
away the fixed cost the register-loading kernel pays at T = 16384 (all CTAs of a wave load, then all compute)?

Each warp owns a ring of `stages` buffers of R rows (R K 2 bytes each) and one mbarrier a buffer; lane 0 issues the
copies. A warp walks the row groups gw, gw + W grid, ...; after reading a buffer into registers (16-byte ld.shared,
the same lane / column map as the register kernel) and a warp barrier, lane 0 refills it with the group `stages`
ahead. The arithmetic is the register kernel's, xn held (so the bytes are the training form's).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from mla_qproj.kernels.cute.rmsnorm_fp8_block_rows_sm90 import CHUNK, MASKS, RMSNormFp8BlockRowsSm90
from mla_qproj.kernels.cute.rmsnorm_fp8_block_sm90 import (
    COLS,
    VEC,
    RMSNormFp8BlockSm90,
    _add_rn,
    _bits_f32,
    _div_rn,
    _e4m3x4,
    _hi_bf16,
    _lds4,
    _ldg4_f32,
    _lo_bf16,
    _mul_rn_t,
    _scale_rule,
    _sqrt_rn,
    _stg2,
    _stg_f32,
)
from mla_qproj.kernels.cute.rope_gemm_sm90 import _absmax, _fma_rn, _fmax, _mul_rn

F32, I32, I64 = cutlass.Float32, cutlass.Int32, cutlass.Int64


@dsl_user_op
def _bulk_g2s(dst: cutlass.Int32, src: cutlass.Int64, nbytes: cutlass.Int32, mbar: cutlass.Int32, *, loc=None,
              ip=None) -> None:
    """nbytes (a multiple of 16) from global src to shared dst, completing on the mbarrier at mbar."""
    llvm.inline_asm(None, [I32(dst).ir_value(loc=loc, ip=ip), I64(src).ir_value(loc=loc, ip=ip),
                           I32(nbytes).ir_value(loc=loc, ip=ip), I32(mbar).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                    "r,l,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


class RowsTmaSm90(RMSNormFp8BlockRowsSm90):
    def __init__(self, K, zero_centered, block_scale="pow2", w_dtype=cutlass.Float32, rows=2, stages=2, ctas=528,
                 warps=4, cap=4):
        super().__init__(K, zero_centered, block_scale, w_dtype, rows)
        self.hold = True
        self.stages, self.ctas, self.warps, self.cap = stages, ctas, warps, cap
        self.stage_bytes = rows * K * 2

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mRs: cute.Tensor, mRowQ: cute.Tensor, mRowS: cute.Tensor,
                 mColQ: cute.Tensor, mColS: cute.Tensor, eps: cutlass.Float32, stream: cuda.CUstream):
        T = mX.shape[0]
        cap = dict(min_blocks_per_mp=self.cap) if self.cap else {}
        self.kernel(mX, mW, mRs, mRowQ, mRowS, eps, T).launch(
            grid=[self.ctas, 1, 1], block=[self.warps * 32, 1, 1], stream=stream,
            max_number_threads=[self.warps * 32, 1, 1], preferred_smem_carveout=100, **cap)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mRs: cute.Tensor, mRowQ: cute.Tensor, mRowS: cute.Tensor,
               eps: cutlass.Float32, T: cutlass.Int32):
        K, C, n, R, S, shift = self.K, self.C, self.n, self.R, self.S, self.shift
        ST, W, SB = self.stages, self.warps, self.stage_bytes
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        h = lane >> 4
        cg = lane & 15

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(I32, cute.make_layout(W * ST * SB // 4), byte_alignment=128)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(W * ST), byte_alignment=8)
        if lane == 0:
            for s in cutlass.range_constexpr(ST):
                cute.arch.mbarrier_init(mbar.iterator + warp * ST + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()

        gw = bid * W + warp
        TW = self.ctas * W
        G = (T + R - 1) // R
        iters = I32(0)
        if gw < G:
            iters = (G - gw + TW - 1) // TW
        x_base = mX.iterator.toint()
        s_base = sX.iterator.toint()
        m_base = mbar.iterator.toint()

        if lane == 0:  # the first `stages` groups
            for s in cutlass.range_constexpr(ST):
                if s < iters:
                    gp = gw + s * TW
                    nrows = T - gp * R
                    nrows = cutlass.select_(nrows > R, I32(R), nrows)
                    nb = nrows * (K * 2)
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator + warp * ST + s, nb)
                    _bulk_g2s(I32(s_base) + (warp * ST + s) * SB, x_base + I64(gp * R) * (K * 2), nb,
                              I32(m_base) + (warp * ST + s) * 8)

        w_base = mW.iterator.toint()
        rq_base = mRowQ.iterator.toint()
        rs_base = mRs.iterator.toint()
        sc_base = mRowS.iterator.toint()
        for k in cutlass.range(iters, unroll=1):
            s = k % ST
            ph = (k // ST) & 1
            g_cur = gw + k * TW
            row0 = g_cur * R
            cute.arch.mbarrier_wait(mbar.iterator + warp * ST + s, ph)

            def col(i):
                return CHUNK * i + COLS * h + VEC * cg if 2 * i + 1 < C else CHUNK * i + VEC * cg

            def gvals(i, tag):
                g = []
                if cutlass.const_expr(self.w_f32):
                    for q in cutlass.range_constexpr(2):
                        g += [_bits_f32(wd) for wd in _ldg4_f32(w_base + I64(col(i) + 4 * q) * 4, tag)]
                else:
                    for wd in _ldg4_f32(w_base + I64(col(i)) * 2, tag):
                        g += [_lo_bf16(wd, tag), _hi_bf16(wd, tag)]
                if cutlass.const_expr(self.zero_centered):
                    g = [_add_rn(v, F32(1.0)) for v in g]
                return g

            def pred(b):
                return I32(cutlass.select_(b, I32(1), I32(0)))

            buf = I32(s_base) + (warp * ST + s) * SB
            xw = [[_lds4(buf + (r * K + col(i)) * 2) for i in range(n)] for r in range(R)]
            cute.arch.sync_warp()
            if lane == 0:
                if k + ST < iters:
                    gn = g_cur + ST * TW
                    nrows = T - gn * R
                    nrows = cutlass.select_(nrows > R, I32(R), nrows)
                    nb = nrows * (K * 2)
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator + warp * ST + s, nb)
                    _bulk_g2s(buf, x_base + I64(gn * R) * (K * 2), nb, I32(m_base) + (warp * ST + s) * 8)

            def row_ok(r):
                return (row0 + r) < T

            def ok(r, i):
                return row_ok(r) if 2 * i + 1 < C else row_ok(r) & (h == 0)

            def xval(r, i, c, tag):
                wd = xw[r][i][c // 2]
                return _lo_bf16(wd, tag) if c % 2 == 0 else _hi_bf16(wd, tag)

            pad = [F32(0.0)] * (S - R * n)
            ss = []
            for r in cutlass.range_constexpr(R):
                for i in cutlass.range_constexpr(n):
                    sq = F32(0.0)
                    for c in cutlass.range_constexpr(VEC):
                        v = xval(r, i, c, 0)
                        sq = _fma_rn(v, v, sq)
                    ss.append(sq)
            part = RMSNormFp8BlockSm90._butterfly(ss + pad, lane, MASKS, _add_rn)[0]
            rsv = []
            for r in cutlass.range_constexpr(R):
                tot = None
                for b in cutlass.range_constexpr(C):
                    p = cute.arch.shuffle_sync(part, 16 * (b % 2) + ((r * n + b // 2) << shift))
                    tot = p if tot is None else _add_rn(tot, p)
                rs = _div_rn(F32(1.0), _sqrt_rn(_add_rn(_div_rn(tot, F32(float(K))), eps)))
                rsv.append(rs)
                _stg_f32(rs_base + I64(row0 + r) * 4, rs, pred((lane == r) & row_ok(r)))

            am = [[None] * n for _ in range(R)]
            xnv = {}
            for i in cutlass.range_constexpr(n):
                g = gvals(i, 1)
                for r in cutlass.range_constexpr(R):
                    a = F32(0.0)
                    for c in cutlass.range_constexpr(VEC):
                        xnv[(r, i, c)] = _mul_rn_t(_mul_rn_t(xval(r, i, c, 1), rsv[r], 1), g[c], 1)
                        a = _absmax(a, xnv[(r, i, c)])
                    am[r][i] = a
            a_slot = RMSNormFp8BlockSm90._butterfly([a for rr in am for a in rr] + pad, lane, MASKS, _fmax)[0]
            scale, sinv = _scale_rule(a_slot, self.pow2)
            s_own = cg >> shift
            r_own, i_own = s_own // n, s_own % n
            b_own, t_own = 2 * i_own + h, row0 + r_own
            first = (cg & ((1 << shift) - 1)) == 0
            _stg_f32(sc_base + (I64(b_own) * T + I64(t_own)) * 4, sinv,
                     pred(first & (s_own < R * n) & (b_own < C) & (t_own < T)))
            for i in cutlass.range_constexpr(n):
                for r in cutlass.range_constexpr(R):
                    sc = cute.arch.shuffle_sync(scale, 16 * h + ((r * n + i) << shift))
                    v = [_mul_rn(xnv[(r, i, c)], sc) for c in range(VEC)]
                    _stg2(rq_base + I64(row0 + r) * K + I64(col(i)), _e4m3x4(*v[0:4]), _e4m3x4(*v[4:8]),
                          pred(ok(r, i)))
