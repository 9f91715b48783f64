"""`MXFP8Tensor`: a dense tensor's stand-in holding MXFP8 data in one or both orientations (SPEC §2, §4).

Ops go through `__torch_dispatch__`: a few are handled natively in `_OPS`; every other op runs through
`_dequantizing_fallback`, which decodes each MXFP8Tensor argument to a dense tensor and calls the op.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from ._config import SCALE_MODES, validate_choice
from ._constants import MX_BLOCK
from .reference.mxfp8 import dequantize_columnwise, dequantize_rowwise

aten = torch.ops.aten

_FIELDS = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


class MXFP8Tensor(torch.Tensor):
    """A tensor quantized to MXFP8 (E4M3 elements, one E8M0 scale byte per 32-block; SPEC §2).

    `shape`, `dtype` and `device` are those of the dense (logical) tensor it stands for. It holds a
    rowwise copy (32-blocks along the last dim), a columnwise copy (32-blocks along T), or both.

    Attributes:
        rowwise_data: float8_e4m3fn, logical shape; None if absent.
        rowwise_scale: uint8, ``shape[:-1] + (shape[-1] // 32,)``; None if absent.
        columnwise_data: float8_e4m3fn, logical shape; its [T, N] view is ``reshape(-1, N)`` with N the
            product of ``columnwise_scale.shape[1:]`` (the trailing dims); None if absent.
        columnwise_scale: uint8, ``[ceil(T / 32), *trailing dims]``; None if absent.
        scale_mode: "rceil" or "floor", the rule the scales were made with.

    Ops: `detach` and `clone` keep the subclass; `_to_copy` with only a dtype change (``q.float()``,
    ``q.to(torch.bfloat16)``) decodes straight to that dtype; any other op dequantizes its MXFP8Tensor
    arguments (to their logical dtype) and runs densely, returning dense tensors. Autograd flows through
    all of them; the gradient of an MXFP8Tensor is dense. In-place ops on an MXFP8Tensor raise.

    Example:
        >>> from mla_qproj.reference.mxfp8 import quantize_rowwise
        >>> x = torch.randn(4, 64)
        >>> data, scale = quantize_rowwise(x)
        >>> q = MXFP8Tensor(shape=x.shape, dtype=x.dtype, rowwise_data=data, rowwise_scale=scale)
        >>> q.shape, q.dtype, q.rowwise_scale.shape
        (torch.Size([4, 64]), torch.float32, torch.Size([4, 2]))
        >>> y = torch.nn.functional.scaled_dot_product_attention(q[None], x[None], x[None])  # dense
    """

    rowwise_data: torch.Tensor | None
    rowwise_scale: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale: torch.Tensor | None
    scale_mode: str

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        rowwise_data: torch.Tensor | None = None,
        rowwise_scale: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale: torch.Tensor | None = None,
        scale_mode: str = "rceil",
        requires_grad: bool = False,
    ) -> MXFP8Tensor:
        shape = torch.Size(shape)
        fields = dict(zip(_FIELDS, (rowwise_data, rowwise_scale, columnwise_data, columnwise_scale), strict=True))
        _check_fields(shape, dtype, **fields)
        validate_choice("scale_mode", scale_mode, SCALE_MODES)
        ref = rowwise_data if rowwise_data is not None else columnwise_data
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=ref.device, requires_grad=requires_grad
        )
        for name, value in fields.items():
            setattr(self, name, value)
        self.scale_mode = scale_mode
        return self

    @classmethod
    def _from_kernel_outputs(cls, shape: torch.Size, dtype: torch.dtype, scale_mode: str, rowwise_data, rowwise_scale,
                             columnwise_data, columnwise_scale) -> MXFP8Tensor:
        """The layer's own outputs, whose shapes and dtypes the launchers fix: the same object as the constructor
        builds, without re-validating the fields (the checks cost microseconds per call on the small-T path)."""
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=rowwise_data.device)
        self.rowwise_data, self.rowwise_scale = rowwise_data, rowwise_scale
        self.columnwise_data, self.columnwise_scale = columnwise_data, columnwise_scale
        self.scale_mode = scale_mode
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense tensor ``fp8 * 2^(byte - 127)``, computed in fp32 and cast once to `dtype` (default: self.dtype).

        Uses the rowwise copy if present, else the columnwise one. Recorded by autograd as a copy, so a
        gradient passes straight through to this tensor.
        """
        return aten._to_copy.default(self, dtype=self.dtype if dtype is None else dtype)

    def _replace(self, **changes: Any) -> MXFP8Tensor:
        """A new MXFP8Tensor with the given constructor arguments changed (the only rebuild path)."""
        kwargs = {name: getattr(self, name) for name in _FIELDS}
        kwargs.update(shape=self.shape, dtype=self.dtype, scale_mode=self.scale_mode)
        unknown = set(changes) - set(kwargs) - {"requires_grad"}
        if unknown:
            raise TypeError(f"_replace got unknown fields {sorted(unknown)}")
        kwargs.update(changes)
        return MXFP8Tensor(**kwargs)

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Drop the orientations not needed any more, in place (None leaves one as it is).

        Raises:
            ValueError: asked to keep (True) an orientation that is absent, or the call would drop both.
        """
        has = {"rowwise": self.rowwise_data is not None, "columnwise": self.columnwise_data is not None}
        want = {"rowwise": rowwise, "columnwise": columnwise}
        for name, keep in want.items():
            if keep and not has[name]:
                raise ValueError(f"{name}=True but this MXFP8Tensor has no {name} data")
        keep = {name: has[name] and (want[name] is None or bool(want[name])) for name in has}
        if not any(keep.values()):
            raise ValueError("update_usage would drop both orientations; keep rowwise or columnwise")
        for name in has:
            if not keep[name]:
                setattr(self, f"{name}_data", None)
                setattr(self, f"{name}_scale", None)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, str]]:
        return [name for name in _FIELDS if getattr(self, name) is not None], (self.dtype, self.scale_mode)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], ctx: tuple[torch.dtype, str], outer_size: Any, outer_stride: Any
    ) -> MXFP8Tensor:
        dtype, scale_mode = ctx
        return MXFP8Tensor(shape=outer_size, dtype=dtype, scale_mode=scale_mode, **inner_tensors)

    # ---- torch.compile: the gradient of an MXFP8Tensor is dense (SPEC §4), also across a compiled region's edge ----

    def __coerce_tangent_metadata__(self) -> torch.Tensor:
        """AOTAutograd, while it traces a graph that returns this tensor with requires_grad, asks which gradient
        the output will get: a dense tensor of the logical shape and dtype, the only kind that code outside the
        graph produces (``q.backward(dy)``, ``q.dequantize()``, attention). So the compiled backward takes a
        plain tangent and a dense runtime gradient needs no conversion (a plain tensor has no hook AOTAutograd
        could call to turn it into an MXFP8Tensor). AOTAutograd reads ``__tensor_flatten__`` of the returned
        tangent once, as it does for a subclass; the instance attribute set here answers that with no inner
        tensors and removes itself, so the tangent is a plain tensor from then on."""
        ref = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        tangent = ref.new_empty(self.shape, dtype=self.dtype)

        def no_inner_tensors() -> tuple[list[str], None]:
            del tangent.__tensor_flatten__
            return [], None

        tangent.__tensor_flatten__ = no_inner_tensors
        return tangent

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any, expected_type: type | None = None) -> Any:
        """An MXFP8Tensor arriving as the runtime gradient of a compiled output traced with a dense tangent: its
        dense decode, as the layer's eager backward uses. None (AOTAutograd then raises) for any other request."""
        return self.dequantize() if expected_type is torch.Tensor else None

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        kept = [name for name in ("rowwise", "columnwise") if getattr(self, f"{name}_data") is not None]
        grad = f", grad_fn={type(self.grad_fn).__name__}" if self.grad_fn is not None else ""
        return (
            f"MXFP8Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, {'+'.join(kept)}, "
            f"scale_mode={self.scale_mode!r}{grad})"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is not None:
            out = handler(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return _dequantizing_fallback(func, args, kwargs)


def _check_fields(shape: torch.Size, dtype: torch.dtype, **fields: torch.Tensor | None) -> None:
    if len(shape) == 0:
        raise ValueError("MXFP8Tensor shape must have at least one dimension")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    present = [o for o in ("rowwise", "columnwise") if fields[f"{o}_data"] is not None]
    if not present:
        raise ValueError("MXFP8Tensor needs rowwise_data or columnwise_data (or both)")
    for o in ("rowwise", "columnwise"):
        data, scale = fields[f"{o}_data"], fields[f"{o}_scale"]
        if (data is None) != (scale is None):
            raise ValueError(f"{o}_data and {o}_scale must be given together")
        if data is None:
            continue
        if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
            raise TypeError(f"{o}_data must be float8_e4m3fn and {o}_scale uint8, got {data.dtype}, {scale.dtype}")
        if data.shape != shape:
            raise ValueError(f"{o}_data shape {tuple(data.shape)} != shape {tuple(shape)}")
        if data.device != scale.device or data.device != fields[f"{present[0]}_data"].device:
            raise ValueError(f"{o}_data and {o}_scale must be on the device of the other fields")
    if "rowwise" in present:
        expected = shape[:-1] + (shape[-1] // MX_BLOCK,)
        if shape[-1] % MX_BLOCK or fields["rowwise_scale"].shape != expected:
            raise ValueError(
                f"rowwise_scale shape {tuple(fields['rowwise_scale'].shape)} != {tuple(expected)} "
                f"(last dim must be a multiple of {MX_BLOCK})"
            )
    if "columnwise" in present:
        cs = fields["columnwise_scale"].shape
        lead = len(shape) - (len(cs) - 1)
        T = math.prod(shape[:lead]) if lead >= 0 else -1
        if len(cs) < 2 or lead < 0 or cs[1:] != shape[lead:] or cs[0] != -(-T // MX_BLOCK):
            raise ValueError(
                f"columnwise_scale shape {tuple(cs)} != [ceil(T/{MX_BLOCK}), *trailing dims of {tuple(shape)}]"
            )


def _dequantize_fields(t: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode from the plain inner tensors (no dispatch back into the subclass)."""
    device = (t.rowwise_data if t.rowwise_data is not None else t.columnwise_data).device
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=dtype, device=device)  # T == 0: nothing to decode
    if t.rowwise_data is not None:
        return dequantize_rowwise(t.rowwise_data, t.rowwise_scale, dtype)
    return dequantize_columnwise(t.columnwise_data, t.columnwise_scale, dtype)


# ---- op table: ops handled without dequantizing. A handler may return NotImplemented to fall back. ----

_Handler = Callable[[Any, tuple, dict], Any]
_OPS: dict[Any, _Handler] = {}


def _implements(*ops: Any) -> Callable[[_Handler], _Handler]:
    def register(fn: _Handler) -> _Handler:
        for op in ops:
            _OPS[op] = fn
        return fn

    return register


@_implements(aten.detach.default)
def _detach(func: Any, args: tuple, kwargs: dict) -> MXFP8Tensor:
    t = args[0]
    return t._replace(**{n: getattr(t, n).detach() for n in _FIELDS if getattr(t, n) is not None})


@_implements(aten.clone.default)
def _clone(func: Any, args: tuple, kwargs: dict) -> Any:
    if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        return NotImplemented  # e.g. channels_last: leave it to the dense fallback
    t = args[0]
    return t._replace(**{n: getattr(t, n).clone() for n in _FIELDS if getattr(t, n) is not None})


@_implements(aten._to_copy.default)
def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """Only a dtype change: decode in fp32 and cast once to the target dtype (so ``q.float()`` of a bf16
    MXFP8Tensor is exact, not rounded through bf16 first). The result is dense. Anything more
    (device, layout, pinning) goes to the fallback."""
    t = args[0]
    same = (
        kwargs.get("device") in (None, t.device)
        and kwargs.get("layout") in (None, torch.strided)
        and not kwargs.get("pin_memory")
        and kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format)
    )
    return _dequantize_fields(t, kwargs.get("dtype") or t.dtype) if same else NotImplemented


def _dequantizing_fallback(func: Any, args: tuple, kwargs: dict) -> Any:
    """SPEC §4: an op the package does not handle dequantizes. Every MXFP8Tensor in args/kwargs becomes
    its dense decode (logical dtype) and `func` runs on that; results are dense. This is what lets
    ``F.scaled_dot_product_attention(q, k, v)``, ``q + 1`` or ``q.view(...)`` work. Ops that would write
    into an MXFP8Tensor raise, since writing into a temporary decode would be silently lost."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, MXFP8Tensor):
                raise NotImplementedError(f"{func} would write into an MXFP8Tensor; dequantize() it first")
    args, kwargs = tree_map_only(MXFP8Tensor, lambda t: _dequantize_fields(t, t.dtype), (args, kwargs))
    return func(*args, **kwargs)
