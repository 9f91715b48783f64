"""Autograd core: `_FusedMLAQUpProjFunction` only does ctx bookkeeping; the math lives in `backend` and the
precision-specific parts in `recipes`.

Saved for backward: x (as given, [T, K]; this rank's tokens under sequence parallelism), rsigma (fp32 [T]), what
the recipe's weight gradient reads of xn (MXFP8: the columnwise codes + one scale byte per 32 tokens per column;
fp8_block: the 128x1-block codes + fp32 scale per 128 tokens per column; bf16: xn in bf16) and the [T, R/2] pair
tables. The dgrad weight operand comes from the module's weight cache, not from ctx.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from . import backend
from ._config import QProjConfig
from .distributed import Parallel
from .recipes import Recipe
from .tensor import MXFP8Tensor


def query_shape(x: torch.Tensor, cfg: QProjConfig, par: Parallel | None) -> tuple[int, ...]:
    """x.shape[:-1] + (H, D), with the first dimension gathered over the group under sequence parallelism."""
    lead = tuple(x.shape[:-1])
    if par is not None and par.sequence_parallel:
        lead = (lead[0] * par.world,) + lead[1:]
    return lead + (cfg.num_heads, cfg.q_head_dim)


def forward_query(x, norm_weight, cos_h, sin_h, pw, cfg: QProjConfig, recipe: Recipe, save: bool = True,
                  par: Parallel | None = None):
    """The forward math and the query object: (q, x2d, rsigma, saved). Shared by the autograd Function and the
    module's no-grad call (save=False: it skips the Function's bookkeeping, host time at small T, and what only the
    backward reads of xn)."""
    # the kernels need a unit inner stride; a [b, s] / [s, b] layout is fine, other strides are copied here
    x2d = x.reshape(-1, cfg.q_lora_rank)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    with torch.autocast(x.device.type, enabled=False):  # the precision is the layer's, not autocast's
        (rd, rs, cd, cs), rsigma, saved = backend.forward(x2d, norm_weight, pw, cos_h, sin_h, cfg, recipe, save,
                                                          par)
    qshape = query_shape(x, cfg, par)
    if cfg.output_format == "bf16":
        # the query is returned as its own tensor, not as a view of the op's output: FSDP2 (and autograd's view
        # tracking) treat a returned view as aliasing a hidden base. The buffer is fresh and not referenced
        # elsewhere, which is what `_unsafe_view` asks for.
        if rd.shape != qshape or rd._base is not None:
            rd = torch.ops.aten._unsafe_view.default(rd, qshape)
        return rd, x2d, rsigma, saved
    if len(qshape) != 3:  # the kernels' outputs are [T, H, ...]
        rd, rs = rd.view(qshape), rs.view(qshape[:-1] + (cfg.q_head_dim // 32,))
        cd = None if cd is None else cd.view(qshape)
    if torch.compiler.is_compiling():  # dynamo traces the subclass through its constructor
        q = MXFP8Tensor(shape=qshape, dtype=x.dtype, scale_mode=cfg.query_scale_mode, rowwise_data=rd,
                        rowwise_scale=rs, columnwise_data=cd, columnwise_scale=cs)
    else:
        q = MXFP8Tensor._from_kernel_outputs(torch.Size(qshape), x.dtype, cfg.query_scale_mode, rd, rs, cd, cs)
    return q, x2d, rsigma, saved


class _FusedMLAQUpProjFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, weight, cos_h, sin_h, pw, cfg: QProjConfig, recipe: Recipe,
                par: Parallel | None):
        # what only the wgrad reads of xn is made and kept only when the weight takes a gradient (a frozen or
        # pre-quantized weight: the backward skips the wgrad)
        q, x2d, rsigma, saved = forward_query(x, norm_weight, cos_h, sin_h, pw, cfg, recipe,
                                              ctx.needs_input_grad[2], par)
        ctx.save_for_backward(x2d, rsigma, norm_weight, cos_h, sin_h, *saved)
        ctx.pw, ctx.cfg, ctx.recipe, ctx.x_shape, ctx.par = pw, cfg, recipe, x.shape, par
        ctx.weight = weight  # a parameter (no copy): used for main_grad and dtype in backward
        return q

    @staticmethod
    @once_differentiable  # the backward's math is not differentiable: a double backward raises, never a wrong grad
    def backward(ctx, dq):
        cfg: QProjConfig = ctx.cfg
        x2d, rsigma, norm_weight, cos_h, sin_h, *saved = ctx.saved_tensors
        if isinstance(dq, MXFP8Tensor):
            dq = dq.dequantize()
        dq2d = dq.reshape(math.prod(dq.shape[:-2]), cfg.out_features)
        if dq2d.stride(-1) != 1 or dq2d.stride(0) != cfg.out_features:
            dq2d = dq2d.contiguous()
        weight = ctx.weight
        main_grad = getattr(weight, "main_grad", None) if ctx.needs_input_grad[2] else None
        with torch.autocast(dq.device.type, enabled=False):
            dx, dg, dw = backend.backward(dq2d, x2d, rsigma, tuple(saved), norm_weight, ctx.pw, cos_h, sin_h, cfg,
                                          ctx.recipe, main_grad=main_grad, dw_dtype=weight.dtype, par=ctx.par,
                                          need_dw=ctx.needs_input_grad[2])
        if dw is None:  # Megatron convention: accumulated into weight.main_grad
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
        return (dx.view(ctx.x_shape), dg if ctx.needs_input_grad[1] else None,
                dw if ctx.needs_input_grad[2] else None, None, None, None, None, None, None)
