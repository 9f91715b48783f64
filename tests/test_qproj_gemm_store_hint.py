"""The fused GEMM's store hint (kernels/qproj_gemm.py, `_store_half`): for deepseek / neox it tells the compiler
that every aligned run of V = min(SEG, HB) kernel columns of a half lands on V contiguous output columns starting at
a multiple of V. The compiled stores are vectorized on that promise (the interpreter ignores hints, so no CPU test
of the kernel's bytes can catch a wrong one); this checks the promise itself on the host twin of the kernel's column
map (`_column_maps`, whose agreement with the kernel the GEMM tests establish) over many geometries.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj._config import QProjConfig
from mla_qproj.kernels.qproj_gemm import HALF_N, HALF_WIDTHS, _column_maps, _seg, fused_gemm_supported


def _check_runs(out: torch.Tensor, v: int) -> int:
    """Every aligned run of v entries of out (-1 = padding) is start + [0, v) on its real entries, with start a
    multiple of v. Returns the number of runs that held real columns."""
    runs = out.reshape(-1, v)
    idx = torch.arange(v)
    checked = 0
    for run in runs:
        real = run >= 0
        if not real.any():
            continue
        start = run[real][0] - idx[real][0]
        assert start % v == 0, f"run {run.tolist()} starts at {start.item()}, not a multiple of {v}"
        assert torch.equal(run[real], start + idx[real]), f"run {run.tolist()} is not contiguous"
        checked += 1
    return checked


def _case(style, fmt, H, P, RH, tail, hb=HALF_N):
    D = P + 2 * RH + tail
    cfg = QProjConfig.make(64, H, P, 2 * RH, D, rope_style=style, output_format=fmt)
    assert fused_gemm_supported(cfg)
    _, out = _column_maps(cfg, hb)
    v = min(_seg(cfg), hb)
    assert _check_runs(out, v) > 0
    return v


def test_deepseek_v3_runs_are_32_wide():
    """DeepSeek-V3 (128 + 64, 128 heads), default tiles: runs of 32 output columns (one MX block each)."""
    assert _case("deepseek", "mxfp8", 128, 128, 32, 0) == 32
    assert _case("neox", "bf16", 128, 128, 32, 0) == 32
    assert _case("deepseek", "mxfp8", 128, 128, 32, 0, hb=64) == 32  # the fp8_block operands' half width


def test_check_runs_catches_a_broken_map():
    """The checker itself: a gptj-like stride-2 run, a shifted run and a permuted run are rejected."""
    for bad in ([0, 2, 4, 6], [1, 2, 3, 4], [0, 1, 3, 2]):
        try:
            _check_runs(torch.tensor(bad), 4)
        except AssertionError:
            continue
        raise AssertionError(f"{bad} passed the run check")
    assert _check_runs(torch.tensor([4, 5, -1, -1, -1, -1, -1, -1]), 4) == 1


@settings(deadline=None, derandomize=True, max_examples=60)
@given(style=st.sampled_from(["deepseek", "neox"]), mx=st.booleans(), H=st.integers(1, 6),
       p=st.integers(0, 8), rh=st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32]), tail=st.integers(0, 4),
       hb=st.sampled_from(HALF_WIDTHS))
def test_output_runs_are_contiguous_and_aligned(style, mx, H, p, rh, tail, hb):
    """Geometries the fused GEMM covers: MXFP8 output (P, R/2, tail multiples of 32) and bf16 output (any multiples
    of 8 here; SEG is then as small as their lowest common power of two)."""
    if mx:
        P, RH, T_ = 32 * p, 32 * ((rh + 7) // 8), 32 * tail
    else:
        P, RH, T_ = 16 * p, 8 * rh, 8 * tail
    _case(style, "mxfp8" if mx else "bf16", H, P, RH, T_, hb)
