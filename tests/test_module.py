"""FusedMLAQUpProjection as an nn.Module (SPEC §4): construction and forward validation, from_modules,
the quantized-weight cache, extra_repr / state_dict, and the public `mxfp8_quantize` (shapes, straight-through
gradient, Triton == PyTorch bytes). CPU lane: Triton's interpreter (conftest); `gpu` variants on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mla_qproj import FusedMLAQUpProjection, MXFP8Query, MXFP8Tensor, mxfp8_quantize

from _helpers import layer_kwargs
from _tolerances import REL_ERR_SAME_QUANT, assert_bytes_equal, rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K, H, NOPE, R = 64, 2, 32, 32
K_FP8_BLOCK = 128  # precision="fp8_block" needs q_lora_rank % 128 == 0 (SPEC §5)
PRECISIONS = ("mxfp8", "bf16", "fp8_block")


def k_for(precision: str) -> int:
    return K_FP8_BLOCK if precision == "fp8_block" else K


def layer_(**kw):
    kw.setdefault("device", DEV)
    return FusedMLAQUpProjection(k_for(kw.get("precision", "mxfp8")), H, NOPE, R, **layer_kwargs(kw))


def tables(lead, rope=R, device=DEV):
    ang = torch.rand(*lead, rope // 2, device=device) * 6
    return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def dense(q):  # MXFP8Tensor or bf16 -> fp32 dense (autograd flows)
    return q.float()


# ------------------------------------------------------------------------------------ 1. construction


@pytest.mark.parametrize("args,kw,name", [
    ((64, 2, 32, 32), {"q_head_dim": 32}, "q_head_dim"),  # nope + rope > q_head_dim
    ((64, 2, 32, 31), {}, "qk_pos_emb_head_dim"),  # odd rope
    ((64, 2, 32, 0), {}, "qk_pos_emb_head_dim"),
    ((64, 2, 32, -2), {}, "qk_pos_emb_head_dim"),
    ((0, 2, 32, 32), {}, "q_lora_rank"),
    ((-32, 2, 32, 32), {}, "q_lora_rank"),
    ((64, 0, 32, 32), {}, "num_heads"),
    ((64, -1, 32, 32), {}, "num_heads"),
    ((64, 2, -1, 32), {}, "qk_head_dim"),
    ((64, 2, 0, 32), {"q_head_dim": 0}, "q_head_dim"),
    ((64, 2, 0, 32), {"q_head_dim": -32}, "q_head_dim"),
    ((48, 2, 32, 32), {}, "q_lora_rank"),  # % 32
    ((64, 2, 16, 16), {"q_head_dim": 40, "output_format": "mxfp8"}, "q_head_dim"),  # % 32 with mxfp8 output
    ((64, 2, 24, 16), {"output_format": "mxfp8"}, "q_head_dim"),  # default q_head_dim 40, an MXFP8 query
    ((64, 2, 32, 32), {"rope_style": "llama"}, "rope_style"),
    ((64, 2, 32, 32), {"precision": "fp8"}, "precision"),
    ((64, 2, 32, 32), {"output_format": "fp8"}, "output_format"),
    ((64, 2, 32, 32), {"backend": "cuda"}, "backend"),
    ((64, 2, 32, 32), {"eps": -1.0}, "eps"),
    ((64, 2, 32, 32), {"rope_theta": 0.0}, "rope_theta"),
    ((64, 2, 32, 32), {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
])
def test_construction_errors_name_the_argument(args, kw, name):
    with pytest.raises(ValueError, match=name):
        FusedMLAQUpProjection(*args, **kw)


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_q_head_dim_not_multiple_of_32_allowed_with_bf16_output(precision):
    layer = FusedMLAQUpProjection(64, 2, 16, 16, q_head_dim=40, precision=precision, output_format="bf16",
                                  device=DEV)
    assert layer.weight.shape == (80, 64) and layer.norm_weight.shape == (64,)
    x = torch.randn(33, 64, device=DEV, requires_grad=True)
    q = layer(x, *tables((33,), 16))
    assert q.shape == (33, 2, 40) and q.dtype == torch.bfloat16
    q.float().backward(torch.randn(q.shape, device=DEV))
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0, "dx"
    assert torch.isfinite(layer.weight.grad).all() and layer.weight.grad.abs().sum() > 0, "dweight"


# ------------------------------------------------------------------------------------------ 2. forward


def test_forward_value_errors():
    layer = layer_()
    x = torch.randn(5, K, device=DEV)
    cos, sin = tables((5,))
    pos = torch.arange(5, device=DEV)
    with pytest.raises(ValueError, match="q_lora_rank"):
        layer(torch.randn(5, K + 32, device=DEV), cos, sin)
    with pytest.raises(ValueError, match="q_lora_rank"):
        layer(torch.tensor(1.0, device=DEV), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        layer(x, *tables((6,)))  # not broadcastable
    with pytest.raises(ValueError, match="cos"):
        layer(x, *tables((5, 5)))  # broadcasts only to a larger shape
    with pytest.raises(ValueError, match="cos"):
        layer(x, cos[..., :-2], sin[..., :-2])  # wrong width
    with pytest.raises(ValueError, match="sin"):
        layer(x, cos, torch.cat([sin, sin], -1))
    for args, kw in (((cos, sin), {"position_ids": pos}), ((), {}), ((cos,), {})):  # both, neither, half a pair
        with pytest.raises(ValueError):
            layer(x, *args, **kw)
    with pytest.raises(ValueError, match="position_ids"):
        layer(x, position_ids=torch.arange(6, device=DEV))


@pytest.mark.parametrize("name", ["cos", "sin"])
def test_tables_requiring_grad_refused(name):
    """The layer gives the RoPE tables no gradient: a table that asks for one is refused (else it stays None)."""
    layer = layer_()
    x = torch.randn(5, K, device=DEV, requires_grad=True)
    t = dict(zip(("cos", "sin"), tables((5,)), strict=True))
    t[name] = t[name].clone().requires_grad_(True)
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode), pytest.raises(ValueError, match=rf"{name}.*no gradient"):
            layer(x, t["cos"], t["sin"])
    layer(x, t["cos"].detach(), t["sin"].detach())


def test_position_ids_shapes():
    """position_ids broadcast to the query's leading dims; extra leading dims of size 1 are dropped (HF's [1, T] for a
    flattened x [T, K]). Any other shape is a ValueError naming position_ids, not an expand error."""
    layer = layer_(precision="bf16", output_format="bf16")
    x = torch.randn(5, K, device=DEV)
    pos = torch.arange(3, 8, device=DEV)
    ref = dense(layer(x, position_ids=pos))
    for p in (pos[None], pos[None, None]):
        assert torch.equal(dense(layer(x, position_ids=p)), ref), f"position_ids {tuple(p.shape)} for x [T, K]"
    xb = torch.stack([x, 2 * x])  # [b, s, K]
    ref_b = dense(layer(xb, position_ids=torch.stack([pos, pos])))
    for p in (pos, pos[None], pos[None, None]):
        assert torch.equal(dense(layer(xb, position_ids=p)), ref_b), f"position_ids {tuple(p.shape)} for x [b, s, K]"
    for p in (pos[:, None], torch.stack([pos, pos]), pos[None].expand(5, 5), torch.arange(6, device=DEV)):
        with pytest.raises(ValueError, match="position_ids"):
            layer(x, position_ids=p)


def test_forward_device_mismatch():
    layer = layer_()
    x = torch.randn(5, K, device=DEV)
    cos, sin = tables((5,))
    with pytest.raises(ValueError, match="cos"):
        layer(x, cos.to("meta"), sin)
    with pytest.raises(ValueError, match="sin"):
        layer(x, cos, sin.to("meta"))
    with pytest.raises(ValueError, match="position_ids"):
        layer(x, position_ids=torch.arange(5, device="meta"))
    with pytest.raises(ValueError, match="weight"):
        layer(x.to("meta"), cos.to("meta"), sin.to("meta"))  # parameters stay on DEV
    meta = layer_(device="meta")
    with pytest.raises(ValueError, match="weight"):
        meta(x, cos, sin)


def test_forward_type_errors():
    layer = layer_()
    x = torch.randn(5, K, device=DEV)
    cos, sin = tables((5,))
    for dt in (torch.int32, torch.float64, torch.int64, torch.bool):
        with pytest.raises(TypeError, match=r"\bx\b"):
            layer(x.to(dt), cos, sin)
    for p in (torch.arange(5.0, device=DEV), torch.ones(5, dtype=torch.bool, device=DEV)):
        with pytest.raises(TypeError, match="position_ids"):
            layer(x, position_ids=p)
    with pytest.raises(TypeError, match="position_ids"):
        layer(x, position_ids=[0, 1, 2, 3, 4])
    for not_a_tensor in (x.tolist(), x.cpu().numpy()):
        with pytest.raises(TypeError, match=r"\bx\b"):
            layer(not_a_tensor, cos, sin)
    with pytest.raises(TypeError, match="cos"):
        layer(x, (cos * 4).int(), sin)


def test_forward_accepts_dtypes_and_half_tables():
    layer = layer_(output_format="bf16", precision="bf16")
    x = torch.randn(2, 5, K, device=DEV)
    cos, sin = tables((5,))  # [s, R] against x [b, s]
    ref = dense(layer(x, cos, sin))
    assert torch.equal(dense(layer(x, cos[..., : R // 2], sin[..., : R // 2])), ref), "half-width tables"
    assert torch.equal(dense(layer(x, cos.double(), sin.double())), dense(layer(x, cos.double().float(),
                                                                               sin.double().float())))
    pos = torch.arange(5, device=DEV)
    assert torch.equal(dense(layer(x, position_ids=pos.int())), dense(layer(x, position_ids=pos))), "int32 pos"
    for dt in (torch.float16, torch.bfloat16):
        q = layer(x.to(dt), cos, sin)
        assert q.shape == (2, 5, H, NOPE + R)
        assert (dense(q) - ref).norm() / ref.norm() < 2e-2, f"x in {dt}"


@pytest.mark.parametrize("rope", [R, 64], ids=["general_kernels", "fused_gemm_and_fast_rope"])
@pytest.mark.parametrize("layout", ["full_width_view", "broadcast_row", "bf16", "transposed"])
def test_table_layouts_read_in_place(layout, rope):
    """cos/sin reach the kernels as views where they can (a full-width table's first half: row stride R; one row
    broadcast over the tokens: row stride 0; bf16 tables upcast in the kernel) and the query and gradients equal
    those of the same values as contiguous fp32 half tables (the torch backend on the same tables too)."""
    layer = FusedMLAQUpProjection(K, H, NOPE, rope, device=DEV, **layer_kwargs(columnwise_output=True))
    T = 37
    x = torch.randn(T, K, device=DEV)
    cos, sin = tables((T,), rope)
    if layout == "broadcast_row":
        cos, sin = cos[:1], sin[:1]  # [1, R] against x [T]
    elif layout == "bf16":
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    elif layout == "transposed":  # inner stride != 1: copied to contiguous fp32
        cos, sin = cos.t().contiguous().t(), sin.t().contiguous().t()
    half = lambda t: t[..., : rope // 2].float().expand(T, rope // 2).contiguous()  # noqa: E731
    dy = torch.randn(T, H, NOPE + rope, device=DEV)
    outs = []
    for c, s, backend in ((cos, sin, "auto"), (half(cos), half(sin), "auto"), (cos, sin, "torch")):
        layer.backend = backend
        xx = x.clone().requires_grad_()
        q = layer(xx, c, s)
        g = torch.autograd.grad(dense(q), (xx, layer.norm_weight, layer.weight), dy)
        outs.append((q, g))
    for (q, g), what in zip(outs[1:], ("contiguous fp32 half tables", "torch backend"), strict=True):
        for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
            assert torch.equal(getattr(outs[0][0], f).view(torch.uint8), getattr(q, f).view(torch.uint8)), \
                f"{layout}: {f} vs {what}"
        if what.startswith("contiguous"):  # same kernels, same values: same gradient bits
            for a, b, name in zip(outs[0][1], g, ("dx", "dnorm_weight", "dweight"), strict=True):
                assert torch.equal(a, b), f"{layout}: {name} vs {what}"


def test_mxfp8_quantize_errors():
    with pytest.raises(ValueError, match="32"):
        mxfp8_quantize(torch.randn(4, 48))  # rowwise needs last dim % 32
    with pytest.raises(ValueError, match="scale_mode"):
        mxfp8_quantize(torch.randn(4, 64), scale_mode="nearest")
    with pytest.raises(ValueError, match="backend"):
        mxfp8_quantize(torch.randn(4, 64), backend="cuda")
    with pytest.raises(TypeError):
        mxfp8_quantize(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(TypeError):
        mxfp8_quantize(torch.randn(4, 64, dtype=torch.float64))
    with pytest.raises(TypeError):
        mxfp8_quantize([[1.0] * 32])
    with pytest.raises(ValueError):
        mxfp8_quantize(torch.randn(4, 64), rowwise=False, columnwise=False)
    q = mxfp8_quantize(torch.randn(33, 48), rowwise=False, columnwise=True)  # columnwise: any last dim
    assert q.columnwise_scale.shape == (2, 48)


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_double_backward_refused(backend, precision):
    """The backward is not itself differentiable: a second differentiation through it raises instead of returning a
    gradient that misses the backward's own dependence on x and the weights."""
    layer = layer_(precision=precision, output_format="bf16", backend=backend)
    x = torch.randn(5, K, device=DEV, requires_grad=True)
    q = dense(layer(x, *tables((5,))))
    (gx,) = torch.autograd.grad(q.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):  # gx's graph does not reach x or the weight
        torch.autograd.grad(gx.square().sum(), [x, layer.weight])
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.square().sum().backward()


