"""Named modes and argument validation. Every check raises ValueError naming the argument."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, fields, replace

from ._constants import BLOCK_SHAPES, MX_BLOCK

SCALE_MODES = ("rceil", "floor")
ROPE_STYLES = ("deepseek", "neox", "gptj")
BLOCK_SCALES = ("pow2", "fp32", "deepseek")
OUTPUT_FORMATS = ("mxfp8", "bf16")
BACKENDS = ("auto", "triton", "torch")


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def validate_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_block_shape(block_shape) -> tuple[int, int]:
    """block_shape as a tuple (bm, bn), one of BLOCK_SHAPES; ValueError otherwise."""
    try:
        bs = tuple(int(v) for v in block_shape)
    except (TypeError, ValueError):
        bs = None
    if bs not in BLOCK_SHAPES:
        raise ValueError(f"block_shape must be one of {BLOCK_SHAPES}, got {block_shape!r}")
    return bs


def check_block_scale(block_scale) -> str:
    return validate_choice("block_scale", block_scale, BLOCK_SCALES)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class QProjConfig:
    """Geometry and numerics of one FusedMLAQUpProjection (all validated in `make`)."""

    q_lora_rank: int
    num_heads: int
    qk_head_dim: int
    rope_dim: int  # qk_pos_emb_head_dim
    q_head_dim: int
    eps: float = 1e-6
    zero_centered_gamma: bool = False
    rope_style: str = "deepseek"
    precision: str = "mxfp8"
    output_format: str = "mxfp8"
    columnwise_output: bool = False
    scale_mode: str = "rceil"
    block_scale: str = "pow2"  # precision "fp8_block" only (SPEC §5)
    norm: bool = True  # False: no RMSNorm, the input is quantized as it is (SPEC §7)

    @property
    def out_features(self) -> int:
        return self.num_heads * self.q_head_dim

    def with_heads(self, num_heads: int) -> QProjConfig:
        """The same layer with `num_heads` heads (a head group of the backward, a tensor-parallel shard)."""
        return replace(self, num_heads=num_heads)

    def encode(self) -> str:
        """The one flattening of the config for torch.library custom ops (which take scalars, not objects):
        a string of its fields, decoded by `QProjConfig.decode`."""
        return ";".join(repr(getattr(self, f.name)) for f in fields(self))

    @staticmethod
    def decode(s: str) -> QProjConfig:
        """Inverse of `encode` (cached: the ops decode on every call)."""
        cfg = _DECODED.get(s)
        if cfg is None:
            values = [ast.literal_eval(v) for v in s.split(";")]
            cfg = _DECODED[s] = QProjConfig(**{f.name: v for f, v in zip(fields(QProjConfig), values, strict=True)})
        return cfg

    @staticmethod
    def make(
        q_lora_rank: int,
        num_heads: int,
        qk_head_dim: int,
        qk_pos_emb_head_dim: int,
        q_head_dim: int | None = None,
        eps: float = 1e-6,
        zero_centered_gamma: bool = False,
        rope_style: str = "deepseek",
        precision: str = "mxfp8",
        output_format: str = "mxfp8",
        columnwise_output: bool = False,
        scale_mode: str = "rceil",
        block_scale: str = "pow2",
        norm: bool = True,
    ) -> QProjConfig:
        _positive_int("q_lora_rank", q_lora_rank)
        _positive_int("num_heads", num_heads)
        if isinstance(qk_head_dim, bool) or not isinstance(qk_head_dim, int) or qk_head_dim < 0:
            raise ValueError(f"qk_head_dim must be a non-negative int, got {qk_head_dim!r}")
        _positive_int("qk_pos_emb_head_dim", qk_pos_emb_head_dim)
        if qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim must be even (RoPE rotates pairs), got {qk_pos_emb_head_dim}")
        if q_head_dim is None:
            q_head_dim = qk_head_dim + qk_pos_emb_head_dim
        _positive_int("q_head_dim", q_head_dim)
        if qk_head_dim + qk_pos_emb_head_dim > q_head_dim:
            raise ValueError(
                f"q_head_dim ({q_head_dim}) must be >= qk_head_dim + qk_pos_emb_head_dim "
                f"({qk_head_dim} + {qk_pos_emb_head_dim})"
            )
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        validate_choice("rope_style", rope_style, ROPE_STYLES)
        from .recipes import PRECISIONS, get_recipe  # the registry (it imports this module: resolved at call time)

        validate_choice("precision", precision, PRECISIONS)
        validate_choice("output_format", output_format, OUTPUT_FORMATS)
        validate_choice("scale_mode", scale_mode, SCALE_MODES)
        validate_choice("block_scale", block_scale, BLOCK_SCALES)
        k_block = get_recipe(precision, kernels=False).k_block
        if q_lora_rank % k_block:
            raise ValueError(f"q_lora_rank must be a multiple of {k_block} for precision={precision!r} (the "
                             f"operands' blocks along K), got {q_lora_rank}")
        if output_format == "mxfp8" and q_head_dim % MX_BLOCK:
            raise ValueError(
                f"q_head_dim must be a multiple of {MX_BLOCK} for output_format='mxfp8', got {q_head_dim}"
            )
        if columnwise_output and output_format != "mxfp8":
            raise ValueError("columnwise_output=True needs output_format='mxfp8'")
        if not norm and zero_centered_gamma:
            raise ValueError("zero_centered_gamma is an RMSNorm option: a layer without a norm (norm=None) has none")
        return QProjConfig(
            q_lora_rank=q_lora_rank,
            num_heads=num_heads,
            qk_head_dim=qk_head_dim,
            rope_dim=qk_pos_emb_head_dim,
            q_head_dim=q_head_dim,
            eps=float(eps),
            zero_centered_gamma=bool(zero_centered_gamma),
            rope_style=rope_style,
            precision=precision,
            output_format=output_format,
            columnwise_output=bool(columnwise_output),
            scale_mode=scale_mode,
            block_scale=block_scale,
            norm=bool(norm),
        )


_DECODED: dict[str, QProjConfig] = {}
