"""Recipes whose GEMM operands are exact bf16 images, multiplied on bf16 tensor cores with fp32 accumulation:
"mxfp8" (every operand is the image of its MXFP8 quantization: E4M3 * 2^k is exact in bf16, so this is MXFP8
arithmetic up to the fp32 summation order; Hopper has no MX tensor-core path) and "bf16" (operands rounded once to
bf16). GEMM map (T tokens, K = q_lora_rank, N = num_heads * q_head_dim):

    forward  y   [T, N] = xn_q(rowwise, along K) @ W_q(rowwise, along K)^T     (fused GEMM + RoPE epilogue on sm_90:
                                                                                 the CuTe DSL engine, else Triton's)
    dgrad    dxn [T, K] = dy_q(rowwise, along N) @ W_q(columnwise, along N)
    wgrad    dW  [N, K] = dy_q(columnwise, along T)^T @ xn_q(columnwise, along T)

Each precision has a reference implementation (PyTorch ops, fp32 images) and a kernel one (bf16 images, cuBLAS).
"""

from __future__ import annotations

import torch

from .._config import QProjConfig
from ..options import BF16, MXFP8
from ..reference import mxfp8 as ref_mx
from ..reference import qproj as ref
from ..reference.rope import apply_rope
from ._gemm import mm_accumulate, mm_fp32, mm_into_dtype, store
from .base import Kernels, Operands, PreparedWeight, Reference, norm_arg


