"""Every constructor option that changes numbers reaches every GEMM precision on both backends.

For each precision (`MXFP8()`, `BF16()`, `FP8Block()`) a base configuration (zero_centered_gamma=False,
rope_style="deepseek", output_format=MXFP8Query(scale_mode="rceil", columnwise=False), the precision's default
options) and one option changed at a time (not the full product), options given through the objects that carry
them (mla_qproj.options): the query's and the MXFP8 GEMM inputs' scale rules separately. The Triton kernels
(backend="triton": the interpreter on the CPU lane) and the PyTorch reference (backend="torch") run the same
weights, inputs and upstream gradient; tolerances are tests/_tolerances.py's:
- the quantized weight (a quantizer's output: MXFP8 / bf16 images, fp8_block codes and scale_inv): bytes identical;
- the query, a GEMM output of the same quantization: >= MIN_CODE_MATCH identical MXFP8 codes and scale bytes
  (MIN_CODE_MATCH_FP8_TC for fp8_block on FP8 tensor cores), decodes and a bf16 query within REL_ERR_SAME_QUANT;
- dx, dweight, dnorm_weight within REL_ERR_SAME_QUANT.
So that a backend which drops an option fails, each changed option must also change the reference's numbers against
the base configuration on the same parameters (a columnwise query adds the columnwise query instead).
"""

from __future__ import annotations

import pytest
import torch

from mla_qproj import BF16, MXFP8, BF16Query, FP8Block, FusedMLAQUpProjection, MXFP8Query, MXFP8Tensor
from mla_qproj.reference.mxfp8 import dequantize_columnwise

from _tolerances import (
    MIN_CODE_MATCH,
    MIN_CODE_MATCH_FP8_TC,
    REL_ERR_SAME_QUANT,
    assert_bytes_equal,
    assert_mxfp8_close,
    assert_rel_err,
)

pytestmark = pytest.mark.slow  # about a minute on two cores: the full tier (MLA_QPROJ_TESTS=full, CI)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K, H, NOPE = 128, 2, 32  # K % 128 == 0 for fp8_block (SPEC §5)
# the RoPE width picks the forward's GEMM path for an MXFP8 query (bf16 queries always take the fused GEMM): R = 32
# (R/2 = 16 columns per MX block half) the GEMM + RoPE/quantize kernels for deepseek and neox, the fused GEMM for
# gptj; R = 64 the fused GEMM + epilogue for every style
ROPE_DIMS = (32, 64)
S, B = 20, 2  # x [s, b, K]: T = 40 tokens (a partial columnwise block for both 32- and 128-row blocks)
GRADS = ("dx", "dnorm_weight", "dweight")
BASE = dict(zero_centered_gamma=False, rope_style="deepseek")
PRECISION_TYPES = {"mxfp8": MXFP8, "bf16": BF16, "fp8_block": FP8Block}
# one option changed from the base: a layer keyword ("layer"), a field of the precision's object ("precision"; its
# own options only: block_scale is FP8Block's, the inputs' scale_mode MXFP8's), or the query format ("query": the
# fields of MXFP8Query, or None for BF16Query)
VARIATIONS = {
    "base": {},
    "zero_centered_gamma": {"layer": {"zero_centered_gamma": True}},
    "rope_neox": {"layer": {"rope_style": "neox"}},
    "rope_gptj": {"layer": {"rope_style": "gptj"}},
    "output_bf16": {"query": None},
    "columnwise_output": {"query": {"columnwise": True}},
    "query_scale_floor": {"query": {"scale_mode": "floor"}},
    "input_scale_floor": {"precision": {"scale_mode": "floor"}},
    "block_scale_fp32": {"precision": {"block_scale": "fp32"}},
    "block_scale_deepseek": {"precision": {"block_scale": "deepseek"}},
}
CASES = [(p, v) for p in ("mxfp8", "bf16", "fp8_block") for v in VARIATIONS
         if not (v.startswith("block_scale") and p != "fp8_block") and not (v == "input_scale_floor" and p != "mxfp8")]


def _layer_kwargs(precision: str, options: dict) -> dict:
    query = options.get("query", {})
    return {**BASE, **options.get("layer", {}),
            "precision": PRECISION_TYPES[precision](**options.get("precision", {})),
            "output_format": BF16Query() if query is None else MXFP8Query(**query)}


def _params(R: int):
    """Parameters shared by every layer of a case: a random weight, and a norm weight that is not all ones (the
    same values under zero_centered_gamma, where g = 1 + norm_weight: the option alone changes the function)."""
    g = torch.Generator().manual_seed(11)
    return {"weight": torch.randn(H * (NOPE + R), K, generator=g) / K**0.5,
            "norm_weight": 1.0 + 0.2 * torch.randn(K, generator=g)}