# ------------------------------------------------------------------------------------- 3. from_modules


class HFRMSNorm(nn.Module):
    """DeepseekV3RMSNorm: `variance_epsilon`, no `eps`."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("norm_cls", ["torch", "hf"])
def test_from_modules_shares_weights_and_eps(norm_cls):
    eps = 1e-2  # large, so a wrong eps shows in the output (x is scaled to rms ~0.05)
    norm = nn.RMSNorm(K, eps=eps, device=DEV) if norm_cls == "torch" else HFRMSNorm(K, eps).to(DEV)
    linear = nn.Linear(K, H * (NOPE + R), bias=False, device=DEV)
    layer = FusedMLAQUpProjection.from_modules(norm, linear, num_heads=H, qk_head_dim=NOPE, qk_pos_emb_head_dim=R,
                                               precision="bf16", output_format="bf16", rope_style="neox")
    assert layer.norm_weight is norm.weight and layer.weight is linear.weight, "weights must be shared"
    assert f"eps={eps}" in layer.extra_repr()
    x = 0.05 * torch.randn(7, K, device=DEV)
    cos, sin = tables((7,))
    y = linear(norm(x)).view(7, H, -1)
    rope = y[..., NOPE:]
    rot = torch.cat([-rope[..., R // 2 :], rope[..., : R // 2]], -1)
    ref = torch.cat([y[..., :NOPE], rope * cos[:, None] + rot * sin[:, None]], -1)
    err = ((dense(layer(x, cos, sin)) - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"output vs norm+linear composition (eps taken from the norm): rel err {err}"
    with torch.no_grad():
        linear.weight.mul_(3)  # the shared parameter drives the layer
    err = ((dense(layer(x, cos, sin)) - 3 * ref).norm() / (3 * ref).norm()).item()
    assert err < 1e-2, f"after scaling linear.weight: rel err {err}"
    assert FusedMLAQUpProjection.from_modules(norm, linear, num_heads=H, qk_head_dim=NOPE, qk_pos_emb_head_dim=R,
                                              eps=1e-3).extra_repr().count("eps=0.001") == 1, "explicit eps wins"


def test_from_modules_rejects():
    norm = nn.RMSNorm(K)
    kw = {"num_heads": H, "qk_head_dim": NOPE, "qk_pos_emb_head_dim": R}
    with pytest.raises(ValueError, match="bias"):
        FusedMLAQUpProjection.from_modules(norm, nn.Linear(K, H * 64, bias=True), **kw)
    with pytest.raises(ValueError):
        FusedMLAQUpProjection.from_modules(norm, nn.Linear(K + 32, H * 64, bias=False), **kw)  # in != norm
    with pytest.raises(ValueError):
        FusedMLAQUpProjection.from_modules(norm, nn.Linear(K, H * 64 + 1, bias=False), **kw)  # out % H
    with pytest.raises(ValueError):
        FusedMLAQUpProjection.from_modules(norm, nn.Linear(K, H * 64, bias=False), q_head_dim=96, **kw)
    with pytest.raises(ValueError):
        FusedMLAQUpProjection.from_modules(nn.RMSNorm(K, elementwise_affine=False), nn.Linear(K, H * 64, bias=False),
                                           **kw)


class ScaleNorm(nn.Module):
    """A norm with `weight` and `eps` that is not an RMSNorm."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6


