"""The CuTe DSL RMSNorm + block-scaled FP8 quantize (kernels/cute/rmsnorm_fp8_block*.py, SPEC §5): x read once.

CPU lane: the launcher's coverage rules; the sm_90a kernels compiled offline, their SASS checked (training: no local
memory, 16-byte loads, cluster barriers and distributed-shared-memory loads, E4M3 conversions, three CTAs an SM by
registers; inference: no barrier or shared memory, exact load, shuffle, conversion and store counts, four CTAs an SM);
an emulation of each kernel's thread -> address mapping (every output byte written exactly once, by the thread that
holds its token and column) and of their transposed butterflies (which token or slot a lane ends with, and the
inference form's reduction trees equal to the training form's).
GPU lane (`gpu`): the five outputs against the reference: rsigma within 1e-6 of an fp64 oracle, and every code and
scale_inv byte equal to `reference.fp8_block` applied to x * rsigma * g with the kernel's rsigma (as
tests/ops/test_rmsnorm_fp8_block.py checks the Triton kernels), at partial and whole tiles, special rows, both gamma
forms and weight dtypes, pow2 and fp32 scales, training and inference; and the same bytes as the Triton kernels'
(given the CuTe rsigma where the two rsigma agree)."""

from __future__ import annotations

import importlib.util
import operator
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj.kernels.cute import rmsnorm_fp8_block as cute_rms
from mla_qproj.reference import fp8_block as F

from _helpers import INF, NAN
from _tolerances import assert_bytes_equal
from conftest import HAS_CUDA, examples

HAS_DSL = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("tvm_ffi") is not None
B = F.FP8_BLOCK
F8 = torch.float8_e4m3fn
# cluster sizes (K / 128) the GPU property draws: every one where the DSL compiles, else the prebuilt Ks
# (tools/build_cute_kernels.py --preset tests: 384, 512, 1536, 2048)
CLUSTERS = [1, 2, 3, 4, 6, 8, 12, 16] if HAS_DSL else [3, 4, 12, 16]


def _tools():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import build_cute_kernels

    return build_cute_kernels


# ------------------------------------------------------------------------------------------------------------ CPU


def test_supported_and_keys():
    bf, f32 = torch.bfloat16, torch.float32
    for K in (128, 256, 384, 512, 1024, 1536, 2048):
        assert cute_rms.supported(K, bf, f32, "pow2") and cute_rms.supported(K, bf, bf, "fp32")
    for K in (64, 192, 704, 2176, 4096):  # not whole 128-column slices, or clusters past 16 CTAs
        assert not cute_rms.supported(K, bf, f32, "pow2")
    assert not cute_rms.supported(1536, bf, f32, "deepseek")  # the Triton kernels serve it
    assert not cute_rms.supported(1536, torch.float32, f32, "pow2")  # bf16 x only
    assert not cute_rms.supported(1536, torch.float16, f32, "pow2")
    assert not cute_rms.supported(1536, bf, torch.float16, "pow2")
    keys = {cute_rms.key(1536, cw, w, zc, bs) for cw in (True, False) for w in (f32, bf) for zc in (True, False)
            for bs in ("pow2", "fp32")}
    assert len(keys) == 16
    assert cute_rms.key(1536, True, f32, False, "pow2") == "rmsnorm_fp8_block_train_k1536_wf32_g_pow2"
    assert cute_rms.key(512, False, bf, True, "fp32") == "rmsnorm_fp8_block_infer_k512_wbf16_zc_fp32"
    assert not any(k.startswith("rope_") for k in keys)


def test_off_gpu_never_serves():
    x, w = torch.zeros(4, 1536, dtype=torch.bfloat16), torch.zeros(1536)
    assert not cute_rms.serves(x, w, "pow2")
    assert not cute_rms.serves("not a tensor", w, "pow2")  # never raises


def _butterfly(vals: list[list], masks, op=operator.add) -> list[list]:
    """`RMSNormFp8BlockSm90._butterfly` on 32 lanes in plain Python (op: + by default, exact on integers)."""
    for m in masks:
        if len(vals[0]) == 1:  # one value left: combined with the partner's
            vals = [[op(vals[lane][0], vals[lane ^ m][0])] for lane in range(32)]
            continue
        n = len(vals[0]) // 2
        out = []
        for lane in range(32):
            up = bool(lane & m)
            keep = vals[lane][n:] if up else vals[lane][:n]
            partner = vals[lane ^ m]
            send = partner[n:] if up else partner[:n]  # the partner sends the half this lane keeps
            out.append([op(k, s) for k, s in zip(keep, send, strict=True)])
        vals = out
    return vals


