"""The CuTe DSL engine's fused forward GEMM (mla_qproj/kernels/cute/): compiled offline for sm_90a on any machine (its
SASS checked: FP8 or bf16 WGMMA, TMA, register reallocation, no local memory), and on an H200 its query against this
test's own reference, tile by tile, so one wrong tile fails however large the tensor: a bf16 query within bf16
rounding of the fp32 reference in every [128 tokens, head] tile; an MXFP8 query against this test's own MXFP8
quantizer of that reference (codes and scale bytes identical but for rounding-boundary flips, counted per tile, and
the decoded values close)."""

from __future__ import annotations

import importlib.util
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj import FusedMLAQUpProjection
from mla_qproj._config import QProjConfig
from mla_qproj.kernels.cute import rope_gemm

from _helpers import rope_oracle
from _tolerances import MIN_CODE_MATCH, MIN_CODE_MATCH_FP8_TC, REL_ERR_BF16_ROUNDING, assert_mxfp8_close
from conftest import HAS_CUDA

F8 = torch.float8_e4m3fn
HAS_DSL = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("tvm_ffi") is not None
V3 = (1536, 128, 128, 64, 192)  # K, H, qk_head_dim, rope, q_head_dim
# the offline compile covers DeepSeek-V3 with each operand kind and query, another head count and K, and q_head_dim >
# nope + rope (trailing columns)
OFFLINE = [(V3, "deepseek", "fp8_block", "bf16"), (V3, "deepseek", "mxfp8", "mxfp8"),
           (V3, "deepseek", "fp8_block", "mxfp8"), (V3, "deepseek", "bf16", "bf16"),
           ((512, 16, 128, 64, 192), "neox", "fp8_block", "mxfp8"),
           ((512, 8, 96, 64, 176), "gptj", "fp8_block", "bf16"), ((512, 8, 96, 64, 192), "gptj", "fp8_block", "bf16"),
           ((512, 8, 96, 64, 192), "gptj", "mxfp8", "mxfp8")]


def _cfg(geom, style="deepseek", precision="fp8_block", query="bf16", scale_mode="rceil") -> QProjConfig:
    K, H, P, R, D = geom
    return QProjConfig(K, H, P, R, D, rope_style=style, precision=precision, output_format=query,
                       query_scale_mode=scale_mode)


def _tools():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import build_cute_kernels

    return build_cute_kernels


def test_supported_configs():
    assert rope_gemm.supported(_cfg(V3))
    assert rope_gemm.supported(_cfg((512, 8, 96, 64, 176), "gptj"))
    for precision in ("fp8_block", "mxfp8", "bf16"):
        for query in ("bf16", "mxfp8"):
            assert rope_gemm.supported(_cfg(V3, precision=precision, query=query))
    # a columnwise MXFP8 query stays on the Triton kernel
    assert not rope_gemm.supported(QProjConfig(*V3, precision="mxfp8", output_format="mxfp8", columnwise_output=True))
    assert not rope_gemm.supported(_cfg((1536, 4, 128, 128, 256)))  # D > 192: two 64 x D fp32 tiles do not fit
    assert not rope_gemm.supported(_cfg((1536, 4, 124, 68, 192)))  # an 8-column group both passes and rotates
    assert not rope_gemm.supported(_cfg((1536, 4, 128, 36, 192), "neox"))  # neox partner not in the same thread
    for style in ("deepseek", "gptj"):  # R/2 = 36: the tables' rows cannot be laid out in shared memory (the Triton
        assert not rope_gemm.supported(_cfg((1536, 4, 64, 72, 136), style))  # kernel serves it)
    assert not rope_gemm.supported("not a config")


