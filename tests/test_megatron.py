"""mla_qproj.megatron: Megatron-Core's MLASelfAttention with the query path through FusedMLAQUpProjection, on gloo at
TP = 1 and 2 (sequence parallelism on and off), RoPE "rope" and "yarn" (mscale != 1), in one spawn per world size.

The oracle is Megatron's own unmodified path (`MLASelfAttention`, a tiny 2-layer `GPTModel` of the same weights):
- precision="bf16", fp32 parameters (bf16-valued weights): the fused query, dX, dW_uq and d(q_layernorm.weight)
  against Megatron's path with the layer's bf16 roundings injected by hooks on Megatron's own modules (xn rounded to
  bf16, the query rounded to bf16, the query's gradient rounded to bf16 where it leaves the bf16 query and again
  where it enters the up projection's GEMMs): equal up to the fp32 summation order (REL_ERR_REDUCTION_ORDER;
  measured <= 3e-7: both sides round the same fp32 values, and no bf16 rounding flips at these inputs); keys and
  values bit for bit; and against the plain fp32 path within REL_ERR_BF16;
- the 2-layer model's loss and every parameter's gradient: the same two bounds, except the gradients against the
  rounded path: REL_ERR_BF16_ROUNDING (through two layers a reordered fp32 value now and then lands on the other
  side of a bf16 rounding point, a one-ulp flip that the later layers carry: 4.6e-5 measured at TP = 2);
- precision="fp8_block" / "mxfp8": three SGD steps track the stock model: every step's loss within
  REL_ERR_FP8_BLOCK / REL_ERR_MXFP8 of the stock model's, and both losses fall (per-parameter gradients of the whole
  model differ by 5-15 % at these sizes: the query's error moves the softmax, beyond the layer's own bound).
backend="torch" (the layer's PyTorch reference) except one TP = 1 query case under Triton's interpreter.

CPU shims (test only): `torch.cuda.current_device` returns "cpu" (Megatron's RoPE builds its tables there), a
DotProductAttention accepting the `k_channels` / `v_channels` the MLA spec passes, `multi_latent_attention.HAVE_TE`
set to False (no Transformer Engine), an explicit causal mask (Megatron's default mask is made on CUDA), and for
sequence parallelism an RMSNorm built without WrappedTorchNorm's assert, its weight tagged `sequence_parallel` as
Megatron's own norms tag it.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'mla_qproj[integrations]')")

from _roundings import Round, RoundBoth, RoundGrad  # noqa: E402
from _spawn import free_port, spawn_ranks  # noqa: E402

from _helpers import sgd_side_by_side  # noqa: E402
from _tolerances import (  # noqa: E402
    REL_ERR_BF16,
    REL_ERR_BF16_ROUNDING,
    REL_ERR_FP8_BLOCK,
    REL_ERR_MXFP8,
    REL_ERR_REDUCTION_ORDER,
    assert_rel_err,
)

VOCAB, HIDDEN, HEADS, NOPE, ROPE, V = 96, 64, 4, 16, 16, 16
STEP_BOUND = {"fp8_block": REL_ERR_FP8_BLOCK, "mxfp8": REL_ERR_MXFP8}


# ----------------------------------------------------------------------------------------------- Megatron setup


def _shims() -> None:
    import megatron.core.transformer.multi_latent_attention as mla

    torch.cuda.current_device = lambda: "cpu"
    mla.HAVE_TE = False  # 0.16.1 sets it from an import that succeeds without Transformer Engine


class _RMSNorm:
    """WrappedTorchNorm's RMSNorm without its sequence-parallel assert, tagged as Megatron tags SP norms (a class:
    Megatron's build_module returns a plain function as it is)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        if config.sequence_parallel:
            norm.weight.sequence_parallel = True
        return norm


def _dpa():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class DPA(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return DPA


def _config(tp: int, sp: bool, rope: str, q_lora_rank: int = 32):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw = dict(rope_type=rope)
    if rope == "yarn":  # mscale = 0.1 ln(4) + 1 multiplies cos and sin
        kw.update(rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.0)
    return MLATransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=96, q_lora_rank=q_lora_rank,
        kv_lora_rank=32, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V, kv_channels=V,
        tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, **kw)


def _block_spec(fused: dict | None):
    """The 2-layer decoder block spec: Megatron's local MLA layer spec (q / kv layernorms on), our shims; with
    `fused` the layer kwargs of mla_layer_spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = _RMSNorm
    attn = sub.self_attention.submodules
    attn.q_layernorm = attn.kv_layernorm = _RMSNorm
    attn.core_attention = _dpa()
    block = TransformerBlockSubmodules(layer_specs=[spec, spec], layer_norm=_RMSNorm)
    if fused is None:
        return block
    from mla_qproj.megatron import mla_layer_spec

    return mla_layer_spec(block, **fused)


def _init_weights(model, seed: int) -> None:
    """O(1) activations with bf16-valued fp32 weights (the bf16 GEMM inputs are then exact): matrices
    N(0, 1/fan_in), norm weights 1 + 0.2 N(0, 1); the same values on every rank for replicated parameters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen)
            p.copy_((1 + 0.2 * r if p.dim() == 1 else r / p.shape[-1] ** 0.5).bfloat16().float())