class BiasedRMSNorm(HFRMSNorm):
    def __init__(self, hidden, eps):
        super().__init__(hidden, eps)
        self.bias = nn.Parameter(torch.zeros(hidden))


class NoEpsRMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


@pytest.mark.parametrize("norm", [nn.LayerNorm(K), nn.LayerNorm(K, bias=False), ScaleNorm(K), BiasedRMSNorm(K, 1e-6),
                                  NoEpsRMSNorm(K)],
                         ids=["LayerNorm", "LayerNorm_no_bias", "ScaleNorm", "RMSNorm_bias", "RMSNorm_no_eps"])
def test_from_modules_refuses_a_norm_it_does_not_compute(norm):
    """The layer computes RMSNorm: any other norm (LayerNorm subtracts the mean and adds a bias) would silently give
    another function."""
    with pytest.raises(ValueError, match=rf"norm.*{type(norm).__name__}"):
        FusedMLAQUpProjection.from_modules(norm, nn.Linear(K, H * 64, bias=False), num_heads=H, qk_head_dim=NOPE,
                                           qk_pos_emb_head_dim=R)


# --------------------------------------------------------------------------------- 4. weight cache


def fresh_output(layer, x, cos, sin):
    """The output of a new layer holding a copy of `layer`'s current parameters (no cache history)."""
    other = copy.deepcopy(layer)
    other._wcache = None
    return dense(other(x, cos, sin))


