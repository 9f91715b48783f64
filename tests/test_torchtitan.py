"""mla_qproj.torchtitan: TorchTitan 0.3.0's DeepSeek-V3 attention with the query path through FusedMLAQUpProjection,
in one process (TP = 1), YaRN (mscale in TorchTitan's softmax scale) and plain RoPE.

The oracle is TorchTitan's own unmodified forward on the same model (a tiny 2-layer DeepSeekV3Model):
- precision="bf16", fp32 parameters (bf16-valued weights): the attention's output and the gradients of its input,
  wq_b.weight, q_norm.weight and wq_a.weight against TorchTitan's forward with the layer's bf16 roundings injected
  by hooks on its own modules (tests/_roundings.py: q_norm's output and the query rounded to bf16, the query's
  gradient rounded where it leaves the bf16 query and after the inverse RoPE): REL_ERR_REDUCTION_ORDER; against the
  plain fp32 forward: REL_ERR_BF16;
- the model's loss and every parameter's gradient: the same two bounds, except the gradients against the
  rounded path: REL_ERR_BF16_ROUNDING (a reordered fp32 value can land on the other side of one of the bf16
  rounding points, a one-ulp flip the later layers carry; tests/test_megatron.py);
- precision="fp8_block" / "mxfp8": three SGD steps track the stock model (every step's loss within REL_ERR_FP8_BLOCK /
  REL_ERR_MXFP8; both losses fall: per-parameter gradients of the whole model differ by 5-15 % at these sizes).
backend="torch", except one interpreter case. CPU shim (test only): SDPA as the inner attention (TorchTitan's
default FlexAttention has no CPU backward).

Tensor parallelism, TP = 2 on gloo (two spawned ranks, one test): TorchTitan's own DeepSeek-V3 plan
(`set_deepseek_v3_sharding_config`, no SP / EP) and `model.parallelize(ParallelDims(tp=2,
spmd_backend="partial_dtensor"))`, CPU shim: TorchTitan's `device_type` set to "cpu". The oracle is the same
parallelized model unpatched: one attention's output, dx and the full gradients of wq_b, q_norm, wq_a and wkv_b
within the TP = 1 bounds (with the roundings injected, and plain fp32); the query TorchTitan's inner attention
receives has the stock type, placements and shapes (a Shard(2) DTensor of 2 local heads); patching before
`parallelize` gives the same bits as patching after; bf16: the whole model's loss and every parameter's full
gradient within the TP = 1 bounds; fp8_block: two SGD steps of the whole model track the stock TP
model's loss (REL_ERR_FP8_BLOCK); a DTensor layout outside the plan (q_norm sharded) keeps TorchTitan's forward with
a warning.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan is not installed "
                    "(pip install 'mla_qproj[integrations]')")

from _roundings import Round, RoundBoth, RoundGrad  # noqa: E402

from _helpers import sgd_side_by_side  # noqa: E402
from _tolerances import (  # noqa: E402
    REL_ERR_BF16,
    REL_ERR_BF16_ROUNDING,
    REL_ERR_FP8_BLOCK,
    REL_ERR_MXFP8,
    REL_ERR_REDUCTION_ORDER,
    assert_rel_err,
)

VOCAB, DIM = 96, 64


def _model(rope: str = "yarn", q_lora_rank: int = 32, seed: int = 0, tp_dims=None, parallelize: bool = True):
    """The tiny model; with tp_dims (a ParallelDims) TorchTitan's DeepSeek-V3 sharding plan (no SP, no EP) is set on
    its config and, with `parallelize`, `model.parallelize(tp_dims)` applied after the weights are set (the same on
    every rank)."""
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    scaling = dict(scaling="yarn", rope_factor=4.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=16) \
        if rope == "yarn" else {}
    layers = ds._build_dsv3_layers(
        n_layers=2, n_dense_layers=2, dim=DIM, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, mscale=0.7, dense_hidden_dim=96, moe_hidden_dim=32,
        num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=16, max_seq_len=256, theta=10000.0, **scaling))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM, layers=layers, mtp_layers=[],
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=ds._output_linear_init(DIM)))
    if tp_dims is not None:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(cfg, enable_sp=False, enable_ep=False)
    model = cfg.build()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) activations, bf16-valued fp32 weights (the bf16 GEMM inputs are then exact)
        for _, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen)
            p.copy_((1 + 0.2 * r if p.dim() == 1 else r / p.shape[-1] ** 0.5).bfloat16().float())
    if tp_dims is not None and parallelize:
        model.parallelize(tp_dims)
    return model


def _attns(model):
    from torchtitan.models.deepseek_v3.model import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def _inject_roundings(model) -> None:
    """The layer's roundings in TorchTitan's own forward: q_norm's output rounded (straight-through); wq_b's output
    has its gradient rounded (the GEMM operand after the inverse RoPE) and its pass-through columns rounded both
    ways; the rotated rope columns rounded both ways after TorchTitan's RoPE (together: the layer's bf16 query)."""
    for attn in _attns(model):
        attn.q_norm.register_forward_hook(lambda mod, inp, out: Round.apply(out))

        def wq_b_hook(mod, inp, out, attn=attn):
            y = RoundGrad.apply(out).unflatten(-1, (attn.n_heads, attn.qk_head_dim))
            nope, pe = torch.split(y, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            return torch.cat([RoundBoth.apply(nope), pe], dim=-1).flatten(-2)

        attn.wq_b.register_forward_hook(wq_b_hook)

        def rope_hook(mod, inp, out):
            q, k = out
            return RoundBoth.apply(q), k

        attn.rope.register_forward_hook(rope_hook)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model, ids, labels):
    """The loss and every parameter's gradient (full tensors under TP)."""
    model.zero_grad(set_to_none=True)
    logits = _full(model(ids))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    return loss.detach(), {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_model_matches(models: dict, ids, labels, tag: str) -> None:
    """models["fused"] (patched, bf16) against models["rounded"] (the layer's roundings injected) and
    models["stock"]: the loss and every parameter's gradient."""
    (lf, gf), (lr, gr), (ls, gs) = (_grads(models[k], ids, labels) for k in ("fused", "rounded", "stock"))
    assert_rel_err(lf, lr, REL_ERR_REDUCTION_ORDER, f"{tag} loss vs rounded TorchTitan")
    assert_rel_err(lf, ls, REL_ERR_BF16, f"{tag} loss vs TorchTitan fp32")
    assert sorted(gf) == sorted(gs) and len(gf) == len(list(models["stock"].parameters())), tag
    for n in gs:
        assert_rel_err(gf[n], gr[n], REL_ERR_BF16_ROUNDING, f"{tag} grad {n} vs rounded TorchTitan")
        assert_rel_err(gf[n], gs[n], REL_ERR_BF16, f"{tag} grad {n} vs TorchTitan fp32")


def _batch(s: int = 16, b: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=gen), torch.randint(0, VOCAB, (b, s), generator=gen)


@pytest.mark.parametrize("rope,backend", [("yarn", "torch"), ("default", "torch"), ("yarn", "auto")])
def test_attention_matches_torchtitan(rope, backend):
    """One attention: output and gradients (input, wq_b, q_norm, wq_a) vs TorchTitan's own forward."""
    from mla_qproj.torchtitan import fused_query_layer, patch_deepseek_v3

    stock = _model(rope)
    rounded, fused = copy.deepcopy(stock), copy.deepcopy(stock)
    _inject_roundings(rounded)
    patch_deepseek_v3(fused, backend=backend)
    attn = _attns(fused)[0]
    layer = fused_query_layer(attn)
    assert layer.weight is attn.wq_b.weight and layer.norm_weight is attn.q_norm.weight
    assert layer.cfg.rope_style == "gptj" and layer.backend == backend
    assert list(fused.state_dict()) == list(stock.state_dict())
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, DIM, generator=gen)
    pos = torch.arange(2, 14).expand(2, 12)  # positions other than 0 .. s - 1
    dy = torch.randn(2, 12, DIM, generator=gen)
    out = {}
    for name, model in (("fused", fused), ("rounded", rounded), ("stock", stock)):
        a = _attns(model)[0]
        xx = x.clone().requires_grad_(True)
        y = a(xx, None, pos)
        (y * dy).sum().backward()
        out[name] = dict(y=y.detach(), dx=xx.grad, dW=a.wq_b.weight.grad, dnorm=a.q_norm.weight.grad,
                         dWa=a.wq_a.weight.grad, dWkv=a.wkv_b.weight.grad)
    for key in out["fused"]:
        assert_rel_err(out["fused"][key], out["rounded"][key], REL_ERR_REDUCTION_ORDER,
                       f"{rope}/{backend} {key} vs TorchTitan with bf16 roundings")
        assert_rel_err(out["fused"][key], out["stock"][key], REL_ERR_BF16, f"{rope}/{backend} {key} vs fp32")


