"""Autograd core: `_FusedMLAQUpProjFunction` only does ctx bookkeeping; the math lives in `backend`.

Saved for backward: x (as given, [T, K]), rsigma (fp32 [T]), and xn's columnwise MXFP8 (fp8 [T, K] + one
scale byte per 32 tokens per column) — or xn in bf16 for precision='bf16' — plus the [T, R/2] fp32 pair
tables. The dgrad weight operand comes from the module's weight cache, not from ctx.
See backend.py for the GEMM map.
"""

from __future__ import annotations

import torch

from . import backend
from ._config import QProjConfig
from .tensor import MXFP8Tensor


def forward_query(x, norm_weight, cos_h, sin_h, pw, cfg: QProjConfig, use_triton: bool, save: bool = True):
    """The forward math and the query object: (q, x2d, rsigma, xn_saved). Shared by the autograd Function and the
    module's no-grad call (save=False: it skips the Function's bookkeeping, host time at small T, and the columnwise
    MXFP8 of xn that only the backward reads)."""
    lead = x.shape[:-1]
    # the kernels need a unit inner stride; a [b, s] / [s, b] layout is fine, other strides are copied here
    x2d = x.reshape(-1, cfg.q_lora_rank)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    outs, rsigma, xn_saved = backend.forward(x2d, norm_weight, pw, cos_h, sin_h, cfg, use_triton, save)
    H, D = cfg.num_heads, cfg.q_head_dim
    qshape = lead + (H, D)
    if cfg.output_format == "bf16":
        # the query is returned as its own tensor, not as a view of the op's output: FSDP2 (and autograd's view
        # tracking) treat a returned view as aliasing a hidden base. The buffer is fresh and not referenced
        # elsewhere, which is what `_unsafe_view` asks for.
        q = outs[0]
        if q.shape != qshape or q._base is not None:
            q = torch.ops.aten._unsafe_view.default(q, qshape)
        return q, x2d, rsigma, xn_saved
    rd, rs, cd, cs = outs
    if len(lead) != 1:  # the kernels' outputs are [T, H, ...]
        rd, rs = rd.view(qshape), rs.view(lead + (H, D // 32))
        cd = None if cd is None else cd.view(qshape)
    if torch.compiler.is_compiling():  # dynamo traces the subclass through its constructor
        q = MXFP8Tensor(shape=qshape, dtype=x.dtype, scale_mode=cfg.scale_mode, rowwise_data=rd, rowwise_scale=rs,
                        columnwise_data=cd, columnwise_scale=cs)
    else:
        q = MXFP8Tensor._from_kernel_outputs(torch.Size(qshape), x.dtype, cfg.scale_mode, rd, rs, cd, cs)
    return q, x2d, rsigma, xn_saved


class _FusedMLAQUpProjFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, weight, cos_h, sin_h, pw, cfg: QProjConfig, use_triton: bool):
        q, x2d, rsigma, xn_saved = forward_query(x, norm_weight, cos_h, sin_h, pw, cfg, use_triton)
        xn_t = tuple(xn_saved) if isinstance(xn_saved, tuple) else (xn_saved,)
        ctx.save_for_backward(x2d, rsigma, norm_weight, cos_h, sin_h, *xn_t)
        ctx.pw, ctx.cfg, ctx.use_triton, ctx.x_shape = pw, cfg, use_triton, x.shape
        ctx.weight = weight  # a parameter (no copy): used for main_grad and dtype in backward
        return q

    @staticmethod
    def backward(ctx, dq):
        cfg: QProjConfig = ctx.cfg
        x2d, rsigma, norm_weight, cos_h, sin_h, *xn_t = ctx.saved_tensors
        xn_saved = tuple(xn_t) if cfg.precision == "mxfp8" else xn_t[0]
        if isinstance(dq, MXFP8Tensor):
            dq = dq.dequantize()
        dq2d = dq.reshape(x2d.shape[0], cfg.out_features)
        if dq2d.stride(-1) != 1 or dq2d.stride(0) != cfg.out_features:
            dq2d = dq2d.contiguous()
        weight = ctx.weight
        main_grad = getattr(weight, "main_grad", None) if ctx.needs_input_grad[2] else None
        dx, dg, dw = backend.backward(dq2d, x2d, rsigma, xn_saved, norm_weight, ctx.pw, cos_h, sin_h, cfg,
                                      ctx.use_triton, main_grad=main_grad, dw_dtype=weight.dtype)
        if dw is None:  # Megatron convention: accumulated into weight.main_grad
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
        return (dx.view(ctx.x_shape), dg if ctx.needs_input_grad[1] else None,
                dw if ctx.needs_input_grad[2] else None, None, None, None, None, None)
