"""GEMM precisions ("recipes") of the layer: `get_recipe(precision)`; see base.Recipe for the interface."""

from __future__ import annotations

from .base import PreparedWeight, Recipe
from .fp8_block import FP8Block
from .images import BF16, MXFP8

RECIPES: dict[str, Recipe] = {r.name: r for r in (MXFP8(), BF16(), FP8Block())}


def get_recipe(precision: str) -> Recipe:
    return RECIPES[precision]


__all__ = ["PreparedWeight", "Recipe", "RECIPES", "get_recipe"]