def torch_output(layer, x, cos, sin):
    ref = copy.deepcopy(layer)
    ref.backend = "torch"
    ref._wcache = None
    return dense(ref(x, cos, sin))


def step_once(layer, opt, x, cos, sin):
    opt.zero_grad()
    q = dense(layer(x, cos, sin))
    q.backward(torch.randn_like(q))
    opt.step()


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.5, fused=True),
}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_cache_follows_optimizer_steps(opt_name, precision):
    layer = layer_(precision=precision)
    x = torch.randn(33, k_for(precision), device=DEV)
    cos, sin = tables((33,))
    opt = OPTIMIZERS[opt_name](layer.parameters())
    before = dense(layer(x, cos, sin))
    for i in range(2):
        step_once(layer, opt, x, cos, sin)
        now = dense(layer(x, cos, sin))
        assert not torch.equal(now, before), f"step {i}: output did not change"
        assert torch.equal(now, fresh_output(layer, x, cos, sin)), f"step {i}: stale quantized weight"
        err = rel_err(now, torch_output(layer, x, cos, sin))
        assert err <= REL_ERR_SAME_QUANT, f"step {i}: vs torch backend rel err {err}"
        before = now


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_layer_cache_follows_fused_optimizer(how, precision):
    """A copy of a layer (deepcopy, torch.save / load) has new parameters; a fused optimizer's steps (no `_version`
    bump) must still refresh its quantized weight."""
    import io

    k = k_for(precision)
    orig = layer_(precision=precision)
    orig(torch.randn(5, k, device=DEV), *tables((5,)))  # a cache exists in the original
    if how == "deepcopy":
        layer = copy.deepcopy(orig)
    else:
        buf = io.BytesIO()
        torch.save(orig, buf)
        buf.seek(0)
        layer = torch.load(buf, weights_only=False)
    x = torch.randn(33, k, device=DEV)
    cos, sin = tables((33,))
    opt = OPTIMIZERS["adamw_fused"](layer.parameters())
    before = dense(layer(x, cos, sin))
    step_once(layer, opt, x, cos, sin)
    after = dense(layer(x, cos, sin))
    assert not torch.equal(after, before), "the step did not change the output"
    assert torch.equal(after, fresh_output(layer, x, cos, sin)), "stale quantized weight"


