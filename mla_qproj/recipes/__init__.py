"""GEMM precisions ("recipes") of the layer, each in two implementations behind one interface (base.Recipe): the
kernels and the PyTorch reference. `get_recipe(precision, kernels)` picks one."""

from __future__ import annotations

from .base import Kernels, PreparedWeight, Recipe, Reference
from .fp8_block import FP8BlockKernels, FP8BlockReference
from .images import BF16Kernels, BF16Reference, MXFP8Kernels, MXFP8Reference

RECIPES: dict[tuple[str, bool], Recipe] = {
    (r.name, r.kernels): r for r in (MXFP8Reference(), MXFP8Kernels(), BF16Reference(), BF16Kernels(),
                                     FP8BlockReference(), FP8BlockKernels())}

PRECISIONS: tuple[str, ...] = tuple(dict.fromkeys(name for name, _ in RECIPES))
PRECISION_OPTIONS: dict[str, type] = {r.name: r.option_type for r in RECIPES.values()}


def get_recipe(precision: str, kernels: bool = True) -> Recipe:
    """The recipe of `precision`: its kernel implementation, or (kernels=False) its PyTorch reference."""
    return RECIPES[(precision, kernels)]


__all__ = ["Kernels", "PreparedWeight", "Recipe", "Reference", "PRECISIONS", "PRECISION_OPTIONS", "RECIPES",
           "get_recipe"]
