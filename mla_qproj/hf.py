"""HF transformers integration: the DeepseekV2 / DeepseekV3 query path through `FusedMLAQUpProjection`.

`patch_deepseek(model)` (also named `patch_deepseek_v3`) gives every `DeepseekV3Attention` and
`DeepseekV2Attention` in `model` an instance-level forward that computes `q_b_proj(q_a_layernorm(x))` (or, for a
config without `q_lora_rank`, `q_proj(x)`: the layer without a norm) and the RoPE of its rope columns in one fused
layer, and leaves everything else as the installed transformers file does it (keys, values, KV cache, mask,
attention function, output projection). `unpatch_deepseek(model)` removes it again; `fused_query_layer(attn)`
returns an attention module's fused layer.

The fused layer is built with `FusedMLAQUpProjection.from_modules`, so its `weight` / `norm_weight` ARE
`q_b_proj.weight` / `q_a_layernorm.weight` (`q_proj.weight` alone without q_lora_rank; no copies). It lives in the
attention module's `__dict__` under a private name, outside the module tree: `state_dict()` keys,
`load_state_dict(strict=True)`, `save_pretrained` / `from_pretrained` and `.to()` see only the HF model's own
parameters.

Written against transformers 5.17 and 5.24 (`DeepseekV3Attention.forward` takes the cache as `past_key_values` in
5.17 and as `cache` in 5.24; both have `expand_kv`); other versions are refused when their attention lacks what the
patched forward calls.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .module import FusedMLAQUpProjection, layer_options
from .tensor import MXFP8Tensor

try:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as _hf
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("mla_qproj.hf needs transformers (pip install 'transformers>=5.17')") from e

try:  # DeepseekV2 (V2, V2-Lite, V2.5): complex-number RoPE; patched when transformers has what its forward calls
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as _hf2
except ImportError:  # pragma: no cover - transformers without DeepseekV2
    _hf2 = None

__all__ = ["patch_deepseek", "unpatch_deepseek", "patch_deepseek_v3", "unpatch_deepseek_v3", "fused_query_layer"]

_LAYER_KEY = "_mla_qproj_query_layer"  # attn.__dict__ entry holding the fused layer (not a registered submodule)
_HF_NAMES = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "eager_attention_forward",
             "ALL_ATTENTION_FUNCTIONS")


def _hf_support_problem() -> str | None:
    """Why the installed transformers cannot be patched (None when it can)."""
    missing = [n for n in _HF_NAMES if not hasattr(_hf, n)]
    attn = getattr(_hf, "DeepseekV3Attention", None)
    if attn is None:
        missing.append("DeepseekV3Attention")
    elif not hasattr(attn, "expand_kv"):
        missing.append("DeepseekV3Attention.expand_kv")
    if missing:
        return f"modeling_deepseek_v3 lacks {', '.join(missing)}"
    params = inspect.signature(attn.forward).parameters
    if "cache" not in params and "past_key_values" not in params:
        return "DeepseekV3Attention.forward takes neither `cache` nor `past_key_values`"
    return None


_UNSUPPORTED = _hf_support_problem()
_V2_NAMES = ("apply_rotary_emb", "eager_attention_forward", "ALL_ATTENTION_FUNCTIONS", "DeepseekV2Attention")


def _v2_support_problem() -> str | None:
    """Why the installed transformers' DeepseekV2 cannot be patched (None when it can, or when it has none)."""
    if _hf2 is None:
        return None
    missing = [n for n in _V2_NAMES if not hasattr(_hf2, n)]
    if not missing and not hasattr(_hf2.DeepseekV2Attention, "expand_kv"):
        missing.append("DeepseekV2Attention.expand_kv")
    if missing:
        return f"modeling_deepseek_v2 lacks {', '.join(missing)}"
    if "cache" not in inspect.signature(_hf2.DeepseekV2Attention.forward).parameters:
        return "DeepseekV2Attention.forward takes no `cache` (transformers >= 5.24 has it)"
    return None


