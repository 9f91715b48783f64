"""RMSNorm forward fused with the block-scaled FP8 quantization of xn (SPEC §5) for sm_90a, written in CuTe DSL: x
[T, K] bf16 is read from HBM once (the Triton form reads it twice: an rsigma kernel, then the quantize kernel).
Outputs, layouts and bytes are those of `kernels/triton/rmsnorm_fp8_block.py` given this kernel's rsigma:
rsigma fp32 [T]; (a) 1x128 blocks along K: codes [T, K], scale_inv M-major [K/128, T]; (b) 128x1 blocks along T:
codes transposed [K, T_pad] (T_pad = round_up(T, 16), zero codes in [T, T_pad)), scale_inv [ceil(T/128), K]. This is
the training form (`columnwise`); inference, without (b), is `rmsnorm_fp8_block_rows_sm90`'s (same bytes of (a)).

# %% Design
One cluster of C = K / 128 CTAs per 128 tokens (grid (C, ceil(T/128)), cluster (C, 1, 1); K = 1536: C = 12, past the
8 portable CTAs: sm_90 launches up to 16 a cluster, which the DSL allows its kernels): CTA `rank` of the cluster owns
columns [128 rank, 128 rank + 128), one whole 1x128 block, so a row block never straddles CTAs and only the sum of
squares crosses them. 256 threads (8 warps): warp w owns tokens [16 w, 16 w + 16) of the tile, its lanes 0-15 the first
8, lanes 16-31 the next 8 (the lane's `half`), lane l columns [8 (l % 16), 8 (l % 16) + 8) of the CTA's 128, so a thread
holds 8 tokens x 8 columns = 32 packed bf16x2 registers:
- x is loaded once, all 8 loads of a thread issued up front (16-byte `ld.global.nc.v4`, each a warp's 2 x 256
  contiguous bytes of two rows; rows past T are predicated off and read as 0), and stays in registers to the end: 32
  registers of data, 80 in all (ptxas, sm_90a: no spills), three CTAs an SM (96 KB of loads in flight) with shared
  memory to spare (~27 KB a CTA). Half the
  columns of the former two-block CTA: a CTA's compute (the SM idles on it in the first wave and in the last) halves.
- sum of squares: fma over the thread's 8 columns per token, then a transposed butterfly over the half-warp (xor 8,
  4, 2 halve the 8 tokens a lane keeps, xor 1 ends it: 8 shuffles for 8 tokens instead of 32) leaves each lane pair
  the CTA's partial of one token (the half-warp spans all 128 columns of the CTA). Partials go to shared memory; after
  a CTA barrier warp 0 pushes the CTA's 128 partials to every CTA of the cluster, itself included (st.async, 16 bytes
  a lane a rank, each completing its bytes on the receiving CTA's mbarrier, which expects C x 512), and thread i < 128
  sums token i's C partials in rank order once its mbarrier's phase completes, so every CTA of the cluster has
  rsigma's identical bits: rsigma = 1 / sqrt(sum / K + eps) with div.rn and sqrt.rn (the Triton rsigma kernel's
  formula; its sum runs in another order, so the two rsigma may differ in the last bits). A push needs no release
  fence (a pull through ld.shared::cluster needs a release arrive, whose fence waits on the memory system, and an exit
  barrier so that no CTA leaves while another reads its shared memory); a CTA never goes on before every write
  addressed to it has landed. The mbarriers are initialized before any st.async can reach them: a relaxed cluster
  arrive at the start, its wait after the sum of squares.
- xn = (x * rsigma) * g with two mul.rn (no contraction), recomputed in each pass (2 multiplies) instead of held.
  Pass 1: amaxes (abs + max.f32, which ignores NaN): per token over the thread's 8 columns, then the half-warp's
  transposed butterfly (xor 8, 4, 2, 1) leaves lanes l, l ^ 1 the amax of the same token as the sum of squares: one
  scale a lane pair (the SPEC's rule as in `reference.fp8_block.fp8_block_scale`: div.rn, FLT_MAX on overflow, pow2
  clears the mantissa; scale_inv = div.rn(1, scale)), stored by the even lane into [K/128, T] (8 contiguous tokens a
  half-warp). Per column over the thread's 8 tokens, then with the other half (xor 16), then across the 8 warps in
  shared memory: thread c < 128 reduces column c, stores its scale_inv (128 contiguous floats of [ceil(T/128), K]).
  Rows past T hold x = 0, so their xn is 0 (or NaN with an inf / NaN weight, or rsigma inf with eps 0), which never
  changes a column's scale: amax 0 and NaN both give scale 1.
- Pass 2, four tokens at a time: codes = cvt.rn.satfinite.e4m3x2.f32 of fp32(xn * scale) (round to nearest even,
  saturate to ±448, NaN -> 0x7F); a token's 8 row codes are one 8-byte store (a half-warp writes 128 contiguous bytes
  of a row), a column's codes of 4 tokens one 32-bit word (masked to zero bytes for tokens >= T), written to shared
  memory: the CTA's 128 columns x 128 tokens of codes (16 KB, a column's 16-byte chunk k of tokens [16 k, 16 k + 16)
  at chunk k ^ ((column >> 3) & 7), its words rotated by (column >> 6) & 1, so neither the writers' 4-byte stores nor
  the readers' 16-byte loads conflict on banks). After a CTA barrier, 8 lanes read one column's 128 tokens and store
  them as one whole 128-byte line of the transposed [K, T_pad] (16-aligned: T_pad % 16 == 0; chunks at or past T_pad
  are skipped): writes of whole lines, where a thread's own column store would cover 16 bytes of a 32-byte sector.
Global addresses are 64-bit (T * K may pass 2^31). T is a run-time extent: one binary serves every T (grid y <= 65535:
T <= 8,388,480). The kernel is compiled per (K, norm-weight dtype fp32 / bf16, zero-centered gamma, block
scale "pow2" / "fp32"); "deepseek" scales, other dtypes of x and K not a multiple of 128 up to 2048 stay on the
Triton kernels.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ..._constants import E4M3_MAX, FP8_BLOCK
from .rope_gemm_sm90 import _absmax, _asm, _bits_f32, _f32_bits, _fma_rn, _fmax, _mul_rn

F32, I32, I64 = cutlass.Float32, cutlass.Int32, cutlass.Int64
COLS = 128  # columns of x per CTA: one 1x128 block
THREADS = 256  # 8 warps: 16 tokens each, 8 a half-warp
TOKENS = 8  # tokens per thread
VEC = 8  # columns per thread (one 16-byte load of bf16)
BLOCK_SCALES = ("pow2", "fp32")
MAX_CLUSTER = 16  # the largest (non-portable) cluster sm_90 launches


def cluster_size(K: int) -> int:
    return K // COLS


def geometry_ok(K: int) -> bool:
    """K the kernel covers: whole 256-column CTA slices, at most 8 CTAs a cluster."""
    return K > 0 and K % COLS == 0 and K // COLS <= MAX_CLUSTER


def check_variant(K: int, block_scale: str, w_dtype) -> None:
    """ValueError for a variant no RMSNorm kernel here compiles (training or inference form)."""
    if not geometry_ok(K):
        raise ValueError(f"unsupported K={K}: a multiple of {COLS} up to {COLS * MAX_CLUSTER}")
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"unsupported block_scale {block_scale!r}")
    if w_dtype not in (cutlass.Float32, cutlass.BFloat16):
        raise ValueError(f"unsupported norm weight dtype {w_dtype}")


# ------------------------------------------------------------------------------------------------ PTX helpers


@dsl_user_op
def _add_rn(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    return _asm(F32, ((F32, a), (F32, b)), "add.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip)


@dsl_user_op
def _div_rn(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """a / b correctly rounded (subnormals kept: no .ftz)."""
    return _asm(F32, ((F32, a), (F32, b)), "div.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip)


@dsl_user_op
def _sqrt_rn(a: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    return _asm(F32, ((F32, a),), "sqrt.rn.f32 $0, $1;", "=f,f", loc, ip)


@dsl_user_op
def _lo_bf16(w: cutlass.Int32, tag: int = 0, *, loc=None, ip=None) -> cutlass.Float32:
    """The bf16 in the low half of w (the lower address) widened to fp32 (exact). tag: a PTX comment that keeps the
    passes' copies apart (identical pure asm would be merged, and its results held in registers across passes)."""
    return _asm(F32, ((I32, w),), f"shl.b32 $0, $1, 16; /* {tag} */", "=f,r", loc, ip)