def test_from_modules_allocates_no_weight_of_its_own():
    norm, lin = nn.RMSNorm(K), nn.Linear(K, H * (NOPE + R), bias=False)
    layer = FusedMLAQUpProjection.from_modules(norm, lin, num_heads=H, qk_head_dim=NOPE, qk_pos_emb_head_dim=R)
    assert layer.weight is lin.weight and layer.norm_weight is norm.weight
    assert not any(t.is_meta for t in list(layer.parameters()) + list(layer.buffers()))
    assert layer.inv_freq.dtype == torch.float32 and layer.inv_freq.device == lin.weight.device


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cache_follows_in_place_and_new_parameter(precision):
    layer = layer_(precision=precision)
    x = torch.randn(33, k_for(precision), device=DEV)
    cos, sin = tables((33,))
    out0 = dense(layer(x, cos, sin))
    with torch.no_grad():
        layer.weight.mul_(2)
    out = dense(layer(x, cos, sin))
    assert torch.equal(out, 2 * out0), "in-place mul_(2) under no_grad (power of two: exactly 2x)"
    assert torch.equal(out, fresh_output(layer, x, cos, sin)), "in-place mul_(2)"
    layer.weight = nn.Parameter(torch.randn_like(layer.weight) * 0.1)
    assert torch.equal(dense(layer(x, cos, sin)), fresh_output(layer, x, cos, sin)), "new Parameter"
    layer.weight.data = torch.randn_like(layer.weight) * 0.1
    assert torch.equal(dense(layer(x, cos, sin)), fresh_output(layer, x, cos, sin)), "weight.data = new tensor"
    layer.load_state_dict({"weight": torch.randn_like(layer.weight), "norm_weight": layer.norm_weight.detach()})
    assert torch.equal(dense(layer(x, cos, sin)), fresh_output(layer, x, cos, sin)), "load_state_dict"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_refresh_after_write_through_data(precision):
    """HF `_init_weights` style (`module.weight.data.normal_()`) writes through `.data` (own version counter,
    same storage): undetectable, so the documented `refresh_weight_cache()` must bring the output back in line."""
    layer = layer_(precision=precision)
    x = torch.randn(33, k_for(precision), device=DEV)
    cos, sin = tables((33,))
    out0 = dense(layer(x, cos, sin))
    layer.weight.data.mul_(2)
    layer.refresh_weight_cache()
    assert torch.equal(dense(layer(x, cos, sin)), 2 * out0), "stale quantized weight after refresh_weight_cache()"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cache_not_rebuilt_without_change(precision):
    layer = layer_(precision=precision)
    x = torch.randn(33, k_for(precision), device=DEV, requires_grad=True)
    cos, sin = tables((33,))
    q = dense(layer(x, cos, sin))
    cached = layer._wcache
    assert cached is not None
    q.backward(torch.randn_like(q))  # backward does not change the weight
    layer(x, cos, sin)
    layer(x.detach()[:5], cos[:5], sin[:5])
    assert layer._wcache is cached, "cache rebuilt although the weight did not change"
    with torch.no_grad():
        layer.norm_weight.add_(1.0)  # only the norm weight: the quantized W stays valid
    layer(x, cos, sin)
    assert layer._wcache is cached, "cache rebuilt by a norm_weight change"
    with torch.no_grad():
        layer.weight.add_(1.0)
    layer(x, cos, sin)
    assert layer._wcache is not cached, "cache not rebuilt after a weight change"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_cache_follows_optimizer_steps_gpu(precision):
    test_cache_follows_optimizer_steps("adamw_foreach", precision)  # CUDA default: foreach
    test_cache_follows_optimizer_steps("adamw_fused", precision)


