"""Quickstart: put FusedMLAQUpProjection into an existing MLA query path.

A DeepSeek-style model builds its query from the compressed latent x as
    q = RoPE(q_b_proj(q_a_layernorm(x)))        (HF DeepseekV3: q_a_layernorm = RMSNorm, q_b_proj = Linear)
This script builds that path from the model's own modules (torch.nn.RMSNorm + nn.Linear + interleaved RoPE
written out below as in HF DeepseekV3 with rope_interleave=True), wraps the two modules with
`FusedMLAQUpProjection.from_modules` (parameters are shared, not copied), runs forward with position_ids and
backward with a random upstream gradient, compares output and gradients with the plain PyTorch composition
(run in fp32 on fp32 copies of the same modules), and feeds q into F.scaled_dot_product_attention.

    pip install -e .   # once, from the repository root (or run with PYTHONPATH=.)
    python examples/quickstart.py          # CUDA if available (Triton kernels, DeepSeek-V3 sizes), else CPU
                                           # (pure-PyTorch path, small sizes, a few seconds)
Exits with status 1 if a relative error is above its (loose) sanity bound.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

ROPE_THETA = 10000.0
PRECISION = "fp8_block"  # Hopper's FP8 recipe (DeepSeek-V3 / TE Float8BlockScaling); "bf16" is the default
MAX_REL_ERR = 0.15  # FP8 (E4M3: 3 mantissa bits) GEMM inputs; typical values are a few percent


# ---- the user's model code: HF DeepseekV3-style rotary embedding and interleaved RoPE, written out ----------


def rotary_cos_sin(position_ids: torch.Tensor, rope_dim: int, theta: float = ROPE_THETA):
    """HF DeepseekV3RotaryEmbedding (no scaling): cos, sin [b, s, rope_dim] = cat(freqs, freqs), fp32."""
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=position_ids.device) / rope_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb_interleave(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF DeepseekV3 (rope_interleave=True): q [b, h, s, r]; pairs are columns (2i, 2i+1), and the rotated
    pair i lands in columns i and r/2 + i. cos/sin [b, s, r]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, s, r = q.shape
    q = q.view(b, h, s, r // 2, 2).transpose(4, 3).reshape(b, h, s, r)
    return (q * cos) + (rotate_half(q) * sin)


def mla_query(norm: nn.Module, linear: nn.Module, x: torch.Tensor, position_ids: torch.Tensor,
              num_heads: int, nope: int, rope: int) -> torch.Tensor:
    """The plain composition, as the model runs it: returns q [b, s, H, nope + rope]."""
    b, s, _ = x.shape
    q = linear(norm(x)).view(b, s, num_heads, nope + rope).transpose(1, 2)  # [b, H, s, D]
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    cos, sin = rotary_cos_sin(position_ids, rope)
    q_rot = apply_rotary_pos_emb_interleave(q_rot, cos.to(q_rot.dtype), sin.to(q_rot.dtype))
    return torch.cat([q_pass, q_rot], dim=-1).transpose(1, 2)  # [b, s, H, D]


# ---- helpers ----------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in fp32."""
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cuda_ms(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() on the current CUDA stream (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # DeepSeek-V3's query path
        q_lora_rank, heads, nope, rope, batch, seq = 1536, 128, 128, 64, 2, 2048
    else:  # small, so the pure-PyTorch path runs in a few seconds
        q_lora_rank, heads, nope, rope, batch, seq = 256, 8, 64, 32, 2, 64
    dtype = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}")

    # 1. the model's own modules
    norm = nn.RMSNorm(q_lora_rank, eps=1e-6, device=device, dtype=dtype)
    linear = nn.Linear(q_lora_rank, heads * (nope + rope), bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn_like(norm.weight))  # not the all-ones init: exercise the gain

    # 2. wrap them: the fused layer shares norm.weight and linear.weight
    layer = FusedMLAQUpProjection.from_modules(
        norm, linear, num_heads=heads, qk_head_dim=nope, qk_pos_emb_head_dim=rope, rope_style="deepseek",
        rope_theta=ROPE_THETA, precision=PRECISION,  # output_format="bf16" (the default): a bf16 query
    )
    assert layer.weight is linear.weight and layer.norm_weight is norm.weight
    print(layer)

    # 3. forward with position_ids, backward with a random upstream gradient
    x = torch.randn(batch, seq, q_lora_rank, device=device, dtype=dtype, requires_grad=True)
    position_ids = torch.arange(seq, device=device).expand(batch, seq)
    q = layer(x, position_ids=position_ids)
    dy = torch.randn(q.shape, device=device, dtype=dtype)
    q.backward(dy)
    print(f"x {tuple(x.shape)} -> q {type(q).__name__} {tuple(q.shape)} {q.dtype}")
    if isinstance(q, MXFP8Tensor):
        print(f"  rowwise_data {tuple(q.rowwise_data.shape)} {q.rowwise_data.dtype}, "
              f"rowwise_scale {tuple(q.rowwise_scale.shape)} {q.rowwise_scale.dtype}")
    print(f"  grads: dx {tuple(x.grad.shape)} {x.grad.dtype}, d(norm.weight) {tuple(norm.weight.grad.shape)}, "
          f"d(linear.weight) {tuple(linear.weight.grad.shape)} {linear.weight.grad.dtype}")

    # 4. the plain composition in fp32 on fp32 copies of the same modules
    ref_norm, ref_linear = copy.deepcopy(norm).float(), copy.deepcopy(linear).float()
    for p in (*ref_norm.parameters(), *ref_linear.parameters()):
        p.grad = None
    x_ref = x.detach().float().requires_grad_(True)
    q_ref = mla_query(ref_norm, ref_linear, x_ref, position_ids, heads, nope, rope)
    q_ref.backward(dy.float())
    errors = {
        "  q": rel_err(q.dequantize(torch.float32) if isinstance(q, MXFP8Tensor) else q.float(), q_ref),
        " dx": rel_err(x.grad, x_ref.grad),
        " dg": rel_err(norm.weight.grad, ref_norm.weight.grad),
        " dW": rel_err(linear.weight.grad, ref_linear.weight.grad),
    }

    # 5. q goes straight into attention (an MXFP8Tensor dequantizes for ops the package does not handle)
    with torch.no_grad():
        k = torch.randn(batch, heads, seq, nope + rope, device=device, dtype=dtype)
        v = torch.randn(batch, heads, seq, nope, device=device, dtype=dtype)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        o_ref = F.scaled_dot_product_attention(q_ref.transpose(1, 2).to(dtype), k, v, is_causal=True)
    errors["attn"] = rel_err(o, o_ref)
    print(f"SDPA: q {tuple(q.transpose(1, 2).shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} -> {tuple(o.shape)}")

    print(f"relative error vs fp32 PyTorch composition (bound {MAX_REL_ERR}):")
    for name, err in errors.items():
        print(f"  {name} {err:.4f}")

    if cuda:  # 6. times: fused layer vs the model's own (eager, bf16) composition
        def fused_fwd():
            with torch.no_grad():
                layer(x, position_ids=position_ids)

        def plain_fwd():
            with torch.no_grad():
                mla_query(norm, linear, x, position_ids, heads, nope, rope)

        def fused_fwdbwd():
            x.grad = norm.weight.grad = linear.weight.grad = None
            layer(x, position_ids=position_ids).backward(dy)

        def plain_fwdbwd():
            x.grad = norm.weight.grad = linear.weight.grad = None
            mla_query(norm, linear, x, position_ids, heads, nope, rope).backward(dy)

        print(f"times at T = {batch}x{seq} (median ms, eager bf16 composition vs fused {PRECISION}):")
        print(f"  forward      {cuda_ms(plain_fwd):8.3f}  vs {cuda_ms(fused_fwd):8.3f}")
        print(f"  fwd + bwd    {cuda_ms(plain_fwdbwd):8.3f}  vs {cuda_ms(fused_fwdbwd):8.3f}")

    bad = {name.strip(): err for name, err in errors.items() if not err <= MAX_REL_ERR}  # NaN counts as bad
    if bad:
        print(f"FAILED: relative error above {MAX_REL_ERR}: {bad}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
