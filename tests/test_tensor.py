"""MXFP8Tensor (SPEC §2, §4): metadata, dequantize, dense fallback (SDPA), detach/clone, update_usage,
autograd, flatten/unflatten. Tensors are built from the pure-PyTorch reference quantizer, so these tests
only depend on `mla_qproj.tensor` and `mla_qproj.reference`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj._constants import MX_BLOCK
from mla_qproj.reference.mxfp8 import (
    dequantize_columnwise,
    dequantize_rowwise,
    e8m0_to_fp32,
    quantize_columnwise,
    quantize_rowwise,
)
from mla_qproj.tensor import MXFP8Tensor

from conftest import examples

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYP = settings(max_examples=examples(25), deadline=None)


def _make(x, rowwise=True, columnwise=False, scale_mode="rceil", col_dims=1, requires_grad=False):
    """Quantize dense `x` with the reference; columnwise blocks run along T = prod(shape[:-col_dims])."""
    kw = {}
    if rowwise:
        kw["rowwise_data"], kw["rowwise_scale"] = quantize_rowwise(x, scale_mode)
    if columnwise:
        trailing = x.shape[len(x.shape) - col_dims :]
        data, scale = quantize_columnwise(x.reshape(-1, math.prod(trailing)), scale_mode)
        kw["columnwise_data"], kw["columnwise_scale"] = data.reshape(x.shape), scale.reshape(-1, *trailing)
    return MXFP8Tensor(shape=x.shape, dtype=x.dtype, scale_mode=scale_mode, requires_grad=requires_grad, **kw)


def _randn(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _decode(data: torch.Tensor, scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """SPEC §2 written out, independent of the package: element = E4M3 value (torch's own fp8 -> fp32) x
    2^(byte - 127) (E8M0 byte from its bit pattern; 0xFF is NaN), blocks of 32 along the last dim (rowwise) or along
    the rows of the [T, N] view (columnwise), in float64 and then fp32 (exact: the product is an fp32 value)."""
    byte = scale.to(torch.int64)
    mult = torch.where(byte == 0xFF, torch.full_like(byte, 0, dtype=torch.float64).fill_(float("nan")),
                       torch.ldexp(torch.ones_like(byte, dtype=torch.float64), byte - 127))
    vals = data.to(torch.float32).to(torch.float64)
    if rowwise:
        m = mult.repeat_interleave(32, dim=-1)
    else:
        v2 = vals.reshape(-1, vals.shape[-1])
        m = mult.reshape(-1, v2.shape[-1]).repeat_interleave(32, dim=0)[: v2.shape[0]].reshape(vals.shape)
    return (vals * m).to(torch.float32)


def _exact(actual, expected, label):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{label}: {m}")


# leading dims (T = their product, often not a multiple of 32) and a last dim that is a multiple of 32
lead_st = st.lists(st.integers(1, 40), min_size=0, max_size=3)
last_st = st.sampled_from([32, 64, 96])
orient_st = st.sampled_from([(True, False), (False, True), (True, True)])


@HYP
@given(lead=lead_st, last=last_st, orient=orient_st, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_metadata_is_the_logical_tensor(lead, last, orient, dtype, seed):
    shape = (*lead, last)
    x = _randn(shape, seed, dtype)
    q = _make(x, *orient)
    assert isinstance(q, torch.Tensor) and type(q) is MXFP8Tensor
    assert q.shape == x.shape and q.dtype == dtype and q.device == x.device and q.dim() == x.dim()
    assert not q.requires_grad and q.scale_mode == "rceil"
    T = math.prod(lead)
    if orient[0]:
        assert q.rowwise_data.dtype == torch.float8_e4m3fn and q.rowwise_data.shape == x.shape
        assert q.rowwise_scale.dtype == torch.uint8 and q.rowwise_scale.shape == (*lead, last // MX_BLOCK)
    else:
        assert q.rowwise_data is None and q.rowwise_scale is None
    if orient[1]:
        assert q.columnwise_data.shape == x.shape and q.columnwise_scale.shape == (-(-T // MX_BLOCK), last)
    else:
        assert q.columnwise_data is None and q.columnwise_scale is None
    r = repr(q)
    assert r.startswith("MXFP8Tensor(") and str(tuple(shape)) in r and str(dtype) in r and "'rceil'" in r
    assert ("rowwise" in r.replace("columnwise", "")) == orient[0] and ("columnwise" in r) == orient[1]


@HYP
@given(lead=lead_st, last=last_st, mode=st.sampled_from(["rceil", "floor"]), seed=st.integers(0, 2**16))
def test_dequantize_matches_reference(lead, last, mode, seed):
    x = _randn((*lead, last), seed) * 10
    row, col = _make(x, True, False, mode), _make(x, False, True, mode)
    _exact(row.dequantize(), _decode(row.rowwise_data, row.rowwise_scale, rowwise=True), "rowwise")
    _exact(col.dequantize(), _decode(col.columnwise_data, col.columnwise_scale, rowwise=False), "columnwise")
    # the package's own decoders agree with this independent one
    _exact(dequantize_rowwise(row.rowwise_data, row.rowwise_scale), row.dequantize(), "dequantize_rowwise")
    _exact(dequantize_columnwise(col.columnwise_data, col.columnwise_scale), col.dequantize(), "dequantize_columnwise")
    _exact(_make(x, True, True, mode).dequantize(), row.dequantize(), "both uses rowwise")
    _exact(row.dequantize(torch.bfloat16), row.dequantize(torch.float32).to(torch.bfloat16), "dtype=bf16")
    assert row.dequantize().dtype == torch.float32 and row.dequantize(torch.float16).dtype == torch.float16


@pytest.mark.parametrize("T", [1, 33, 70])  # partial last columnwise block
@pytest.mark.parametrize("N", [5, 64])  # columnwise-only needs no multiple of 32 along N
def test_columnwise_only_partial_block(T, N):
    x = _randn((T, N), seed=T * N)
    q = _make(x, False, True)
    assert q.columnwise_scale.shape == (-(-T // MX_BLOCK), N)
    _exact(q.dequantize(), dequantize_columnwise(q.columnwise_data, q.columnwise_scale), "columnwise")


def test_columnwise_scale_over_heads():
    """The layer's query layout: data [s, b, H, D], columnwise_scale [ceil(T/32), H, D]."""
    x = _randn((7, 5, 3, 64), seed=1)
    q = _make(x, False, True, col_dims=2)
    assert q.columnwise_scale.shape == (2, 3, 64)
    flat = _make(x.reshape(35, 192), False, True)
    _exact(q.dequantize(), flat.dequantize().reshape(x.shape), "[s,b,H,D] vs [T,H*D]")


def test_to_copy_decodes_once():
    """`_to_copy` with a dtype change decodes straight to that dtype (documented in tensor.py). Like the
    layer's query (fp32 accumulator quantized, logical dtype x.dtype), the data comes from fp32 values;
    tiny blocks decode off fp16's subnormal grid, where a detour through the logical fp16 would round."""
    q = _make(_randn((3, 64), seed=2) * 2.0**-20)._replace(dtype=torch.float16)
    exact = dequantize_rowwise(q.rowwise_data, q.rowwise_scale, torch.float32)
    assert not torch.equal(exact.half().float(), exact)  # the case is meaningful
    _exact(q.float(), exact, "q.float()")
    _exact(q.to(torch.bfloat16), exact.bfloat16(), "q.to(bf16)")
    _exact(q.dequantize(), exact.half(), "q.dequantize()")


@HYP
@given(
    shape=st.tuples(st.integers(1, 70), st.sampled_from([32, 128])),
    orient=st.sampled_from(["rowwise", "columnwise"]),
    mode=st.sampled_from(["rceil", "floor"]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_relative_error(shape, orient, mode, seed):
    """E4M3 has 3 mantissa bits: within the normal range and below saturation, RNE error <= 2^-4 relative."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    q = _make(x, orient == "rowwise", orient == "columnwise", mode)
    if orient == "rowwise":
        s = e8m0_to_fp32(q.rowwise_scale).repeat_interleave(MX_BLOCK, dim=-1)
    else:
        s = e8m0_to_fp32(q.columnwise_scale).repeat_interleave(MX_BLOCK, dim=0)[: shape[0]]
    scaled = x.abs() / s  # |x| * r on the E4M3 side of the scale
    normal = (scaled >= 2.0**-6) & (scaled <= 448.0)
    assert normal.any()
    if mode == "rceil":  # rceil never saturates: every block's amax lands at or below 448
        assert (scaled <= 448.0).all()
    err = (q.dequantize() - x).abs()
    bad = normal & (err > 2.0**-4 * x.abs())
    assert not bad.any(), f"{int(bad.sum())} elements exceed 2^-4, e.g. x={x[bad][:3]}, deq={q.dequantize()[bad][:3]}"


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


FALLBACK_OPS = {
    "add": lambda q, w: q + 1,
    "sum": lambda q, w: q.sum(),
    "matmul": lambda q, w: torch.matmul(q, w),
    "sdpa": lambda q, w: _sdpa(q, _randn((2, 3, 5, 64), 8, q.dtype), _randn((2, 3, 5, 64), 9, q.dtype)),
    "permute": lambda q, w: q.permute(2, 0, 1, 3),
    "reshape": lambda q, w: q.reshape(-1, 64),
    "mul": lambda q, w: q * 2,
}


@pytest.mark.parametrize("op", list(FALLBACK_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unhandled_op_falls_back_dense(op, dtype):
    q = _make(_randn((2, 3, 7, 64), seed=3, dtype=dtype), True, True)  # [b, h, s, d] for SDPA
    w = _randn((64, 8), seed=4, dtype=dtype)
    out, ref = FALLBACK_OPS[op](q, w), FALLBACK_OPS[op](q.dequantize(), w)
    assert type(out) is torch.Tensor and out.dtype == ref.dtype
    _exact(out, ref, op)


def test_inplace_on_mxfp8_raises():
    q = _make(_randn((2, 32), seed=5))
    with pytest.raises(NotImplementedError, match="MXFP8Tensor"):
        q.add_(1)
    dense = torch.zeros(2, 32)
    dense.copy_(q)  # writing *from* an MXFP8Tensor is fine
    _exact(dense, q.dequantize(), "copy_")


@pytest.mark.parametrize("orient", [(True, False), (False, True), (True, True)])
def test_detach_and_clone_keep_subclass(orient):
    q = _make(_randn((33, 64), seed=6, dtype=torch.bfloat16), *orient, requires_grad=True)
    for name, other in (("detach", q.detach()), ("clone", q.clone())):
        assert type(other) is MXFP8Tensor, name
        assert other.shape == q.shape and other.dtype == q.dtype and other.scale_mode == q.scale_mode
        for field in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
            a, b = getattr(q, field), getattr(other, field)
            assert (a is None) == (b is None), f"{name}.{field}"
            if a is not None:
                _exact(_bytes(b), _bytes(a), f"{name}.{field}")
                assert (a.data_ptr() == b.data_ptr()) == (name == "detach"), f"{name}.{field} storage"
    assert not q.detach().requires_grad and q.clone().requires_grad


def test_update_usage():
    x = _randn((40, 64), seed=7)
    q = _make(x, True, True)
    col_ref = _make(x, False, True).dequantize()
    q.update_usage(rowwise=None, columnwise=None)  # no-op
    assert q.rowwise_data is not None and q.columnwise_data is not None
    q.update_usage(rowwise=False)
    assert q.rowwise_data is None and q.rowwise_scale is None and q.columnwise_data is not None
    _exact(q.dequantize(), col_ref, "after dropping rowwise")
    assert "rowwise" not in repr(q).replace("columnwise", "")
    with pytest.raises(ValueError, match="rowwise"):
        q.update_usage(rowwise=True)
    with pytest.raises(ValueError, match="both"):
        q.update_usage(columnwise=False)
    with pytest.raises(ValueError, match="both"):
        _make(x, True, True).update_usage(rowwise=False, columnwise=False)
    assert q.columnwise_data is not None  # a failed call changes nothing
    r = _make(x, True, True)
    r.update_usage(columnwise=False)
    assert r.columnwise_data is None and r.rowwise_data is not None


class _QuantizeST(torch.autograd.Function):
    """Straight-through quantization: forward returns an MXFP8Tensor, backward passes the gradient on."""

    @staticmethod
    def forward(ctx, x):
        return _make(x, True, True)

    @staticmethod
    def backward(ctx, dq):
        assert type(dq) is torch.Tensor  # gradients of an MXFP8Tensor arrive dense
        return dq


GRAD_OPS = {
    "float": lambda q: q.float(),
    "dequantize": lambda q: q.dequantize() if isinstance(q, MXFP8Tensor) else q,  # dense side: identity
    "mul": lambda q: q * 2,
    "permute": lambda q: q.permute(2, 0, 1, 3),
    "sdpa": lambda q: _sdpa(q, _randn((2, 3, 9, 64), 8, q.dtype), _randn((2, 3, 9, 64), 9, q.dtype)),
}


@pytest.mark.parametrize("op", list(GRAD_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_flows_through(op, dtype):
    x = _randn((2, 3, 7, 64), seed=10, dtype=dtype).requires_grad_()
    q = _QuantizeST.apply(x)
    assert type(q) is MXFP8Tensor and q.requires_grad and q.grad_fn is not None
    out = GRAD_OPS[op](q)
    assert out.requires_grad and (type(out) is torch.Tensor or (op == "float" and out is q))  # fp32 .float() is q
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dy)
    # straight-through: dx is the gradient of the same op applied to the dense decode
    d = q.dequantize().detach().requires_grad_()
    (dd,) = torch.autograd.grad(GRAD_OPS[op](d), d, dy)
    assert dx.dtype == dtype
    _exact(dx, dd.to(dtype), f" dx ({op})")
    if op in ("float", "dequantize"):  # identity on values: the upstream gradient itself
        _exact(dx, dy.to(dtype), f" dx == dy ({op})")


@pytest.mark.parametrize("orient", [(True, False), (False, True), (True, True)])
def test_flatten_unflatten_round_trip(orient):
    q = _make(_randn((33, 64), seed=11, dtype=torch.bfloat16), *orient, scale_mode="floor")
    names, ctx = q.__tensor_flatten__()
    expected = ["rowwise_data", "rowwise_scale"] * orient[0] + ["columnwise_data", "columnwise_scale"] * orient[1]
    assert names == expected and ctx == (torch.bfloat16, "floor")
    r = MXFP8Tensor.__tensor_unflatten__({n: getattr(q, n) for n in names}, ctx, q.shape, q.stride())
    assert type(r) is MXFP8Tensor and r.shape == q.shape and r.dtype == q.dtype and r.scale_mode == "floor"
    for n in names:
        assert getattr(r, n) is getattr(q, n)
    _exact(r.dequantize(), q.dequantize(), "unflatten")


def test_traces_under_torch_compile():
    """aot_eager needs no C++ compiler, so this runs on CPU CI; it traces through flatten/dispatch."""
    q = _make(_randn((4, 64), seed=12), True, True)
    w = _randn((64, 3), seed=13)
    f = torch.compile(lambda q, w: (q.float() * 2) @ w + q.sum(), backend="aot_eager", fullgraph=True)
    d = q.dequantize()
    _exact(f(q, w), (d * 2) @ w + d.sum(), "compiled")


def test_replace():
    q = _make(_randn((2, 64), seed=14))
    r = q._replace(scale_mode="floor")
    assert type(r) is MXFP8Tensor and r.scale_mode == "floor" and r.rowwise_data is q.rowwise_data
    with pytest.raises(TypeError, match="bogus"):
        q._replace(bogus=1)


def test_empty():
    q = _make(torch.empty(0, 64), True, True)
    assert q.shape == (0, 64) and q.columnwise_scale.shape == (0, 64)
    assert q.dequantize().shape == (0, 64) and q.sum().item() == 0


def test_constructor_validation():
    x = _randn((4, 64), seed=15)
    d, s = quantize_rowwise(x)
    with pytest.raises(ValueError, match="rowwise_data or columnwise_data"):
        MXFP8Tensor(shape=x.shape, dtype=x.dtype)
    with pytest.raises(ValueError, match="rowwise_scale"):
        MXFP8Tensor(shape=x.shape, dtype=x.dtype, rowwise_data=d)
    with pytest.raises(ValueError, match="rowwise_scale shape"):
        MXFP8Tensor(shape=x.shape, dtype=x.dtype, rowwise_data=d, rowwise_scale=s[:, :1])
    with pytest.raises(ValueError, match="rowwise_data shape"):
        MXFP8Tensor(shape=(2, 128), dtype=x.dtype, rowwise_data=d, rowwise_scale=s)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        MXFP8Tensor(shape=x.shape, dtype=x.dtype, rowwise_data=x, rowwise_scale=s)
    with pytest.raises(TypeError, match="floating"):
        MXFP8Tensor(shape=x.shape, dtype=torch.int32, rowwise_data=d, rowwise_scale=s)
    with pytest.raises(ValueError, match="scale_mode"):
        MXFP8Tensor(shape=x.shape, dtype=x.dtype, rowwise_data=d, rowwise_scale=s, scale_mode="ceil")
    cd, cs = quantize_columnwise(x)
    with pytest.raises(ValueError, match="columnwise_scale shape"):
        MXFP8Tensor(shape=x.shape, dtype=x.dtype, columnwise_data=cd, columnwise_scale=cs.reshape(1, 2, 32)[:, :1])


@pytest.mark.parametrize("columnwise", [False, True])
def test_unchecked_constructor_builds_the_same_tensor(columnwise):
    """The layer builds its query with `MXFP8Tensor._from_kernel_outputs` (no field re-validation on the hot path):
    the same metadata, fields and dequantized values as the checked constructor, and fields the checks accept."""
    x = _randn((37, 3, 64), 5)
    ref = _make(x, rowwise=True, columnwise=columnwise, col_dims=2)
    q = MXFP8Tensor._from_kernel_outputs(ref.shape, ref.dtype, ref.scale_mode, ref.rowwise_data, ref.rowwise_scale,
                                         ref.columnwise_data, ref.columnwise_scale)
    assert type(q) is MXFP8Tensor and q.shape == ref.shape and q.dtype == ref.dtype and not q.requires_grad
    assert q.scale_mode == ref.scale_mode and q.device == ref.device
    for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
        assert getattr(q, f) is getattr(ref, f), f
    _exact(q.dequantize(), ref.dequantize(), "dequantize")
    MXFP8Tensor(shape=q.shape, dtype=q.dtype, scale_mode=q.scale_mode, rowwise_data=q.rowwise_data,
                rowwise_scale=q.rowwise_scale, columnwise_data=q.columnwise_data,
                columnwise_scale=q.columnwise_scale)  # the checks accept what it holds