@pytest.mark.parametrize("rope", ["yarn", "default"])
def test_model_loss_and_grads_match(rope):
    from mla_qproj.torchtitan import patch_deepseek_v3, unpatch_deepseek_v3

    stock = _model(rope)
    rounded, fused = copy.deepcopy(stock), copy.deepcopy(stock)
    _inject_roundings(rounded)
    patch_deepseek_v3(fused, backend="torch")
    ids, labels = _batch()
    _assert_model_matches(dict(fused=fused, rounded=rounded, stock=stock), ids, labels, rope)
    unpatch_deepseek_v3(fused)
    assert torch.equal(_grads(fused, ids, labels)[0], _grads(stock, ids, labels)[0]), \
        "unpatched: TorchTitan's forward again"


@pytest.mark.parametrize("precision,bound", [("fp8_block", REL_ERR_FP8_BLOCK), ("mxfp8", REL_ERR_MXFP8)])
def test_training_steps_track_stock(precision, bound):
    from mla_qproj.torchtitan import patch_deepseek_v3

    stock = _model("yarn", q_lora_rank=128 if precision == "fp8_block" else 32)
    fused = patch_deepseek_v3(copy.deepcopy(stock), precision=precision, backend="torch")
    ids, labels = _batch(s=64)
    sgd_side_by_side(fused, stock, lambda model: torch.nn.functional.cross_entropy(
        model(ids).reshape(-1, VOCAB), labels.reshape(-1)), 3, 0.2, bound, precision)