# ------------------------------------------------------------------------- 5. repr and state_dict


def test_extra_repr_and_state_dict():
    layer = FusedMLAQUpProjection(64, 3, 16, 32, q_head_dim=64, eps=1e-5, zero_centered_gamma=True,
                                  rope_style="gptj", precision="bf16",
                                  output_format=MXFP8Query(scale_mode="floor", columnwise=True),
                                  rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64})
    r = repr(layer)
    for s in ("q_lora_rank=64", "num_heads=3", "qk_head_dim=16", "qk_pos_emb_head_dim=32", "q_head_dim=64",
              "eps=1e-05", "rope_style=gptj", "precision=BF16()",
              "output_format=MXFP8Query(scale_mode='floor', columnwise=True)", "zero_centered_gamma=True", "yarn",
              "backend=auto"):
        assert s in r, f"{s!r} missing from {r}"
    assert set(layer.state_dict()) == {"weight", "norm_weight"}, f"state_dict keys {list(layer.state_dict())}"
    assert layer.weight.shape == (3 * 64, 64) and layer.norm_weight.shape == (64,)
    assert not layer.norm_weight.any(), "zero-centered gamma starts at 0"
    assert layer_().norm_weight.eq(1).all(), "gamma starts at 1"
    other = FusedMLAQUpProjection(64, 3, 16, 32, q_head_dim=64, zero_centered_gamma=True, output_format="bf16")
    other.load_state_dict(layer.state_dict())  # strict: nothing else expected
    assert torch.equal(other.weight, layer.weight)