def _gpt(config, fused: dict | None, seed: int = 0):
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(config, _block_spec(fused), vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type="none")
    _init_weights(model, seed)
    return model


def _attn(model):
    return model.decoder.layers[0].self_attention


# ---------------------------------------------------------------------- the layer's roundings in Megatron's path


def _inject_roundings(model) -> list:
    """Hooks on Megatron's own modules giving its query path the layer's bf16 roundings (precision="bf16",
    output_format="bf16": xn and the query rounded, the query's gradient rounded where it leaves the bf16 query and
    again after the inverse RoPE, where it enters the GEMMs); returns the handles."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    handles = []
    for m in model.modules():
        if type(m) is not MLASelfAttention:
            continue
        handles.append(m.q_layernorm.register_forward_hook(lambda mod, inp, out: Round.apply(out)))
        handles.append(m.linear_q_up_proj.register_forward_hook(
            lambda mod, inp, out: (RoundGrad.apply(out[0]),) + tuple(out[1:])))
        orig = m.get_query_key_value_tensors

        def qkv(*args, _orig=orig, **kwargs):
            q, *rest = _orig(*args, **kwargs)
            return (RoundBoth.apply(q), *rest)

        m.get_query_key_value_tensors = qkv
        handles.append(qkv)
    return handles


def _mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s), 1).bool()[None, None]


# ------------------------------------------------------------------------------------------------------- checks


def _check_attention(tp: int, sp: bool, rope: str, backend: str, tag: str) -> None:
    """One attention's query / key / value and gradients: fused vs Megatron (with the layer's roundings, and
    plain)."""
    from mla_qproj.megatron import FusedMLASelfAttention, fused_query_layer

    cfg = _config(tp, sp, rope)
    fused = {"backend": backend}
    models = {"fused": _gpt(cfg, fused), "rounded": _gpt(cfg, None), "stock": _gpt(cfg, None)}
    _inject_roundings(models["rounded"])
    attn = _attn(models["fused"])
    assert isinstance(attn, FusedMLASelfAttention)
    layer = fused_query_layer(attn)
    assert layer is not None and layer.cfg.precision == "bf16" and layer.backend == backend
    assert layer.weight is attn.linear_q_up_proj.weight and layer.norm_weight is attn.q_layernorm.weight
    assert list(models["fused"].state_dict()) == list(models["stock"].state_dict())
    s, b = 16, 2
    gen = torch.Generator().manual_seed(5)
    h_full = torch.randn(s, b, HIDDEN, generator=gen)
    rank = dist.get_rank()
    h = h_full.chunk(tp)[rank] if sp else h_full
    local = HEADS // tp
    dq = torch.randn(s, b, local, NOPE + ROPE, generator=gen)
    dk = torch.randn(s, b, local, NOPE + ROPE, generator=gen)
    dv = torch.randn(s, b, local, V, generator=gen)
    out = {}
    for name, model in models.items():
        a = _attn(model)
        x = h.clone().requires_grad_(True)
        q, k, v, *_ = a.get_query_key_value_tensors(x)
        ((q * dq).sum() + (k * dk).sum() + (v * dv).sum()).backward()
        out[name] = dict(q=q.detach(), k=k.detach(), v=v.detach(), dx=x.grad, dW=a.linear_q_up_proj.weight.grad,
                         dnorm=a.q_layernorm.weight.grad, dWdown=a.linear_q_down_proj.weight.grad)
    got, want, plain = out["fused"], out["rounded"], out["stock"]
    assert got["q"].shape == (s, b, local, NOPE + ROPE) and got["q"].dtype == torch.float32
    for key in ("k", "v"):
        assert torch.equal(got[key], plain[key]), f"{tag} {key} must be Megatron's, bit for bit"
    for key in ("q", "dx", "dW", "dnorm", "dWdown"):
        assert_rel_err(got[key], want[key], REL_ERR_REDUCTION_ORDER, f"{tag} {key} vs Megatron with bf16 roundings")
        assert_rel_err(got[key], plain[key], REL_ERR_BF16, f"{tag} {key} vs Megatron fp32")
    if rope == "yarn":  # the case exercises YaRN's mscale (the oracle applies it to cos and sin)
        assert abs(attn.rotary_pos_emb(s)[1] - 1) > 0.1


def _loss(model, ids, labels, s):
    pos = torch.arange(s)[None].expand(ids.shape[0], s)
    return model(ids, pos, attention_mask=_mask(s), labels=labels).mean()


def _batch(s: int, b: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=gen), torch.randint(0, VOCAB, (b, s), generator=gen)


def _check_model(tp: int, sp: bool, rope: str, tag: str) -> None:
    """The 2-layer model's loss and every parameter's gradient: fused vs Megatron (with roundings, and plain)."""
    cfg = _config(tp, sp, rope)
    models = {"fused": _gpt(cfg, {"backend": "torch"}), "rounded": _gpt(cfg, None), "stock": _gpt(cfg, None)}
    _inject_roundings(models["rounded"])
    ids, labels = _batch(16)
    losses, grads = {}, {}
    for name, model in models.items():
        loss = _loss(model, ids, labels, 16)
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    assert_rel_err(losses["fused"], losses["rounded"], REL_ERR_REDUCTION_ORDER, f"{tag} loss vs rounded Megatron")
    assert_rel_err(losses["fused"], losses["stock"], REL_ERR_BF16, f"{tag} loss vs Megatron fp32")
    assert sorted(grads["fused"]) == sorted(grads["stock"])
    for n, g in grads["fused"].items():
        assert g is not None, f"{tag} {n} has no gradient"
        assert_rel_err(g, grads["rounded"][n], REL_ERR_BF16_ROUNDING, f"{tag} grad {n} vs rounded Megatron")
        assert_rel_err(g, grads["stock"][n], REL_ERR_BF16, f"{tag} grad {n} vs Megatron fp32")


def _check_training(tp: int, sp: bool, precision: str, tag: str, steps: int = 3) -> None:
    """SGD steps of the fused model track the stock model's loss."""
    q_lora_rank = 128 if precision == "fp8_block" else 32  # SPEC §5: a multiple of 128
    cfg = _config(tp, sp, "yarn", q_lora_rank=q_lora_rank)
    s = 64 * tp  # a rank's tokens under sequence parallelism: 64 x 2 (a whole fp8_block column block)
    fused, stock = _gpt(cfg, {"precision": precision, "backend": "torch"}), _gpt(cfg, None)
    ids, labels = _batch(s)
    bound = STEP_BOUND[precision]
    sgd_side_by_side(fused, stock, lambda model: _loss(model, ids, labels, s), steps, 0.5, bound, tag)