def query_outputs(rd, rs, cd, cs, T: int, cfg: QProjConfig) -> tuple:
    """An op's four outputs (absent ones empty or None) in `reference.qproj.quantize_output`'s form, 4 entries."""
    H, D = cfg.num_heads, cfg.q_head_dim
    if cfg.output_format == "bf16":
        return rd.view(T, H, D), None, None, None
    cols = (cd.view(T, H, D), cs.view(-1, H, D)) if cfg.columnwise_output else (None, None)
    return (rd.view(T, H, D), rs.view(T, H, D // 32), *cols)


def cute_query(outs: list) -> tuple:
    """The CuTe DSL engine's op result ([q] or [codes, scale bytes]) as `forward_gemm`'s 4 entries."""
    return (outs[0], None, None, None) if len(outs) == 1 else (outs[0], outs[1], None, None)


def reference_query(y: torch.Tensor, cos_h, sin_h, cfg: QProjConfig) -> tuple:
    """The pure-PyTorch epilogue: RoPE on the fp32 y [T, N], then the output quantization (4 entries)."""
    y = apply_rope(y.reshape(y.shape[0], cfg.num_heads, cfg.q_head_dim), cos_h, sin_h, cfg.qk_head_dim,
                   cfg.rope_dim, cfg.rope_style)
    outs = ref.quantize_output(y, cfg)
    return (outs[0], None, None, None) if len(outs) == 1 else outs


def rope_epilogue(y: torch.Tensor, cos_h, sin_h, cfg: QProjConfig) -> tuple:
    """The general forward's epilogue on the Triton path: y [T, N] fp32 -> RoPE + output quantization kernel."""
    from ..kernels._op import encoded
    from ..kernels.triton.rope_quant import rope_quant_op

    outs = rope_quant_op(y, cos_h, sin_h, encoded(cfg), False, cfg.output_format, cfg.columnwise_output)
    return query_outputs(*outs, y.shape[0], cfg)


class _Images:
    """What each image precision supplies to both of its implementations."""

    def _images(self, w: torch.Tensor, cfg: QProjConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward image, dgrad image) of W [N, K] (bf16 in both implementations)."""
        raise NotImplementedError

    def _xn_image(self, saved: Operands) -> torch.Tensor:
        """xn's wgrad operand [T, K]: the image of its columnwise quantization (bf16 in the kernels')."""
        raise NotImplementedError


class ImageReference(_Images, Reference):
    """The shared reference part of "mxfp8" and "bf16": fp32 GEMMs of the images."""

    def prepare_weight(self, w, cfg, key):
        fwd, bwd = self._images(w.detach(), cfg)
        return PreparedWeight(key, {"fwd": fwd, "bwd": bwd})

    def forward_gemm(self, a, pw, cos_h, sin_h, cfg):
        return reference_query(a[0].float() @ pw["fwd"].float().t(), cos_h, sin_h, cfg)

    def dgrad(self, g_row, pw, cols, cfg, dxn):
        part = g_row[0].float() @ pw["bwd"][cols].float()
        return part if dxn is None else dxn.add_(part)

    def wgrad(self, g_col, saved, cols, cfg, out, accumulate):
        store(out, g_col[0].float().t() @ self._xn_image(saved).float(), accumulate)


class ImageKernels(_Images, Kernels):
    """The shared kernel part of "mxfp8" and "bf16": bf16-image GEMMs (fused forward on sm_90, cuBLAS elsewhere)."""

    def prepare_weight(self, w, cfg, key):
        from ..kernels.cute import rope_gemm as cute_gemm

        fwd, bwd = self._images(w.detach(), cfg)
        tensors = {"bwd": bwd}
        src = None if cute_gemm.serves(cfg, fwd.device) else self.fused_rows(cfg, fwd.device)
        if src is not None:  # the fused GEMM's row order (an exact permutation, zero rows as padding)
            tensors["fused"] = torch.cat([fwd, fwd.new_zeros(1, fwd.shape[1])])[src]
        else:
            tensors["fwd"] = fwd  # only one forward operand is kept (N * K * 2 bytes)
        return PreparedWeight(key, tensors)

    def forward_gemm(self, a, pw, cos_h, sin_h, cfg):
        from ..kernels._op import encoded
        from ..kernels.cute import rope_gemm as cute_gemm

        (a,) = a
        T = a.shape[0]
        if pw.get("fwd") is not None and cute_gemm.serves(cfg, a.device):  # the CuTe DSL kernel (W in its own order)
            return cute_query(cute_gemm.rope_gemm_op(a, None, pw["fwd"], None, cos_h, sin_h, encoded(cfg)))
        if pw.get("fused") is not None:
            from ..kernels.triton.qproj_gemm import qproj_gemm_fwd_op

            outs = qproj_gemm_fwd_op(a, pw["fused"], cos_h, sin_h, encoded(cfg))
            return query_outputs(*outs, T, cfg)
        return rope_epilogue(mm_fp32(a, pw["fwd"].t()), cos_h, sin_h, cfg)

    def fused_launch(self, a, pw, cos_h, sin_h, cfg, out, config):
        from ..kernels.triton.qproj_gemm import qproj_gemm_fwd

        qproj_gemm_fwd(a[0], pw["fused"], cos_h, sin_h, cfg, check=False, config=config, out=out)

    def dgrad(self, g_row, pw, cols, cfg, dxn):
        (g,) = g_row
        w = pw["bwd"][cols]
        if dxn is None:
            return mm_fp32(g, w)
        mm_accumulate(dxn, g, w)
        return dxn

    def wgrad(self, g_col, saved, cols, cfg, out, accumulate):
        mm_into_dtype(out, g_col[0].t(), self._xn_image(saved), accumulate)


class _MXFP8:
    """precision="mxfp8" (SPEC §1-§2): the geometry both implementations share."""

    name = "mxfp8"
    col_block = 32
    n_align = 32
    option_type = MXFP8

    # sequence parallelism: the GEMM input is the exact image of xn's rowwise MXFP8; it crosses the ranks as MXFP8
    # (codes and scale bytes: about half the bytes of bf16) and is decoded again. Re-encoding an MXFP8 image with
    # its own scale mode is lossless (the image's values are on the E4M3 grid times its block's power of two), so
    # every rank multiplies the same image as the tp = 1 layer


class MXFP8Reference(_MXFP8, ImageReference):
    def _images(self, w, cfg):
        return ref.mxfp8_weight_images(w, cfg.scale_mode)

    def grad_operands(self, dq2d, cos_h, sin_h, cfg):
        row, col = ref.mxfp8_grad_images(ref.rope_inverse_grad(dq2d, cos_h, sin_h, cfg), cfg.scale_mode)
        return (row,), (col,)

    def norm_quant(self, x2d, norm_weight, cfg, save):
        xn, rsigma = ref.rmsnorm_fwd(x2d, norm_weight, cfg.eps, cfg.zero_centered_gamma)
        a = ref_mx.dequantize_rowwise(*ref_mx.quantize_rowwise(xn, cfg.scale_mode))
        return rsigma, (a,), ref_mx.quantize_columnwise(xn, cfg.scale_mode) if save else ()

    def wire_input(self, a, cfg: QProjConfig):
        return ref_mx.quantize_rowwise(a[0], cfg.scale_mode)

    def input_from_wire(self, w, ranks: int, cfg: QProjConfig):
        return (ref_mx.dequantize_rowwise(*w, torch.float32),)  # fp32 images, as norm_quant makes them

    def _xn_image(self, saved):
        return ref_mx.dequantize_columnwise(*saved)


class MXFP8Kernels(_MXFP8, ImageKernels):
    def _images(self, w, cfg):
        from ..kernels.triton.mxfp8_quant import mxfp8_quantize_2d_op

        rd, rs, cd, cs = mxfp8_quantize_2d_op(w, True, True, cfg.scale_mode)
        return (ref_mx.dequantize_rowwise(rd, rs, torch.bfloat16),
                ref_mx.dequantize_columnwise(cd, cs, torch.bfloat16))

    def norm_quant(self, x2d, norm_weight, cfg, save):
        from ..kernels._op import encoded
        from ..kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd_op

        rsigma, a, xcd, xcs = rmsnorm_quant_fwd_op(x2d, norm_arg(x2d, norm_weight), encoded(cfg), save)
        return rsigma, (a,), (xcd, xcs) if save else ()

    def wire_input(self, a, cfg: QProjConfig):
        from ..kernels.triton.mxfp8_quant import mxfp8_quantize_2d_op

        return mxfp8_quantize_2d_op(a[0], True, False, cfg.scale_mode)[:2]  # one pass (the reference's takes ~10)

    def input_from_wire(self, w, ranks: int, cfg: QProjConfig):
        return (ref_mx.dequantize_rowwise(*w, torch.bfloat16),)  # bf16 images, as norm_quant makes them

    def grad_operands(self, dq2d, cos_h, sin_h, cfg):
        from ..kernels._op import encoded
        from ..kernels.triton.mxfp8_quant import mxfp8_quantize_2d_op
        from ..kernels.triton.rope_quant import rope_quant_op

        args = (cos_h, sin_h, encoded(cfg), True)
        if cfg.q_head_dim % 32 == 0:  # the N-blocks stay inside a head: one fused pass
            row, _, col, _ = rope_quant_op(dq2d, *args, "mxfp8_images", True)
            return (row,), (col,)
        # general geometry: N-blocks cross heads (partial last block): rotate, then quantize the [T, N] tensor
        g = rope_quant_op(dq2d, *args, "fp32", False)[0]
        _, _, cdt, cst = mxfp8_quantize_2d_op(g.t(), False, True, cfg.scale_mode)  # along N == columnwise of g^T
        _, _, cd, cs = mxfp8_quantize_2d_op(g, False, True, cfg.scale_mode)
        row = ref_mx.dequantize_columnwise(cdt, cst, torch.bfloat16).t()
        return (row,), (ref_mx.dequantize_columnwise(cd, cs, torch.bfloat16),)

    def _xn_image(self, saved):
        from ..kernels.triton.mxfp8_quant import dequantize_columnwise_bf16_op

        return dequantize_columnwise_bf16_op(*saved)


class _BF16:
    """precision="bf16": xn rounded once to bf16, W and dy in bf16."""

    name = "bf16"
    option_type = BF16

    def _images(self, w, cfg):
        wb = w.to(torch.bfloat16)
        return wb, wb

    def _xn_image(self, saved):  # xn rounded to bf16 is its own image
        return saved[0]


class BF16Reference(_BF16, ImageReference):
    def norm_quant(self, x2d, norm_weight, cfg, save):
        xn, rsigma = ref.rmsnorm_fwd(x2d, norm_weight, cfg.eps, cfg.zero_centered_gamma)
        xb = xn.to(torch.bfloat16)
        return rsigma, (xb.float(),), (xb,) if save else ()

    def grad_operands(self, dq2d, cos_h, sin_h, cfg):
        gb = ref.rope_inverse_grad(dq2d, cos_h, sin_h, cfg).to(torch.bfloat16).float()
        return (gb,), (gb,)


class BF16Kernels(_BF16, ImageKernels):
    def norm_quant(self, x2d, norm_weight, cfg, save):
        from ..kernels._op import encoded
        from ..kernels.triton.rmsnorm_quant import rmsnorm_quant_fwd_op

        rsigma, a, _, _ = rmsnorm_quant_fwd_op(x2d, norm_arg(x2d, norm_weight), encoded(cfg), save)
        return rsigma, (a,), (a,) if save else ()

    def grad_operands(self, dq2d, cos_h, sin_h, cfg):
        from ..kernels._op import encoded
        from ..kernels.triton.rope_quant import rope_quant_op

        g = rope_quant_op(dq2d, cos_h, sin_h, encoded(cfg), True, "bf16", False)[0]
        return (g,), (g,)
