"""TorchTitan integration: the DeepSeek-V3 attention's query path (`wq_b(q_norm(.))` and the query's RoPE) as one
`FusedMLAQUpProjection`.

`patch_deepseek_v3(model)` gives every `torchtitan.models.deepseek_v3.model.Attention` in `model` an
instance-level forward that computes the query with the fused layer and everything else (`wq_a`, keys, values,
their RoPE, the inner attention, `wo`) with TorchTitan's own modules. TorchTitan's `ComplexRoPE` rotates the pairs
(2i, 2i + 1) in place: the "gptj" style (SPEC §3); the tables are its cache at the call's positions (YaRN's mscale is
in TorchTitan's softmax scale, not in the tables). The fused layer shares `q_norm.weight` and `wq_b.weight`
(re-read at every call) and lives outside the module tree: `state_dict()` and checkpoints are unchanged.
`unpatch_deepseek_v3(model)` removes the patch; `fused_query_layer(attn)` returns an attention's fused layer.

Not covered (the attention keeps TorchTitan's forward, with a one-line warning at patch time): DTensor parameters
(tensor parallelism or FSDP applied before patching), attentions without `q_lora_rank` (`wq`), RoPE classes other
than `ComplexRoPE`. Written against torchtitan 0.3.0.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .module import FusedMLAQUpProjection
from .tensor import MXFP8Tensor

try:
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3.model import Attention
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("mla_qproj.torchtitan needs torchtitan (pip install 'mla_qproj[integrations]')") from e

__all__ = ["patch_deepseek_v3", "unpatch_deepseek_v3", "fused_query_layer"]

_LAYER_KEY = "_mla_qproj_query_layer"
_ALLOWED_KWARGS = ("precision", "output_format", "scale_mode", "block_scale", "backend", "columnwise_output")
_DEFAULT_KWARGS = {"precision": "bf16", "output_format": "bf16"}


def _problem(attn: nn.Module) -> str | None:
    if not attn.q_lora_rank:
        return "q_lora_rank == 0 (the `wq` projection)"
    if not isinstance(attn.rope, ComplexRoPE):
        return f"rope is {type(attn.rope).__name__} (the fused layer serves ComplexRoPE)"
    for name, p in (("wq_b.weight", attn.wq_b.weight), ("q_norm.weight", attn.q_norm.weight)):
        if type(p.data) is not torch.Tensor:
            return f"{name} is a {type(p.data).__name__} (tensor parallelism / FSDP applied)"
    if getattr(attn.wq_b, "bias", None) is not None:
        return "wq_b has a bias"
    return None


def _build(attn: nn.Module, kwargs: dict) -> FusedMLAQUpProjection:
    try:
        return FusedMLAQUpProjection.from_modules(
            attn.q_norm, attn.wq_b, num_heads=attn.n_heads, qk_head_dim=attn.qk_nope_head_dim,
            qk_pos_emb_head_dim=attn.qk_rope_head_dim, q_head_dim=attn.qk_head_dim, rope_style="gptj", **kwargs)
    except ValueError as e:
        raise ValueError(f"patch_deepseek_v3 (torchtitan): {e}") from e


def _synced(attn: nn.Module) -> FusedMLAQUpProjection:
    layer = attn.__dict__[_LAYER_KEY]
    if layer.weight is not attn.wq_b.weight:
        layer.weight = attn.wq_b.weight
    if layer.norm_weight is not attn.q_norm.weight:
        layer.norm_weight = attn.q_norm.weight
    if layer._fused_src is not None and layer._fused_src.device != layer.weight.device:
        layer._fused_src = layer._fused_src.to(layer.weight.device)
    return layer


def _patched_forward(self, x: torch.Tensor, attention_masks, positions: torch.Tensor | None = None):
    """TorchTitan's DeepSeek-V3 Attention.forward with the query from the fused layer."""
    bsz, seqlen, _ = x.size()
    rope_dim = self.qk_rope_head_dim
    slot = x.new_empty(()).expand(bsz, seqlen, 1, rope_dim)  # a query-shaped stand-in for the cache's layout
    cache = self.rope._reshape_cache(slot, positions)  # complex [1 or b, s, 1, R/2]
    cos, sin = cache.real[:, :, 0].float(), cache.imag[:, :, 0].float()
    q = _synced(self)(self.wq_a(x), cos, sin)
    q = q.dequantize(x.dtype) if isinstance(q, MXFP8Tensor) else q.to(x.dtype)  # [b, s, H, D]

    kv = self.wkv_a(x)
    kv, k_pe = torch.split(kv, [self.kv_lora_rank, rope_dim], dim=-1)
    k_pe = k_pe.unsqueeze(2)
    k_pe = self.rope.apply_rotary_emb(k_pe, k_pe, cache)[1]  # TorchTitan's own RoPE for the key
    kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
    k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
    out = self.inner_attention(q, k, v, attention_masks=attention_masks, scale=self.softmax_scale).contiguous()
    return self.wo(out.view(bsz, seqlen, -1))


class _PatchedForward:
    """`attn.forward` while patched (a class, so that a patched model pickles and deep-copies)."""

    __slots__ = ("attn",)

    def __init__(self, attn: nn.Module) -> None:
        self.attn = attn

    def __call__(self, *args, **kwargs):
        return _patched_forward(self.attn, *args, **kwargs)


def patch_deepseek_v3(model: nn.Module, **layer_kwargs) -> nn.Module:
    """Route the query path of every TorchTitan DeepSeek-V3 `Attention` in `model` through one
    `FusedMLAQUpProjection` sharing `q_norm.weight` and `wq_b.weight` (module doc). layer_kwargs: the layer's
    `precision`, `output_format`, `scale_mode`, `block_scale`, `backend`, `columnwise_output` (default
    precision="bf16", output_format="bf16"). Patch before applying tensor parallelism or FSDP: attentions whose
    parameters are DTensors keep TorchTitan's forward (a warning says which). Returns `model`, patched in place.
    Raises TypeError for another argument, ValueError when the model has no such attention or the layer rejects its
    geometry."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    unknown = sorted(set(layer_kwargs) - set(_ALLOWED_KWARGS))
    if unknown:
        raise TypeError(f"patch_deepseek_v3: unsupported layer argument(s) {unknown}; allowed: {_ALLOWED_KWARGS} "
                        "(geometry, eps and RoPE come from the model)")
    kwargs = {**_DEFAULT_KWARGS, **layer_kwargs}
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if not attns:
        raise ValueError("patch_deepseek_v3: model has no torchtitan deepseek_v3 Attention module")
    plan = []
    for attn in attns:
        why = _problem(attn)
        if why is not None:
            warnings.warn(f"mla_qproj.torchtitan: an attention keeps TorchTitan's query path: {why}", stacklevel=2)
            continue
        plan.append((attn, _build(attn, kwargs)))
    for attn, layer in plan:
        object.__setattr__(attn, _LAYER_KEY, layer)
        object.__setattr__(attn, "forward", _PatchedForward(attn))
    return model


def unpatch_deepseek_v3(model: nn.Module) -> nn.Module:
    """Undo `patch_deepseek_v3`. Returns `model`."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), _PatchedForward):
            del m.__dict__["forward"]
        m.__dict__.pop(_LAYER_KEY, None)
    return model


def fused_query_layer(attn: nn.Module) -> FusedMLAQUpProjection | None:
    """A patched attention's fused layer (bound to its current parameters), or None."""
    return _synced(attn) if _LAYER_KEY in attn.__dict__ else None