def test_patch_errors():
    from mla_qproj.torchtitan import patch_deepseek_v3

    with pytest.raises(TypeError, match="rope_theta"):
        patch_deepseek_v3(_model(), rope_theta=1.0)
    with pytest.raises(ValueError, match="no torchtitan"):
        patch_deepseek_v3(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="q_lora_rank"):  # fp8_block needs a multiple of 128
        patch_deepseek_v3(_model(), precision="fp8_block")


# ------------------------------------------------------------------------ TP = 2 on gloo (spawned ranks)


def _capture_query(model, store: dict) -> None:
    """Record what the first attention's inner attention receives as q (type, placements, global and local shape)."""
    def pre(mod, args, kwargs):
        q = args[0]
        store["q"] = (type(q).__name__, tuple(getattr(q, "placements", ())), tuple(q.shape),
                      tuple(getattr(q, "_local_tensor", q).shape))

    _attns(model)[0].inner_attention.register_forward_pre_hook(pre, with_kwargs=True)


def _tp_check_attention(dims, tag: str) -> None:
    """One attention under TP = 2: output, dx and the gradients of wq_b / q_norm / wq_a / wkv_b (full tensors) vs
    TorchTitan's own TP path on the same parallelized model, with and without the layer's roundings; the query
    TorchTitan's inner attention receives has TorchTitan's type and placements; patching before `parallelize` gives
    the same bits as patching after."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mla_qproj.torchtitan import fused_query_layer, patch_deepseek_v3, unpatch_deepseek_v3

    models = {name: _model("yarn", tp_dims=dims) for name in ("fused", "rounded", "stock")}
    _inject_roundings(models["rounded"])
    patch_deepseek_v3(models["fused"], backend="torch")
    models["before"] = patch_deepseek_v3(_model("yarn", tp_dims=dims, parallelize=False), backend="torch")
    models["before"].parallelize(dims)
    attn = _attns(models["fused"])[0]
    layer = fused_query_layer(attn)
    assert layer.tp_size == 2 and layer.cfg.num_heads == 2 and layer.num_heads == 4, tag
    assert dist.get_world_size(layer.par.group) == 2 and not layer.par.sequence_parallel, tag
    w_local = attn.wq_b.weight.to_local()
    assert layer.weight.data_ptr() == w_local.data_ptr() and layer.weight.shape == w_local.shape == (64, 32), tag
    assert layer.norm_weight.data_ptr() == attn.q_norm.weight.to_local().data_ptr(), tag
    assert list(models["fused"].state_dict()) == list(models["stock"].state_dict()), tag
    mesh = attn.wq_b.weight.device_mesh
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, DIM, generator=gen)
    dy = torch.randn(2, 12, DIM, generator=gen)
    pos = torch.arange(2, 14).expand(2, 12)  # positions other than 0 .. s - 1
    out, seen = {}, {}
    for name, model in models.items():
        a = _attns(model)[0]
        seen[name] = {}
        _capture_query(model, seen[name])
        xx = x.clone().requires_grad_(True)  # the attention's input as TorchTitan hands it over: a replica
        y = a(DTensor.from_local(xx, mesh, [Replicate()], run_check=False), None, pos)
        (y * DTensor.from_local(dy, mesh, [Replicate()], run_check=False)).sum().backward()
        out[name] = dict(y=_full(y).detach(), dx=xx.grad, dW=_full(a.wq_b.weight.grad),
                         dnorm=_full(a.q_norm.weight.grad), dWa=_full(a.wq_a.weight.grad),
                         dWkv=_full(a.wkv_b.weight.grad))
    # the gradients land on the DTensor parameters: dW_uq as its Shard(0), d(norm weight) reduced (Replicate)
    assert tuple(attn.wq_b.weight.grad.placements) == (Shard(0),), tag
    assert tuple(attn.q_norm.weight.grad.placements) == (Replicate(),), tag
    assert seen["fused"]["q"] == seen["stock"]["q"] == ("DTensor", (Shard(2),), (2, 12, 4, 32), (2, 12, 2, 32)), \
        f"{tag} the query TorchTitan's inner attention receives: {seen}"
    for key in out["fused"]:
        assert_rel_err(out["fused"][key], out["rounded"][key], REL_ERR_REDUCTION_ORDER,
                       f"{tag} {key} vs TorchTitan TP with bf16 roundings")
        assert_rel_err(out["fused"][key], out["stock"][key], REL_ERR_BF16, f"{tag} {key} vs TorchTitan TP fp32")
        assert torch.equal(out["before"][key], out["fused"][key]), f"{tag} {key}: patched before parallelize"
    unpatch_deepseek_v3(models["fused"])
    assert fused_query_layer(_attns(models["fused"])[0]) is None


def _tp_check_model(dims, tag: str) -> None:
    """precision="bf16" under TP = 2: the whole model's loss and every parameter's full gradient vs the stock TP
    model (with the roundings injected, and plain fp32), as at TP = 1."""
    from mla_qproj.torchtitan import patch_deepseek_v3

    models = {name: _model("yarn", tp_dims=dims) for name in ("fused", "rounded", "stock")}
    _inject_roundings(models["rounded"])
    patch_deepseek_v3(models["fused"], backend="torch")
    ids, labels = _batch()
    _assert_model_matches(models, ids, labels, tag)


def _tp_check_training(dims, tag: str, steps: int = 2) -> None:
    """precision="fp8_block" under TP = 2: SGD steps of the whole model track the stock TP model's loss."""
    from mla_qproj.torchtitan import patch_deepseek_v3

    stock = _model("yarn", q_lora_rank=128, tp_dims=dims)
    fused = patch_deepseek_v3(_model("yarn", q_lora_rank=128, tp_dims=dims), precision="fp8_block", backend="torch")
    ids, labels = _batch(s=64)
    sgd_side_by_side(fused, stock, lambda model: torch.nn.functional.cross_entropy(
        _full(model(ids)).reshape(-1, VOCAB), labels.reshape(-1)), steps, 0.2, REL_ERR_FP8_BLOCK, f"{tag} fp8_block")