def test_keys_name_the_variant():
    keys = {rope_gemm.key(_cfg(V3, precision=p, query=f, scale_mode=m), 132)
            for p in ("fp8_block", "mxfp8") for f in ("bf16", "mxfp8") for m in ("rceil", "floor")}
    assert len(keys) == 6  # a bf16 query has no scale mode
    assert rope_gemm.key(_cfg(V3), 132) == "rope_fp8_block_bf16_k1536_h128_d192_p128_r64_deepseek_sm132"
    # mxfp8 and bf16 precisions multiply the same bf16 images: one kernel
    assert rope_gemm.key(_cfg(V3, precision="mxfp8"), 132) == rope_gemm.key(_cfg(V3, precision="bf16"), 132)
    assert rope_gemm.key(_cfg(V3, precision="bf16", query="mxfp8", scale_mode="floor"), 78) == \
        "rope_bf16_mxfloor_k1536_h128_d192_p128_r64_deepseek_sm78"


def test_wide_tiles_where_the_heads_allow():
    """fp8 operands take [128, 256] output tiles across heads where every head's rope columns lie inside one tile
    (checked here by hand on the column ranges) and the tiles cover N whole; else one head a tile."""
    assert rope_gemm.wide_tiles(128, 192, 128, 64)  # V3: heads' rope columns [192h + 128, 192h + 192), 64-aligned
    assert rope_gemm.wide_tiles(16, 192, 128, 64) and rope_gemm.wide_tiles(4, 128, 48, 64)
    # P = 96: head 2's rope columns [480, 544) cross the tile edge at 512
    assert not rope_gemm.wide_tiles(8, 192, 96, 64)
    assert not rope_gemm.wide_tiles(3, 192, 128, 64)  # N = 576 is not a whole number of 256-column tiles
    assert not rope_gemm.wide_tiles(8, 176, 96, 64)  # 1408 columns: not whole tiles either
    assert not rope_gemm.wide_tiles(8, 160, 16, 16)  # rope columns inside tiles, whole tiles, but five tile phases


def test_off_gpu_the_engine_never_serves():
    for precision in ("fp8_block", "mxfp8", "bf16"):
        assert not rope_gemm.serves(_cfg(V3, precision=precision), torch.device("cpu"))


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@pytest.mark.parametrize("geom,style,precision,query", OFFLINE,
                         ids=["v3", "v3_mxfp8", "v3_fp8_mxq", "v3_bf16", "h16_neox_mxq", "trailing_gptj",
                              "head_tiles_gptj", "gptj_mxfp8"])
