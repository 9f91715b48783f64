"""The fused layer's bf16 roundings (precision="bf16", output_format="bf16") as autograd functions, for
injecting into an engine's own query path (tests/test_megatron.py, tests/test_torchtitan.py)."""

from __future__ import annotations

import torch


class Round(torch.autograd.Function):
    """Forward: rounded to bf16 (kept fp32); backward: the gradient as it is (the layer's straight-through)."""

    @staticmethod
    def forward(ctx, t):
        return t.bfloat16().float()

    @staticmethod
    def backward(ctx, g):
        return g


class RoundBoth(torch.autograd.Function):
    """Forward and backward rounded to bf16: a bf16 tensor cast to fp32 (the layer's bf16 query, whose gradient
    autograd hands back in bf16)."""

    @staticmethod
    def forward(ctx, t):
        return t.bfloat16().float()

    @staticmethod
    def backward(ctx, g):
        return g.bfloat16().float()


class RoundGrad(torch.autograd.Function):
    """Forward: identity; backward: the gradient rounded to bf16 (the layer's bf16 GEMM operand dy)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.bfloat16().float()
