"""Megatron-Core integration: MLA's query path (q_layernorm, linear_q_up_proj, the query's RoPE) as one
`FusedMLAQUpProjection` inside Megatron-Core's `MLASelfAttention`.

`FusedMLASelfAttention` (a subclass of `megatron.core.transformer.multi_latent_attention.MLASelfAttention`) keeps
every submodule Megatron builds; its `get_query_key_value_tensors` computes the query with the fused layer and the
keys and values with Megatron's own modules and RoPE function. The fused layer shares `q_layernorm.weight` and
`linear_q_up_proj.weight` (re-read at every call, so optimizers, checkpoints, `.to()` and Megatron's TP metadata see
only Megatron's parameters) and takes Megatron's tensor-parallel group and `config.sequence_parallel` (SPEC §6: the
norm on this rank's tokens, the query over every token, dnorm left partial when the weight is tagged
`sequence_parallel`). The RoPE tables are Megatron's (`rotary_pos_emb`, YaRN's mscale folded into cos and sin as
Megatron applies it); Megatron's MLA RoPE de-interleaves the pairs (2i, 2i + 1): the "deepseek" style (SPEC §3).

What it does not cover runs Megatron's own `get_query_key_value_tensors` (a one-line warning once per reason):
packed sequences (THD), inference contexts, `recompute_granularity="selective"` with "mla_up_proj",
`cache_mla_latents`, `apply_rope_fusion`, `rotary_interleaved`, context parallelism, the "dsa" attention variant,
Transformer Engine linear / fused-norm modules (`TELayerNormColumnParallelLinear` and the like), a LayerNorm
`q_layernorm`. Megatron's fourth return value (`q_compressed`, read only by the "dsa" variant) is the latent before
the norm on the fused path.

`mla_layer_spec(spec=None, **layer_kwargs)` returns a GPT layer spec (or the given one, copied) whose MLA attention
is `FusedMLASelfAttention`. Written against megatron-core 0.16.1. megatron is imported when this module is.
"""

from __future__ import annotations

import copy
import warnings

import torch

from .module import FusedMLAQUpProjection, layer_options
from .tensor import MXFP8Tensor

try:
    from megatron.core.models.common.embeddings import apply_rotary_pos_emb
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("mla_qproj.megatron needs megatron-core (pip install 'mla_qproj[integrations]')") from e

__all__ = ["FusedMLASelfAttention", "mla_layer_spec", "fused_query_layer"]

_WARNED: set = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"mla_qproj.megatron: Megatron's own query path runs: {reason}", stacklevel=3)


def _check_kwargs(layer_kwargs: dict | None) -> dict:
    return layer_options("fused_query", layer_kwargs,
                         "geometry, eps, RoPE and parallelism come from the Megatron config")


def _static_problem(attn) -> str | None:
    """Why this attention's configuration is not served by the fused layer (None when it is)."""
    c = attn.config
    checks = (
        (c.context_parallel_size > 1, f"context_parallel_size={c.context_parallel_size} (context parallelism)"),
        (c.apply_rope_fusion, "apply_rope_fusion=True"),
        (c.rotary_interleaved, "rotary_interleaved=True"),
        (attn.recompute_up_proj, "recompute_modules with 'mla_up_proj'"),
        (c.cache_mla_latents, "cache_mla_latents=True"),
        (getattr(c, "experimental_attention_variant", None) is not None,
         f"experimental_attention_variant={getattr(c, 'experimental_attention_variant', None)!r}"),
        (not c.multi_latent_attention, "multi_latent_attention=False"),
        (c.rope_type not in ("rope", "yarn"), f"rope_type={c.rope_type!r}"),
    )
    for bad, why in checks:
        if bad:
            return why
    linear = attn.linear_q_up_proj if c.q_lora_rank is not None else attn.linear_q_proj
    if not isinstance(linear, ColumnParallelLinear) or getattr(linear, "bias", None) is not None:
        return (f"the query projection is {type(linear).__name__} (the fused layer serves a bias-free "
                "ColumnParallelLinear)")
    if c.q_lora_rank is not None and not isinstance(attn.q_layernorm, IdentityOp):
        norm = attn.q_layernorm
        if c.normalization != "RMSNorm" or not isinstance(getattr(norm, "weight", None), torch.nn.Parameter):
            return f"q_layernorm is {type(norm).__name__} with normalization={c.normalization!r} (not an RMSNorm)"
    return None