def _tp_check_fallback(dims, tag: str) -> None:
    """A DTensor layout outside TorchTitan's TP plan (q_norm.weight sharded) keeps TorchTitan's forward, warned."""
    import warnings

    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from mla_qproj.torchtitan import fused_query_layer, patch_deepseek_v3

    model = _model("yarn", tp_dims=dims)
    attn = _attns(model)[0]
    mesh = attn.wq_b.weight.device_mesh
    attn.q_norm.weight = nn.Parameter(distribute_tensor(attn.q_norm.weight.detach().full_tensor(), mesh, [Shard(0)]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch_deepseek_v3(model, backend="torch")
    assert any("q_norm (Shard(dim=0),)" in str(w.message) for w in caught), f"{tag} {[str(w.message) for w in caught]}"
    assert fused_query_layer(attn) is None and fused_query_layer(_attns(model)[1]) is not None, tag


def _tp_worker(rank: int, world: int, port: int) -> None:
    import os
    import warnings

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims
        import torchtitan.tools.utils as tt_utils
        from torchtitan.distributed import ParallelDims

        tt_utils.device_type = parallel_dims.device_type = "cpu"  # TorchTitan builds its meshes on this device
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world,
                            spmd_backend="partial_dtensor")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _tp_check_attention(dims, f"[tp={world} rank={rank}]")
            _tp_check_model(dims, f"[tp={world} rank={rank}]")
            _tp_check_training(dims, f"[tp={world} rank={rank}]")
        _tp_check_fallback(dims, f"[tp={world} rank={rank}]")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_matches_torchtitan(tmp_path):
    """TP = 2 on gloo (TorchTitan's own `parallelize` with spmd_backend="partial_dtensor"): module doc."""
    from _spawn import free_port, spawn_ranks

    spawn_ranks(_tp_worker, 2, tmp_path, 2, free_port())
