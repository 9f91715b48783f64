"""The layer without a norm (SPEC §7: `norm=None`, a model's `q_proj`): xn = x, dx = dxn, no norm_weight."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

from _helpers import rope_oracle
from _tolerances import REL_ERR_SAME_QUANT, assert_mxfp8_close, assert_rel_err, rel_err_bound
from conftest import examples

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PRECISIONS = [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("mxfp8", "bf16"), ("fp8_block", "bf16"), ("fp8_block", "mxfp8")]


def _layer(K, H, P, R, precision, output_format, backend, style="deepseek"):
    torch.manual_seed(0)
    return FusedMLAQUpProjection(K, H, P, R, precision=precision, output_format=output_format, backend=backend,
                                 rope_style=style, norm=None, device=DEV)


def _tables(T, R):
    ang = torch.rand(T, R // 2, device=DEV) * 6.0
    return ang.cos(), ang.sin()


def _dense(q):
    return (q.dequantize() if isinstance(q, MXFP8Tensor) else q).float()


def _oracle(x, w, cos_h, sin_h, dy, H, P, R, style):
    """fp64 autograd of RoPE(x @ Wᵀ), the test's own RoPE: (q, dx, dW)."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = (x64 @ w64.t()).view(x.shape[0], H, -1)
    q = rope_oracle(y, cos_h.double(), sin_h.double(), P, R, style)
    q.backward(dy.double())
    return q.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("precision,output_format", PRECISIONS)
@settings(max_examples=examples(4), deadline=None)
@given(T=st.integers(1, 300), style=st.sampled_from(["deepseek", "neox", "gptj"]), seed=st.integers(0, 2**16))
def test_matches_fp64_oracle(precision, output_format, backend, T, style, seed):
    """Against the unquantized math without a norm: the query and both gradients within the precision's bound."""
    K, H, P, R = 128, 2, 32, 32
    layer = _layer(K, H, P, R, precision, output_format, backend, style)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(DEV).requires_grad_(True)
    cos_h, sin_h = _tables(T, R)
    q = layer(x, cos_h, sin_h)
    dy = torch.randn(T, H, P + R, generator=g).to(DEV)
    _dense(q).backward(dy)
    rq, rdx, rdw = _oracle(x, layer.weight, cos_h, sin_h, dy, H, P, R, style)
    bound = rel_err_bound(precision, output_format)
    assert_rel_err(_dense(q).double(), rq, bound, "q")
    assert_rel_err(x.grad.double(), rdx, rel_err_bound(precision), "dx")
    assert_rel_err(layer.weight.grad.double(), rdw, rel_err_bound(precision), "dW")


@pytest.mark.parametrize("precision,output_format", PRECISIONS)
def test_backends_agree(precision, output_format):
    """The Triton kernels (the interpreter on the CPU) and the reference: the same quantization of x."""
    K, H, P, R, T = 256, 2, 64, 64, 70
    lt = _layer(K, H, P, R, precision, output_format, "triton")
    lr = _layer(K, H, P, R, precision, output_format, "torch")
    lr.load_state_dict(lt.state_dict())
    x = torch.randn(T, K, device=DEV)
    cos_h, sin_h = _tables(T, R)
    xt, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    qt, qr = lt(xt, cos_h, sin_h), lr(xr, cos_h, sin_h)
    dy = torch.randn(T, H, P + R, device=DEV)
    _dense(qt).backward(dy)
    _dense(qr).backward(dy)
    if output_format == "mxfp8":
        assert_mxfp8_close(qt.rowwise_data, qt.rowwise_scale, _dense(qt), qr.rowwise_data, qr.rowwise_scale,
                           _dense(qr), "rowwise")
    else:
        assert_rel_err(qt.float(), qr.float(), REL_ERR_SAME_QUANT, "q")
    assert_rel_err(xt.grad, xr.grad, REL_ERR_SAME_QUANT, "dx")
    assert_rel_err(lt.weight.grad, lr.weight.grad, REL_ERR_SAME_QUANT, "dW")


