"""cuBLAS GEMMs with fp32 accumulation for the recipes whose operands are exact bf16 images (and the CPU twins)."""

from __future__ import annotations

import contextlib

import torch


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 accumulation and fp32 result (cuBLAS bf16 -> fp32 on CUDA)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def mm_accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in fp32 without a separate product buffer where cuBLAS allows it."""
    if a.is_cuda:
        try:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError):
            pass
    out.add_(mm_fp32(a, b))


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32, contiguous) = a @ b with fp32 accumulation, written in place."""
    if a.is_cuda:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError):
            pass
    out.copy_(mm_fp32(a, b))


@contextlib.contextmanager
def _fp32_reductions():
    """cuBLAS bf16-output GEMMs keep fp32 partial sums (split-K included): the only rounding is the final one to
    bf16, as if the fp32 product were cast (torch's default allows reduced-precision split-K reductions)."""
    m = torch.backends.cuda.matmul
    old = m.allow_bf16_reduced_precision_reduction
    if not old:
        yield
        return
    try:
        old_split_k = m.allow_bf16_reduced_precision_reduction_split_k
    except AttributeError:  # older torch: one flag
        old_split_k = None
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = old if old_split_k is None else (old, old_split_k)


def mm_into_dtype(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out (contiguous rows, any float dtype) = a @ b (or += for accumulate) with fp32 accumulation and one final
    rounding to out's dtype. bf16 on CUDA: cuBLAS writes bf16 directly (no fp32 [N, K] buffer, no cast pass); under
    torch.compile the fp32 product is cast (the reduction flag is a Python-side global the compiled graph would not
    keep)."""
    if accumulate:
        if out.dtype == torch.float32:
            mm_accumulate(out, a, b)
        else:
            out.add_(mm_fp32(a, b))
    elif out.dtype == torch.float32:
        _mm_into(out, a, b)
    elif (a.is_cuda and out.dtype == torch.bfloat16 and a.dtype == torch.bfloat16
          and not torch.compiler.is_compiling()):
        with _fp32_reductions():
            torch.mm(a, b, out=out)
    else:
        out.copy_(mm_fp32(a, b))


def store(out: torch.Tensor, dw: torch.Tensor, accumulate: bool) -> None:
    """out = dw, or out += dw (a weight gradient written, or accumulated into main_grad)."""
    if accumulate:
        out.add_(dw)
    else:
        out.copy_(dw)
