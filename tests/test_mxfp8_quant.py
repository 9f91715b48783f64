"""MXFP8 quantization: Triton kernel (interpreter on CPU, compiled on GPU) vs the reference, byte for byte,
plus hand-derived SPEC §2 examples."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj import mxfp8_quantize
from mla_qproj.reference import mxfp8 as R

from _tolerances import assert_bytes_equal
from conftest import DEVICE

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


@settings(max_examples=20, deadline=None, derandomize=True)
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
    from test_kernels import bf16_subnormal_heavy

    _check(bf16_subnormal_heavy((64, 96), 7).to(DEVICE), scale_mode, True, True)


def test_columnwise_only_allows_any_width():
    t = torch.randn(40, 50, device=DEVICE)
    _check(t, "rceil", False, True)


def test_hand_derived_examples():
    # amax 448 -> v = 1 exactly -> byte 127, elements unscaled; 449 -> v has mantissa bits -> 128
    assert R.e8m0_from_amax_rceil(torch.tensor([448.0, 449.0, 0.0])).tolist() == [127, 128, 0]
    # floor: floor(log2(448)) = 8 -> 8 - 8 + 127 = 127; 256 -> 127; 255 -> 126
    assert R.e8m0_from_amax_floor(torch.tensor([448.0, 256.0, 255.0])).tolist() == [127, 127, 126]
    # RNE onto the grid: 17 is halfway between 16 and 18 -> 16 (even); 19 -> 20; 127.97 -> 128; 464 -> 448
    g = R.round_to_e4m3_grid(torch.tensor([17.0, 19.0, 127.97, 464.0, -1e-12]))
    assert g[:4].tolist() == [16.0, 20.0, 128.0, 448.0]
    assert g[4].item() == 0.0 and math.copysign(1.0, g[4].item()) == -1.0


def test_floor_byte_zero_decodes_with_two_pow_127():
    # SPEC §2 floor: amax 2^-125 -> floor(log2) - 8 + 127 = -6 -> byte 0, and r = 2^127 for byte 0 too, so the block
    # keeps its codes: 2^-125 * 2^127 = 4.0, decoding back exactly (4 * 2^-127); rceil's byte 0 gives r = 1 (zeros)
    x = torch.full((1, 32), 2.0**-125)
    x[0, 1] = -(2.0**-126)
    data, scale = R.quantize_rowwise(x, "floor")
    assert scale.tolist() == [[0]]
    assert data.float()[0, :2].tolist() == [4.0, -2.0]
    assert torch.equal(R.dequantize_rowwise(data, scale), x)
    data, scale = R.quantize_rowwise(x, "rceil")  # v = 2^-125 / 448 < 2^-127: byte 0, r = 1
    assert scale.tolist() == [[0]] and (data.float() == 0).all()


def test_reference_encoder_matches_explicit_grid():
    # the reference encodes with torch's cast after clamping (one pass); the kernels' emulated path rounds
    # explicitly (round_to_e4m3_grid): both must agree on every fp32 value (random bit patterns over all exponents,
    # scaled normals, the grid's midpoints and their neighbours, NaN and inf)
    g = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    g = g[torch.isfinite(g)].unique()
    mids = (g[1:] + g[:-1]) / 2
    x = torch.cat([
        torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int64).to(torch.int32).view(torch.float32),
        torch.randn(1 << 16) * torch.exp2(torch.randint(-20, 12, (1 << 16,)).float()),
        mids, -mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
        torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 448.0, 464.0, 465.0]),
    ])
    for dev in ("cpu",) + (("cuda",) if torch.cuda.is_available() else ()):  # torch's cast differs past the grid
        xd = x.to(dev)
        assert_bytes_equal(R.encode_e4m3(xd, xd), R.to_e4m3(R.round_to_e4m3_grid(xd), xd), f"encode vs grid {dev}")
        no_nan = xd[~torch.isnan(xd)]
        assert_bytes_equal(R.encode_e4m3(no_nan, no_nan, has_nan=False), R.to_e4m3(R.round_to_e4m3_grid(no_nan),
                                                                                   no_nan), f"no-NaN path {dev}")


def test_dequantize_roundtrip_error():
    x = torch.randn(64, 128)
    q = mxfp8_quantize(x, columnwise=True, backend="torch")
    for deq in (R.dequantize_rowwise(q.rowwise_data, q.rowwise_scale),
                R.dequantize_columnwise(q.columnwise_data, q.columnwise_scale)):
        big = x.abs() > 2.0**-6 * x.abs().max()
        assert ((deq - x).abs()[big] <= x.abs()[big] * 2.0**-4).all()


@pytest.mark.gpu
@pytest.mark.parametrize("scale_mode", MODES)
def test_gpu_large_random(scale_mode):
    t = torch.randn(8192, 4096, device="cuda") * torch.exp2(torch.randint(-30, 30, (8192, 4096), device="cuda").float())
    _check(t, scale_mode, True, True)