def test_offline_compile_sass(geom, style, precision, query, tmp_path):
    """The sm_90a kernel compiled without a GPU: WGMMA of the operands' kind only (QGMMA for E4M3, HGMMA for bf16), TMA
    loads (A, W, and with fp8 operands the RoPE tables' rows, which reach shared memory by TMA during the main loop;
    the ping-pong schedule of bf16 operands reads them in the epilogue, under the other warpgroup's main loop) and
    stores, setmaxnreg in both directions (producer down, consumers up), no local memory in the main
    loop (a spill shows as LDL / STL), at most a few spilled words per tile outside it; an MXFP8 query converts with
    the E4M3 instruction and stores its scale bytes, a bf16 one neither."""
    tools = _tools()
    cfg = _cfg(geom, style, precision, query)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, cubin = tools.compile_one(cfg, 132, str(tmp_path))
    # nothing the kernel uses is deprecated in the pinned DSL (what a release would then remove)
    assert not [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    rep = tools.sass_report(cubin)
    fp8 = precision == "fp8_block"
    assert rep["QGMMA" if fp8 else "HGMMA"] >= 4 and rep["HGMMA" if fp8 else "QGMMA"] == 0, rep
    assert ("F32.E4M3.E4M3" in rep["sass"]) == fp8 and ("F32.BF16" in rep["sass"]) != fp8
    # fp8 (cooperative): A, W and the tables by TMA; bf16 operands (ping-pong): A and W by TMA, the tables' rows read
    # in the epilogue (cos and sin of R/8 pairs for each of a thread's rows, two in each of its two 64-row blocks)
    assert rep["UTMALDG"] >= (4 if fp8 else 2) and rep["UTMASTG"] >= 1 and (fp8 or rep["LDG"] >= cfg.rope_dim), rep
    assert rep["USETMAXREG"] >= 2 and "USETMAXREG.DEALLOC" in rep["sass"] and "USETMAXREG.TRY_ALLOC" in rep["sass"]
    assert rep["LOOP_LDL_STL"] == 0, rep["LOOP_LDL_STL"]
    assert rep["STACK"] <= 32 and rep["LDL"] + rep["STL"] <= 8, {k: rep[k] for k in ("LDL", "STL", "STACK")}
    # the persistent schedule (`schedule_tile`) divides by compile-time constants only: no integer division by a
    # run-time value, which ptxas expands around a float reciprocal (I2F.RP)
    assert "I2F.RP" not in rep["sass"]
    mx = query == "mxfp8"
    assert ("SATFINITE.E4M3" in rep["sass"]) == mx and ("STG.E.U8" in rep["sass"]) == mx
    if style == "deepseek" and not mx:  # the default regroups a' / b' by quad shuffles (`ds_halves`: below)
        assert re.search(r"\bSHFL\.", rep["sass"]) and "STS.U16" not in rep["sass"]
    K, H, P, R, D = geom
    if not fp8:
        # ping-pong, a warpgroup's whole [128, D] head tile in m64nD WGMMAs accumulating in place, one group kept in
        # flight (DEPBAR 0x1)
        assert re.search(rf"HGMMA\.64x{D}x16\b", rep["sass"]) and not re.search(rf"HGMMA\.64x(?!{D}x)", rep["sass"]), D
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in rep["sass"]
    else:
        if rope_gemm.wide_tiles(H, D, P, R):
            # [128, 256] tiles across heads: each warpgroup's 64 x 256 accumulator filled in two m64n128 sub-tiles
            # (one W block each) in turn through one buffer, each waited to 0
            assert re.search(r"QGMMA\.64x128x32\b", rep["sass"]) and "QGMMA.64x256x" not in rep["sass"], D
            assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in rep["sass"]
        else:
            # one head a tile, in two halves (m64n(D/2) WGMMAs); where the promotion is compiled per head phase
            # (q_head_dim 192 here: phases 0 and 64) the two groups are in flight together and the first half is
            # promoted after a wait that leaves one group running (DEPBAR 0x1); else (176: eight phases) they run in
            # turn, each waited to 0
            assert re.search(rf"QGMMA\.64x{D // 2}x32\b", rep["sass"]) and f"QGMMA.64x{D}x" not in rep["sass"], D
            assert ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in rep["sass"]) == (D == 192), D


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
def test_offline_compile_sass_ds_halves(tmp_path):
    """`ds_halves` (deepseek, bf16 query: a' and b' stored as 16-bit halves at their columns): no shuffles left in
    the fp8 kernel, 16-bit shared-memory stores instead, no spills (the default's shuffles:
    `test_offline_compile_sass`). bf16 operands (ping-pong, whose epilogue runs under the other warpgroup's main
    loop) do not take it."""
    from mla_qproj.kernels.cute.rope_gemm_sm90 import RopeGemmSm90

    tools = _tools()
    _, cubin = tools.compile_one(_cfg(V3, "deepseek", "fp8_block", "bf16"), 132, str(tmp_path), ds_halves=True)
    rep = tools.sass_report(cubin)
    assert not re.search(r"\bSHFL\.", rep["sass"]) and "STS.U16" in rep["sass"]
    assert rep["LDL"] + rep["STL"] == 0 and rep["LOOP_LDL_STL"] == 0, rep
    with pytest.raises(ValueError, match="ds_halves"):
        RopeGemmSm90(1536, 128, 192, 128, 64, "deepseek", 132, operands="bf16", ds_halves=True)  # K, H, D, P, R


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@pytest.mark.parametrize("precision,query", [("fp8_block", "bf16"), ("mxfp8", "mxfp8")])
def test_offline_compile_sass_swz_addr(precision, query, tmp_path):
    """`swz_addr` (the epilogue's shared-memory stores and table reads at addresses formed once per thread): the
    128-byte swizzle's arithmetic (a shift right by 3, then an XOR under the mask 0x70), which the default repeats for
    most accesses, is left only for the per-thread bases: fewer such shifts than one in sixteen stores; the stores
    all remain, and nothing spills."""
    tools = _tools()
    _, cubin = tools.compile_one(_cfg(V3, "deepseek", precision, query), 132, str(tmp_path), swz_addr=True)
    rep = tools.sass_report(cubin)
    sass = rep["sass"]
    sts = len(re.findall(r"\bSTS\b", sass))
    shifts = len(re.findall(r"SHF\.R\.U32\.HI R\d+, RZ, 0x3,", sass))
    # a bf16 query: 64 words a row pair for each of the 3 tile phases of the [128, 256] tiles; MXFP8: 96 code words
    # and 32 deepseek bytes (ping-pong, one head a tile)
    assert sts >= (192 if precision == "fp8_block" else 128), sts
    assert shifts < sts // 16, (shifts, sts)
    assert rep["LDL"] + rep["STL"] == 0 and rep["LOOP_LDL_STL"] == 0


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@settings(max_examples=200, deadline=None)
@given(num_m=st.integers(1, 300), n_tiles=st.integers(1, 40), cluster_m=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 3, 4, 8]), sms=st.integers(4, 140), pingpong=st.booleans())
def test_persistent_schedule_covers_every_tile_once(num_m, n_tiles, cluster_m, group, sms, pingpong):
    """The kernel's persistent schedule, walked as the kernel walks it (`schedule_limit`, `schedule_tile`; a CTA
    `rank` of each cluster, every grid-stride step; ping-pong: each consumer warpgroup every other step of its CTA):
    every output tile [0, num_m) x [0, n_tiles) is computed exactly once, the only others are the rows past T of
    the last cluster (fewer than cluster_m rows), a cluster's CTAs take consecutive tile rows of one column, and the
    steps of whole groups running at once (one wave of the grid) cover at most ceil(wave / group) + 1 columns of W
    per group of rows."""
    from mla_qproj.kernels.cute.rope_gemm_sm90 import schedule_limit, schedule_tile

    limit = schedule_limit(num_m, cluster_m, n_tiles)
    clusters = min(limit, max(sms // cluster_m, 1))
    seen = {}
    for z in range(clusters):
        for c in range(2 if pingpong else 1):
            for step in range(z + c * clusters, limit, 2 * clusters if pingpong else clusters):
                row, n = schedule_tile(step, n_tiles, group, limit)
                assert 0 <= n < n_tiles
                for t in [(row * cluster_m + rank, n) for rank in range(cluster_m)]:
                    assert t not in seen, (t, step, seen[t])
                    seen[t] = step
    real = {(m, n) for m in range(num_m) for n in range(n_tiles)}
    assert real <= seen.keys()
    assert all(num_m <= m < num_m + cluster_m - 1 for m, _ in seen.keys() - real)
    # locality: the first wave's steps in whole groups of cluster rows touch few distinct columns of each group
    grouped = limit // (group * n_tiles) * group * n_tiles
    wave = [schedule_tile(s, n_tiles, group, limit) for s in range(min(clusters, grouped))]
    for g in {row // group for row, _ in wave}:
        cols = {n for row, n in wave if row // group == g}
        assert len(cols) <= -(-clusters // group) + 1, (g, cols)


def _assert_formed_once(L, sw: str, eb: int, plan: tuple, off: tuple, cc: int, tile: int) -> None:
    """For every thread row of a warpgroup, lane q and row pair of a tile at byte address `tile`: the formed-once
    address of element (lrow + 8·r2, cc + q) (`swz_base` of the thread's base, XOR k, + rest + r2·d8) equals CuTe's
    swizzle S<B, M, S> (sw) of its byte address eb·L(row, column)."""
    from mla_qproj.kernels.cute.rope_gemm_sm90 import swz_base

    b, m, sh = (int(x) for x in sw.strip("S<>").split(","))
    (k, rest), d8 = off, plan[1]
    for lrow in range(56):
        for q in range(4):
            base = swz_base(tile + eb * L(lrow, 0) + eb * q, plan[0])
            for r2 in range(2):
                addr = tile + eb * L(lrow + 8 * r2, cc + q)
                want = addr ^ ((addr & (((1 << b) - 1) << (m + sh))) >> sh)  # CuTe's Swizzle<B, M, S>
                assert (base ^ k) + rest + r2 * d8 == want, (sw, eb, cc, tile, lrow, q, r2)


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@pytest.mark.parametrize("width", [128, 96, 64, 24, 136, "tab8", "tab16", "tab32"])
def test_swz_addresses_match_cute_swizzle(width):
    """`swz_addr`' address algebra (`swz_plan`, `swz_offset`, `swz_base`) against CuTe's swizzle applied to CuTe's
    layout (the epilogue's [64, width] tiles; "tabN": the RoPE tables' [64, N] fp32 stages), for every thread row and
    lane of a warpgroup, both rows, every column, tiles at 1024-aligned bases (the slot strides among them): where
    the plan says an access may take the formed-once address, that address is the swizzled one. V3's tiles (128 and
    96 columns, tables of 32) take it for every access of every view."""
    from _cute_layouts import layout_tables

    from mla_qproj.kernels.cute.rope_gemm_sm90 import swz_offset, swz_plan

    tabs = layout_tables(True, int(width[3:]), 4) if isinstance(width, str) else layout_tables(False, width, 2)
    sw = tabs["swizzle"]
    for eb in [e for e in (1, 2, 4) if e in tabs]:
        tab, slot = tabs[eb]
        L = lambda r, c, tab=tab: tab[r][c]  # noqa: E731
        plan = swz_plan(L, sw, eb)
        if plan is None:
            assert width not in (128, 96, "tab32"), (width, eb, sw)
            continue
        fast = 0
        for cc in range(0, len(tab[0]) - 3, 4):
            off = swz_offset(L, plan[0], eb, cc)
            if off is None:
                continue
            fast += 1
            for tile in {0, 1024 * 5, eb * slot}:
                _assert_formed_once(L, sw, eb, plan, off, cc, tile)
        if width in (128, 96, "tab32"):
            assert fast == len(tab[0]) // 4, (width, eb, fast)


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@settings(max_examples=1500, deadline=None)
@given(b=st.integers(0, 3), eb=st.sampled_from([1, 2, 4]), s0=st.sampled_from([4, 8, 16, 24, 32, 64, 128]),
       s1=st.sampled_from([1, 3, 8, 16, 32, 64, 128]), a=st.sampled_from([4, 8, 16, 32, 64, 128]),
       s3=st.sampled_from([1, 5, 16, 64, 128, 256]),
       tile=st.integers(0, 15), data=st.data())
def test_swz_addresses_on_other_layouts(b, eb, s0, s1, a, s3, tile, data):
    """The same algebra on row-major layouts CuTe's epilogue does not build (row r at (r % 8)·s0 + (r / 8)·s1·8,
    column c at c % a + (c / a)·s3·8 elements; S<b, 4, 3>; a 1024-aligned tile): wherever `swz_plan` and
    `swz_offset` accept a store, its formed-once address is the swizzled one, so each of their conditions is
    needed only where it is checked."""
    from mla_qproj.kernels.cute.rope_gemm_sm90 import swz_offset, swz_plan

    def L(r: int, c: int) -> int:
        return (r % 8) * s0 + (r // 8) * s1 * 8 + c % a + (c // a) * s3 * 8

    sw = f"S<{b},4,3>"
    plan = swz_plan(L, sw, eb)
    if plan is None:
        return
    cc = data.draw(st.integers(0, 2 * a - 4))
    off = swz_offset(L, plan[0], eb, cc)
    if off is None:
        return
    _assert_formed_once(L, sw, eb, plan, off, cc, 1024 * tile)


# ------------------------------------------------------------------------------------------------------------ GPU


def _blocks(x: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This test's own SPEC §5 quantizer (pow2 scales) for a finite x [M, N]: (codes, scale_inv [M/bm, N/bn])."""
    M, N = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -N % bn, 0, -M % bm))
    amax = xp.reshape(xp.shape[0] // bm, bm, xp.shape[1] // bn, bn).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    s = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :N]
    return (x.float() * s).clamp(-448.0, 448.0).to(F8), 1.0 / scale


def _mx_images(x: torch.Tensor) -> torch.Tensor:
    """bf16 images of x's rowwise MXFP8 (rceil, 32-blocks along the last dim), this test's own (finite x)."""
    amax = x.float().unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q = (x.float().unflatten(-1, (-1, 32)) * torch.exp2(-e)).clamp(-448.0, 448.0).to(F8)
    return (q.float() * torch.exp2(e)).flatten(-2).to(torch.bfloat16)


def _mx_oracle(y: torch.Tensor, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SPEC §2's rowwise MXFP8 of a finite y [T, H, D] fp32, written from the SPEC: (codes, E8M0 bytes, decoded)."""
    b = y.unflatten(-1, (-1, 32))
    amax = b.abs().amax(-1, keepdim=True)
    if scale_mode == "rceil":
        v = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=y.device)
        bits = v.view(torch.int32)
        exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        byte = exp + ((mant != 0) & (exp != 0xFE) & ((exp != 0) | (mant > 0x400000))).int()
    else:
        exp = (amax.view(torch.int32) >> 23) & 0xFF
        byte = (exp - 8).clamp(0, 254)
    r = torch.exp2(127.0 - byte.double()).float()
    if scale_mode == "rceil":
        r = torch.where(byte == 0, 1.0, r)
    codes = (b * r).clamp(-448.0, 448.0).to(F8)
    dec = codes.float() * torch.exp2(byte.double() - 127).float()
    return codes.flatten(-2), byte.squeeze(-1).to(torch.uint8), dec.flatten(-2)


def _case(T: int, cfg: QProjConfig, device):
    """Operands as the recipe hands them (fp8_block: codes and scales; mxfp8 / bf16: bf16 images) and the fp32
    reference query before any output rounding."""
    K, N = cfg.q_lora_rank, cfg.out_features
    x, w = torch.randn(T, K, device=device), torch.randn(N, K, device=device) * K**-0.5
    ang = torch.rand(T, cfg.rope_dim // 2, device=device) * 6.0
    cos_h, sin_h = ang.cos(), ang.sin()
    if cfg.precision == "fp8_block":
        a, sa = _blocks(x, 1, 128)  # sa [T, K/128]
        wq, sw = _blocks(w, 128, 128)  # sw [N/128, K/128]
        y = torch.zeros(T, N, device=device)
        sw_rows = sw.repeat_interleave(128, 0)[:N]
        for kb in range(K // 128):
            ks = slice(kb * 128, (kb + 1) * 128)
            y += (a[:, ks].float() @ wq[:, ks].float().t()) * sa[:, kb, None] * sw_rows[None, :, kb]
        args = (a, sa.t().contiguous(), wq, sw)
    else:
        a, wi = (_mx_images(x), _mx_images(w)) if cfg.precision == "mxfp8" else (x.bfloat16(), w.bfloat16())
        y = a.float() @ wi.float().t()
        args = (a, None, wi, None)
    ref = rope_oracle(y.view(T, cfg.num_heads, cfg.q_head_dim), cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim,
                      cfg.rope_style)
    return (*args, cos_h, sin_h), ref


def _worst_tile(q: torch.Tensor, ref: torch.Tensor) -> tuple[float, tuple[int, int]]:
    """Largest relative error over the [128 tokens, one head] tiles of q [T, H, D] against ref, and where."""
    T, H, D = ref.shape
    pad = -T % 128
    d = torch.nn.functional.pad((q.double() - ref.double()), (0, 0, 0, 0, 0, pad)).view(-1, 128, H, D)
    r = torch.nn.functional.pad(ref.double(), (0, 0, 0, 0, 0, pad)).view(-1, 128, H, D)
    err = d.pow(2).sum(dim=(1, 3)).sqrt() / r.pow(2).sum(dim=(1, 3)).sqrt().clamp_min(1e-30)
    i = int(err.argmax())
    return float(err.flatten()[i]), divmod(i, H)


def _check(cfg: QProjConfig, T: int) -> None:
    """The engine's query for cfg at T against the reference: bf16 within bf16 rounding per tile; MXFP8 against the
    test's own quantizer of the reference (codes: the FP8 tensor cores' looser share where the operands are E4M3)."""
    _needs_engine(cfg)
    args, ref = _case(T, cfg, torch.device("cuda"))
    q, s = rope_gemm.rope_gemm(*args, cfg)
    H, D = cfg.num_heads, cfg.q_head_dim
    assert q.shape == ref.shape
    if cfg.output_format == "bf16":
        assert q.dtype == torch.bfloat16 and s is None
        err, (tm, h) = _worst_tile(q, ref)
        assert err <= REL_ERR_BF16_ROUNDING, f"tile (tokens {128 * tm}.., head {h}): rel err {err:.3g}"
        return
    assert q.dtype == F8 and s.dtype == torch.uint8 and s.shape == (T, H, D // 32)
    codes, byte, dec = _mx_oracle(ref, cfg.query_scale_mode)
    got = (q.float().unflatten(-1, (-1, 32)) * torch.exp2(s.double() - 127).float().unsqueeze(-1)).flatten(-2)
    min_codes = MIN_CODE_MATCH_FP8_TC if cfg.precision == "fp8_block" else MIN_CODE_MATCH
    assert_mxfp8_close(q.view(T, H * D), s.view(T, -1), got.view(T, H * D), codes.view(T, H * D), byte.view(T, -1),
                       dec.view(T, H * D), f"{cfg.precision} T={T}", min_codes=min_codes, min_scales=min_codes)


def _needs_engine(cfg: QProjConfig) -> None:
    if not rope_gemm.serves(cfg, torch.device("cuda")):
        pytest.skip(f"the CuTe DSL engine has no kernel for {rope_gemm.key(cfg, 132)} here")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("T", [4096, 1000, 1])
@pytest.mark.parametrize("precision,query", [("fp8_block", "bf16"), ("fp8_block", "mxfp8"), ("mxfp8", "bf16"),
                                             ("mxfp8", "mxfp8"), ("bf16", "bf16")])
def test_v3_vs_reference(precision, query, style, T):
    """DeepSeek-V3's geometry, a partial last row tile (T = 1000) and a single token, every operand kind and query."""
    _check(_cfg(V3, style, precision, query), T)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,query,scale_mode", [("fp8_block", "bf16", "rceil"), ("mxfp8", "bf16", "rceil"),
                                                        ("mxfp8", "mxfp8", "floor"), ("fp8_block", "mxfp8", "rceil")])
@pytest.mark.parametrize("geom,style,T", [((256, 4, 128, 64, 192), "deepseek", 33),
                                          ((512, 8, 96, 64, 192), "gptj", 300),
                                          ((640, 4, 128, 64, 192), "deepseek", 200),
                                          ((128, 4, 128, 64, 192), "neox", 130),
                                          ((384, 4, 64, 64, 128), "deepseek", 257),
                                          ((256, 4, 48, 64, 128), "deepseek", 77)],
                         ids=["k2", "k4_trailing", "k5", "k1", "k3_d128", "rope_across_halves"])
def test_small_geometries(geom, style, T, precision, query, scale_mode):
    """K blocks even and odd (1 to 5 with fp8 operands; bf16 operands: 2 to 10 tiles of 64), D = 128 (one sub-tile:
    the loop without overlap), trailing pass-through columns, and deepseek's a' columns [P, P + R/2) across the
    epilogue's halves and MX blocks (P = 48, D = 128: a' of the first pairs in the first half, their b' in the
    second); the floor scale rule."""
    _check(_cfg(geom, style, precision, query, scale_mode), T)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,query", [("fp8_block", "bf16"), ("fp8_block", "mxfp8"), ("mxfp8", "bf16"),
                                             ("mxfp8", "mxfp8"), ("bf16", "bf16"), ("bf16", "mxfp8")])
def test_layer_runs_the_engine_and_matches_triton(monkeypatch, precision, query):
    """The layer's forward goes through the engine (checked by counting calls), and its query agrees tile by tile
    with the Triton engine's (MLA_QPROJ_CUTE=0) on the same weights; the backward runs."""
    cfg = _cfg(V3, precision=precision, query=query)
    _needs_engine(cfg)
    torch.manual_seed(0)
    layer = FusedMLAQUpProjection(*V3[:4], precision=precision, output_format=query, device="cuda",
                                  dtype=torch.bfloat16)
    x = torch.randn(2048, V3[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(2048, device="cuda")
    calls = []
    real = rope_gemm.rope_gemm

    def counting(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(rope_gemm, "rope_gemm", counting)
    q = layer(x, position_ids=pos)
    assert calls, "the layer did not run the CuTe DSL engine"
    monkeypatch.setenv(rope_gemm.ENV_DISABLE, "0")
    layer.refresh_weight_cache()
    q_tri = layer(x, position_ids=pos)
    assert len(calls) == 1
    if query == "bf16":
        err, where = _worst_tile(q.float(), q_tri.float())
        assert err <= 2 * REL_ERR_BF16_ROUNDING, f"tile {where}: engines differ by {err:.3g}"
    else:
        T, N = q.shape[0], cfg.out_features
        min_codes = MIN_CODE_MATCH_FP8_TC if precision == "fp8_block" else MIN_CODE_MATCH
        assert_mxfp8_close(q.rowwise_data.view(T, N), q.rowwise_scale.view(T, -1), q.dequantize().view(T, N),
                           q_tri.rowwise_data.view(T, N), q_tri.rowwise_scale.view(T, -1),
                           q_tri.dequantize().view(T, N), "CuTe vs Triton", min_codes=min_codes, min_scales=min_codes)
    monkeypatch.delenv(rope_gemm.ENV_DISABLE)
    (q.dequantize() if query == "mxfp8" else q).float().pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,query", [("fp8_block", "bf16"), ("mxfp8", "mxfp8")])
def test_compiled_layer_uses_the_engine(precision, query):
    """torch.compile(fullgraph=True) traces the engine's custom op and gives the eager query's bytes."""
    cfg = _cfg(V3, precision=precision, query=query)
    _needs_engine(cfg)
    layer = FusedMLAQUpProjection(*V3[:4], precision=precision, output_format=query, device="cuda",
                                  dtype=torch.bfloat16)
    x = torch.randn(512, V3[0], device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(512, device="cuda")
    with torch.no_grad():
        eager = layer(x, position_ids=pos)
        comp = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, position_ids=pos)
    if query == "bf16":
        assert torch.equal(eager.view(torch.int16), comp.view(torch.int16))
    else:
        assert torch.equal(eager.rowwise_data.view(torch.uint8), comp.rowwise_data.view(torch.uint8))
        assert torch.equal(eager.rowwise_scale, comp.rowwise_scale)
