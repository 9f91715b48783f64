"""TorchTitan integration: the DeepSeek-V3 attention's query path (`wq_b(q_norm(.))` and the query's RoPE) as one
`FusedMLAQUpProjection`.

`patch_deepseek_v3(model)` gives every `torchtitan.models.deepseek_v3.model.Attention` in `model` an
instance-level forward that computes the query with the fused layer and everything else (`wq_a`, keys, values,
their RoPE, the inner attention, `wo`) with TorchTitan's own modules. TorchTitan's `ComplexRoPE` rotates the pairs
(2i, 2i + 1) in place: the "gptj" style (SPEC §3); the tables are its cache at the call's positions (YaRN's mscale is
in TorchTitan's softmax scale, not in the tables). The fused layer shares `q_norm.weight` and `wq_b.weight`
(re-read at every call) and lives outside the module tree: `state_dict()` and checkpoints are unchanged.
`unpatch_deepseek_v3(model)` removes the patch; `fused_query_layer(attn)` returns an attention's fused layer.

Tensor parallelism (`spmd_backend="partial_dtensor"`, TorchTitan's DeepSeek-V3 plan: `wq_b` colwise, weight
Shard(0) and output Shard(-1); `wq_a` and `q_norm` Replicate; the attention's input made Replicate, so no sequence
parallelism inside the query path): the fused layer runs on the local shards, with `tp_group` the TP mesh's process
group and this rank's num_heads / tp heads. It reads `wq_b.weight.to_local()` and `q_norm.weight.to_local()` at
every call (views: the gradients land on the DTensor parameters, dW_uq as its Shard(0) and d(norm weight) as
Replicate, the layer having all-reduced dxn in its backward where TorchTitan's own path leaves Partial gradients;
the full tensors are equal). `wq_a`'s output enters as the local replica and the query leaves as TorchTitan's
colwise `wq_b` leaves it: a DTensor [b, s, H, D] Shard(2) on the TP mesh, for the inner attention's `local_map`.
Patching works before or after `model.parallelize(parallel_dims)`: before, TorchTitan's redistributing wrapper
wraps the patched forward and the TP layer is built at the first call that sees DTensor parameters; after, the
patched forward replaces that wrapper and applies the attention's input rule itself (x to Replicate on the TP mesh;
a plain x is taken as a replica), and `unpatch_deepseek_v3` puts the wrapper back.

Not covered (the attention keeps TorchTitan's forward, with a one-line warning at patch time, or at the first call
when the parameters change after patching): DTensor parameters in any other layout (a mesh of more than one
dimension: FSDP / HSDP, and `spmd_backend="full_dtensor"` where it unfolds the dp axes; placements other than `wq_b`
Shard(0) and `q_norm` Replicate; head counts the TP degree does not divide), `spmd_backend="spmd_types"` (plain local
shards annotated with SPMD types), attentions without `q_lora_rank` (`wq`), RoPE classes other than `ComplexRoPE`.
Written against torchtitan 0.3.0.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_post_hook

from .module import FusedMLAQUpProjection, layer_options
from .tensor import MXFP8Tensor

try:
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3.model import Attention
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("mla_qproj.torchtitan needs torchtitan (pip install 'mla_qproj[integrations]')") from e

try:  # TorchTitan's "spmd_types" backend annotates plain local shards
    from spmd_types.runtime import has_local_type as _has_spmd_type
except ImportError:  # pragma: no cover
    def _has_spmd_type(t) -> bool:
        return False

__all__ = ["patch_deepseek_v3", "unpatch_deepseek_v3", "fused_query_layer"]

_LAYER_KEY = "_mla_qproj_query_layer"
_KWARGS_KEY = "_mla_qproj_layer_kwargs"

# TP layers read their weight through a fresh `to_local()` view at every call: the module's own weight-cache hook
# (keyed by the layer's weight) cannot see a fused optimizer update the DTensor parameter, so this one does
_TP_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> weakref to its attention


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    if not _TP_LAYERS:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for layer, ref in list(_TP_LAYERS.items()):
        attn = ref()
        if attn is not None and id(attn.wq_b.weight) in owned:
            layer._weight_epoch += 1


register_optimizer_step_post_hook(_on_optimizer_step)


def _tp_layout(attn: nn.Module) -> tuple[object, str | None]:
    """(mesh, None) when wq_b / q_norm are DTensors in TorchTitan's TP plan on one 1-D mesh; (None, why) for another
    DTensor layout; (None, None) for plain parameters."""
    w, nw = attn.wq_b.weight, attn.q_norm.weight
    dts = [isinstance(p, DTensor) for p in (w, nw)]
    if not any(dts):
        return None, None
    if not all(dts):
        return None, "wq_b.weight and q_norm.weight are not both DTensors"
    mesh = w.device_mesh
    if mesh.ndim != 1 or nw.device_mesh != mesh:
        return None, (f"DTensor parameters on a {mesh.ndim}-D mesh {mesh.mesh_dim_names} (FSDP / HSDP or "
                      "full_dtensor; the layer serves TorchTitan's TP plan on a 1-D TP mesh)")
    if tuple(w.placements) != (Shard(0),) or tuple(nw.placements) != (Replicate(),):
        return None, (f"DTensor placements wq_b {tuple(w.placements)}, q_norm {tuple(nw.placements)} (the layer "
                      "serves wq_b Shard(0), q_norm Replicate)")
    tp = mesh.size()
    if attn.n_heads % tp or w.shape[0] != attn.n_heads * attn.qk_head_dim:
        return None, f"{attn.n_heads} heads over a TP degree of {tp} (the heads must split evenly)"
    return mesh, None


def _problem(attn: nn.Module) -> str | None:
    if not attn.q_lora_rank:
        return "q_lora_rank == 0 (the `wq` projection)"
    if not isinstance(attn.rope, ComplexRoPE):
        return f"rope is {type(attn.rope).__name__} (the fused layer serves ComplexRoPE)"
    if getattr(attn.wq_b, "bias", None) is not None:
        return "wq_b has a bias"
    for name, p in (("wq_b.weight", attn.wq_b.weight), ("q_norm.weight", attn.q_norm.weight)):
        if isinstance(p, DTensor):
            continue
        if type(p.data) is not torch.Tensor:
            return f"{name} is a {type(p.data).__name__}"
        if _has_spmd_type(p):
            return f"{name} carries SPMD types (spmd_backend='spmd_types': local shards the layer cannot place)"
    return _tp_layout(attn)[1]


class _LocalShard(nn.Module):
    """A stand-in Linear over a local shard, for `from_modules` (the layer's parameter is then rebound per call)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)


class _LocalShardRMSNorm(_LocalShard):
    """A stand-in RMSNorm (`weight`, `eps`) over a local replica, for `from_modules`."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__(weight)
        self.eps = eps


def _build(attn: nn.Module, kwargs: dict, mesh=None) -> FusedMLAQUpProjection:
    geometry = dict(num_heads=attn.n_heads, qk_head_dim=attn.qk_nope_head_dim,
                    qk_pos_emb_head_dim=attn.qk_rope_head_dim, q_head_dim=attn.qk_head_dim, rope_style="gptj")
    try:
        if mesh is None:
            return FusedMLAQUpProjection.from_modules(attn.q_norm, attn.wq_b, **geometry, **kwargs)
        eps = attn.q_norm.eps
        eps = torch.finfo(attn.q_norm.weight.dtype).eps if eps is None else eps
        norm = _LocalShardRMSNorm(attn.q_norm.weight.to_local(), eps)
        layer = FusedMLAQUpProjection.from_modules(norm, _LocalShard(attn.wq_b.weight.to_local()), **geometry,
                                                   tp_group=mesh.get_group(), **kwargs)
    except ValueError as e:
        raise ValueError(f"patch_deepseek_v3 (torchtitan): {e}") from e
    # the parameters are views of the DTensors' local shards, bound at every call (`_synced`)
    del layer.weight, layer.norm_weight
    layer._tp_mesh = mesh
    _TP_LAYERS[layer] = weakref.ref(attn)
    return layer


_WARNED: set = set()


def _warn_once(why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"mla_qproj.torchtitan: an attention keeps TorchTitan's query path: {why}", stacklevel=3)


def _synced(attn: nn.Module) -> FusedMLAQUpProjection | None:
    """The attention's fused layer bound to its current parameters (rebuilt when they became DTensors or moved to
    another mesh); None, with a one-time warning, when they are in a layout the layer does not serve."""
    layer = attn.__dict__[_LAYER_KEY]
    w, nw = attn.wq_b.weight, attn.q_norm.weight
    if isinstance(w, DTensor) or isinstance(nw, DTensor) or getattr(layer, "_tp_mesh", None) is not None:
        mesh, why = _tp_layout(attn)
        if mesh is None:
            _warn_once(why or "the parameters are no longer DTensors")
            return None
        if getattr(layer, "_tp_mesh", None) is not mesh:
            layer = _build(attn, attn.__dict__[_KWARGS_KEY], mesh)
            object.__setattr__(attn, _LAYER_KEY, layer)
        # plain attributes (nn.Module's setattr would take the views for parameters: they pass isinstance checks)
        layer.__dict__["weight"], layer.__dict__["norm_weight"] = w.to_local(), nw.to_local()
    else:
        why = _problem(attn)
        if why is not None:
            _warn_once(why)
            return None
        if layer.weight is not w:
            layer.weight = w
        if layer.norm_weight is not nw:
            layer.norm_weight = nw
    return layer


def _replica(t: torch.Tensor, mesh) -> torch.Tensor:
    """t as a Replicate DTensor on mesh (a plain tensor is taken as a replica, as TorchTitan's input rule does)."""
    if not isinstance(t, DTensor):
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    if t.device_mesh != mesh:
        raise ValueError(f"patch_deepseek_v3 (torchtitan): an activation is on mesh {t.device_mesh}, the "
                         f"attention's parameters on {mesh}")
    return t if tuple(t.placements) == (Replicate(),) else t.redistribute(mesh, [Replicate()])


def _patched_forward(self, layer: FusedMLAQUpProjection, x: torch.Tensor, attention_masks,
                     positions: torch.Tensor | None = None):
    """TorchTitan's DeepSeek-V3 Attention.forward with the query from the fused layer (bound by `_synced`)."""
    mesh = getattr(layer, "_tp_mesh", None)
    if mesh is not None:  # the attention's input rule under TP: x Replicate on the TP mesh
        x = _replica(x, mesh)
    bsz, seqlen, _ = x.size()
    rope_dim = self.qk_rope_head_dim
    slot = torch.empty((), device=x.device).expand(bsz, seqlen, 1, rope_dim)  # query-shaped, for the cache's layout
    if mesh is not None:  # a DTensor, so that TorchTitan's RoPE wraps plain positions for its DTensor cache
        slot = DTensor.from_local(slot, mesh, [Replicate()], run_check=False)
    cache = self.rope._reshape_cache(slot, positions)  # complex [1 or b, s, 1, R/2] (a replica under TP)
    tables = cache.to_local() if isinstance(cache, DTensor) else cache
    cos, sin = tables.real[:, :, 0].float(), tables.imag[:, :, 0].float()
    q_a = self.wq_a(x)
    if mesh is not None:
        q_a = _replica(q_a, mesh).to_local()  # the layer all-reduces d(q_a)'s partial sums in its backward
    q = layer(q_a, cos, sin)
    q = q.dequantize(x.dtype) if isinstance(q, MXFP8Tensor) else q.to(x.dtype)  # [b, s, H(/tp), D]
    if mesh is not None:  # as TorchTitan's colwise wq_b leaves it: this rank's heads of a Shard(2) DTensor
        q = DTensor.from_local(q, mesh, [Shard(2)], run_check=False)

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
    """`attn.forward` while patched (a class, so that a patched model pickles and deep-copies). `prev`: the instance
    forward it replaced (TorchTitan's redistributing wrapper when patched after `parallelize`), or None."""

    __slots__ = ("attn", "prev")

    def __init__(self, attn: nn.Module, prev=None) -> None:
        self.attn = attn
        self.prev = prev

    def __call__(self, *args, **kwargs):
        attn = self.attn
        layer = _synced(attn) if _LAYER_KEY in attn.__dict__ else None
        if layer is not None:
            return _patched_forward(attn, layer, *args, **kwargs)
        # unpatched while TorchTitan's wrapper still wraps this one, or a layout the layer does not serve
        return (self.prev or type(attn).forward.__get__(attn))(*args, **kwargs)


def patch_deepseek_v3(model: nn.Module, **layer_kwargs) -> nn.Module:
    """Route the query path of every TorchTitan DeepSeek-V3 `Attention` in `model` through one
    `FusedMLAQUpProjection` sharing `q_norm.weight` and `wq_b.weight` (module doc). layer_kwargs: the layer's
    `precision`, `output_format` and `backend` (its defaults: precision="bf16", output_format="bf16"). Patch before
    or after `model.parallelize(...)` (tensor parallelism: module doc); attentions in a layout the layer does not
    serve (FSDP, spmd_types, ...) keep TorchTitan's forward (a warning says which). Returns `model`, patched in place.
    Raises TypeError for another argument, ValueError when the model has no such attention or the layer rejects its
    geometry."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    kwargs = layer_options("patch_deepseek_v3", layer_kwargs, "geometry, eps and RoPE come from the model")
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if not attns:
        raise ValueError("patch_deepseek_v3: model has no torchtitan deepseek_v3 Attention module")
    plan = []
    for attn in attns:
        why = _problem(attn)
        if why is not None:
            warnings.warn(f"mla_qproj.torchtitan: an attention keeps TorchTitan's query path: {why}", stacklevel=2)
            continue
        plan.append((attn, _build(attn, kwargs, _tp_layout(attn)[0])))
    for attn, layer in plan:
        prev = attn.__dict__.get("forward")
        if isinstance(prev, _PatchedForward):  # patched again: keep what the first patch replaced
            prev = prev.prev
        object.__setattr__(attn, _LAYER_KEY, layer)
        object.__setattr__(attn, _KWARGS_KEY, kwargs)
        object.__setattr__(attn, "forward", _PatchedForward(attn, prev))
    return model


def unpatch_deepseek_v3(model: nn.Module) -> nn.Module:
    """Undo `patch_deepseek_v3` (TorchTitan's redistributing wrapper comes back where the patch replaced it; where
    that wrapper was applied over the patch, the patched forward stays and runs TorchTitan's). Returns `model`."""
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, _PatchedForward):
            if fwd.prev is None:
                del m.__dict__["forward"]
            else:
                object.__setattr__(m, "forward", fwd.prev)
        m.__dict__.pop(_LAYER_KEY, None)
        m.__dict__.pop(_KWARGS_KEY, None)
    return model


def fused_query_layer(attn: nn.Module) -> FusedMLAQUpProjection | None:
    """A patched attention's fused layer (bound to its current parameters), or None."""
    return _synced(attn) if _LAYER_KEY in attn.__dict__ else None
