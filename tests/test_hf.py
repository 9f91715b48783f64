"""mla_qproj.hf: DeepseekV3 (HF transformers) with the query path through FusedMLAQUpProjection.

Tiny random DeepseekV3 models on CPU (backend="auto": the Triton kernels under the interpreter on the CPU lane).
Tolerances (tests/_tolerances.py): the patched query against a reference built from HF's own modules and RoPE
functions with the layer's bf16 roundings (bf16 GEMM inputs, bf16 query): REL_ERR_BF16_ROUNDING; patched against
unpatched fp32 HF (exact GEMM inputs): REL_ERR_BF16 for precision="bf16", REL_ERR_MXFP8 for MXFP8,
REL_ERR_FP8_BLOCK for block-scaled FP8 (q_lora_rank 128: SPEC §5 needs a multiple of 128); the interpreter's
fp8_block gradients against the PyTorch reference's (same quantization): REL_ERR_SAME_QUANT.
"""

from __future__ import annotations

import copy
import io
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod  # noqa: E402

from mla_qproj import FP8Block, FusedMLAQUpProjection  # noqa: E402
from mla_qproj.hf import (  # noqa: E402
    fused_query_layer,
    patch_deepseek,
    patch_deepseek_v3,
    unpatch_deepseek,
    unpatch_deepseek_v3,
)

from _tolerances import (  # noqa: E402
    REL_ERR_BF16,
    REL_ERR_BF16_ROUNDING,
    REL_ERR_FP8_BLOCK,
    REL_ERR_MXFP8,
    REL_ERR_SAME_QUANT,
    assert_rel_err,
    rel_err,
)
from conftest import examples  # noqa: E402

HYP = settings(deadline=None, max_examples=examples(6))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0}  # attention factor ~1.065