def test_dx_is_the_dgrad_alone():
    """No RMSNorm backward: dx equals the bf16 layer's dgrad, W'ᵀ·inverse-RoPE(dy), computed here in plain torch
    (neox: the rotation keeps its layout, so its transpose is the rotation by -angle)."""
    K, H, P, R, T = 128, 2, 32, 32, 40
    layer = _layer(K, H, P, R, "bf16", "bf16", "torch", "neox")
    x = torch.randn(T, K, device=DEV, requires_grad=True)
    cos_h, sin_h = _tables(T, R)
    dy = torch.randn(T, H, P + R, device=DEV)
    layer(x, cos_h, sin_h).float().backward(dy)
    # inverse RoPE = the transpose of the rotation: RoPE with -sin
    g = rope_oracle(dy.double(), cos_h.double(), -sin_h.double(), P, R, "neox").reshape(T, -1)
    want = g.to(torch.bfloat16).double() @ layer.weight.detach().to(torch.bfloat16).double()
    assert_rel_err(x.grad.double(), want, 1e-2, "dx")


def test_structure_and_from_modules():
    lin = nn.Linear(128, 2 * 64, bias=False)
    layer = FusedMLAQUpProjection.from_modules(None, lin, num_heads=2, qk_head_dim=32, qk_pos_emb_head_dim=32,
                                               precision="bf16", output_format="bf16")
    assert layer.weight is lin.weight and layer.norm_weight is None and layer.cfg.norm is False
    assert list(layer.state_dict()) == ["weight"]
    assert "in_features=128" in repr(layer) and "norm=None" in repr(layer) and "eps=" not in repr(layer)
    direct = FusedMLAQUpProjection(128, 2, 32, 32, precision="bf16", output_format="bf16", norm=None)
    direct.load_state_dict(layer.state_dict())
    x = torch.randn(5, 128)
    pos = torch.arange(5)
    assert torch.equal(layer(x, position_ids=pos), direct(x, position_ids=pos))
    with torch.no_grad():
        got = layer(x, position_ids=pos).float()
    y = (x.double() @ lin.weight.detach().double().t()).view(5, 2, 64)
    assert_rel_err(got[..., :32].double(), y[..., :32], 1e-2, "pass-through columns are x · Wᵀ")


@pytest.mark.parametrize("kwargs,name", [(dict(eps=1e-5), "eps"), (dict(zero_centered_gamma=True),
                                                                      "zero_centered_gamma")])
def test_rmsnorm_options_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FusedMLAQUpProjection(128, 2, 32, 32, norm=None, **kwargs)


def test_bad_norm_arguments():
    with pytest.raises(ValueError, match="norm"):
        FusedMLAQUpProjection(128, 2, 32, 32, norm="layernorm")
    lin = nn.Linear(128, 128, bias=False)
    with pytest.raises(ValueError, match="eps"):
        FusedMLAQUpProjection.from_modules(None, lin, num_heads=2, qk_head_dim=32, qk_pos_emb_head_dim=32, eps=1e-5)


@pytest.mark.parametrize("precision,output_format", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("fp8_block", "bf16")])
def test_compiled_matches_eager(precision, output_format):
    """torch.compile(fullgraph=True) traces the norm-free layer (aot_eager; the kernels in the interpreter on the CPU)
    and gives eager's bytes, forward and backward."""
    torch._dynamo.reset()
    K, H, P, R = 256, 2, 128, 64
    layer = _layer(K, H, P, R, precision, output_format, "auto")

    def model(x, cos, sin):
        return _dense(layer(x, cos, sin)) * 0.5

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(33, K, device=DEV, requires_grad=True)
    cos, sin = torch.randn(33, R, device=DEV), torch.randn(33, R, device=DEV)
    dy = torch.randn(33, H, P + R, device=DEV)
    outs = []
    for fn in (model, compiled):
        x.grad = layer.weight.grad = None
        q = fn(x, cos, sin)
        q.backward(dy)
        outs.append((q.detach(), x.grad.clone(), layer.weight.grad.clone()))
    for name, a, b in zip(("q", "dx", "dW"), *outs, strict=True):
        assert torch.equal(a, b), name