def _inputs(R: int):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(S, B, K, generator=g)
    pos = torch.arange(S)[:, None].expand(S, B)  # HF tables: cat(freqs, freqs), freqs = pos * inv_freq
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2).float() / R))
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    dy = torch.randn(S, B, H, NOPE + R, generator=g)
    return x.to(DEV), emb.cos().to(DEV), emb.sin().to(DEV), dy.to(DEV)


def _run(R: int, precision: str, options: dict, backend: str):
    """The layer's query, its dense fp32 value, the gradients and the cached prepared weight."""
    layer = FusedMLAQUpProjection(K, H, NOPE, R, backend=backend, device=DEV, **_layer_kwargs(precision, options))
    layer.load_state_dict(_params(R))
    x, cos, sin, dy = _inputs(R)
    x.requires_grad_()
    q = layer(x, cos, sin)
    qd = q.float()
    grads = torch.autograd.grad(qd, (x, layer.norm_weight, layer.weight), dy)
    return q, qd.detach(), dict(zip(GRADS, grads, strict=True)), layer._wcache


@pytest.mark.parametrize("precision,variation", CASES)
@pytest.mark.parametrize("R", ROPE_DIMS, ids=lambda r: f"R{r}")
def test_option_reaches_precision_on_both_backends(R, precision, variation):
    options = VARIATIONS[variation]
    qt, dt, gt, wt = _run(R, precision, options, "triton")
    qr, dr, gr, wr = _run(R, precision, options, "torch")
    label = f"{precision}, {variation}, R = {R}"

    # the weight's quantization (a quantizer): the operands both backends keep, byte for byte
    common = sorted(set(wt.tensors) & set(wr.tensors))
    assert common, f"{label}: no prepared-weight operand in common ({sorted(wt.tensors)} vs {sorted(wr.tensors)})"
    for name in common:
        assert_bytes_equal(wt[name], wr[name], f"{label}: prepared weight {name!r}")

    # the query
    query = _layer_kwargs(precision, options)["output_format"]
    output_format, columnwise = query.name, getattr(query, "columnwise", False)
    assert type(qt) is type(qr) and qt.shape == qr.shape == (S, B, H, NOPE + R), label
    if output_format == "mxfp8":
        # compiled fp8_block runs on FP8 tensor cores (reduced-precision accumulation inside each 128-block)
        min_codes = MIN_CODE_MATCH_FP8_TC if precision == "fp8_block" and DEV.type == "cuda" else MIN_CODE_MATCH
        assert isinstance(qt, MXFP8Tensor), label
        assert_mxfp8_close(qt.rowwise_data, qt.rowwise_scale, dt, qr.rowwise_data, qr.rowwise_scale, dr,
                           f"{label}: rowwise", min_codes)
        if columnwise:
            ct = dequantize_columnwise(qt.columnwise_data, qt.columnwise_scale)
            cr = dequantize_columnwise(qr.columnwise_data, qr.columnwise_scale)
            assert_mxfp8_close(qt.columnwise_data, qt.columnwise_scale, ct, qr.columnwise_data, qr.columnwise_scale,
                               cr, f"{label}: columnwise", min_codes)
        else:
            assert qt.columnwise_data is None and qr.columnwise_data is None, label
    else:
        assert qt.dtype == qr.dtype == torch.bfloat16, label
        assert_rel_err(dt, dr, REL_ERR_SAME_QUANT, f"{label}: bf16 q")
    for k in GRADS:
        assert_rel_err(gt[k], gr[k], REL_ERR_SAME_QUANT, f"{label}: {k} triton vs torch")

    # the option changes the numbers (else a backend that ignored it would pass the comparisons above)
    if variation == "base":
        return
    if variation == "columnwise_output":
        assert qr.columnwise_data is not None and qr.columnwise_scale is not None, label
        return
    _, db, gb, _ = _run(R, precision, {}, "torch")
    assert not torch.equal(dr, db), f"{label}: the option does not change the reference query"
    for k in _grads_it_changes(precision, variation):
        assert not torch.equal(gr[k], gb[k]), f"{label}: the option does not change the reference {k}"
    if variation == "query_scale_floor":  # the query's scale rule is its own: the GEMM inputs' stay as they were
        for k in GRADS:
            assert torch.equal(gr[k], gb[k]), f"{label}: the query's scale rule changed the reference {k}"


def _grads_it_changes(precision: str, variation: str) -> tuple[str, ...]:
    """The gradients an option changes: the query's own format and scales are straight-through (SPEC §1), and
    dnorm_weight = sum over tokens of dxn * x * rsigma does not depend on g (so not on zero_centered_gamma)."""
    if variation == "zero_centered_gamma":
        return ("dx", "dweight")
    if variation in ("rope_neox", "rope_gptj", "block_scale_fp32", "block_scale_deepseek"):
        return GRADS
    return GRADS if variation == "input_scale_floor" else ()  # the MXFP8 GEMM inputs' scales (the query's: none)