@pytest.mark.parametrize("cast", ["to_bf16", "half", "to_fp16_then_fp32"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}])
def test_module_dtype_cast_keeps_rope_tables_fp32(cast, scaling):
    """SPEC §3: `model.to(dtype)` / `.half()` must not round the RoPE frequencies: the position_ids query of a cast
    layer equals (bit for bit) the one of a layer built in that dtype with the same parameters."""
    dtype = torch.float32 if cast == "to_fp16_then_fp32" else torch.float16 if cast == "half" else torch.bfloat16
    kw = dict(precision="bf16", output_format="bf16", rope_scaling=scaling, backend="torch")
    built = layer_(dtype=dtype, **kw)
    cast_layer = layer_(**kw)
    cast_layer.load_state_dict(built.state_dict())
    if cast == "to_bf16":
        cast_layer = cast_layer.to(torch.bfloat16)
    elif cast == "half":
        cast_layer = cast_layer.half()
    else:
        cast_layer = cast_layer.to(torch.float16).to(torch.float32)
        cast_layer.load_state_dict(built.state_dict())
    assert cast_layer.inv_freq.dtype == torch.float32
    assert torch.equal(cast_layer.inv_freq, built.inv_freq)
    T = 4096
    x = torch.randn(T, K, device=DEV).to(dtype)
    pos = torch.arange(T, device=DEV)
    assert_bytes_equal(cast_layer(x, position_ids=pos), built(x, position_ids=pos), f"query after {cast}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.complex64])
def test_unsupported_parameter_dtype_refused_at_construction(dtype):
    with pytest.raises(TypeError, match="dtype"):
        layer_(dtype=dtype)
    old = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
        try:
            with pytest.raises(TypeError, match="dtype"):
                layer_()
        finally:
            torch.set_default_dtype(old)


@pytest.mark.filterwarnings("ignore:Complex modules:UserWarning")  # torch's, for the complex cast
@pytest.mark.parametrize("cast", ["to_float64", "double", "to_complex64", "in_a_model"])
def test_unsupported_dtype_cast_refused(cast):
    """`module.to(dtype)` to a parameter dtype the layer does not run raises at the cast (naming the dtype), not at
    the next forward."""
    layer = layer_()
    casts = {"to_float64": lambda m: m.to(torch.float64), "double": lambda m: m.double(),
             "to_complex64": lambda m: m.to(torch.complex64),
             "in_a_model": lambda m: nn.Sequential(nn.Linear(4, 4), m).to(torch.float64)}
    with pytest.raises(TypeError, match="float64" if cast != "to_complex64" else "complex64"):
        casts[cast](layer)


# ----------------------------------------------------------------------------------- 6. mxfp8_quantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_quantize_straight_through(dtype):
    t = torch.randn(3, 11, 64, device=DEV, dtype=dtype, requires_grad=True)
    q = mxfp8_quantize(t, rowwise=True, columnwise=True)
    assert isinstance(q, MXFP8Tensor) and q.dtype == dtype and q.shape == t.shape and q.device == t.device
    d = q.dequantize()
    dy = torch.randn_like(d)
    d.backward(dy)
    assert torch.equal(t.grad, dy), "gradient must pass straight through"
    assert (d.float() - t.float()).norm() / t.float().norm() < 0.1, "dequantized value"


def test_mxfp8_quantize_shapes_3d():
    t = torch.randn(3, 11, 96, device=DEV)  # T = 33: a partial columnwise block
    q = mxfp8_quantize(t, rowwise=True, columnwise=True)
    assert q.rowwise_data.shape == (3, 11, 96) and q.rowwise_data.dtype == torch.float8_e4m3fn
    assert q.rowwise_scale.shape == (3, 11, 3) and q.rowwise_scale.dtype == torch.uint8
    assert q.columnwise_data.shape == (3, 11, 96) and q.columnwise_data.dtype == torch.float8_e4m3fn
    assert q.columnwise_scale.shape == (2, 96) and q.columnwise_scale.dtype == torch.uint8
    r = mxfp8_quantize(t)
    assert r.columnwise_data is None and r.columnwise_scale is None and r.rowwise_scale.shape == (3, 11, 3)
    c = mxfp8_quantize(t, rowwise=False, columnwise=True)
    assert c.rowwise_data is None and c.columnwise_scale.shape == (2, 96)


def special_values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,), generator=g).float())
    flat = t.view(-1)
    flat[::97] = 0.0
    flat[5::101] = -0.0
    flat[7::131] = float("nan")
    flat[17::157] = -float("nan")  # SPEC §2: a NaN keeps its sign (0xFF)
    flat[11::173] = float("inf")
    flat[13::199] = 1e-30
    return t.to(dtype).to(DEV)