def _build(attn, layer_kwargs: dict) -> FusedMLAQUpProjection:
    c = attn.config
    if c.q_lora_rank is None:
        norm, linear = None, attn.linear_q_proj
    else:
        norm = None if isinstance(attn.q_layernorm, IdentityOp) else attn.q_layernorm
        linear = attn.linear_q_up_proj
    kw = dict(num_heads=c.num_attention_heads, qk_head_dim=c.qk_head_dim, qk_pos_emb_head_dim=c.qk_pos_emb_head_dim,
              q_head_dim=attn.q_head_dim, rope_style="deepseek", tp_group=attn.pg_collection.tp,
              sequence_parallel=bool(c.sequence_parallel), **layer_kwargs)
    if norm is not None:
        kw.update(eps=float(c.layernorm_epsilon), zero_centered_gamma=bool(c.layernorm_zero_centered_gamma))
    try:
        return FusedMLAQUpProjection.from_modules(norm, linear, **kw)
    except ValueError as e:
        raise ValueError(f"FusedMLASelfAttention (layer {attn.layer_number}): {e}") from e


class FusedMLASelfAttention(MLASelfAttention):
    """Megatron-Core's `MLASelfAttention` with the query path through one `FusedMLAQUpProjection` (module doc).

    Built like `MLASelfAttention` (from a layer spec: `mla_layer_spec`), plus `fused_query`: a dict of the fused
    layer's `precision`, `output_format` and `backend` (its defaults: `precision="bf16", output_format="bf16"`).
    The fused layer is kept outside the module tree: `state_dict()` keys, `named_parameters()` and the distributed
    optimizer's buffers are those of `MLASelfAttention`.
    """

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.padding, cp_comm_type=None,
                 pg_collection=None, fused_query: dict | None = None):
        layer_kwargs = _check_kwargs(fused_query)
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        problem = _static_problem(self)
        object.__setattr__(self, "_mla_qproj_problem", problem)
        object.__setattr__(self, "_mla_qproj_layer", None if problem else _build(self, layer_kwargs))
        if problem:
            _warn_once(problem)

    def _fused_layer(self) -> FusedMLAQUpProjection:
        """The fused layer re-bound to Megatron's current parameters (load_state_dict(assign=True), a new
        Parameter) and device."""
        layer = self._mla_qproj_layer
        c = self.config
        linear = self.linear_q_up_proj if c.q_lora_rank is not None else self.linear_q_proj
        if layer.weight is not linear.weight:
            layer.weight = linear.weight
        if layer.norm_weight is not None and layer.norm_weight is not self.q_layernorm.weight:
            layer.norm_weight = self.q_layernorm.weight
        return layer

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        """(query [s, b, n_local, q_head_dim], key, value, the query latent, the normed kv latent), as Megatron's
        method returns them; the query from the fused layer. Falls back to Megatron's method where the module doc
        says."""
        if self._mla_qproj_problem is None:
            reason = None
            if packed_seq_params is not None:
                reason = "packed sequences (packed_seq_params)"
            elif inference_context is not None or inference_params is not None:
                reason = "an inference context"
            elif key_value_states is not None:
                reason = "key_value_states given"
        else:
            reason = self._mla_qproj_problem
        if reason is not None:
            _warn_once(reason)
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params, inference_context,
                inference_params=inference_params)
        if hidden_states.ndim != 3:
            raise ValueError(f"hidden_states must be [s, b, h], got shape {tuple(hidden_states.shape)}")
        c = self.config
        rope_dim = c.qk_pos_emb_head_dim
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, c, None)
        if c.rope_type == "rope":
            freqs, mscale = self.rotary_pos_emb(seq_len), 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(seq_len)
        freqs = freqs[:seq_len]  # [s, 1, 1, R]: cat(f, f), the tokens' positions 0 .. s - 1

        # the query latent: Megatron's down projection, gathered / scattered as its method does
        if c.q_lora_rank is not None:
            q_latent, _ = self.linear_q_down_proj(hidden_states)
            if q_latent.size(-1) != c.q_lora_rank:  # a column-parallel down projection: whole width, own tokens
                q_latent = gather_from_tensor_model_parallel_region(q_latent)
                if c.sequence_parallel:
                    q_latent = scatter_to_sequence_parallel_region(q_latent)
        else:
            q_latent = hidden_states
        # the fused query: RMSNorm + up projection + RoPE, over every token under sequence parallelism
        half = freqs[:, 0, 0, : rope_dim // 2].float().to(hidden_states.device)
        cos, sin = (half.cos() * mscale).unsqueeze(1), (half.sin() * mscale).unsqueeze(1)  # [s, 1, R/2]
        query = self._fused_layer()(q_latent, cos, sin)
        query = query.dequantize(hidden_states.dtype) if isinstance(query, MXFP8Tensor) else query
        query = query.to(hidden_states.dtype).contiguous()

        key, value, kv_latent = self._key_value(hidden_states, freqs, mscale, query.size(2))
        return query, key, value, q_latent, kv_latent

    def _key_value(self, hidden_states, freqs, mscale, heads):
        """Keys and values with Megatron's modules and RoPE function (its unfused, non-packed path)."""
        c = self.config
        kv_rank, rope_dim = c.kv_lora_rank, c.qk_pos_emb_head_dim
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if kv_combined.size(-1) != kv_rank + rope_dim:  # column-parallel: gathered to full width over all tokens
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
            kv_latent, k_rope = torch.split(kv_combined, [kv_rank, rope_dim], dim=-1)
            if c.sequence_parallel:
                kv_latent = scatter_to_sequence_parallel_region(kv_latent)
        else:
            kv_latent, k_rope = torch.split(kv_combined, [kv_rank, rope_dim], dim=-1)
            if c.sequence_parallel and self.pg_collection.tp.size() > 1:
                k_rope = gather_from_sequence_parallel_region(k_rope, group=self.pg_collection.tp)
        kv_latent = self.kv_layernorm(kv_latent)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        kv = kv.view(*kv.shape[:-1], heads, c.qk_head_dim + c.v_head_dim)
        k_nope, value = torch.split(kv, [c.qk_head_dim, c.v_head_dim], dim=-1)
        k_rope = apply_rotary_pos_emb(k_rope.unsqueeze(-2), freqs, config=c, cu_seqlens=None, mscale=mscale,
                                      cp_group=self.pg_collection.cp)
        key = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        return key.contiguous(), value.contiguous(), kv_latent


def fused_query_layer(attn) -> FusedMLAQUpProjection | None:
    """The fused layer of a `FusedMLASelfAttention` (bound to its current parameters), or None when the attention
    runs Megatron's query path (not a `FusedMLASelfAttention`, or a configuration it does not cover)."""
    if not isinstance(attn, FusedMLASelfAttention) or attn._mla_qproj_layer is None:
        return None
    return attn._fused_layer()


def _swap_attention(spec, layer_kwargs: dict) -> int:
    """Replace MLASelfAttention by FusedMLASelfAttention in a layer spec (or a block spec's layer specs), in place;
    returns how many attention specs were changed."""
    layers = getattr(spec, "layer_specs", None)
    if layers is None:  # a ModuleSpec(TransformerBlock, submodules=TransformerBlockSubmodules(...))
        layers = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    if layers is not None:
        return sum(_swap_attention(s, layer_kwargs) for s in layers)
    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if not isinstance(attn, ModuleSpec) or not isinstance(attn.module, type) \
            or not issubclass(attn.module, MLASelfAttention):
        return 0
    attn.module = FusedMLASelfAttention
    attn.params = {**(attn.params or {}), "fused_query": dict(layer_kwargs)}
    return 1


def mla_layer_spec(spec=None, **layer_kwargs):
    """A Megatron GPT layer spec whose MLA self-attention is `FusedMLASelfAttention`.

    spec: a layer `ModuleSpec` (`get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, ...)`)
    or a decoder block spec (`TransformerBlockSubmodules` / a ModuleSpec holding one, as
    `get_gpt_decoder_block_spec` returns); it is copied, not changed. None: Megatron's local-module MLA spec with
    RMSNorm and the query / kv layernorms. layer_kwargs: the fused layer's `precision`, `output_format` and
    `backend` (its defaults: precision="bf16", output_format="bf16").
    Raises ValueError when the spec holds no MLASelfAttention, TypeError for another layer argument.
    """
    kwargs = _check_kwargs(layer_kwargs)
    if spec is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    else:
        spec = copy.deepcopy(spec)
    if not _swap_attention(spec, kwargs):
        raise ValueError("mla_layer_spec: spec has no MLASelfAttention self_attention (build it with "
                         "multi_latent_attention=True)")
    return spec