@dsl_user_op
def _hi_bf16(w: cutlass.Int32, tag: int = 0, *, loc=None, ip=None) -> cutlass.Float32:
    """The bf16 in the high half of w widened to fp32 (exact); tag as in `_lo_bf16`."""
    return _asm(F32, ((I32, w),), f"and.b32 $0, $1, 0xffff0000; /* {tag} */", "=f,r", loc, ip)


@dsl_user_op
def _mul_rn_t(a: cutlass.Float32, b: cutlass.Float32, tag: int, *, loc=None, ip=None) -> cutlass.Float32:
    """`_mul_rn` (a·b rounded on its own, never contracted) tagged as `_lo_bf16`: xn is recomputed in each pass."""
    return _asm(F32, ((F32, a), (F32, b)), f"mul.rn.f32 $0, $1, $2; /* {tag} */", "=f,f,f", loc, ip)


@dsl_user_op
def _e4m3x4(a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32, d: cutlass.Float32, *, loc=None,
            ip=None) -> cutlass.Int32:
    """E4M3 codes of a, b, c, d (round to nearest even, saturate to ±448, NaN -> 0x7F) in one word, a in the low
    byte (memory order a, b, c, d). cvt.rn.satfinite.e4m3x2.f32 d, x, y puts x's code in the high byte."""
    return _asm(I32, ((F32, a), (F32, b), (F32, c), (F32, d)),
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", loc, ip)


def _words(n: int, addr_args, text: str, constraints: str, loc, ip, side_effects: bool) -> list:
    """An inline PTX statement with n 32-bit results (an LLVM struct), as a list of Int32."""
    i32 = I32.mlir_type
    st = llvm.StructType.get_literal([i32] * n)
    res = llvm.inline_asm(st, [t(v).ir_value(loc=loc, ip=ip) for t, v in addr_args], text, constraints,
                          has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [I32(llvm.extractvalue(i32, res, [k], loc=loc, ip=ip)) for k in range(n)]


@dsl_user_op
def _ldg4(addr: cutlass.Int64, pred: cutlass.Int32, *, loc=None, ip=None) -> list:
    """16 bytes at a global address as 4 words, read through the non-coherent path (x is read-only here); pred 0:
    no load, the words are 0."""
    return _words(4, ((I64, addr), (I32, pred)),
                  "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
                  "mov.b32 $3, 0; @p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4]; }",
                  "=r,=r,=r,=r,l,r", loc, ip, False)


@dsl_user_op
def _ldg4_f32(addr: cutlass.Int64, tag: int = 0, *, loc=None, ip=None) -> list:
    """16 bytes at a global address (always valid) as 4 words; tag as in `_lo_bf16` (a load re-issued per pass)."""
    return _words(4, ((I64, addr),), f"ld.global.nc.v4.b32 {{$0, $1, $2, $3}}, [$4]; /* {tag} */", "=r,=r,=r,=r,l",
                  loc, ip, False)


@dsl_user_op
def _stg4(addr: cutlass.Int64, a: cutlass.Int32, b: cutlass.Int32, c: cutlass.Int32, d: cutlass.Int32,
          pred: cutlass.Int32, *, loc=None, ip=None) -> None:
    """16 bytes to a 16-aligned global address where pred != 0."""
    llvm.inline_asm(None, [I64(addr).ir_value(loc=loc, ip=ip)] + [I32(v).ir_value(loc=loc, ip=ip)
                                                                   for v in (a, b, c, d, pred)],
                    "{ .reg .pred p; setp.ne.b32 p, $5, 0; @p st.global.v4.b32 [$0], {$1, $2, $3, $4}; }",
                    "l,r,r,r,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _stg2(addr: cutlass.Int64, a: cutlass.Int32, b: cutlass.Int32, pred: cutlass.Int32, *, loc=None,
          ip=None) -> None:
    """8 bytes to an 8-aligned global address where pred != 0."""
    llvm.inline_asm(None, [I64(addr).ir_value(loc=loc, ip=ip)] + [I32(v).ir_value(loc=loc, ip=ip)
                                                                   for v in (a, b, pred)],
                    "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.v2.b32 [$0], {$1, $2}; }",
                    "l,r,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _sts32(addr: cutlass.Int32, v: cutlass.Int32, *, loc=None, ip=None) -> None:
    """One 32-bit word to a shared-memory address."""
    llvm.inline_asm(None, [I32(addr).ir_value(loc=loc, ip=ip), I32(v).ir_value(loc=loc, ip=ip)],
                    "st.shared.b32 [$0], $1;", "r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _lds4(addr: cutlass.Int32, *, loc=None, ip=None) -> list:
    """16 bytes at a shared-memory address as 4 words (ordered after the barrier: side effects)."""
    return _words(4, ((I32, addr),), "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip, True)


@dsl_user_op
def _stg_f32(addr: cutlass.Int64, v: cutlass.Float32, pred: cutlass.Int32, *, loc=None, ip=None) -> None:
    """One fp32 to a global address where pred != 0."""
    llvm.inline_asm(None, [I64(addr).ir_value(loc=loc, ip=ip), F32(v).ir_value(loc=loc, ip=ip),
                           I32(pred).ir_value(loc=loc, ip=ip)],
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.f32 [$0], $1; }",
                    "l,f,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _st_async4(smem_addr: cutlass.Int32, rank: cutlass.Int32, mbar_addr: cutlass.Int32, a: cutlass.Int32,
               b: cutlass.Int32, c: cutlass.Int32, d: cutlass.Int32, *, loc=None, ip=None) -> None:
    """16 bytes to this shared-memory address in the CTA of cluster rank `rank`, completing 16 bytes of the
    transaction count of that CTA's mbarrier at mbar_addr (both addresses as in this CTA: mapa translates them)."""
    llvm.inline_asm(None, [I32(v).ir_value(loc=loc, ip=ip) for v in (smem_addr, rank, mbar_addr, a, b, c, d)],
                    "{ .reg .b32 ra, rb; mapa.shared::cluster.u32 ra, $0, $1; mapa.shared::cluster.u32 rb, $2, $1; "
                    "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [ra], {$3, $4, $5, $6}, [rb]; }",
                    "r,r,r,r,r,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


def _scale_rule(amax, pow2: bool):
    """(scale, scale_inv) of a block with this amax (>= 0 or NaN): `reference.fp8_block.fp8_block_scale` step by
    step. 1.0 for amax 0, NaN or inf; else fp32(448 / amax) correctly rounded, FLT_MAX where that is inf; "pow2"
    clears its mantissa bits; scale_inv = fp32(1 / scale) (exact for pow2, 2^-127 subnormal included)."""
    bits = _f32_bits(amax) & 0x7FFFFFFF
    special = (bits == 0) | ((bits & 0x7F800000) == 0x7F800000)
    safe = cutlass.select_(special, F32(1.0), amax)
    scale = _div_rn(F32(E4M3_MAX), safe)
    sb = _f32_bits(scale)
    sb = cutlass.select_(sb == 0x7F800000, I32(0x7F7FFFFF), sb)  # overflow: FLT_MAX
    if pow2:
        sb = sb & 0x7F800000
    scale = cutlass.select_(special, F32(1.0), _bits_f32(I32(sb)))
    return F32(scale), _div_rn(F32(1.0), F32(scale))


class RMSNormFp8BlockSm90:
    """rsigma, xn's 1x128 codes + M-major scale_inv and 128x1 codes transposed + scale_inv (the training form),
    from x [T, K] bf16 read once; clusters of K/128 CTAs per 128 tokens."""

    def __init__(self, K: int, zero_centered: bool, block_scale: str = "pow2", w_dtype=cutlass.Float32):
        check_variant(K, block_scale, w_dtype)
        self.K, self.C = K, cluster_size(K)
        self.zero_centered = bool(zero_centered)
        self.pow2 = block_scale == "pow2"
        self.w_f32 = w_dtype == cutlass.Float32

    # ------------------------------------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mRs: cute.Tensor, mRowQ: cute.Tensor, mRowS: cute.Tensor,
                 mColQ: cute.Tensor, mColS: cute.Tensor, eps: cutlass.Float32, stream: cuda.CUstream):
        """mX [T, K] bf16 (row stride K), mW [K] fp32 / bf16, written: mRs [T] f32, mRowQ [T, K] e4m3, mRowS
        [K/128, T] f32, mColQ [K, T_pad] e4m3, mColS [ceil(T/128), K] f32."""
        T = mX.shape[0]
        t_pad = mColQ.shape[1]
        n_tiles = (T + FP8_BLOCK - 1) // FP8_BLOCK
        self.kernel(mX, mW, mRs, mRowQ, mRowS, mColQ, mColS, eps, T, t_pad).launch(
            grid=[self.C, n_tiles, 1], block=[THREADS, 1, 1], cluster=[self.C, 1, 1], stream=stream)

    # ---------------------------------------------------------------------------------------------- device

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mRs: cute.Tensor, mRowQ: cute.Tensor, mRowS: cute.Tensor,
               mColQ: cute.Tensor, mColS: cute.Tensor, eps: cutlass.Float32, T: cutlass.Int32,
               t_pad: cutlass.Int32):
        K, C = self.K, self.C
        tidx, _, _ = cute.arch.thread_idx()
        _, tile, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())  # the CTA's column slice
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        smem = cutlass.memory.SmemAllocator()
        sPart = smem.allocate_tensor(F32, cute.make_layout(FP8_BLOCK), byte_alignment=16)  # this CTA's partials
        sAll = smem.allocate_tensor(F32, cute.make_layout((FP8_BLOCK, C)), byte_alignment=16)  # (token, rank)
        mbar = smem.allocate_tensor(I64, cute.make_layout(1), byte_alignment=8)
        # every CTA's partials arrive here by st.async, counted on this mbarrier. The peers' mbarriers must be
        # initialized before the first st.async: a relaxed cluster arrive now, its wait once the loads are issued
        if tidx == 0:
            cute.arch.mbarrier_init(mbar.iterator, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        sRs = smem.allocate_tensor(F32, cute.make_layout(FP8_BLOCK), byte_alignment=16)  # rsigma of the tile
        sRowSc = smem.allocate_tensor(F32, cute.make_layout(FP8_BLOCK), byte_alignment=16)  # row scale of a token
        sColAm = smem.allocate_tensor(F32, cute.make_layout((COLS, 8)), byte_alignment=16)  # (column, warp)
        sColSc = smem.allocate_tensor(F32, cute.make_layout(COLS), byte_alignment=16)
        # the tile's column codes transposed, [128 columns][128 tokens] bytes (16 KB); a column's 16-byte chunk k
        # (tokens 16 k ..) sits at chunk k ^ ((column >> 3) & 7), its words rotated by (column >> 6) & 1: the
        # writers' 4-byte stores and the readers' 16-byte loads are free of bank conflicts
        sColQ = smem.allocate_tensor(I32, cute.make_layout(COLS * FP8_BLOCK // 4), byte_alignment=128)

        half = lane >> 4  # which 8 of the warp's 16 tokens
        cg = lane & 15  # column group: the thread's 8 columns of the CTA's 128
        t_loc = warp * TOKENS * 2 + half * TOKENS  # the thread's first token in the tile
        t_base = tile * FP8_BLOCK + t_loc
        c_cta = rank * COLS
        c_thr = c_cta + cg * VEC  # the thread's first column
        x_base = mX.iterator.toint()
        # ---- x: 8 loads of 16 bytes, issued together; rows past T read as 0
        xw = []
        for j in cutlass.range_constexpr(TOKENS):
            t = t_base + j
            addr = x_base + (I64(t) * K + I64(c_thr)) * 2
            xw.append(_ldg4(addr, I32(cutlass.select_(t < T, I32(1), I32(0)))))
        # ---- the norm weight of the thread's 8 columns (fp32), + 1 where zero-centered
        w_base = mW.iterator.toint()
        g = []
        if cutlass.const_expr(self.w_f32):
            for h in cutlass.range_constexpr(2):
                for wd in _ldg4_f32(w_base + I64(c_thr + 4 * h) * 4):
                    g.append(_bits_f32(wd))
        else:
            for wd in _ldg4_f32(w_base + I64(c_thr) * 2):
                g.append(_lo_bf16(wd))
                g.append(_hi_bf16(wd))
        if cutlass.const_expr(self.zero_centered):
            g = [_add_rn(v, F32(1.0)) for v in g]

        def xval(j, c, tag):  # x[token j, column c] of the thread, fp32 (tag: the pass)
            wd = xw[j][c // 2]
            return _lo_bf16(wd, tag) if c % 2 == 0 else _hi_bf16(wd, tag)

        # ---- sum of squares: the thread's 8 columns per token, then the half-warp's 128 (transposed butterfly)
        ss = []
        for j in cutlass.range_constexpr(TOKENS):
            s = F32(0.0)
            for c in cutlass.range_constexpr(VEC):
                v = xval(j, c, 0)
                s = _fma_rn(v, v, s)
            ss.append(s)
        s_tok = self._butterfly(ss, lane, (8, 4, 2, 1), _add_rn)[0]  # token 4 b3 + 2 b2 + b1 of the lane's half
        tok = ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1)
        if lane % 2 == 0:
            sPart[t_loc + tok] = s_tok
        # ---- warp 0 sends the CTA's 128 partials to every CTA of the cluster (itself included), 16 bytes a
        # lane a rank; each CTA then sums the C partials of a token in rank order
        cute.arch.cluster_wait()  # the peers' mbarriers initialized
        cute.arch.sync_threads()  # sPart complete
        mbar_addr = mbar.iterator.toint()
        if warp == 0:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator, C * FP8_BLOCK * 4)
            pw = _lds4((sPart.iterator + lane * 4).toint())
            dst = (sAll.iterator + rank * FP8_BLOCK + lane * 4).toint()
            for r in cutlass.range_constexpr(C):
                _st_async4(dst, I32(r), mbar_addr, pw[0], pw[1], pw[2], pw[3])
        cute.arch.mbarrier_wait(mbar.iterator, 0)
        if tidx < FP8_BLOCK:
            tot = sAll[(tidx, 0)]
            for r in cutlass.range_constexpr(1, C):
                tot = _add_rn(tot, sAll[(tidx, r)])
            rs = _div_rn(F32(1.0), _sqrt_rn(_add_rn(_div_rn(tot, F32(float(K))), eps)))
            sRs[tidx] = rs
            t_rs = tile * FP8_BLOCK + tidx
            _stg_f32(mRs.iterator.toint() + I64(t_rs) * 4, rs,
                     I32(cutlass.select_((rank == 0) & (t_rs < T), I32(1), I32(0))))
        cute.arch.sync_threads()
        rsv = [sRs[t_loc + j] for j in range(TOKENS)]

        def xn(j, c, tag):  # (x * rsigma) * g, the reference's op order
            return _mul_rn_t(_mul_rn_t(xval(j, c, tag), rsv[j], tag), g[c], tag)

        # ---- pass 1: amaxes
        ra = []
        ca = [F32(0.0)] * VEC
        for j in cutlass.range_constexpr(TOKENS):
            a = F32(0.0)
            for c in cutlass.range_constexpr(VEC):
                v = xn(j, c, 1)
                a = _absmax(a, v)
                ca[c] = _absmax(ca[c], v)
            ra.append(a)
        a_tok = self._butterfly(ra, lane, (8, 4, 2, 1), _fmax)[0]  # token tok of the lane's half
        r_scale, r_sinv = _scale_rule(a_tok, self.pow2)
        t_own = t_base + tok
        if lane % 2 == 0:
            _stg_f32(mRowS.iterator.toint() + (I64(rank) * T + I64(t_own)) * 4, r_sinv,
                     I32(cutlass.select_(t_own < T, I32(1), I32(0))))
            sRowSc[t_loc + tok] = r_scale
        # the warp's 16 tokens: the two halves' column amaxes combined, stored by the first half
        ca = [_fmax(v, cute.arch.shuffle_sync_bfly(v, 16)) for v in ca]
        if half == 0:
            for c in cutlass.range_constexpr(VEC):
                sColAm[(cg * VEC + c, warp)] = ca[c]
        cute.arch.sync_threads()
        if tidx < COLS:
            m = sColAm[(tidx, 0)]
            for w in cutlass.range_constexpr(1, 8):
                m = _fmax(m, sColAm[(tidx, w)])
            c_scale, c_sinv = _scale_rule(m, self.pow2)
            mColS[(tile, c_cta + tidx)] = c_sinv  # [ceil(T/128), K]: the tile exists
            sColSc[tidx] = c_scale
        cute.arch.sync_threads()
        csc = [sColSc[cg * VEC + c] for c in range(VEC)]

        # ---- pass 2: codes, four tokens at a time
        rq_base = mRowQ.iterator.toint()
        # writer: column cg * 8 + c, chunk warp (the column's tokens 16 warp ..), word 2 half + q
        cq_w = sColQ.iterator.toint() + cg * (VEC * FP8_BLOCK) + ((warp ^ (cg & 7)) * 16)
        for q in cutlass.range_constexpr(2):
            cv = [[None] * 4 for _ in range(VEC)]
            for jj in cutlass.range_constexpr(4):
                j = 4 * q + jj
                rsc = sRowSc[t_loc + j]
                vals = []
                for c in cutlass.range_constexpr(VEC):
                    v = xn(j, c, 2)
                    vals.append(_mul_rn(v, rsc))
                    cv[c][jj] = _mul_rn(v, csc[c])
                t = t_base + j
                _stg2(rq_base + I64(t) * K + I64(c_thr), _e4m3x4(*vals[0:4]), _e4m3x4(*vals[4:8]),
                      I32(cutlass.select_(t < T, I32(1), I32(0))))
            n_ok = cutlass.min(cutlass.max(T - (t_base + 4 * q), I32(0)), I32(4))
            # bytes of tokens < T kept (no shift by 32: n_ok = 4 is the select's other arm)
            mask = cutlass.select_(n_ok == 4, I32(-1), (I32(1) << (cutlass.min(n_ok, I32(3)) * 8)) - 1)
            wq = cq_w + (((2 * half + q) ^ (cg >> 3)) * 4)
            for c in cutlass.range_constexpr(VEC):
                _sts32(wq + c * FP8_BLOCK, _e4m3x4(*cv[c]) & mask)
        # the transposed codes leave as whole 128-byte lines: 8 lanes a column (chunk k = lane % 8), 4 columns
        # a warp, 32 a pass; chunks at or past T_pad are not stored
        cute.arch.sync_threads()
        cq_base = mColQ.iterator.toint()
        k = lane & 7
        t_k = tile * FP8_BLOCK + k * 16
        ok = I32(cutlass.select_(t_k < t_pad, I32(1), I32(0)))
        for p in cutlass.range_constexpr(COLS // 32):
            cl = p * 32 + warp * 4 + (lane >> 3)
            wd = _lds4(sColQ.iterator.toint() + cl * FP8_BLOCK + ((k ^ ((cl >> 3) & 7)) * 16))
            r = (p >> 1) & 1  # the words' rotation: (cl >> 6) & 1, the same for the whole pass
            _stg4(cq_base + I64(c_cta + cl) * I64(t_pad) + I64(t_k), *[wd[qq ^ r] for qq in range(4)], ok)

    @staticmethod
    def _butterfly(vals: list, lane, masks, op) -> list:
        """A transposed reduction over lanes: at each xor mask m, a lane with (lane & m) keeps the upper half of its
        list and sends the lower half to its partner, which does the reverse; op(kept, received) (commutative, so
        both partners of a pair compute the same bits); a mask met with one value left combines it with the
        partner's. 8 values over masks (8, 4, 2, 1) end in one value a lane: the reduction over the lane's 16-lane
        half of token 4 b3 + 2 b2 + b1 (b_i: lane's bit i), the same bits on lanes l and l ^ 1."""
        for m in masks:
            if len(vals) == 1:
                vals = [op(F32(vals[0]), cute.arch.shuffle_sync_bfly(F32(vals[0]), m))]
                continue
            n = len(vals) // 2
            up = (lane & m) != 0
            out = []
            for i in range(n):
                keep = cutlass.select_(up, vals[n + i], vals[i])
                send = cutlass.select_(up, vals[i], vals[n + i])
                out.append(op(F32(keep), cute.arch.shuffle_sync_bfly(F32(send), m)))
            vals = out
        return vals