def test_butterfly_token_mapping():
    """The transposed reductions end where the kernel reads them: over a half-warp's 8 tokens, xor 8, 4, 2, 1 (the sum
    of squares and the row amax alike) give lane l the half's total of token 4 b3 + 2 b2 + b1."""
    vals = [[1000 * lane + tok for tok in range(8)] for lane in range(32)]
    red = _butterfly(vals, (8, 4, 2, 1))
    for lane in range(32):
        tok = ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1)
        half = range(16 * (lane // 16), 16 * (lane // 16) + 16)
        assert red[lane][0] == sum(vals[ln][tok] for ln in half), lane


def _rows_geometry(K: int, R: int) -> tuple[int, int, int, int]:
    """The inference form's (C, n, S, shift) by its formulas (rmsnorm_fp8_block_rows_sm90.py): K / 128 blocks, n
    256-column chunks, S slots (R n up to a power of two), slot s ending on the lanes 16 h + (s << shift)."""
    C, n = K // 128, -(-K // 256)
    S = 1 << (R * n - 1).bit_length()
    return C, n, S, 4 - (S.bit_length() - 1)


def _tree(a, b):
    """A commutative, non-associative stand-in for fp32 +: its result is the reduction's shape."""
    return frozenset((a, b))


@pytest.mark.parametrize("K", range(128, 2049, 128))
@pytest.mark.parametrize("R", [1, 2])
def test_rows_butterfly_slots_and_trees(K, R):
    """The inference form's butterfly over S slots (row r, chunk i: slot r n + i) ends with slot (lane & 15) >> shift
    on each lane, the sum over the lane's half (block 2 i + h); the lanes it gathers a row's block partials from and
    its blocks' scales from hold them; and every slot's reduction tree over the 16 column groups is the training
    form's for every token (so the partial sums, hence rsigma, have the same bits)."""
    C, n, S, shift = _rows_geometry(K, R)
    assert S <= 16 and R * n <= S < 2 * R * n
    vals = [[1000 * lane + s for s in range(S)] for lane in range(32)]
    red = _butterfly(vals, (8, 4, 2, 1))
    for lane in range(32):
        s = (lane & 15) >> shift
        half = range(16 * (lane // 16), 16 * (lane // 16) + 16)
        assert red[lane][0] == sum(vals[ln][s] for ln in half), (lane, s)
    for r in range(R):
        for b in range(C):  # rsigma's gather: block b of row r
            src = 16 * (b % 2) + ((r * n + b // 2) << shift)
            assert src // 16 == b % 2 and ((src & 15) >> shift) == r * n + b // 2
        for i in range(n):  # pass 2's scale of chunk i, row r, for either half
            for h in range(2):
                src = 16 * h + ((r * n + i) << shift)
                assert src // 16 == h and ((src & 15) >> shift) == r * n + i
    train = _butterfly([[lane & 15] * 8 for lane in range(32)], (8, 4, 2, 1), _tree)
    rows = _butterfly([[lane & 15] * S for lane in range(32)], (8, 4, 2, 1), _tree)
    shapes = {v[0] for v in train} | {v[0] for v in rows}
    assert len(shapes) == 1 and len(next(iter(shapes))) == 2  # one tree, 16 leaves


def _emulate_rows_stores(T: int, K: int, R: int):
    """The inference form's global stores by its own index formulas, as `_emulate_stores`: a warp per R rows, 4 warps
    a CTA; lane 16 h + cg holds columns 256 i + 128 h + 8 cg of chunk i (block 2 i + h)."""
    C, n, S, shift = _rows_geometry(K, R)
    cta, warp, lane = torch.meshgrid(torch.arange(-(-T // (4 * R))), torch.arange(4), torch.arange(32),
                                     indexing="ij")
    cta, warp, lane = (v.reshape(-1) for v in (cta, warp, lane))
    h, cg = lane >> 4, lane & 15
    row0 = (cta * 4 + warp) * R
    out = {"row": [], "row_sinv": [], "rsigma": []}
    for r in range(R):
        t = row0 + r
        for i in range(n):
            whole = 2 * i + 1 < C
            col = 256 * i + 128 * h + 8 * cg if whole else 256 * i + 8 * cg
            ok = (t < T) if whole else (t < T) & (h == 0)
            for c in range(8):
                out["row"].append(torch.stack([(t * K + col + c)[ok], t[ok], (col + c)[ok]], 1))
        ok = (lane == r) & (t < T)
        out["rsigma"].append(torch.stack([t[ok], t[ok], torch.zeros_like(t[ok])], 1))
    s_own = cg >> shift
    b_own, t_own = 2 * (s_own % n) + h, row0 + s_own // n
    ok = ((cg & ((1 << shift) - 1)) == 0) & (s_own < R * n) & (b_own < C) & (t_own < T)
    out["row_sinv"].append(torch.stack([(b_own * T + t_own)[ok], t_own[ok], (b_own * 128)[ok]], 1))
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.parametrize("T", [1, 3, 7, 8, 9, 127, 1000, 4096 + 5])
@pytest.mark.parametrize("K,R", [(1536, 2), (1536, 1), (384, 2), (128, 2), (128, 1), (2048, 2), (640, 1)])
def test_rows_store_mapping_covers_every_byte_once(T, K, R):
    """The inference form writes each row code, scale_inv and rsigma once, by a lane holding its token and column
    (the scale_inv: the lane holding the block's slot), nothing past the tensors."""
    st_ = _emulate_rows_stores(T, K, R)
    sizes = {"row": T * K, "row_sinv": K // 128 * T, "rsigma": T}
    for name, rows in st_.items():
        idx = rows[:, 0]
        assert idx.numel() == sizes[name], name
        assert torch.bincount(idx, minlength=sizes[name]).eq(1).all(), f"{name}: an element written 0 or 2+ times"
    r = st_["row"]
    assert torch.equal(r[:, 0], r[:, 1] * K + r[:, 2])
    r = st_["row_sinv"]
    assert torch.equal(r[:, 0], (r[:, 2] // 128) * T + r[:, 1])


def _col_smem_writes():
    """The transposed codes' shared-memory staging, by the kernel's own index formulas: the byte address each writer
    (warp, lane, column c of its 8, word q, byte b) stores to, and the (local token, local column) it holds."""
    warp, lane, c, q, b = torch.meshgrid(*(torch.arange(n) for n in (8, 32, 8, 2, 4)), indexing="ij")
    half, cg = lane >> 4, lane & 15
    addr = cg * 1024 + (warp ^ (cg & 7)) * 16 + ((2 * half + q) ^ (cg >> 3)) * 4 + c * 128 + b
    return addr.reshape(-1), (warp * 16 + half * 8 + 4 * q + b).reshape(-1), (cg * 8 + c).reshape(-1)


def _col_smem_reads():
    """The readers: pass p, (warp, lane) loads 16 bytes of column cl at chunk k ^ ((cl >> 3) & 7) and stores word qq
    from the loaded word qq ^ ((cl >> 6) & 1) at tokens 16 k + 4 qq + b: (smem address, local token, local column)."""
    p, warp, lane, qq, b = torch.meshgrid(*(torch.arange(n) for n in (4, 8, 32, 4, 4)), indexing="ij")
    cl, k = p * 32 + warp * 4 + (lane >> 3), lane & 7
    r = (p >> 1) & 1  # the kernel's per-pass rotation
    addr = cl * 128 + (k ^ ((cl >> 3) & 7)) * 16 + (qq ^ r) * 4 + b
    return addr.reshape(-1), (k * 16 + 4 * qq + b).reshape(-1), cl.reshape(-1)


def test_column_staging_is_a_transpose():
    """Each of the 16 KB is written once and read once, and a reader finds at its address the (token, column) it
    stores; the writers' 4-byte stores of one instruction (fixed c, q) hit 32 distinct banks, and each readers'
    quarter-warp of 16-byte loads covers 128 distinct bytes (no bank conflicts)."""
    wa, wt, wc = _col_smem_writes()
    ra, rt, rc = _col_smem_reads()
    assert torch.bincount(wa, minlength=16384).eq(1).all() and torch.bincount(ra, minlength=16384).eq(1).all()
    tok, col = torch.full((16384,), -1), torch.full((16384,), -1)
    tok[wa], col[wa] = wt, wc
    assert torch.equal(tok[ra], rt) and torch.equal(col[ra], rc)
    w4 = wa.view(8, 32, 8, 2, 4)[..., 0]  # (warp, lane, c, q): word addresses
    banks = (w4 // 4) % 32
    assert all(banks[w, :, c, q].unique().numel() == 32 for w in range(8) for c in range(8) for q in range(2))
    r16 = ra.view(4, 8, 32, 4, 4)[:, :, :, 0, 0]  # (p, warp, lane): the 16-byte loads' addresses (word 0 ^ r)
    chunk = (r16 // 16)
    for p in range(4):
        for w in range(8):
            for quarter in range(4):
                ch = chunk[p, w, 8 * quarter:8 * quarter + 8]
                assert (ch % 8).unique().numel() == 8  # 8 chunks of 16 bytes over all 32 banks


def _emulate_stores(T: int, K: int, columnwise: bool):
    """Every global store of the kernel, by its own index formulas (rmsnorm_fp8_block_sm90.py), as (output, flat
    index, token, column) rows per output: which thread writes where, and the (token, column) whose value it holds
    (the column codes: the value the shared-memory staging hands the reader, `test_column_staging_is_a_transpose`).
    One cluster per 128-token tile."""
    C, t_pad, n_tiles = K // 128, -(-T // 16) * 16, -(-T // 128)
    tile, rank, warp, lane = torch.meshgrid(torch.arange(n_tiles), torch.arange(C), torch.arange(8), torch.arange(32),
                                            indexing="ij")
    tile, rank, warp, lane = (v.reshape(-1) for v in (tile, rank, warp, lane))
    t_base = tile * 128 + warp * 16 + (lane >> 4) * 8
    c_thr = rank * 128 + (lane & 15) * 8
    out = {"row": [], "row_sinv": [], "col": [], "col_sinv": [], "rsigma": []}
    for j in range(8):  # row codes: 8 bytes at t * K + c_thr, tokens < T
        t = t_base + j
        for c in range(8):
            ok = t < T
            out["row"].append(torch.stack([(t * K + c_thr + c)[ok], t[ok], (c_thr + c)[ok]], 1))
    t_own = t_base + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1)  # row scale_inv: even lanes
    kb = rank  # the CTA's block
    ok = (t_own < T) & (lane % 2 == 0)
    out["row_sinv"].append(torch.stack([(kb * T + t_own)[ok], t_own[ok], (kb * 128)[ok]], 1))
    tidx = warp * 32 + lane
    t_rs = tile * 128 + tidx
    ok = (tidx < 128) & (rank == 0) & (t_rs < T)
    out["rsigma"].append(torch.stack([t_rs[ok], t_rs[ok], torch.zeros_like(t_rs[ok])], 1))
    if columnwise:
        col = rank * 128 + tidx  # column scale_inv: thread tidx < 128, column c_cta + tidx
        ok = tidx < 128
        out["col_sinv"].append(torch.stack([(tile * K + col)[ok], (tile * 128)[ok], col[ok]], 1))
        t_k = tile * 128 + (lane & 7) * 16  # 16 bytes at (c_cta + cl) * T_pad + t_k, where t_k < T_pad
        ok = t_k < t_pad
        for p in range(4):
            cl = rank * 128 + p * 32 + warp * 4 + (lane >> 3)
            for j in range(16):
                out["col"].append(torch.stack([(cl * t_pad + t_k + j)[ok], (t_k + j)[ok], cl[ok]], 1))
    return {k: torch.cat(v) if v else torch.zeros(0, 3, dtype=torch.long) for k, v in out.items()}


@pytest.mark.parametrize("T", [1, 15, 16, 17, 127, 128, 129, 1000, 4096 + 17])
@pytest.mark.parametrize("K,columnwise", [(1536, True), (512, True), (2048, True), (128, True)])
def test_store_mapping_covers_every_byte_once(T, K, columnwise):
    """Each output element is written once and by a thread holding its token and column: row codes [T, K], scale_inv
    [K/128, T] (the lane's token and block), rsigma [T] (rank 0 only), col codes [K, T_pad] and scale_inv
    [ceil(T/128), K]; nothing past the tensors."""
    t_pad, n_tiles = -(-T // 16) * 16, -(-T // 128)
    st_ = _emulate_stores(T, K, columnwise)
    sizes = {"row": T * K, "row_sinv": K // 128 * T, "rsigma": T,
             "col": K * t_pad if columnwise else 0, "col_sinv": n_tiles * K if columnwise else 0}
    for name, rows in st_.items():
        idx = rows[:, 0]
        assert idx.numel() == sizes[name], name
        assert (idx >= 0).all() and (idx < max(sizes[name], 1)).all(), name
        assert torch.bincount(idx, minlength=sizes[name]).eq(1).all(), f"{name}: an element written 0 or 2+ times"
    r = st_["row"]
    assert torch.equal(r[:, 0], r[:, 1] * K + r[:, 2])  # [T, K]: token t, column k
    r = st_["row_sinv"]
    assert torch.equal(r[:, 0], (r[:, 2] // 128) * T + r[:, 1])  # M-major [K/128, T]
    if columnwise:
        r = st_["col"]
        assert torch.equal(r[:, 0], r[:, 2] * t_pad + r[:, 1])  # transposed [K, T_pad]
        r = st_["col_sinv"]
        assert torch.equal(r[:, 0], (r[:, 1] // 128) * K + r[:, 2])


@pytest.mark.parametrize("T", [1, 3, 4, 5, 16, 17, 100, 129])
def test_padding_byte_mask(T):
    """The kernel's word mask for the transposed codes keeps the bytes of tokens < T and zeroes the rest."""
    for t_base in range(0, -(-T // 8) * 8, 8):
        for q in range(2):
            n_ok = min(max(T - (t_base + 4 * q), 0), 4)
            mask = -1 if n_ok == 4 else (1 << (min(n_ok, 3) * 8)) - 1
            for b in range(4):
                assert bool((mask >> (8 * b)) & 0xFF) == (t_base + 4 * q + b < T)


def _sass(K: int, columnwise: bool, w_dtype: torch.dtype, zc: bool, block_scale: str, tmp_path) -> dict:
    tools = _tools()
    _, cubin = tools.compile_rms((K, columnwise, w_dtype, zc, block_scale), str(tmp_path))
    return tools.rms_sass_report(cubin, 256 if columnwise else 128)


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@pytest.mark.parametrize("K,columnwise,w_dtype,zc,block_scale", [
    (1536, True, torch.float32, False, "pow2"), (1536, True, torch.bfloat16, True, "fp32"),
    (512, True, torch.float32, True, "pow2")], ids=["v3_train", "v3_train_fp32scale", "k512_train"])
def test_offline_compile_sass(K, columnwise, w_dtype, zc, block_scale, tmp_path):
    """The sm_90a kernel compiled without a GPU: no local memory, x's 8 loads of 16 bytes a thread (plus the norm
    weight's), one cluster barrier (the mbarriers' initialization), the partial sums pushed by one 16-byte st.async a
    CTA of the cluster (read by one 16-byte shared load) and no load from another CTA's shared memory, the E4M3
    conversions (two codes each: 32 row conversions a thread, 32 more for the columnwise form), the row codes' 8
    stores of 8 bytes (shared memory: the partial, rsigma and the row scale stored, 5 loads of 16 bytes), and for the
    columnwise form the transposed codes staged in shared memory (16 more stores of 4 bytes a thread, plus the column
    scale's; 4 loads of 16 bytes, plus 2 of the column scales) and stored as 4 whole 16-byte vectors; registers for
    three CTAs an SM."""
    pytest.importorskip("nvidia.cu13", reason="needs nvidia-cuda-cuobjdump")
    rep = _sass(K, columnwise, w_dtype, zc, block_scale, tmp_path)
    summary = {k: v for k, v in rep.items() if k != "sass"}
    assert rep["STACK"] == 0 and rep["LDL"] == 0 and rep["STL"] == 0, summary
    assert rep["REG"] <= 80 and rep["CTAS_PER_SM_BY_REG"] >= 3, summary
    assert rep["LDGSTS.128"] == 0, summary
    assert rep["LDG.E.128"] == 8 + (2 if w_dtype == torch.float32 else 1), summary
    assert rep["UCGABAR_ARV"] == 1 and rep["UCGABAR_WAIT"] == 1, summary
    assert rep["STAS.128"] == K // 128 and rep["DSMEM_LD"] == 0, summary
    assert rep["F2FP_E4M3"] == (64 if columnwise else 32), summary
    assert rep["STG.E.64"] == 8 and rep["STG.E.128"] == (4 if columnwise else 0), summary
    assert rep["STS.32"] == 3 + (17 if columnwise else 0), summary
    assert rep["LDS.128"] == 5 + (6 if columnwise else 0), summary
    assert "SATFINITE.E4M3" in rep["sass"]


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@pytest.mark.parametrize("K,w_dtype,zc,block_scale", [
    (1536, torch.float32, False, "pow2"), (1536, torch.bfloat16, True, "pow2"), (384, torch.float32, True, "fp32"),
    (2048, torch.bfloat16, False, "pow2")], ids=["v3_f32w", "v3_bf16w", "k384_fp32scale", "k2048"])
def test_offline_compile_sass_inference(K, w_dtype, zc, block_scale, tmp_path):
    """The inference form (a warp per 2 rows) compiled without a GPU: no local memory, no barrier, cluster or shared
    memory of any kind; x's 2 n loads of 16 bytes (n = ceil(K / 256) chunks) and the norm weight read per chunk in
    pass 1, and again in pass 2 unless xn is held between the passes (2 n <= 12: K <= 1536); the transposed
    butterflies over S slots (S - 1 xor shuffles, plus one a mask left, for the sum of squares and for the amax), the
    index shuffles of the block partials (2 K / 128) and of the scales (2 n);
    the E4M3 conversions and one 8-byte store of codes a row and chunk; four 128-thread CTAs an SM by registers."""
    pytest.importorskip("nvidia.cu13", reason="needs nvidia-cuda-cuobjdump")
    rep = _sass(K, False, w_dtype, zc, block_scale, tmp_path)
    summary = {k: v for k, v in rep.items() if k != "sass"}
    R = 2
    C, n, S, _ = _rows_geometry(K, R)
    assert rep["STACK"] == 0 and rep["LDL"] == 0 and rep["STL"] == 0, summary
    assert rep["REG"] <= 128 and rep["CTAS_PER_SM_BY_REG"] >= 4, summary
    assert rep["BAR"] == rep["UCGABAR_ARV"] == rep["STAS.128"] == rep["DSMEM_LD"] == 0, summary
    assert rep["STS.32"] == rep["LDS.128"] == rep["LDGSTS.128"] == 0, summary
    hold = R * n <= 12  # xn held from pass 1 to pass 2: the weight is not re-read
    assert rep["LDG.E.128"] == R * n + (1 if hold else 2) * n * (2 if w_dtype == torch.float32 else 1), summary
    assert rep["SHFL.BFLY"] == 2 * (S - 1 + 4 - (S.bit_length() - 1)), summary
    # holding xn under the 128-register cap, ptxas copies one index shuffle into both arms of a branch
    assert rep["SHFL.IDX"] == R * C + R * n + hold, summary
    assert rep["F2FP_E4M3"] == 4 * R * n, summary
    assert rep["STG.E.64"] == R * n and rep["STG.E.128"] == 0, summary
    assert "SATFINITE.E4M3" in rep["sass"]


# ------------------------------------------------------------------------------------------------------------ GPU


def _needs_kernel(x, w, block_scale="pow2"):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    if not cute_rms.serves(x, w, block_scale):
        pytest.skip("the CuTe DSL RMSNorm kernel does not serve this call here (not sm_90, or no kernel)")


def _rsigma_oracle(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1 / sqrt(mean(x^2) + eps) with the SPEC's fp32 squares, and its relative tolerance. Each square rounded to fp32
    (under the fp32 range it is 0: the bf16-subnormal row of `_special_x` sums to 0 and has rsigma 1/sqrt(eps), inf at
    eps = 0), summed in fp64; a row whose sum passes FLT_MAX has rsigma 0 (x[5]). The tolerance: 1e-6, plus what fp32
    loses where squares and partial sums are subnormal (x[8]'s squares of ~1e-40): the kernel's K additions and the
    oracle's K squares each round to the 2^-149 grid, up to K 2^-149 absolute on the sum, half that relative on
    rsigma."""
    sq = x.float().cpu().pow(2).double()
    tot = sq.sum(-1)
    ora = 1.0 / torch.sqrt(tot / x.shape[-1] + eps)
    tol = 1e-6 + x.shape[-1] * 2.0**-150 / (tot + eps * x.shape[-1])
    tol = torch.where(tot.isnan(), 1e-6, tol)  # a NaN row's rsigma is NaN: `check` compares the NaN rows themselves
    return torch.where(tot > torch.finfo(torch.float32).max, 0.0, ora), tol


def reference_outputs(x, w, rsigma, zc, block_scale, columnwise):
    """The five outputs' reference given the kernel's rsigma (tests/ops/test_rmsnorm_fp8_block.py's
    `rmsnorm_reference`): xn = (x * rsigma) * g in fp32, NaN made +NaN, quantized in the kernel's layouts."""
    T, K = x.shape
    g = w.float().cpu() + 1.0 if zc else w.float().cpu()
    xn = F.canonical_nan(x.float().cpu() * rsigma.cpu()[:, None] * g)
    rd, rs = F.quantize_blocks(xn, (1, B), block_scale)
    outs = [rd, rs.t().contiguous()]
    if columnwise:
        cd, cs = F.quantize_blocks(xn, (B, 1), block_scale)
        t_pad = -(-T // 16) * 16
        cdt = torch.zeros(K, t_pad, dtype=torch.uint8)
        cdt[:, :T] = cd.view(torch.uint8).t()
        outs += [cdt.view(F8), cs]
    else:
        outs += [torch.empty(K, 0, dtype=F8), torch.empty(0, K)]
    return outs


def check(x, w, zc, block_scale="pow2", columnwise=True, eps=1e-6):
    """The kernel's outputs against the references; returns them."""
    got = cute_rms.rmsnorm_fp8_block(x, w, eps, zc, block_scale, columnwise)
    rsigma = got[0]
    T, K = x.shape
    assert rsigma.shape == (T,) and rsigma.dtype == torch.float32
    ora, tol = _rsigma_oracle(x, eps)
    rel = ((rsigma.cpu().double() - ora).abs() / ora.abs()).nan_to_num(0.0)
    assert (rel <= tol).all(), f"rsigma: worst relative error over tolerance {(rel / tol).max():.3g} at token " \
        f"{int((rel / tol).argmax())}"
    assert torch.equal(rsigma.isnan().cpu(), ora.isnan()), "rsigma NaN rows"
    assert torch.equal(rsigma.isinf().cpu(), ora.isinf()), "rsigma inf rows (eps = 0)"
    ref = reference_outputs(x, w, rsigma, zc, block_scale, columnwise)
    names = ("row codes", "row scale_inv [K/128, T]", "col codes [K, T_pad]", "col scale_inv")
    for name, a, b in zip(names, got[1:], ref, strict=True):
        assert_bytes_equal(a, b, f"T={T} K={K} zc={zc} {block_scale} w {w.dtype} columnwise={columnwise}: {name}")
    return got


def _x(T, K, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, K, generator=g) * scale).to(torch.bfloat16).cuda()


def _w(K, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(K, generator=g) * 0.5 + 1.0).to(dtype).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 127, 128, 129, 1000, 4096 + 17, 16384])
@pytest.mark.parametrize("K", [1536, 512])
def test_gpu_vs_reference(T, K):
    """Partial and whole 128-token tiles, a single token, many clusters; training and inference, fp32 and bf16
    weights, both gamma forms, pow2 and fp32 scales."""
    x = _x(T, K, seed=T + K)
    for w_dtype, zc, bs in ((torch.float32, False, "pow2"), (torch.bfloat16, True, "pow2"),
                            (torch.float32, True, "fp32"), (torch.bfloat16, False, "fp32")):
        w = _w(K, w_dtype) - (1.0 if zc else 0.0)
        _needs_kernel(x, w, bs)
        train = check(x, w, zc, bs, True)
        infer = check(x, w, zc, bs, False)
        for i in range(3):  # rsigma, row codes, row scale_inv: the same bytes without the columnwise pair
            assert_bytes_equal(infer[i], train[i], f"T={T} output {i} inference vs training")


def _special_x(T, K, seed=5, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) * 3
    x[2] = 0.0  # an all-zero row: rsigma 1/sqrt(eps), zero codes, scale 1
    x[3, 7] = NAN  # a NaN element: the row's rsigma NaN, its xn all NaN (code 0x7F), scales 1
    x[4, 9] = INF  # an inf element: rsigma 0, xn NaN at inf, 0 elsewhere
    x[5] = torch.randn(K, generator=g) * 1e30  # squares overflow: rsigma 0
    x[6] = torch.randn(K, generator=g) * 2.0**-130  # bf16 subnormals
    x[7, :128] = -0.0  # negative zeros: code 0x80
    x[8] = torch.randn(K, generator=g) * 1e-20  # tiny: large rsigma
    x[9, 200] = -NAN
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_rsigma_oracle_tolerance_is_defined(eps):
    """The rsigma oracle's tolerance is a positive number on every special row (a NaN tolerance fails any
    comparison: the NaN rows are checked as NaN rows instead)."""
    for T, K in ((10, 1536), (300, 512)):
        _, tol = _rsigma_oracle(_special_x(T, K, device="cpu"), eps)
        assert not tol.isnan().any() and (tol > 0).all(), tol


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [10, 140, 300])
@pytest.mark.parametrize("K", [1536, 512])
def test_gpu_special_values(T, K):
    """Special rows (zeros, NaN, inf, overflowing squares, subnormals, -0), and norm-weight columns at the E4M3 /
    fp32 edges (inf, NaN, -inf, 0, a whole 1x128 block of 2^-126: 448 / amax overflows to FLT_MAX); padding rows of
    the last tile times inf / NaN weights still give zero codes."""
    x = _special_x(T, K)
    g = torch.Generator().manual_seed(7)
    w = torch.rand(K, generator=g) * torch.exp2(torch.randint(-60, 60, (K,), generator=g).float())
    w[3], w[40], w[41], w[70] = INF, NAN, -INF, 0.0
    w[256:384] = 2.0**-126
    for w_dtype in (torch.float32, torch.bfloat16):
        wd = w.to(w_dtype).cuda()
        for zc, bs in ((False, "pow2"), (True, "pow2"), (False, "fp32")):
            _needs_kernel(x, wd, bs)
            check(x, wd, zc, bs, True)
            check(x, wd, zc, bs, False)
    check(x, w.cuda(), False, "pow2", True, eps=0.0)  # eps 0: the zero row's rsigma is inf


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@settings(max_examples=examples(12), deadline=None)
@given(T=st.integers(1, 700), kc=st.sampled_from(CLUSTERS), log_scale=st.integers(-30, 30),
       zc=st.booleans(), columnwise=st.booleans(), bs=st.sampled_from(["pow2", "fp32"]),
       w_bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gpu_property(T, kc, log_scale, zc, columnwise, bs, w_bf16, seed):
    """Any T, any cluster size (K = 128 .. 2048), magnitudes over 2^±30: the reference's bytes."""
    K = 128 * kc
    x = _x(T, K, seed=seed, scale=2.0**log_scale)
    w = _w(K, torch.bfloat16 if w_bf16 else torch.float32, seed=seed + 1)
    _needs_kernel(x, w, bs)
    check(x, w, zc, bs, columnwise)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("columnwise", [True, False])
def test_gpu_matches_triton_and_dispatch(columnwise, monkeypatch):
    """`rmsnorm_fp8_block_fwd` dispatches here by default; with MLA_QPROJ_CUTE=0 the Triton kernels run: rsigma
    within 1e-6 of each other, and on the tokens whose rsigma bits agree, every code and scale byte equal (the
    Triton kernels given the CuTe rsigma would give the reference's bytes, checked above)."""
    from mla_qproj.kernels.triton import rmsnorm_fp8_block as tri

    T, K = 4096 + 17, 1536
    x, w = _x(T, K, seed=11), _w(K, torch.float32)
    _needs_kernel(x, w)
    calls = []
    real = cute_rms.rmsnorm_fp8_block

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cute_rms, "rmsnorm_fp8_block", counting)
    got = tri.rmsnorm_fp8_block_fwd(x, w, 1e-6, False, "pow2", columnwise)
    assert calls, "rmsnorm_fp8_block_fwd did not run the CuTe kernel"
    monkeypatch.setenv(cute_rms.ENV_DISABLE, "0")
    assert not cute_rms.serves(x, w, "pow2")
    want = tri.rmsnorm_fp8_block_fwd(x, w, 1e-6, False, "pow2", columnwise)
    assert len(calls) == 1
    rel = ((got[0] - want[0]).abs() / want[0].abs()).max().item()
    assert rel <= 2e-6, f"rsigma CuTe vs Triton: {rel:.3g}"
    same = got[0].view(torch.int32) == want[0].view(torch.int32)  # tokens whose rsigma bits agree
    assert same.float().mean() > 0.5
    assert torch.equal(got[1].view(torch.uint8)[same], want[1].view(torch.uint8)[same]), "row codes"
    assert torch.equal(got[2][:, same], want[2][:, same]), "row scale_inv"
    if columnwise:  # 128-token tiles whose every rsigma agrees
        tiles = [i for i in range(-(-T // 128)) if same[128 * i:128 * i + 128].all()]
        for i in tiles:
            s = slice(128 * i, min(128 * i + 128, T))
            assert torch.equal(got[3].view(torch.uint8)[:, s], want[3].view(torch.uint8)[:, s]), f"col codes {i}"
            assert torch.equal(got[4][i], want[4][i]), f"col scale_inv {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_declines():
    """Calls the kernel does not cover go to the Triton kernels: a row stride other than K, a misaligned pointer,
    fp32 x, deepseek scales, K not a multiple of 128; T == 0 returns empty outputs."""
    K = 1536
    w = _w(K, torch.float32)
    big = _x(64, K + 256)
    assert not cute_rms.serves(big[:, :K], w, "pow2")  # row stride K + 256
    flat = _x(1, 64 * K + 8).view(-1)
    assert not cute_rms.serves(flat[1:1 + 64 * K].view(64, K), w, "pow2")  # 2-byte offset
    assert not cute_rms.serves(_x(64, K).float(), w, "pow2")
    assert not cute_rms.serves(_x(64, K), w, "deepseek")
    assert not cute_rms.serves(_x(64, 704), _w(704, torch.float32), "pow2")
    x = _x(64, K)
    _needs_kernel(x, w)
    outs = cute_rms.rmsnorm_fp8_block(x[:0], w, 1e-6, False)
    assert [tuple(o.shape) for o in outs] == [(0,), (0, K), (K // B, 0), (K, 0), (0, K)]
