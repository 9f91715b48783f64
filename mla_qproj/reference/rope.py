"""RoPE tables and the three pair layouts (SPEC §3), in fp32 plain PyTorch.

Pair i (i < R/2) has members (a, b), cos c = cos[i], sin s = sin[i]; forward a' = a*c - b*s, b' = b*c + a*s.
- deepseek: a, b = input columns (2i, 2i+1); a' -> output column i, b' -> output column R/2 + i
- neox:     a, b = columns (i, i + R/2), in place
- gptj:     a, b = columns (2i, 2i+1), in place
The inverse applies the transpose rotation (a = a'*c + b'*s, b = b'*c - a'*s) and puts members back.
"""

from __future__ import annotations

import math

import torch

from .._constants import FLOAT_DTYPES


def split_pairs(r: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) members of every pair of the rope columns r [..., R] as laid out *before* the rotation."""
    half = r.shape[-1] // 2
    if style in ("deepseek", "gptj"):
        return r[..., 0::2], r[..., 1::2]
    if style == "neox":
        return r[..., :half], r[..., half:]
    raise ValueError(f"rope_style must be one of deepseek|neox|gptj, got {style!r}")


def join_pairs(a: torch.Tensor, b: torch.Tensor, style: str) -> torch.Tensor:
    """Rope columns [..., R] holding the rotated pairs (a', b') as laid out *after* the rotation."""
    if style in ("deepseek", "neox"):
        return torch.cat([a, b], dim=-1)
    if style == "gptj":
        return torch.stack([a, b], dim=-1).flatten(-2)
    raise ValueError(f"rope_style must be one of deepseek|neox|gptj, got {style!r}")


def split_pairs_rotated(r: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a', b') from the rotated layout (inverse of `join_pairs`)."""
    half = r.shape[-1] // 2
    if style in ("deepseek", "neox"):
        return r[..., :half], r[..., half:]
    return r[..., 0::2], r[..., 1::2]


def join_pairs_unrotated(a: torch.Tensor, b: torch.Tensor, style: str) -> torch.Tensor:
    """Rope columns with (a, b) put back in the pre-rotation layout (inverse of `split_pairs`)."""
    if style == "neox":
        return torch.cat([a, b], dim=-1)
    return torch.stack([a, b], dim=-1).flatten(-2)


TABLE_DTYPES = FLOAT_DTYPES  # read as is (exact upcast in the arithmetic)


def half_table(t: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The per-pair part of a cos/sin table (width R as cat(freqs, freqs), or R/2): a view when it can be (fp32,
    bf16 and fp16 tables are kept as they are: the RoPE arithmetic upcasts them exactly to fp32), else fp32."""
    if t.shape[-1] == rope_dim:
        t = t[..., : rope_dim // 2]
    return t if t.dtype in TABLE_DTYPES else t.float()


def _rotate(y, c, s, qk_head_dim, rope_dim, split, join) -> torch.Tensor:
    """Pairs (a, b) of y's rope columns, read with `split`, become (a c - b s, b c + a s), written with `join`."""
    lo, hi = qk_head_dim, qk_head_dim + rope_dim
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    a, b = split(y[..., lo:hi])
    return torch.cat([y[..., :lo], join(a * c - b * s, b * c + a * s), y[..., hi:]], dim=-1)


def apply_rope(
    y: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, qk_head_dim: int, rope_dim: int, style: str
) -> torch.Tensor:
    """Forward RoPE on y [..., H, D] (fp32). cos_h/sin_h: [..., R/2] broadcast over heads (add the head dim)."""
    return _rotate(y, cos_h, sin_h, qk_head_dim, rope_dim, lambda r: split_pairs(r, style),
                   lambda a, b: join_pairs(a, b, style))


def apply_rope_inverse(
    g: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, qk_head_dim: int, rope_dim: int, style: str
) -> torch.Tensor:
    """Transpose of `apply_rope` (its backward): the rotation by -angle, read in the rotated layout and written in
    the unrotated one, (ga c + gb s, gb c - ga s); pass-through columns unchanged. Negating sin is exact, so these
    are the same fp32 values as writing the signs out."""
    return _rotate(g, cos_h, -sin_h, qk_head_dim, rope_dim, lambda r: split_pairs_rotated(r, style),
                   lambda a, b: join_pairs_unrotated(a, b, style))


# --------------------------------------------------------------------------------------------- tables


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def normalize_rope_scaling(rope_scaling: dict | None) -> dict | None:
    """Accept HF `rope_parameters` ({"rope_type": "yarn", ...}) and DeepSeek config.json ({"type": "yarn", ...})."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be None or a dict, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling: only 'yarn' (or 'default') is supported, got type {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rope_scaling:
            raise ValueError(f"rope_scaling (yarn) needs {key!r}")
    return dict(rope_scaling)


def yarn_inv_freq(rope_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and attention factor, as HF transformers' DeepseekV3 (`_compute_yarn_parameters`)."""
    factor = float(scaling["factor"])
    orig = scaling["original_max_position_embeddings"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (rope_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)


def rope_inv_freq(rope_dim: int, theta: float, rope_scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] fp32, attention scaling) for the built-in tables."""
    scaling = normalize_rope_scaling(rope_scaling)
    if scaling is None:
        return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)), 1.0
    return yarn_inv_freq(rope_dim, float(scaling.get("rope_theta", theta)), scaling)


def build_rope_tables(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width HF tables cos, sin [..., R] = cat(freqs, freqs) with freqs = pos * inv_freq, times the
    attention scaling (HF DeepseekV3RotaryEmbedding; fp32 whatever the activations' dtype)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq.float().to(position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling
