"""The layer's two numeric choices as objects carrying their own options (SPEC §4): the GEMM precision (`FP8Block`,
`MXFP8`, `BF16`) and the query's format (`BF16Query`, `MXFP8Query`). `FusedMLAQUpProjection(precision=...,
output_format=...)` takes one of each, or its name as a shorthand ("fp8_block", "mxfp8", "bf16") for the object with
its default options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._config import BLOCK_SCALES, SCALE_MODES, validate_choice


@dataclass(frozen=True)
class FP8Block:
    """Block-scaled FP8 GEMMs on FP8 tensor cores: DeepSeek-V3's recipe, TransformerEngine's Float8BlockScaling
    (SPEC §5). xn and the query gradient in 1x128 blocks, W in 128x128 blocks, E4M3 codes with fp32 scales; needs
    q_lora_rank % 128 == 0.

    block_scale: how a block's scale follows from its amax: "pow2" (a power of two, TransformerEngine's Hopper
    default), "fp32" (TransformerEngine's rule without the power-of-two rounding: scale = fp32(448 / amax)) or
    "deepseek" (DeepSeek-V3's kernels: scale_inv = fp32(amax / 448))."""

    block_scale: str = "pow2"
    name: ClassVar[str] = "fp8_block"

    def __post_init__(self) -> None:
        validate_choice("block_scale", self.block_scale, BLOCK_SCALES)


@dataclass(frozen=True)
class MXFP8:
    """MXFP8 GEMM inputs (OCP Microscaling: E4M3 codes, an E8M0 scale per 32 elements along K, SPEC §1-§2); on
    Hopper the GEMMs run on their exact bf16 images. scale_mode: the inputs' E8M0 scales, "rceil"
    (TransformerEngine's MXFP8 quantizer) or "floor" (OCP v1.0)."""

    scale_mode: str = "rceil"
    name: ClassVar[str] = "mxfp8"

    def __post_init__(self) -> None:
        validate_choice("scale_mode", self.scale_mode, SCALE_MODES)


@dataclass(frozen=True)
class BF16:
    """bf16 GEMM inputs: xn rounded once to bf16, W in its parameter dtype rounded to bf16."""

    name: ClassVar[str] = "bf16"


@dataclass(frozen=True)
class BF16Query:
    """The query as a bf16 tensor [..., H, D], rounded once from the fp32 result."""

    name: ClassVar[str] = "bf16"


@dataclass(frozen=True)
class MXFP8Query:
    """The query as an `MXFP8Tensor`: rowwise 32-blocks along each head's q_head_dim (needs q_head_dim % 32 == 0).
    scale_mode: its E8M0 scales ("rceil" or "floor", as `MXFP8`'s); columnwise: also the 32-blocks along T (what a
    backward GEMM over the tokens reads)."""

    scale_mode: str = "rceil"
    columnwise: bool = False
    name: ClassVar[str] = "mxfp8"

    def __post_init__(self) -> None:
        validate_choice("scale_mode", self.scale_mode, SCALE_MODES)
        if not isinstance(self.columnwise, bool):
            raise ValueError(f"columnwise must be a bool, got {self.columnwise!r}")


Precision = FP8Block | MXFP8 | BF16
QueryFormat = BF16Query | MXFP8Query
QUERY_FORMATS: dict[str, type] = {t.name: t for t in (BF16Query, MXFP8Query)}


def _as(argument: str, value: object, types: dict[str, type]):
    if isinstance(value, str) and value in types:
        return types[value]()
    if isinstance(value, tuple(types.values())):
        return value
    kinds = ", ".join(f"{t.__name__}(...)" for t in types.values())
    raise ValueError(f"{argument} must be one of {tuple(types)} or {kinds}, got {value!r}")


def as_precision(value: object) -> Precision:
    """`precision` as an object: a name stands for its object with the default options. The precisions are the
    recipes' (`recipes.RECIPES`, each naming its options type)."""
    from .recipes import PRECISION_OPTIONS  # the registry imports this module: resolved at call time

    return _as("precision", value, PRECISION_OPTIONS)


def as_query_format(value: object) -> QueryFormat:
    """`output_format` as an object: a name stands for its object with the default options."""
    return _as("output_format", value, QUERY_FORMATS)


__all__ = ["BF16", "BF16Query", "FP8Block", "MXFP8", "MXFP8Query", "Precision", "QueryFormat", "as_precision",
           "as_query_format"]
