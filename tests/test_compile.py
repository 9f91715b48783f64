"""torch.compile(fullgraph=True) traces the layer (custom ops with fake implementations, no host syncs).
On the CPU lane this uses the aot_eager backend (no C++ toolchain needed); the kernels run in the interpreter."""

from __future__ import annotations

import pytest
import torch

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

from _tolerances import assert_bytes_equal
from conftest import DEVICE

_BACKEND = "aot_eager"  # a tracing test: AOTAutograd without code generation, any device


def _dense(q):
    return q.dequantize(torch.float32) if isinstance(q, MXFP8Tensor) else q.float()


@pytest.mark.parametrize("output_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("geom", [(64, 2, 32, 32, 64), (256, 2, 128, 64, 192)])  # general path; fused GEMM path
def test_compiled_module_matches_eager(output_format, geom):
    K, H, nope, R, D = geom
    layer = FusedMLAQUpProjection(K, H, nope, R, D, output_format=output_format, device=DEVICE)

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


def test_compiled_module_follows_weight_updates():
    layer = FusedMLAQUpProjection(64, 2, 32, 32, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend=_BACKEND)  # inference: the layer alone
    x = torch.randn(33, 64, device=DEVICE)
    cos, sin = torch.randn(33, 32, device=DEVICE), torch.randn(33, 32, device=DEVICE)
    with torch.no_grad():
        before = _dense(compiled(x, cos, sin))
        layer.weight.mul_(-2.0)
        after = _dense(compiled(x, cos, sin))
        eager = _dense(layer(x, cos, sin))
    assert not torch.equal(after, before)
    assert_bytes_equal(after, eager, "q after the weight changed")