@pytest.mark.parametrize("shape,rowwise", [((33, 64), True), ((3, 11, 96), True), ((1, 32), True),
                                           ((70, 40), False), ((2, 5, 7, 64), True)])
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_quantize_backends_byte_identical(shape, rowwise, scale_mode, dtype):
    t = special_values(shape, dtype, seed=len(shape) * 1000 + shape[-1])
    a = mxfp8_quantize(t, rowwise=rowwise, columnwise=True, scale_mode=scale_mode, backend="triton")
    b = mxfp8_quantize(t, rowwise=rowwise, columnwise=True, scale_mode=scale_mode, backend="torch")
    for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale") if rowwise else \
            ("columnwise_data", "columnwise_scale"):
        assert_bytes_equal(getattr(a, f), getattr(b, f), f)
    auto = mxfp8_quantize(t, rowwise=rowwise, columnwise=True, scale_mode=scale_mode)
    assert_bytes_equal(auto.columnwise_data, b.columnwise_data, "auto columnwise_data")


_NAN_BITS = {torch.float32: (0x7FC00000, -0x400000, torch.int32),  # (+NaN, -NaN as signed ints, int view)
             torch.bfloat16: (0x7FC0, -0x40, torch.int16), torch.float16: (0x7E00, -0x200, torch.int16)}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", list(_NAN_BITS))
def test_mxfp8_quantize_nan_keeps_sign(dtype, backend):
    """SPEC §2: a NaN element encodes as 0x7F with its sign kept (-NaN -> 0xFF), both orientations; for fp16 on CUDA
    too, whose fp16 -> fp32 conversion makes every NaN +NaN (the quantizers read the sign from the input's bits)."""
    pos, neg, ity = _NAN_BITS[dtype]
    t = torch.ones(2, 32, dtype=dtype)
    bits = t.view(ity)
    bits[0, 3], bits[1, 4] = neg, pos  # exact NaN bit patterns, no float conversion on the way
    q = mxfp8_quantize(t.to(DEV), rowwise=True, columnwise=True, backend=backend)
    for f in ("rowwise_data", "columnwise_data"):
        codes = getattr(q, f).view(torch.uint8).cpu()
        assert codes[0, 3].item() == 0xFF, f"{f}: -NaN encoded as {codes[0, 3].item():#04x}, expected 0xff"
        assert codes[1, 4].item() == 0x7F, f"{f}: +NaN encoded as {codes[1, 4].item():#04x}, expected 0x7f"


@pytest.mark.gpu
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_mxfp8_quantize_backends_byte_identical_gpu(scale_mode):
    t = special_values((4096, 1536), torch.bfloat16, seed=7)
    a = mxfp8_quantize(t, columnwise=True, scale_mode=scale_mode, backend="triton")
    b = mxfp8_quantize(t, columnwise=True, scale_mode=scale_mode, backend="torch")
    for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
        assert_bytes_equal(getattr(a, f), getattr(b, f), f)


@pytest.mark.parametrize("precision,backend", [("mxfp8", "torch"), ("bf16", "torch"), ("bf16", "auto")])
def test_autocast_changes_nothing(precision, backend):
    """The layer's precision is its own: under torch.autocast (bf16) the query and every gradient are those of a call
    without it (autocast would otherwise run the reference's fp32 GEMMs in bf16)."""
    torch.manual_seed(0)
    layer = layer_(precision=precision, output_format="bf16", backend=backend)
    x = torch.randn(40, K, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(40, device=DEV)
    dy = torch.randn(40, H, NOPE + R, device=DEV)
    results = []
    for enabled in (False, True):
        layer.zero_grad()
        xg = x.clone().requires_grad_(True)
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=enabled):
            q = layer(xg, position_ids=pos)
            (q.float() * dy).sum().backward()
        results.append((q, xg.grad, layer.weight.grad, layer.norm_weight.grad))
    for name, a, b in zip(("q", "dx", "dW", "dnorm_w"), *results, strict=True):
        assert_bytes_equal(b, a, name)