def _check_fallback(tag: str) -> None:
    """Packed sequences (a case the layer does not serve) run Megatron's own method, with a warning."""
    from unittest import mock

    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.packed_seq_params import PackedSeqParams

    from mla_qproj.megatron import fused_query_layer

    attn = _attn(_gpt(_config(1, False, "rope"), {"backend": "torch"}))
    assert fused_query_layer(attn) is not None
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    with (mock.patch.object(mla.MLASelfAttention, "get_query_key_value_tensors", lambda self, *a, **k: "megatron"),
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always")
        mla_qproj_megatron = __import__("mla_qproj.megatron", fromlist=["_WARNED"])
        mla_qproj_megatron._WARNED.clear()
        got = attn.get_query_key_value_tensors(torch.randn(12, 1, HIDDEN), packed_seq_params=psp)
    assert got == "megatron", f"{tag} packed sequences did not run Megatron's method"
    assert any("packed sequences" in str(w.message) for w in caught), f"{tag} no warning"


# -------------------------------------------------------------------------------------------------- the spawn


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _shims()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
        sps = (False, True) if world > 1 else (False,)
        for sp in sps:
            for rope in ("rope", "yarn"):
                tag = f"[tp={world} rank={rank} sp={sp} {rope}]"
                _check_attention(world, sp, rope, "torch", tag)
                _check_model(world, sp, rope, tag)
        if world == 1:
            _check_attention(1, False, "yarn", "auto", "[tp=1 interpreter]")
            _check_fallback("[tp=1 fallback]")
        for precision in ("fp8_block", "mxfp8"):
            _check_training(world, world > 1, precision, f"[tp={world} rank={rank} sp={world > 1} {precision}]")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_mla_matches_stock(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path, world, free_port())


def test_spec_helper_errors():
    from mla_qproj.megatron import mla_layer_spec

    with pytest.raises(TypeError, match="rope_theta"):
        mla_layer_spec(rope_theta=5.0)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with pytest.raises(ValueError, match="MLASelfAttention"):
        mla_layer_spec(get_gpt_layer_local_spec())
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    out = mla_layer_spec(spec, precision="fp8_block")
    assert out is not spec and spec.submodules.self_attention.module.__name__ == "MLASelfAttention"
    attn = out.submodules.self_attention
    assert attn.module.__name__ == "FusedMLASelfAttention"
    assert attn.params["fused_query"] == {"precision": "fp8_block"}  # the rest: the layer's defaults
