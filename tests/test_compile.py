"""torch.compile(fullgraph=True) traces the layer (custom ops with fake implementations, no host syncs).
Most tests use the aot_eager backend (AOTAutograd without code generation); one uses inductor (on the CPU lane
it needs a C++ compiler). On the CPU lane the kernels run in the interpreter."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import mla_qproj
from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

from _tolerances import assert_bytes_equal
from conftest import DEVICE

_BACKEND = "aot_eager"  # a tracing test: AOTAutograd without code generation, any device


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles its own layer: no recompile limit carried across tests
    yield


def _dense(q):
    return q.dequantize(torch.float32) if isinstance(q, MXFP8Tensor) else q.float()


PRECISIONS = ("mxfp8", "bf16", "fp8_block")


def _k_for(precision: str, K: int) -> int:
    """fp8_block needs q_lora_rank % 128 == 0 (SPEC §5): the smallest such K >= the geometry's."""
    return -(-K // 128) * 128 if precision == "fp8_block" else K


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("output_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("geom", [(64, 2, 32, 32, 64), (256, 2, 128, 64, 192)])  # general path; fused GEMM path
def test_compiled_module_matches_eager(output_format, geom, precision):
    K, H, nope, R, D = geom
    K = _k_for(precision, K)
    layer = FusedMLAQUpProjection(K, H, nope, R, D, precision=precision, output_format=output_format, device=DEVICE)

    def model(x, cos, sin):  # the layer and its consumer in one graph (an MXFP8Tensor never leaves it)
        return _dense(layer(x, cos, sin)) * 0.5

    compiled = torch.compile(model, fullgraph=True, backend=_BACKEND)
    x = torch.randn(33, K, device=DEVICE, requires_grad=True)
    cos, sin = torch.randn(33, R, device=DEVICE), torch.randn(33, R, device=DEVICE)
    q_eager = model(x, cos, sin)
    q_comp = compiled(x, cos, sin)
    assert_bytes_equal(q_comp, q_eager, "q")
    dy = torch.randn(q_eager.shape, device=DEVICE)
    grads = []
    for q in (q_eager, q_comp):
        x.grad = layer.weight.grad = layer.norm_weight.grad = None
        q.backward(dy)
        grads.append((x.grad.clone(), layer.weight.grad.clone(), layer.norm_weight.grad.clone()))
    for name, a, b in zip(("dx", "dweight", "dnorm_weight"), *grads, strict=True):
        assert_bytes_equal(b, a, name)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_compiled_module_follows_weight_updates(precision):
    K = _k_for(precision, 64)
    layer = FusedMLAQUpProjection(K, 2, 32, 32, precision=precision, output_format="mxfp8", device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend=_BACKEND)  # inference: the layer alone
    x = torch.randn(33, K, device=DEVICE)
    cos, sin = torch.randn(33, 32, device=DEVICE), torch.randn(33, 32, device=DEVICE)
    with torch.no_grad():
        before = _dense(compiled(x, cos, sin))
        layer.weight.mul_(-2.0)
        after = _dense(compiled(x, cos, sin))
        eager = _dense(layer(x, cos, sin))
    assert not torch.equal(after, before)
    assert_bytes_equal(after, eager, "q after the weight changed")


_FUSED = (64, 2, 32, 64, 96)  # K, H, nope, R, D: the fused GEMM path (its weight preparation is traced too)


def _fused(precision: str) -> tuple[int, ...]:
    return (_k_for(precision, _FUSED[0]),) + _FUSED[1:]


def _sdpa_consumer(q, dy):
    """Attention outside the compiled region: SDPA over q [T, H, D] read as (batch T, length H, dim D); keys and
    values come from a fixed seed. SPEC §4's dequantizing fallback decodes an MXFP8Tensor q."""
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(q.shape, generator=g).to(q.device, q.dtype) for _ in range(2))
    torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(dy)


def _mxfp8_gradient_consumer(q, dy):
    """A gradient that is itself an MXFP8Tensor: decoded by the layer's backward, eager and compiled alike."""
    from mla_qproj import mxfp8_quantize

    q.backward(mxfp8_quantize(dy, backend="torch"))


_CONSUMERS = {  # what eager code does with the query a compiled layer returned; dy is a random upstream gradient
    "backward": lambda q, dy: q.backward(dy),
    "dequantize": lambda q, dy: _dense(q).backward(dy.float()),  # q.dequantize(fp32) for an MXFP8Tensor
    "sdpa": _sdpa_consumer,
    "mxfp8_gradient": _mxfp8_gradient_consumer,
}


def _inputs(geom, T=33):
    K, R = geom[0], geom[3]
    x = torch.randn(T, K, device=DEVICE, requires_grad=True)
    return x, torch.randn(T, R, device=DEVICE), torch.randn(T, R, device=DEVICE)


def _grads_through(layer, forward, consumer, x, cos, sin, dy):
    x.grad = layer.weight.grad = layer.norm_weight.grad = None
    q = forward(x, cos, sin)
    consumer(q, dy)
    return q, (x.grad.clone(), layer.weight.grad.clone(), layer.norm_weight.grad.clone())


def _assert_same_query_and_grads(q_c, g_c, q_e, g_e, label):
    assert type(q_c) is type(q_e), label
    assert_bytes_equal(_dense(q_c), _dense(q_e), f"{label}: q")
    for name, a, b in zip(("dx", "dweight", "dnorm_weight"), g_c, g_e, strict=True):
        assert_bytes_equal(a, b, f"{label}: {name}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("output_format", ["mxfp8", "bf16"])
def test_compiled_layer_alone_takes_a_dense_gradient(output_format, precision):
    """torch.compile(layer) on its own: the query leaves the compiled region and eager code makes its gradient,
    a dense tensor (SPEC §4). Every consumer's backward equals eager bit for bit (AOTAutograd used to demand an
    MXFP8Tensor gradient for an MXFP8Tensor output)."""
    geom = _fused(precision)
    layer = FusedMLAQUpProjection(*geom, precision=precision, output_format=output_format, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend=_BACKEND)
    x, cos, sin = _inputs(geom)
    dtype = torch.float32 if output_format == "mxfp8" else torch.bfloat16
    dy = torch.randn(33, _FUSED[1], _FUSED[4], device=DEVICE).to(dtype)
    # ("dequantize" hands the layer the same plain gradient as "backward": the inductor test runs it)
    names = ("backward", "sdpa", "mxfp8_gradient") if output_format == "mxfp8" else ("sdpa",)
    for name in names:
        consumer = _CONSUMERS[name]
        q_e, g_e = _grads_through(layer, layer, consumer, x, cos, sin, dy)
        q_c, g_c = _grads_through(layer, compiled, consumer, x, cos, sin, dy)
        _assert_same_query_and_grads(q_c, g_c, q_e, g_e, name)


@pytest.mark.slow
def test_compiled_layer_alone_inductor():
    """The inductor backend (C++ code generation on the CPU lane, Triton on CUDA): the layer alone, MXFP8 query,
    dense gradient from eager code; same bytes as eager."""
    layer = FusedMLAQUpProjection(*_FUSED, precision="mxfp8", output_format="mxfp8", device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    x, cos, sin = _inputs(_FUSED)
    dy = torch.randn(33, _FUSED[1], _FUSED[4], device=DEVICE)
    q_e, g_e = _grads_through(layer, layer, _CONSUMERS["dequantize"], x, cos, sin, dy)
    q_c, g_c = _grads_through(layer, compiled, _CONSUMERS["dequantize"], x, cos, sin, dy)
    _assert_same_query_and_grads(q_c, g_c, q_e, g_e, "inductor")


def _warnings_of_ours(records) -> list[str]:
    """Warnings raised in the package's code or about it (dynamo names the calling file in its message)."""
    pkg = os.path.dirname(os.path.abspath(mla_qproj.__file__))
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in records
            if os.path.abspath(w.filename).startswith(pkg) or pkg in str(w.message) or "lru_cache" in str(w.message)]


@pytest.mark.parametrize("output_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_compile_emits_no_warnings_of_ours(precision, output_format, monkeypatch):
    """fullgraph compile + forward + backward on the fused GEMM path: no warning from (or about) the package."""
    # dynamo reports a warning once per process: start from an empty record so the test does not depend on order
    if hasattr(torch._dynamo.utils, "warn_once_cache"):
        monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    geom = _fused(precision)
    layer = FusedMLAQUpProjection(*geom, precision=precision, output_format=output_format, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend=_BACKEND)
    x, cos, sin = _inputs(geom)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _dense(compiled(x, cos, sin)).backward(torch.randn(33, _FUSED[1], _FUSED[4], device=DEVICE))
    assert _warnings_of_ours(records) == []
    assert x.grad is not None and layer.weight.grad is not None and layer.norm_weight.grad is not None
