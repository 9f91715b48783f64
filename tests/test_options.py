"""The precision and the query format as objects (mla_qproj.options, SPEC §4): names as shorthands, the defaults,
the options that moved out of the constructor, and validation on every way a layer config is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj import BF16, MXFP8, BF16Query, FP8Block, FusedMLAQUpProjection, MXFP8Query, MXFP8Tensor
from mla_qproj._config import QProjConfig

GEOMETRY = (128, 2, 32, 32)  # q_lora_rank, heads, qk_head_dim, rope dim: valid for every precision and format


@pytest.mark.parametrize("name,obj", [("bf16", BF16()), ("mxfp8", MXFP8()), ("fp8_block", FP8Block())])
def test_a_precision_name_is_its_object_with_the_defaults(name, obj):
    by_name = FusedMLAQUpProjection(*GEOMETRY, precision=name)
    by_obj = FusedMLAQUpProjection(*GEOMETRY, precision=obj)
    assert by_name.cfg == by_obj.cfg
    assert by_name.cfg.precision_options == obj


@pytest.mark.parametrize("name,obj", [("bf16", BF16Query()), ("mxfp8", MXFP8Query())])
def test_a_query_format_name_is_its_object_with_the_defaults(name, obj):
    assert FusedMLAQUpProjection(*GEOMETRY, output_format=name).cfg.query_format == obj


def test_defaults_are_the_bf16_layer():
    layer = FusedMLAQUpProjection(*GEOMETRY)
    assert layer.cfg.precision_options == BF16() and layer.cfg.query_format == BF16Query()
    x = torch.randn(5, GEOMETRY[0])
    q = layer(x, position_ids=torch.arange(5))
    assert type(q) is torch.Tensor and q.dtype == torch.bfloat16
    assert "precision=BF16()" in repr(layer) and "output_format=BF16Query()" in repr(layer)


@given(block_scale=st.sampled_from(["pow2", "fp32", "deepseek"]), in_mode=st.sampled_from(["rceil", "floor"]),
       q_mode=st.sampled_from(["rceil", "floor"]), columnwise=st.booleans(),
       precision=st.sampled_from(["fp8_block", "mxfp8", "bf16"]))
@settings(max_examples=30, deadline=None)
def test_each_object_carries_its_options_into_the_config_and_back(block_scale, in_mode, q_mode, columnwise,
                                                                  precision):
    p = {"fp8_block": FP8Block(block_scale), "mxfp8": MXFP8(in_mode), "bf16": BF16()}[precision]
    f = MXFP8Query(scale_mode=q_mode, columnwise=columnwise)
    layer = FusedMLAQUpProjection(*GEOMETRY, precision=p, output_format=f)
    c = layer.cfg
    assert c.precision_options == p and c.query_format == f
    assert c.query_scale_mode == q_mode and c.columnwise_output == columnwise
    # a field another precision does not read keeps its default: equal choices give equal configs
    assert c.block_scale == (block_scale if precision == "fp8_block" else "pow2")
    assert c.scale_mode == (in_mode if precision == "mxfp8" else "rceil")
    assert QProjConfig.decode(c.encode()) == c
    assert repr(p) in repr(layer) and repr(f) in repr(layer)


def test_the_query_scale_rule_is_the_querys_own():
    """MXFP8(scale_mode) sets the GEMM inputs' E8M0 scales, MXFP8Query(scale_mode) the query's: two layers with the
    same inputs' rule and different query rules compute the same fp32 result, and their query scale bytes follow
    SPEC §2's two rules for the same amax: with L = log2(amax), floor's byte is floor(L) - 8 + 127 and rceil's is
    one more when frac(L) >= log2(448) - 8 (about a fifth of the blocks), else the same."""
    torch.manual_seed(0)
    x = torch.randn(40, GEOMETRY[0])
    pos = torch.arange(40)
    layers = {m: FusedMLAQUpProjection(*GEOMETRY, precision=MXFP8("floor"), output_format=MXFP8Query(m),
                                       backend="torch") for m in ("rceil", "floor")}
    layers["floor"].load_state_dict(layers["rceil"].state_dict())
    q = {m: layer(x, position_ids=pos) for m, layer in layers.items()}
    assert all(isinstance(v, MXFP8Tensor) for v in q.values())
    assert q["rceil"].scale_mode == "rceil" and q["floor"].scale_mode == "floor"
    diff = q["rceil"].rowwise_scale.int() - q["floor"].rowwise_scale.int()
    assert set(diff.unique().tolist()) == {0, 1}


@pytest.mark.parametrize("kwarg,points_to", [("block_scale", "FP8Block"), ("scale_mode", "MXFP8Query"),
                                             ("columnwise_output", "MXFP8Query")])
def test_options_moved_out_of_the_constructor_say_where(kwarg, points_to):
    value = {"block_scale": "pow2", "scale_mode": "rceil", "columnwise_output": True}[kwarg]
    with pytest.raises(TypeError, match=f"{kwarg}.*{points_to}"):
        FusedMLAQUpProjection(*GEOMETRY, **{kwarg: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        FusedMLAQUpProjection(*GEOMETRY, bogus=1)


def test_arguments_after_the_geometry_are_keyword_only():
    with pytest.raises(TypeError):
        FusedMLAQUpProjection(*GEOMETRY, 64, 1e-6)


@pytest.mark.parametrize("make,name", [
    (lambda: FP8Block(block_scale="pow3"), "block_scale"),
    (lambda: MXFP8(scale_mode="ceil"), "scale_mode"),
    (lambda: MXFP8Query(scale_mode="ceil"), "scale_mode"),
    (lambda: MXFP8Query(columnwise=1), "columnwise"),
    (lambda: FusedMLAQUpProjection(*GEOMETRY, precision=MXFP8Query()), "precision"),
    (lambda: FusedMLAQUpProjection(*GEOMETRY, output_format=MXFP8()), "output_format"),
    (lambda: FusedMLAQUpProjection(*GEOMETRY, precision="fp8"), "precision"),
    (lambda: FusedMLAQUpProjection(96, 2, 32, 32, precision=FP8Block()), "q_lora_rank"),
    (lambda: FusedMLAQUpProjection(128, 2, 16, 16, q_head_dim=40, output_format=MXFP8Query()), "q_head_dim"),
])
def test_bad_options_name_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_every_way_of_building_a_config_validates():
    cfg = FusedMLAQUpProjection(*GEOMETRY, precision="fp8_block").cfg
    with pytest.raises(ValueError, match="num_heads"):
        cfg.with_heads(0)
    with pytest.raises(ValueError, match="precision"):
        dataclasses.replace(cfg, precision="fp4")
    with pytest.raises(ValueError, match="q_lora_rank"):
        dataclasses.replace(cfg, q_lora_rank=96)  # not a multiple of fp8_block's 128
    with pytest.raises(ValueError, match="columnwise"):
        dataclasses.replace(cfg, columnwise_output=True)  # a bf16 query has no columnwise form
    bad = cfg.encode().replace("'fp8_block'", "'fp9'")
    with pytest.raises(ValueError, match="precision"):
        QProjConfig.decode(bad)
    with pytest.raises(ValueError, match="qk_pos_emb_head_dim"):
        QProjConfig(128, 2, 32, 31, 63)
