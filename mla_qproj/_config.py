"""Named modes and argument validation. Every check raises ValueError naming the argument."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, fields, replace

from ._constants import BLOCK_SHAPES, MX_BLOCK

SCALE_MODES = ("rceil", "floor")
ROPE_STYLES = ("deepseek", "neox", "gptj")
BLOCK_SCALES = ("pow2", "fp32", "deepseek")
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
    """Geometry and numerics of one FusedMLAQUpProjection, flat (the kernels and the custom ops read its fields).
    Every construction validates (`__post_init__`): the constructor, `make`, `with_heads`, `decode`,
    `dataclasses.replace`. The precision's options and the query format's are fields of their own, one meaning
    each: `scale_mode` and `block_scale` are the GEMM inputs' (MXFP8 / FP8Block), `query_scale_mode` and
    `columnwise_output` the MXFP8 query's; a field another precision or format does not read keeps its default."""

    q_lora_rank: int
    num_heads: int
    qk_head_dim: int
    rope_dim: int  # qk_pos_emb_head_dim
    q_head_dim: int
    eps: float = 1e-6
    zero_centered_gamma: bool = False
    rope_style: str = "deepseek"
    precision: str = "bf16"
    output_format: str = "bf16"
    columnwise_output: bool = False  # output_format "mxfp8" only
    scale_mode: str = "rceil"  # precision "mxfp8" only: the GEMM inputs' E8M0 scales
    block_scale: str = "pow2"  # precision "fp8_block" only (SPEC §5)
    norm: bool = True  # False: no RMSNorm, the input is quantized as it is (SPEC §7)
    query_scale_mode: str = "rceil"  # output_format "mxfp8" only: the query's E8M0 scales

    def __post_init__(self) -> None:
        _positive_int("q_lora_rank", self.q_lora_rank)
        _positive_int("num_heads", self.num_heads)
        if isinstance(self.qk_head_dim, bool) or not isinstance(self.qk_head_dim, int) or self.qk_head_dim < 0:
            raise ValueError(f"qk_head_dim must be a non-negative int, got {self.qk_head_dim!r}")
        _positive_int("qk_pos_emb_head_dim", self.rope_dim)
        if self.rope_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim must be even (RoPE rotates pairs), got {self.rope_dim}")
        _positive_int("q_head_dim", self.q_head_dim)
        if self.qk_head_dim + self.rope_dim > self.q_head_dim:
            raise ValueError(f"q_head_dim ({self.q_head_dim}) must be >= qk_head_dim + qk_pos_emb_head_dim "
                             f"({self.qk_head_dim} + {self.rope_dim})")
        eps = self.eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        object.__setattr__(self, "eps", float(eps))
        for name in ("zero_centered_gamma", "columnwise_output", "norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        validate_choice("rope_style", self.rope_style, ROPE_STYLES)
        from .options import QUERY_FORMATS
        from .recipes import PRECISIONS, get_recipe  # the registry (it imports this module: resolved at call time)

        validate_choice("precision", self.precision, PRECISIONS)
        validate_choice("output_format", self.output_format, tuple(QUERY_FORMATS))
        validate_choice("scale_mode", self.scale_mode, SCALE_MODES)
        validate_choice("query_scale_mode", self.query_scale_mode, SCALE_MODES)
        validate_choice("block_scale", self.block_scale, BLOCK_SCALES)
        k_block = get_recipe(self.precision, kernels=False).k_block
        if self.q_lora_rank % k_block:
            raise ValueError(f"q_lora_rank must be a multiple of {k_block} for precision={self.precision!r} (the "
                             f"operands' blocks along K), got {self.q_lora_rank}")
        if self.output_format == "mxfp8" and self.q_head_dim % MX_BLOCK:
            raise ValueError(f"q_head_dim must be a multiple of {MX_BLOCK} for an MXFP8 query (output_format='mxfp8' "
                             f"or MXFP8Query(...)), got {self.q_head_dim}")
        if self.columnwise_output and self.output_format != "mxfp8":
            raise ValueError("a columnwise query (MXFP8Query(columnwise=True)) needs output_format='mxfp8'")
        if not self.norm and self.zero_centered_gamma:
            raise ValueError("zero_centered_gamma is an RMSNorm option: a layer without a norm (norm=None) has none")

    @property
    def out_features(self) -> int:
        return self.num_heads * self.q_head_dim

    @property
    def precision_options(self):
        """The precision as its public object (`options.FP8Block`, `MXFP8`, `BF16`) with this config's options."""
        from .recipes import PRECISION_OPTIONS

        t = PRECISION_OPTIONS[self.precision]
        return t(**{f.name: getattr(self, f.name) for f in fields(t)})

    @property
    def query_format(self):
        """The query format as its public object (`options.BF16Query`, `MXFP8Query`)."""
        from .options import BF16Query, MXFP8Query

        if self.output_format == "bf16":
            return BF16Query()
        return MXFP8Query(scale_mode=self.query_scale_mode, columnwise=self.columnwise_output)

    def with_heads(self, num_heads: int) -> QProjConfig:
        """The same layer with `num_heads` heads (a head group of the backward, a tensor-parallel shard)."""
        key = (self, num_heads)
        cfg = _WITH_HEADS.get(key)
        if cfg is None:
            cfg = _WITH_HEADS[key] = replace(self, num_heads=num_heads)
        return cfg

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
    def make(q_lora_rank: int, num_heads: int, qk_head_dim: int, qk_pos_emb_head_dim: int,
             q_head_dim: int | None = None, eps: float = 1e-6, zero_centered_gamma: bool = False,
             rope_style: str = "deepseek", precision: object = "bf16", output_format: object = "bf16",
             norm: bool = True) -> QProjConfig:
        """The config of the constructor's arguments: precision and output_format as objects of `mla_qproj.options`
        or their names (the object with its default options); q_head_dim None is qk_head_dim + qk_pos_emb_head_dim."""
        from .options import as_precision, as_query_format

        p, f = as_precision(precision), as_query_format(output_format)
        if q_head_dim is None and isinstance(qk_head_dim, int) and isinstance(qk_pos_emb_head_dim, int):
            q_head_dim = qk_head_dim + qk_pos_emb_head_dim
        return QProjConfig(
            q_lora_rank, num_heads, qk_head_dim, qk_pos_emb_head_dim, q_head_dim, eps=eps,
            zero_centered_gamma=zero_centered_gamma, rope_style=rope_style, precision=p.name, output_format=f.name,
            columnwise_output=getattr(f, "columnwise", False), scale_mode=getattr(p, "scale_mode", "rceil"),
            block_scale=getattr(p, "block_scale", "pow2"), norm=norm,
            query_scale_mode=getattr(f, "scale_mode", "rceil"))


_DECODED: dict[str, QProjConfig] = {}
_WITH_HEADS: dict[tuple, QProjConfig] = {}