def _config(**overrides) -> DeepseekV3Config:
    """2 layers: a dense MLP layer, then a small MoE layer (first_k_dense_replace=1)."""
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
              max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def _model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> DeepseekV3ForCausalLM:
    """A model with O(1) activations: N(0, 1/fan_in) matrices, norm weights 1 + 0.2 N(0, 1), so attention
    is far from uniform and RoPE visibly matters. The MoE routers' correction bias fixes which experts each token
    takes (the last top_k): a top-k choice flipped by rounding is a jump in the output, not an error of the query
    path (the expert weights still come from the router's scores)."""
    model = DeepseekV3ForCausalLM(_config(**overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            r = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * r if p.dim() == 1 else r / p.shape[-1] ** 0.5)
        for m in model.modules():
            if isinstance(m, hf_mod.DeepseekV3TopkRouter):
                m.e_score_correction_bias.copy_(2.0 * (torch.arange(m.num_experts) >= m.num_experts - m.top_k))
    return model.to(dtype)


def _ids(batch: int = 2, seq: int = 8, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _attentions(model) -> list:
    return [m for m in model.modules() if isinstance(m, hf_mod.DeepseekV3Attention)]


def _spy_attention(monkeypatch) -> dict:
    """Record the query / key the eager attention function receives (HF's forward and the patched one both look
    `eager_attention_forward` up in the modeling module at call time)."""
    seen: dict = {}
    orig = hf_mod.eager_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen["q"], seen["k"] = query.detach().clone(), key.detach().clone()
        return orig(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(hf_mod, "eager_attention_forward", spy)
    return seen


def _hf_query_bf16_inputs(attn, h, cos, sin, interleave: bool) -> torch.Tensor:
    """HF's query [b, H, s, D] from HF's own modules and RoPE functions, with the layer's roundings for
    precision='bf16', output_format='bf16': xn (fp32 RMSNorm) and W rounded to bf16, fp32 GEMM, fp32 RoPE,
    the result rounded to bf16."""
    x = attn.q_a_proj(h).float()
    norm = attn.q_a_layernorm
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.float()
    y = torch.nn.functional.linear(xn.bfloat16().float(), attn.q_b_proj.weight.bfloat16().float())
    y = y.view(h.shape[0], h.shape[1], -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(y, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    rope = hf_mod.apply_rotary_pos_emb_interleave if interleave else hf_mod.apply_rotary_pos_emb
    q_rot, _ = rope(q_rot, q_rot[:, :1], cos.float(), sin.float())
    return torch.cat([q_pass, q_rot], dim=-1).bfloat16().float()


def _grad(model, ids, g, keys=("q_a_", "q_b_")):
    """The query path's weight gradients (parameter names containing one of keys) of sum(logits * g)."""
    model.zero_grad(set_to_none=True)
    (model(ids).logits * g).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if any(k in n for k in keys)}


# ------------------------------------------------------------------------------------------- the query


@pytest.mark.parametrize("rope", ["default", "yarn"])
@pytest.mark.parametrize("interleave", [True, False])
def test_query_matches_hf(monkeypatch, interleave, rope):
    """The query attention receives: the layer's roundings of HF's query (same RoPE style, same YaRN tables),
    and far from what the other RoPE style or YaRN-unscaled tables would give (so a wrong mapping fails)."""
    over = {"rope_interleave": interleave, "attn_implementation": "eager", "num_hidden_layers": 1}
    if rope == "yarn":
        over["rope_parameters"] = dict(YARN)
    model = _model(**over)
    attn = _attentions(model)[0]
    h = torch.randn(2, 12, 64)
    pos = torch.arange(12).expand(2, 12)
    cos, sin = model.model.rotary_emb(h, pos)
    spy = _spy_attention(monkeypatch)
    out_hf, _ = attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    q_hf, k_hf = spy["q"], spy["k"]
    patch_deepseek_v3(model)
    out, _ = attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    q, k = spy["q"], spy["k"]
    assert q.shape == q_hf.shape and q.dtype == q_hf.dtype == torch.float32
    assert torch.equal(k, k_hf), "keys must be HF's, bit for bit"
    ref = _hf_query_bf16_inputs(attn, h, cos, sin, interleave)
    nope = attn.qk_nope_head_dim
    assert_rel_err(q[..., :nope], ref[..., :nope], REL_ERR_BF16_ROUNDING, "q nope vs HF (bf16 roundings)")
    assert_rel_err(q[..., nope:], ref[..., nope:], REL_ERR_BF16_ROUNDING, "q rope vs HF (bf16 roundings)")
    assert_rel_err(q, q_hf, REL_ERR_BF16, "q vs HF fp32")
    assert_rel_err(out, out_hf, REL_ERR_BF16, "attention output vs HF fp32")
    # the checks above can fail: the other style, or tables without YaRN's factor, are far off
    wrong = _hf_query_bf16_inputs(attn, h, cos, sin, not interleave)
    assert rel_err(q[..., nope:], wrong[..., nope:]) > 0.1
    if rope == "yarn":
        scale = model.model.rotary_emb.attention_scaling
        assert abs(scale - 1) > 0.05
        unscaled = _hf_query_bf16_inputs(attn, h, cos / scale, sin / scale, interleave)
        assert rel_err(q[..., nope:], unscaled[..., nope:]) > 10 * REL_ERR_BF16_ROUNDING


@HYP
@given(heads=st.integers(1, 4), nope=st.sampled_from([0, 16, 32]), rope_dim=st.sampled_from([8, 16, 32]),
       interleave=st.booleans(), seq=st.integers(1, 9))
def test_query_geometries(heads, nope, rope_dim, interleave, seq):
    """Odd head counts and widths (D not a multiple of 32 included: bf16 output takes any D)."""
    model = _model(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, rope_interleave=interleave,
                   attn_implementation="eager")
    attn = _attentions(model)[0]
    h = torch.randn(1, seq, 64)
    cos, sin = model.model.rotary_emb(h, torch.arange(seq)[None])
    with pytest.MonkeyPatch.context() as mp:
        spy = _spy_attention(mp)
        patch_deepseek_v3(model)
        attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    ref = _hf_query_bf16_inputs(attn, h, cos, sin, interleave)
    assert_rel_err(spy["q"], ref, REL_ERR_BF16_ROUNDING, "q vs HF (bf16 roundings)")


def test_layer_rope_from_config():
    """rope_theta and YaRN come from the config: the layer's own tables (position_ids) are HF's."""
    model = _model(num_hidden_layers=1, rope_parameters=dict(YARN, rope_theta=5000.0), rope_interleave=False)
    patch_deepseek_v3(model)
    layer = fused_query_layer(_attentions(model)[0])
    rot = model.model.rotary_emb
    assert layer.cfg.rope_style == "neox" and layer.rope_theta == 5000.0
    torch.testing.assert_close(layer.inv_freq, rot.inv_freq.float(), rtol=1e-6, atol=0)
    assert layer.attention_scaling == pytest.approx(rot.attention_scaling, rel=1e-12)
    x = torch.randn(2, 10, 32)
    pos = torch.arange(3, 13).expand(2, 10)
    cos, sin = rot(x, pos)
    with torch.no_grad():
        a, b = layer(x, cos, sin), layer(x, position_ids=pos)
    assert_rel_err(b.float(), a.float(), REL_ERR_BF16_ROUNDING, "position_ids tables vs HF tables")


# ---------------------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_logits_match(impl, masked):
    """Patched vs unpatched fp32 logits (bf16 GEMM inputs), eager and sdpa, with and without a padding mask."""
    model = _model(attn_implementation=impl)
    ids = _ids()
    mask = None
    if masked:
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding in the second row
    ref = model(ids, attention_mask=mask, output_attentions=impl == "eager")
    patch_deepseek_v3(model)
    out = model(ids, attention_mask=mask, output_attentions=impl == "eager")
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert_rel_err(out.logits[keep], ref.logits[keep], REL_ERR_BF16, f"logits {impl}")
    if impl == "eager":
        for a, r in zip(out.attentions, ref.attentions, strict=True):
            assert_rel_err(a, r, REL_ERR_BF16, "attention probabilities")


def test_logits_match_torch_backend_moe_layers():
    """backend='torch' (the PyTorch reference), 3 heads of D = 48 over 3 layers (2 MoE)."""
    model = _model(num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, qk_nope_head_dim=32)
    ids = _ids(seq=7)
    ref = model(ids).logits
    patch_deepseek_v3(model, backend="torch")
    assert all(fused_query_layer(a).backend == "torch" for a in _attentions(model))
    assert_rel_err(model(ids).logits, ref, REL_ERR_BF16, "logits (torch backend)")


def test_logits_bf16_model():
    """A bf16 model: patched within REL_ERR_BF16 of unpatched (both against the fp32 model of the same weights)."""
    fp32 = _model()
    ids = _ids()
    exact = fp32(ids).logits
    model = copy.deepcopy(fp32).to(torch.bfloat16)
    ref = model(ids).logits
    patch_deepseek_v3(model)
    out = model(ids).logits
    assert out.dtype == torch.bfloat16
    assert_rel_err(out.float(), ref.float(), REL_ERR_BF16, "bf16 logits vs unpatched bf16")
    assert rel_err(out.float(), exact) <= max(REL_ERR_BF16, 1.5 * rel_err(ref.float(), exact))


def test_logits_mxfp8():
    model = _model()
    ids = _ids()
    ref = model(ids).logits
    patch_deepseek_v3(model, precision="mxfp8", output_format="mxfp8")
    assert_rel_err(model(ids).logits, ref, REL_ERR_MXFP8, "logits (MXFP8)")


FP8_BLOCK_RANK = 128  # q_lora_rank for precision="fp8_block" (SPEC §5: a multiple of 128)


def _q_rank(precision: str) -> dict:
    return {"q_lora_rank": FP8_BLOCK_RANK} if precision == "fp8_block" else {}


@pytest.mark.parametrize("block_scale", ["pow2", "fp32", "deepseek"])
def test_logits_fp8_block(block_scale):
    """precision="fp8_block" (1x128 / 128x128 blocks, SPEC §5) through the patch: every attention's fused layer runs
    it with the requested block_scale, and the logits stay within the block-scaled FP8 bound of unpatched fp32."""
    model = _model(q_lora_rank=FP8_BLOCK_RANK)
    ids = _ids()
    ref = model(ids).logits
    patch_deepseek_v3(model, precision=FP8Block(block_scale=block_scale))
    for a in _attentions(model):
        cfg = fused_query_layer(a).cfg
        assert (cfg.precision, cfg.block_scale, cfg.q_lora_rank) == ("fp8_block", block_scale, FP8_BLOCK_RANK)
    out = model(ids).logits
    assert_rel_err(out, ref, REL_ERR_FP8_BLOCK, f"logits (fp8_block, {block_scale})")


def test_backward_fp8_block():
    """fp8_block gradients of the patched model: the interpreter's (backend="auto") within the same-quantization
    bound of the PyTorch reference's. Then an optimizer step on the shared weights: each patched model's logits are
    those of a freshly patched copy of its stepped weights (a stale cached 128x128-tile weight would not be)."""
    model, twin, ids, g = _training_pair(q_lora_rank=FP8_BLOCK_RANK)
    patch_deepseek_v3(model, precision="fp8_block")
    patch_deepseek_v3(twin, precision="fp8_block", backend="torch")
    got, ref = _grad(model, ids, g), _grad(twin, ids, g)
    _assert_grads_close(got, ref, 6, REL_ERR_SAME_QUANT, " (interpreter vs reference)")
    with torch.no_grad():
        before = model(ids).logits
    for m in (model, twin):
        _step_query_weights(m)
    for m, backend in ((model, "auto"), (twin, "torch")):
        fresh = unpatch_deepseek_v3(copy.deepcopy(m))
        patch_deepseek_v3(fresh, precision="fp8_block", backend=backend)
        with torch.no_grad():
            after, want = m(ids).logits, fresh(ids).logits
        assert torch.equal(after, want), f"{backend}: logits after an optimizer step are not the fresh layer's"
        if m is model:
            assert rel_err(after, before) > 5 * REL_ERR_FP8_BLOCK, "the step is too small to show a stale weight"


def _assert_grads_close(got: dict, want: dict, count: int, bound: float, what: str = "") -> None:
    """The same `count` parameters have gradients on both sides, each within bound."""
    assert sorted(got) == sorted(want) and len(got) == count, (sorted(got), sorted(want))
    for name in want:
        assert_rel_err(got[name], want[name], bound, f"grad {name}{what}")


def _training_pair(**overrides):
    """A model in train mode, its copy, token ids and an upstream gradient for the logits."""
    model = _model(seed=3, **overrides).train()
    return model, copy.deepcopy(model), _ids(seed=4), torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(5))


def _step_query_weights(m) -> None:
    """One SGD step on the query path's weights (q_b_proj, q_a_layernorm) that moves each by 20 % of its norm."""
    params = [p for n, p in m.named_parameters() if "q_b_" in n or "q_a_layernorm" in n]
    groups = [{"params": [p], "lr": 0.2 * (p.norm() / p.grad.norm()).item()} for p in params]
    torch.optim.SGD(groups).step()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_backward_matches(backend):
    """Gradients of q_a_proj / q_a_layernorm / q_b_proj weights through the patched model vs unpatched."""
    model, twin, ids, g = _training_pair()
    ref = _grad(twin, ids, g)
    patch_deepseek_v3(model, backend=backend)
    got = _grad(model, ids, g)
    _assert_grads_close(got, ref, 6, REL_ERR_BF16)  # 3 weights x 2 layers
    # one optimizer step on the shared weights (the fused layer's cached quantized W must follow), with a
    # learning rate that moves every weight by 20 % of its norm
    with torch.no_grad():
        before = twin(ids).logits
    for m in (twin, model):
        _step_query_weights(m)
    with torch.no_grad():
        after_ref, after = twin(ids).logits, model(ids).logits
    assert rel_err(after_ref, before) > 5 * REL_ERR_BF16, "the step is too small to show a stale weight"
    assert_rel_err(after, after_ref, REL_ERR_BF16, "logits after an optimizer step")


def test_generate():
    """Greedy decoding with the KV cache runs, and the logits it decodes with match (a) the unpatched model and
    (b) the patched model's own full-sequence forward, both teacher-forced on the generated tokens. The tokens
    themselves may legitimately differ from the unpatched model's under bf16 rounding: not asserted."""
    model = _model()
    ids = _ids(seq=6)
    ref_model = copy.deepcopy(model)
    patch_deepseek_v3(model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    seq = out.sequences
    assert seq.shape == (2, 10) and torch.equal(seq[:, :6], ids)
    steps = torch.stack(out.logits, dim=1)  # [b, 4, V], step i predicts token 6 + i
    with torch.no_grad():
        ref = ref_model(seq).logits[:, 5:9]
        full = model(seq).logits[:, 5:9]
    assert_rel_err(steps, ref, REL_ERR_BF16, "cached decoding vs unpatched")
    assert_rel_err(steps, full, REL_ERR_SAME_QUANT, "cached decoding vs full forward (patched)")


# -------------------------------------------------------------------------------- module tree and state


def test_state_dict_and_load():
    model = _model()
    keys = list(model.state_dict())
    patch_deepseek_v3(model)
    assert list(model.state_dict()) == keys
    assert not any("fused" in n or "mla" in n for n, _ in model.named_modules())
    attn = _attentions(model)[0]
    layer = fused_query_layer(attn)
    assert layer.weight is attn.q_b_proj.weight and layer.norm_weight is attn.q_a_layernorm.weight
    # another model's weights, loaded in place (copy_ bumps the version: the weight cache is rebuilt)
    src = _model(seed=7)
    ids = _ids()
    ref = src(ids).logits
    model(ids)  # fills the weight caches with the old weights
    model.load_state_dict(src.state_dict(), strict=True)
    assert_rel_err(model(ids).logits, ref, REL_ERR_BF16, "after load_state_dict")
    # assign=True puts new Parameter objects into the HF modules: the layer follows them
    model.load_state_dict(_model(seed=8).state_dict(), strict=True, assign=True)
    assert fused_query_layer(attn).weight is attn.q_b_proj.weight
    model.load_state_dict(src.state_dict(), strict=True, assign=True)
    assert_rel_err(model(ids).logits, ref, REL_ERR_BF16, "after load_state_dict(assign=True)")


def test_save_pretrained_round_trip(tmp_path):
    model = _model()
    ids = _ids()
    ref = model(ids).logits
    patch_deepseek_v3(model)
    patched = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert list(loaded.state_dict()) == list(model.state_dict())
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    loaded.eval()
    assert all(fused_query_layer(a) is None for a in _attentions(loaded))
    assert torch.equal(loaded(ids).logits, ref)
    patch_deepseek_v3(loaded)
    assert torch.equal(loaded(ids).logits, patched)


def test_deepcopy_and_torch_save():
    """A patched model deep-copies and pickles whole: the copy's fused layer shares the copy's weights."""
    model = _model()
    ids = _ids()
    patch_deepseek_v3(model, backend="torch")
    out = model(ids).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        for a, orig in zip(_attentions(twin), _attentions(model), strict=True):
            layer = fused_query_layer(a)
            assert layer is not fused_query_layer(orig)
            assert layer.weight is a.q_b_proj.weight and layer.norm_weight is a.q_a_layernorm.weight
        assert torch.equal(twin(ids).logits, out)
        unpatch_deepseek_v3(twin)
        assert all("forward" not in a.__dict__ for a in _attentions(twin))


def test_to_dtype_keeps_sharing():
    model = _model()
    ids = _ids()
    ref = copy.deepcopy(model).to(torch.bfloat16)(ids).logits
    patch_deepseek_v3(model)
    model.to(torch.bfloat16)
    attn = _attentions(model)[0]
    layer = fused_query_layer(attn)
    assert layer.weight is attn.q_b_proj.weight and layer.weight.dtype == torch.bfloat16
    assert layer.inv_freq.dtype == torch.float32
    out = model(ids).logits
    assert out.dtype == torch.bfloat16
    assert_rel_err(out.float(), ref.float(), REL_ERR_BF16, "logits after .to(bf16)")


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_unpatch_restores_exactly(precision):
    model = _model(**_q_rank(precision))
    ids = _ids()
    ref = model(ids).logits
    twin = copy.deepcopy(model)
    before = [dict(a.__dict__) for a in _attentions(twin)]
    patch_deepseek_v3(twin, precision="mxfp8")
    patch_deepseek_v3(twin, precision=precision)  # a second patch replaces the first
    for a in _attentions(twin):
        assert "forward" in a.__dict__ and fused_query_layer(a).cfg.precision == precision
    assert not torch.equal(twin(ids).logits, ref)
    unpatch_deepseek_v3(twin)
    for a, d in zip(_attentions(twin), before, strict=True):
        assert set(a.__dict__) == set(d), "an attribute of the patch remains"
        assert "forward" not in a.__dict__ and a.forward.__func__ is type(a).forward
        assert fused_query_layer(a) is None
    assert torch.equal(twin(ids).logits, ref)
    unpatch_deepseek_v3(twin)  # a no-op on an unpatched model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_no_q_lora_rank_gets_the_norm_free_layer(impl):
    """A config without q_lora_rank (q_proj on the already-normalized hidden state, as DeepSeek-V2-Lite): the layer
    without a norm, sharing q_proj.weight. Logits and q_proj's gradient match the unpatched model, the state_dict
    keys are unchanged, greedy decoding runs, and unpatching restores the model exactly."""
    model = _model(q_lora_rank=None, attn_implementation=impl)
    twin = copy.deepcopy(model)
    ids = _ids()
    keys = list(model.state_dict())
    ref = model(ids).logits
    patch_deepseek_v3(model)
    for a in _attentions(model):
        layer = fused_query_layer(a)
        assert layer.norm_weight is None and layer.weight is a.q_proj.weight and layer.cfg.norm is False
    assert list(model.state_dict()) == keys
    assert_rel_err(model(ids).logits, ref, REL_ERR_BF16, f"logits {impl}")
    g = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(5))
    got, want = _grad(model, ids, g, ("q_proj",)), _grad(twin, ids, g, ("q_proj",))
    _assert_grads_close(got, want, 2, REL_ERR_BF16)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 11)
    unpatch_deepseek_v3(model)
    assert torch.equal(model(ids).logits, ref)


def test_bad_arguments():
    model = _model(num_hidden_layers=1)
    with pytest.raises(TypeError, match="rope_style"):
        patch_deepseek_v3(model, rope_style="gptj")
    with pytest.raises(ValueError, match="precision"):
        patch_deepseek_v3(model, precision="fp4")
    with pytest.raises(TypeError, match="model must be"):
        patch_deepseek_v3("model")
    with pytest.raises(ValueError, match="no DeepseekV3Attention"):
        patch_deepseek_v3(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"layer 0: .*q_lora_rank must be a multiple of 32"):
        patch_deepseek_v3(_model(num_hidden_layers=1, q_lora_rank=48))
    with pytest.raises(ValueError, match="output_format='mxfp8'"):  # D = 48
        patch_deepseek_v3(_model(num_hidden_layers=1, qk_nope_head_dim=32), output_format="mxfp8")
    with pytest.raises(ValueError, match="rope type 'linear'"):
        patch_deepseek_v3(_model(num_hidden_layers=1,
                                 rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
    assert all("forward" not in a.__dict__ for a in _attentions(model)), "a failed patch changed the model"


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_cuda_model(precision):
    """The compiled kernels inside a bf16 model on the GPU; `.to('cuda')` after patching moves the layer's
    parameters (they are the model's) and its inv_freq follows."""
    model = _model()
    ids = _ids()
    exact = model(ids).logits
    ref = copy.deepcopy(model).to("cuda", torch.bfloat16)
    patch_deepseek_v3(model, precision=precision, output_format=precision)
    model.to("cuda", torch.bfloat16)
    out = model(ids.cuda()).logits
    layer = fused_query_layer(_attentions(model)[0])
    assert layer.inv_freq.device.type == "cuda" and layer.weight.device.type == "cuda"
    ref_out = ref(ids.cuda()).logits
    bound = REL_ERR_BF16 if precision == "bf16" else REL_ERR_MXFP8
    assert_rel_err(out.float(), ref_out.float(), bound, f"cuda logits ({precision}) vs unpatched")
    assert rel_err(out.float().cpu(), exact) <= max(bound, 1.5 * rel_err(ref_out.float().cpu(), exact))
    assert isinstance(layer, FusedMLAQUpProjection)


# ------------------------------------------------------------------------------------------- DeepseekV2


def _model_v2(q_lora_rank, impl: str = "sdpa", seed: int = 0) -> DeepseekV2ForCausalLM:
    """A tiny DeepseekV2 model (dense MLPs only: no router whose top-k choice a rounding could flip), weights as in
    `_model`."""
    cfg = DeepseekV2Config(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                           q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                           v_head_dim=16, max_position_embeddings=64, attn_implementation=impl, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    model = DeepseekV2ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            r = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * r if p.dim() == 1 else r / p.shape[-1] ** 0.5)
    return model


def test_deepseek_v2_refused_when_unserved(monkeypatch):
    """With a transformers whose DeepseekV2Attention the patch does not serve (older forwards take no `cache`), a V2
    model is refused with the reason, before any module changes, not reported as having no attention."""
    from mla_qproj import hf

    monkeypatch.setattr(hf, "_V2", None)
    monkeypatch.setattr(hf, "_V2_UNSUPPORTED", "DeepseekV2Attention.forward takes no `cache`")
    model = _model_v2(32, "eager")
    keys = list(model.state_dict())
    with pytest.raises(RuntimeError, match="DeepseekV2 on transformers .*takes no `cache`"):
        patch_deepseek(model)
    assert list(model.state_dict()) == keys and fused_query_layer(next(
        m for m in model.modules() if type(m).__name__ == "DeepseekV2Attention")) is None
    # a modeling_deepseek_v2 without the class at all: a model of neither kind is told so
    monkeypatch.setattr(hf, "_hf2", types.SimpleNamespace())
    with pytest.raises(ValueError, match="no DeepseekV3Attention"):
        patch_deepseek(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_deepseek_v2(q_lora_rank, impl):
    """DeepseekV2 (complex-number RoPE: the "gptj" pairs), with and without q_lora_rank: logits and the query
    weights' gradients against the unpatched model, state_dict keys unchanged, greedy decoding with the cache, and
    unpatching restores the model exactly."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf2

    from mla_qproj import hf

    if hf._V2 is None:  # CI's transformers serves it; an older one is refused (test_deepseek_v2_refused_when_unserved)
        pytest.skip(f"this transformers' DeepseekV2 is not patched: {hf._V2_UNSUPPORTED}")
    model = _model_v2(q_lora_rank, impl)
    twin = copy.deepcopy(model)
    ids = _ids()
    keys = list(model.state_dict())
    ref = model(ids).logits
    patch_deepseek(model)
    attns = [m for m in model.modules() if isinstance(m, hf2.DeepseekV2Attention)]
    assert len(attns) == 2
    for a in attns:
        layer = fused_query_layer(a)
        assert layer is not None and layer.cfg.rope_style == "gptj" and layer.cfg.norm == (q_lora_rank is not None)
    assert list(model.state_dict()) == keys
    assert_rel_err(model(ids).logits, ref, REL_ERR_BF16, f"logits {impl}")
    g = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(5))
    keys = ("q_proj",) if q_lora_rank is None else ("q_a_", "q_b_")
    got, want = _grad(model, ids, g, keys), _grad(twin, ids, g, keys)
    _assert_grads_close(got, want, 2 * (1 if q_lora_rank is None else 3), REL_ERR_BF16)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        teacher = twin(out.sequences).logits[:, 7:10]
    assert_rel_err(torch.stack(out.logits, dim=1), teacher, REL_ERR_BF16, "cached decoding vs unpatched")
    unpatch_deepseek(model)
    assert torch.equal(model(ids).logits, ref)
