"""MXFP8 quantization kernels (kernels/triton/mxfp8_quant.py; interpreter on CPU, compiled on GPU) vs the reference,
byte for byte: the quantizer through `mxfp8_quantize(backend="triton")`, the bf16 image of a columnwise tensor, and
the GPU image path's multipliers (kernels/triton/_common.py `image_multipliers_rceil`) against SPEC §2 rceil. The
reference's hand-derived SPEC §2 examples: tests/test_reference.py."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj import mxfp8_quantize
from mla_qproj.kernels.triton._common import image_multipliers_rceil
from mla_qproj.reference import mxfp8 as R
from mla_qproj.reference import mxfp8 as RM  # the name the columnwise-image and multiplier tests use

from _helpers import _same_bytes_or_both_nan, bf16_subnormal_heavy
from _tolerances import assert_bytes_equal
from conftest import DEVICE, examples

MODES = ["rceil", "floor"]


def _special_values(device) -> torch.Tensor:
    """One 32-column block per row: zeros, ±448 edges, amax exactly 448·2^k, subnormals, NaN, inf."""
    rows = []
    base = torch.linspace(-1, 1, 32)
    rows.append(torch.zeros(32))
    rows.append(-torch.zeros(32))
    for k in (-10, 0, 3):
        r = base * (448.0 * 2.0**k)
        r[5] = 448.0 * 2.0**k  # amax exactly 448·2^k
        rows.append(r)
    rows.append(torch.tensor([448.0, -448.0, 449.0, 464.0, 465.0, 480.0] + [1.0] * 26))
    rows.append(torch.full((32,), 2.0**-130))  # fp32 subnormals
    rows.append(base * 2.0**-8)  # E4M3 subnormals after scaling
    r = base.clone()
    r[3] = float("nan")
    r[4] = -float("nan")  # sign kept: 0xFF
    rows.append(r)  # NaN element: ignored by the amax, encoded as NaN
    rows.append(torch.full((32,), float("nan")))  # NaN block
    r = base.clone()
    r[7] = float("inf")
    rows.append(r)
    r = base * 1e-3
    r[0] = -1e-12  # tiny negative rounds to -0
    rows.append(r)
    rows.append(torch.tensor([127.97, 1.0, -0.0] + [0.5] * 29))  # carry into the exponent
    rows.append(base * 2.0**-125)  # floor: byte 0 with r = 2^127 (non-zero codes); rceil: byte 0, codes ±0
    rows.append(base * 2.0**-118)  # rceil: v just above 2^-127 (byte 1)
    return torch.stack(rows).to(device)


def _check(t: torch.Tensor, scale_mode: str, rowwise: bool, columnwise: bool) -> None:
    q = mxfp8_quantize(t, rowwise=rowwise, columnwise=columnwise, scale_mode=scale_mode, backend="triton")
    x2d = t.reshape(-1, t.shape[-1]).cpu()
    if rowwise:
        rd, rs = R.quantize_rowwise(x2d, scale_mode)
        assert_bytes_equal(q.rowwise_data.reshape(x2d.shape), rd, "rowwise data")
        assert_bytes_equal(q.rowwise_scale.reshape(rs.shape), rs, "rowwise scale")
    if columnwise:
        cd, cs = R.quantize_columnwise(x2d, scale_mode)
        assert_bytes_equal(q.columnwise_data.reshape(cd.shape), cd, "columnwise data")
        assert_bytes_equal(q.columnwise_scale, cs, "columnwise scale")


@pytest.mark.parametrize("scale_mode", MODES)
def test_special_values_bytes(scale_mode):
    t = _special_values(DEVICE)
    _check(t, scale_mode, True, True)
    _check(t.t().contiguous(), scale_mode, False, True)  # same values along T, T = 32 rows


@pytest.mark.parametrize("scale_mode", MODES)
@pytest.mark.parametrize("T", [1, 31, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(scale_mode, T, dtype):
    t = (torch.randn(T, 96) * torch.exp2(torch.randint(-12, 12, (T, 96)).float())).to(dtype).to(DEVICE)
    _check(t, scale_mode, True, True)


@settings(max_examples=examples(20), deadline=None)
@given(
    lead=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    nblk=st.integers(1, 4),
    log2mag=st.integers(-40, 40),
    scale_mode=st.sampled_from(MODES),
    columnwise=st.booleans(),
)
def test_property_shapes_and_magnitudes(lead, nblk, log2mag, scale_mode, columnwise):
    t = (torch.randn(*lead, nblk * 32) * 2.0**log2mag).to(DEVICE)
    _check(t, scale_mode, True, columnwise)
    q = mxfp8_quantize(t, columnwise=columnwise, scale_mode=scale_mode, backend="triton")
    assert q.rowwise_scale.shape == t.shape[:-1] + (nblk,)
    if columnwise:
        assert q.columnwise_scale.shape == (math.ceil(math.prod(lead) / 32), nblk * 32)


@pytest.mark.parametrize("scale_mode", MODES)
def test_bf16_subnormal_input_bytes(scale_mode):
    # bf16 subnormals decide the codes of blocks with a small scale; the interpreter lane widens them exactly too
    _check(bf16_subnormal_heavy((64, 96), 7).to(DEVICE), scale_mode, True, True)


def test_columnwise_only_allows_any_width():
    t = torch.randn(40, 50, device=DEVICE)
    _check(t, "rceil", False, True)


@pytest.mark.gpu
@pytest.mark.parametrize("scale_mode", MODES)
def test_gpu_large_random(scale_mode):
    t = torch.randn(8192, 4096, device="cuda") * torch.exp2(torch.randint(-30, 30, (8192, 4096), device="cuda").float())
    _check(t, scale_mode, True, True)


@pytest.mark.parametrize("T", [1, 45, 96])
def test_dequantize_columnwise_kernel(T):
    """bf16 image of the saved columnwise xn: bytes of the reference's dequantize (NaN positions kept)."""
    x = torch.randn(T, 96) * torch.exp2(torch.randint(-30, 30, (T, 96)).float())
    x[0, 3], x[-1, 5], x[T // 2, 7] = float("nan"), -float("nan"), float("inf")
    x[:, 9] = 0.0
    cd, cs = RM.quantize_columnwise(x.to(DEVICE))
    from mla_qproj.kernels.triton.mxfp8_quant import dequantize_columnwise_bf16

    _same_bytes_or_both_nan(dequantize_columnwise_bf16(cd, cs), RM.dequantize_columnwise(cd, cs, torch.bfloat16),
                            "xn image")


@triton.jit
def _image_multipliers_probe(amax_ptr, r_ptr, s_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    b_r, b_s = image_multipliers_rceil(tl.load(amax_ptr + o, mask=m, other=0.0))
    tl.store(r_ptr + o, b_r, mask=m)
    tl.store(s_ptr + o, b_s, mask=m)


def test_image_multipliers_rceil():
    """The GPU image path's (r, s), formed from the amax bits without the scale byte, against SPEC §2 rceil:
    r = quant_multiplier(byte), s = 2^(byte - 127) for bytes 1..254; byte 0 (every code ±0) and an all-NaN block (every
    code NaN) give r = 1, s = 0 (the same images). Edges: v = amax / 448 subnormal on both sides of 2^-127, exact
    powers of two, the 0xFE exponent with and without mantissa, fp32 max, inf, NaN; random magnitudes over the range."""
    g = torch.Generator().manual_seed(11)
    inv = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    v_edges = torch.tensor([0x400000, 0x400001, 0x3FFFFF, 0x7FFFFF, 0x800000, 0x800001, 1, 0x7F000000, 0x7F000001,
                            0x7F7FFFFF, 0x3F800000, 0x3F800001], dtype=torch.int32).view(torch.float32)
    amax = torch.cat([
        torch.tensor([0.0, 448.0, 448.0 * 2.0 ** -20, float(torch.finfo(torch.float32).max), float("inf"),
                      float("nan"), 1e-45, 2.0 ** -126, 2.0 ** 127]),
        v_edges / inv, v_edges / inv * (1 + 2.0 ** -23), v_edges / inv * (1 - 2.0 ** -23),
        torch.rand(400, generator=g) * torch.exp2(torch.randint(-149, 128, (400,), generator=g).float()),
    ]).abs()
    amax = amax.to(DEVICE)
    n = amax.numel()
    r, s = torch.empty_like(amax), torch.empty_like(amax)
    _image_multipliers_probe[(1,)](amax, r, s, n, BLOCK=triton.next_power_of_2(n))
    byte = RM.e8m0_from_amax_rceil(amax).to(torch.int32)
    mid = (byte >= 1) & (byte <= 254)
    assert mid.sum() > 300 and (byte == 0).any() and (byte == 255).any() and (byte == 254).any(), "edges not hit"
    assert_bytes_equal(r[mid], RM.quant_multiplier(byte[mid]), "r for bytes 1..254")
    assert_bytes_equal(s[mid], RM.e8m0_to_fp32(byte[mid]), "s for bytes 1..254")
    ends = ~mid
    assert torch.equal(r[ends], torch.ones_like(r[ends])), "r for byte 0 / 0xFF"
    assert torch.equal(s[ends], torch.zeros_like(s[ends])), "s for byte 0 / 0xFF"