_V2_UNSUPPORTED = _v2_support_problem()
_V2 = _hf2.DeepseekV2Attention if _hf2 is not None and _V2_UNSUPPORTED is None else None
# Newer transformers (5.24) name the forward's cache argument `cache` and hand the attention kwargs to cache.update;
# 5.17 names it `past_key_values` and passes no kwargs. Mirrored as installed.
_CACHE_TAKES_KWARGS = _UNSUPPORTED is None and "cache" in inspect.signature(_hf.DeepseekV3Attention.forward).parameters


def _rope_from_config(config) -> tuple[float, dict | None]:
    """(rope_theta, YaRN rope_scaling or None) from a DeepseekV3 config (`rope_parameters`, or the older
    `rope_theta` + `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta (config.rope_parameters['rope_theta'])")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise ValueError(f"config rope type {kind!r}: FusedMLAQUpProjection supports 'default' and 'yarn' only")
    scaling = {k: v for k, v in params.items() if k != "type"}
    scaling["rope_type"] = "yarn"
    if scaling.get("factor") is None:  # HF's YaRN: the ratio of the context lengths when no factor is given
        scaling["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(theta), scaling


def _build_layer(attn: nn.Module, layer_kwargs: dict) -> FusedMLAQUpProjection:
    config = attn.config
    rope_theta, rope_scaling = _rope_from_config(config)
    norm, linear = (attn.q_a_layernorm, attn.q_b_proj) if attn.q_lora_rank is not None else (None, attn.q_proj)
    if _is_v2(attn):  # view_as_complex of pairs (2i, 2i + 1), written back in place: SPEC §3 "gptj"
        style = "gptj"
    else:  # HF rope_interleave=True: pairs (2i, 2i+1) out as [a' | b'] = SPEC §3 "deepseek"; False: rotate_half
        style = "deepseek" if config.rope_interleave else "neox"
    try:
        return FusedMLAQUpProjection.from_modules(
            norm, linear, num_heads=attn.num_heads, qk_head_dim=attn.qk_nope_head_dim,
            qk_pos_emb_head_dim=attn.qk_rope_head_dim, q_head_dim=attn.qk_head_dim,
            rope_style=style,
            rope_theta=rope_theta, rope_scaling=rope_scaling, **layer_kwargs)
    except ValueError as e:
        raise ValueError(f"patch_deepseek_v3: attention layer {attn.layer_idx}: {e}") from e


def _synced_layer(attn: nn.Module) -> FusedMLAQUpProjection:
    """The attention's fused layer, re-bound to its current parameters and device.

    `load_state_dict(assign=True)` and `torch.__future__.set_overwrite_module_params_on_conversion(True)` put new
    Parameter objects into the HF modules; the layer follows them here. The RoPE `inv_freq` buffer is not reached
    by `model.to(...)` (the layer is outside the module tree), so it follows the weight's device here too (fp32
    kept: it feeds only the `position_ids` tables of a direct layer call).
    """
    layer = attn.__dict__[_LAYER_KEY]
    linear = attn.q_b_proj if attn.q_lora_rank is not None else attn.q_proj
    if layer.weight is not linear.weight:
        layer.weight = linear.weight
    if attn.q_lora_rank is not None and layer.norm_weight is not attn.q_a_layernorm.weight:
        layer.norm_weight = attn.q_a_layernorm.weight
    if layer.inv_freq.device != layer.weight.device:
        layer.inv_freq = layer.inv_freq.to(layer.weight.device)
    return layer


def _attention(self, layer: FusedMLAQUpProjection, hidden_states: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, rope_key, attention_mask, cache, kwargs: dict, hf, cache_kwargs: bool):
    """The MLA attention of HF's DeepseekV2 / V3 forward with the query path fused: the query [b, s, H, D] =
    RoPE(W_uq · RMSNorm(q_a_proj(h))) (without q_lora_rank: RoPE(W_q · h)), nope columns first, then the rotated
    rope columns (what HF builds as cat(q_pass, q_rot)), dense in the activations' dtype for the attention
    function; keys (rotated by `rope_key`, HF's own RoPE), values, cache and attention as the installed file does
    them (`hf`: its modeling module)."""
    batch_size, seq_length = hidden_states.shape[:-1]
    q = layer(self.q_a_proj(hidden_states) if self.q_lora_rank is not None else hidden_states, cos, sin)
    q = q.dequantize(hidden_states.dtype) if isinstance(q, MXFP8Tensor) else q.to(hidden_states.dtype)
    query_states = q.transpose(1, 2)  # [b, H, s, D]

    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_rot = rope_key(k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim))
    if cache is not None:  # the latents are cached compressed, as in HF
        if cache_kwargs:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
        else:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx)
    key_states, value_states = self.expand_kv(kv_nope, k_rot)

    attention_interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, hf.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _patched_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                     attention_mask: torch.Tensor | None = None, cache=None, past_key_values=None, **kwargs):
    """DeepseekV3Attention.forward with the query path fused; everything else as the installed file does it."""
    layer = _synced_layer(self)
    if bool(self.config.rope_interleave) != (layer.cfg.rope_style == "deepseek"):
        raise RuntimeError("config.rope_interleave changed after patch_deepseek_v3: call patch_deepseek_v3 again")
    cos, sin = position_embeddings  # HF's tables [b, s, R]: they already carry YaRN's attention scaling
    # HF's own RoPE function for the shared key (each output depends only on its own input: an empty query slot)
    rope = _hf.apply_rotary_pos_emb_interleave if self.config.rope_interleave else _hf.apply_rotary_pos_emb
    return _attention(self, layer, hidden_states, cos, sin, lambda k: rope(k[:, :0], k, cos, sin)[1],
                      attention_mask, past_key_values if cache is None else cache, kwargs, _hf, _CACHE_TAKES_KWARGS)


def _is_v2(attn: nn.Module) -> bool:
    return _V2 is not None and isinstance(attn, _V2)


def _patched_forward_v2(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                        position_embeddings: torch.Tensor | None = None, past_key_values=None, **kwargs):
    """DeepseekV2Attention.forward with the query path fused. HF's V2 RoPE is complex: `position_embeddings` is
    freqs_cis [b, s, R/2] (attention scaling folded in), its real and imaginary parts the cos and sin half tables."""
    layer = _synced_layer(self)
    fc = position_embeddings
    return _attention(self, layer, hidden_states, fc.real, fc.imag,
                      lambda k: _hf2.apply_rotary_emb(k, k, fc.to(k.device))[1],  # HF's own RoPE for the key
                      attention_mask, past_key_values if cache is None else cache, kwargs, _hf2, True)


class _PatchedForward:
    """`attn.forward` while patched: `_patched_forward` bound to one attention module. A module-level class rather
    than a bound method so that a patched model pickles (torch.save) and unpickles (a bound method would be looked
    up by name on the module when loaded); copy.deepcopy re-binds it to the copy."""

    __slots__ = ("attn",)

    def __init__(self, attn: nn.Module) -> None:
        self.attn = attn

    def __call__(self, *args, **kwargs):
        if _is_v2(self.attn):
            return _patched_forward_v2(self.attn, *args, **kwargs)
        return _patched_forward(self.attn, *args, **kwargs)


def _is_patched(attn: nn.Module) -> bool:
    return _LAYER_KEY in attn.__dict__


def _remove_patch(attn: nn.Module) -> None:
    if isinstance(attn.__dict__.get("forward"), _PatchedForward):
        del attn.__dict__["forward"]
    attn.__dict__.pop(_LAYER_KEY, None)


def patch_deepseek_v3(model: nn.Module, **layer_kwargs) -> nn.Module:
    """Route the query path of every DeepseekV3 and DeepseekV2 attention in `model` through one
    `FusedMLAQUpProjection` (also named `patch_deepseek`).

    Per attention module (found by class, `DeepseekV3Attention`, `DeepseekV2Attention`): `q_b_proj(q_a_layernorm(.))`
    and the RoPE of the query's rope columns become one fused layer sharing `q_a_layernorm.weight` and
    `q_b_proj.weight`. RoPE style: V3 from `config.rope_interleave` (True: "deepseek", False: "neox"), V2 "gptj"
    (its complex RoPE rotates the pairs (2i, 2i + 1) in place); `rope_theta` and YaRN scaling from
    `config.rope_parameters` (for direct `layer(x, position_ids=...)` calls). The patched forward applies the cos /
    sin tables HF passes in `position_embeddings` (YaRN's attention scaling included), so query and key rotate with
    the same tables. Keys, values, the KV cache, masks and the attention function (`attn_implementation`, eager /
    sdpa / others registered in ALL_ATTENTION_FUNCTIONS) are computed as in the installed transformers.

    layer_kwargs: the layer's `precision`, `output_format` and `backend` (its defaults: `precision="bf16",
    output_format="bf16"`). The attention functions take a dense
    query: a bf16 query is cast to the activations' dtype, an MXFP8 one (`output_format="mxfp8"`) is dequantized
    to it.

    Attention modules without `q_lora_rank` (they use `q_proj` on the normalized hidden state) get the layer without
    a norm (`norm=None`, sharing `q_proj.weight`). Patching a patched model rebuilds the fused layers with the new
    layer_kwargs. Returns `model` (patched in place).
    Raises TypeError for a layer argument the model's config and modules fix (geometry, eps, RoPE), ValueError for
    a geometry the layer does not support (all checked before any module is changed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _UNSUPPORTED is not None:
        import transformers

        raise RuntimeError(f"patch_deepseek_v3 does not support transformers {transformers.__version__}: "
                           f"{_UNSUPPORTED} (written for 5.17 - 5.24)")
    kwargs = layer_options("patch_deepseek_v3", layer_kwargs, "geometry, eps and RoPE come from the model")
    classes = (_hf.DeepseekV3Attention,) + ((_V2,) if _V2 is not None else ())
    attns = [m for m in model.modules() if isinstance(m, classes)]
    if not attns:
        v2 = getattr(_hf2, "DeepseekV2Attention", None)  # absent from a transformers that lacks it altogether
        if _V2_UNSUPPORTED is not None and v2 is not None and any(isinstance(m, v2) for m in model.modules()):
            import transformers

            raise RuntimeError(f"patch_deepseek does not support DeepseekV2 on transformers {transformers.__version__}"
                               f": {_V2_UNSUPPORTED}")
        raise ValueError("patch_deepseek_v3: model has no DeepseekV3Attention (or DeepseekV2Attention) module")
    plan = []
    for attn in attns:
        base = _V2 if _is_v2(attn) else _hf.DeepseekV3Attention
        if type(attn).forward is not base.forward:
            raise TypeError(f"patch_deepseek_v3: {type(attn).__name__} overrides {base.__name__}.forward; "
                            "its query path is not the one this patch mirrors")
        if "forward" in attn.__dict__ and not _is_patched(attn):
            raise RuntimeError(f"patch_deepseek_v3: attention layer {attn.layer_idx} already has an instance-level "
                               "forward (e.g. accelerate hooks from device_map); patch before adding those")
        plan.append((attn, _build_layer(attn, kwargs)))
    for attn, layer in plan:
        _remove_patch(attn)
        object.__setattr__(attn, _LAYER_KEY, layer)  # plain attribute: not a submodule, no state_dict entries
        object.__setattr__(attn, "forward", _PatchedForward(attn))
    return model


def unpatch_deepseek_v3(model: nn.Module) -> nn.Module:
    """Undo `patch_deepseek_v3`: every patched attention runs `type(attn).forward` again and carries no attribute
    the patch added. Modules that were never patched are untouched. Returns `model`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for m in model.modules():
        if _is_patched(m):
            _remove_patch(m)
    return model


def fused_query_layer(attn: nn.Module) -> FusedMLAQUpProjection | None:
    """The fused layer of a patched attention module (its parameters and `inv_freq` brought to the module's
    current ones), or None when `attn` is not patched."""
    if not isinstance(attn, nn.Module):
        raise TypeError(f"attn must be a torch.nn.Module, got {type(attn).__name__}")
    return _synced_layer(attn) if _is_patched(attn) else None


patch_deepseek = patch_deepseek_v3  # the same function under a name that covers DeepseekV2 models too
unpatch_deepseek = unpatch_deepseek_v3
