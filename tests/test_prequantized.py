"""Pre-quantized weights (DeepSeek-V3 / R1 checkpoints: q_b_proj as E4M3 codes + a 128x128 weight_scale_inv):
precision="fp8_block" takes them as they are (SPEC §5), dequantized value = code × scale_inv exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mla_qproj import FP8Block, FusedMLAQUpProjection

from _helpers import rope_oracle
from _tolerances import REL_ERR_FP8_BLOCK, REL_ERR_SAME_QUANT, assert_rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K, H, P, R = 256, 3, 64, 64  # N = 384: three 128-row blocks; heads of 128 columns


class _Fp8Linear(nn.Module):
    """What transformers' fine-grained FP8 integration loads for a checkpoint's Linear: codes and scale_inv."""

    def __init__(self, codes: torch.Tensor, scale_inv: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
        self.bias = None
        self.block_size = (128, 128)


def _checkpoint(pow2: bool, seed: int = 0):
    """E4M3 codes [N, K] with a ±448 in every 128x128 block, and scale_inv [N/128, K/128]: powers of two (what a
    pow2 requantization of the dequantized weight reproduces exactly) or arbitrary fp32 (DeepSeek's amax / 448)."""
    g = torch.Generator().manual_seed(seed)
    N = H * (P + R)
    vals = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448)
    vals[::128, ::128] = 448.0  # each block's first element: the block's amax is 448 x its scale_inv
    codes = vals.to(torch.float8_e4m3fn)
    e = torch.randint(-9, -4, (N // 128, K // 128), generator=g).float()
    sinv = torch.exp2(e) if pow2 else torch.exp2(e) * (1 + torch.rand(e.shape, generator=g))
    return codes, sinv


def _dequant(codes, sinv):
    return codes.double() * sinv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)


def _layer(codes, sinv, backend, norm=True):
    lin = _Fp8Linear(codes.to(DEV), sinv.to(DEV))
    rms = nn.RMSNorm(K, eps=1e-6, device=DEV) if norm else None
    return FusedMLAQUpProjection.from_modules(rms, lin, num_heads=H, qk_head_dim=P, qk_pos_emb_head_dim=R,
                                              precision="fp8_block", output_format="bf16", backend=backend), lin


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pow2_checkpoint_equals_the_requantized_layer_bit_for_bit(backend):
    """Power-of-two scales: the pre-quantized layer and a layer holding the dequantized weight (which requantizes it
    into the same codes and scales) give the same query and dx bytes."""
    codes, sinv = _checkpoint(pow2=True)
    pre, _ = _layer(codes, sinv, backend)
    w = _dequant(codes, sinv)
    assert torch.equal(w.bfloat16().double(), w)  # the dequantized weight is exact in bf16
    ref = FusedMLAQUpProjection(K, H, P, R, precision=FP8Block(block_scale="pow2"), output_format="bf16",
                                backend=backend, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w.bfloat16())
    ref.weight.requires_grad_(False)
    x = torch.randn(64, K, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(64, device=DEV)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    qa, qb = pre(xa, position_ids=pos), ref(xb, position_ids=pos)
    assert torch.equal(qa.view(torch.int16), qb.view(torch.int16))
    dy = torch.randn(qa.shape, device=DEV)
    qa.float().backward(dy)
    qb.float().backward(dy)
    assert torch.equal(xa.grad.view(torch.int16), xb.grad.view(torch.int16))
    assert pre.weight.grad is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_scales_against_the_checkpoints_dequantization(backend, norm):
    """Arbitrary fp32 scale_inv (DeepSeek's rule): the query against fp64 RoPE(xn · (code × scale_inv)ᵀ) within the
    block-FP8 bound (only the activations are quantized); a transposed or inverted scale would be off by far more."""
    codes, sinv = _checkpoint(pow2=False, seed=1)
    layer, lin = _layer(codes, sinv, backend, norm)
    T = 70
    x = torch.randn(T, K, device=DEV)
    ang = torch.rand(T, R // 2, device=DEV) * 6
    with torch.no_grad():
        q = layer(x, ang.cos(), ang.sin()).double()
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) if norm else xd
    y = (xn @ _dequant(codes, sinv).to(DEV).t()).view(T, H, P + R)
    assert_rel_err(q, rope_oracle(y, ang.cos().double(), ang.sin().double(), P, R, "deepseek"), REL_ERR_FP8_BLOCK,
                   "q")
    assert layer.weight is lin.weight and layer.weight_scale_inv is lin.weight_scale_inv
    assert {"weight", "weight_scale_inv"} <= set(layer.state_dict())


def test_backends_agree():
    codes, sinv = _checkpoint(pow2=False, seed=2)
    lt, _ = _layer(codes, sinv, "triton")
    lr, _ = _layer(codes, sinv, "torch")
    x = torch.randn(40, K, device=DEV)
    pos = torch.arange(40, device=DEV)
    with torch.no_grad():
        assert_rel_err(lt(x, position_ids=pos).float(), lr(x, position_ids=pos).float(), REL_ERR_SAME_QUANT, "q")


def test_no_weight_gradient():
    """The codes have no high-precision master: from_modules refuses codes that require grad, and a forward with
    weight.requires_grad set later raises; dx still flows."""
    codes, sinv = _checkpoint(pow2=True)
    lin = _Fp8Linear(codes.to(DEV), sinv.to(DEV))
    lin.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="requires_grad"):
        FusedMLAQUpProjection.from_modules(None, lin, num_heads=H, qk_head_dim=P, qk_pos_emb_head_dim=R,
                                           precision="fp8_block", output_format="bf16")
    layer, lin = _layer(codes, sinv, "torch")
    x = torch.randn(8, K, device=DEV, requires_grad=True)
    layer(x, position_ids=torch.arange(8, device=DEV)).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and lin.weight.grad is None
    lin.weight.requires_grad_(True)
    with pytest.raises(TypeError, match="master"):
        layer(x, position_ids=torch.arange(8, device=DEV))


def test_bad_checkpoints():
    codes, sinv = _checkpoint(pow2=True)
    kw = dict(num_heads=H, qk_head_dim=P, qk_pos_emb_head_dim=R)
    with pytest.raises(ValueError, match="precision"):
        FusedMLAQUpProjection.from_modules(None, _Fp8Linear(codes, sinv), precision="mxfp8", **kw)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        FusedMLAQUpProjection.from_modules(None, _Fp8Linear(codes, sinv.t().contiguous()), precision="fp8_block", **kw)
    lin = _Fp8Linear(codes, sinv)
    lin.block_size = (1, 128)
    with pytest.raises(ValueError, match="128x128"):
        FusedMLAQUpProjection.from_modules(None, lin, precision="fp8_block", **kw)
