"""precision="fp8_block": the DeepSeek-V3 / TransformerEngine Float8BlockScaling recipe (SPEC §5), at the FP8
tensor-core rate on Hopper. GEMM map (T tokens, K = q_lora_rank, N = num_heads * q_head_dim; E4M3 codes, one fp32
scale per 1x128 / 128x1 block or 128x128 tile, fp32 accumulation promoted once per 128-long reduction block):

    forward  y   [T, N] = xn(1x128 along K) @ W(128x128)^T        fused GEMM with the RoPE epilogue (sm_90): the CuTe
                                                                   DSL engine (bf16 query), else the Triton kernel
    dgrad    dxn [T, K] = dy(1x128 along N) @ W(128x128)          cuBLAS blockwise (torch._scaled_mm), fp32 out
    wgrad    dW  [N, K] = dy(128x1 along T)^T @ xn(128x1 along T)  cuBLAS blockwise (1x128 x 1x128 along T)

W is quantized once per version; the same tiles serve forward (in the fused kernel's row order) and dgrad (as the
transposed codes cuBLAS wants). Off sm_90 / on the CPU the kernels' GEMMs run as `reference.fp8_block.block_scaled_mm`.
`FP8BlockReference` is the same recipe in PyTorch ops, `FP8BlockKernels` runs the kernels.
"""

from __future__ import annotations

import torch

from .._config import QProjConfig
from .._constants import FP8_BLOCK
from ..distributed import Parallel, rows_to_cols
from ..kernels.cute import rope_gemm as cute_gemm
from ..options import FP8Block
from ..reference import fp8_block as ref8
from ..reference import qproj as ref
from ._gemm import store
from .base import Kernels, PreparedWeight, Reference
from .images import cute_query, query_outputs, reference_query, rope_epilogue


def cublas_blockwise(device: torch.device, *reductions: int) -> bool:
    """torch._scaled_mm's 1x128 / 128x128 block scaling runs on sm_90 (cuBLASLt >= 12.9); its scale layouts want
    the reduction's block count a multiple of 4 and the reduction a multiple of 16 bytes."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and all(r % (4 * FP8_BLOCK) == 0 for r in reductions))


class _FP8Block:
    """The recipe's geometry, shared by both implementations."""

    name = "fp8_block"
    col_block = FP8_BLOCK
    n_align = FP8_BLOCK
    fused_operands = "fp8_block"
    k_block = FP8_BLOCK  # 1x128 blocks along K
    option_type = FP8Block

    @staticmethod
    def _prequantized(w: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A checkpoint's E4M3 codes [N, K] and 128x128 scale_inv, taken as they are."""
        return w[0].detach().contiguous(), w[1].detach().float().contiguous()


class FP8BlockReference(_FP8Block, Reference):
    """Operands token-major: GEMM input (codes [T, K], scale_inv [T, K/128]); saved xn (codes [T, K], scale_inv
    [T/128, K]); the query gradient's (codes [T, n], scale_inv [T, n/128]) and (codes [T, n], scale_inv [T/128, n])."""

    def prepare_weight(self, w, cfg, key):
        if isinstance(w, tuple):  # pre-quantized
            wq, ws = self._prequantized(w)
        else:
            wq, ws = ref8.prepare_weight_fp8_block(w.detach(), cfg.block_scale)
        return PreparedWeight(key, {"wq": wq, "ws": ws})

    def norm_quant(self, x2d, norm_weight, cfg, save):
        bs = cfg.block_scale
        xn, rsigma = ref.rmsnorm_fwd(x2d, norm_weight, cfg.eps, cfg.zero_centered_gamma)
        xn = ref8.canonical_nan(xn)
        a = ref8.quantize_blocks(xn, (1, FP8_BLOCK), bs)  # codes [T, K], scale_inv [T, K/128]
        return rsigma, a, ref8.quantize_blocks(xn, (FP8_BLOCK, 1), bs) if save else ()

    def forward_gemm(self, a, pw, cos_h, sin_h, cfg):
        ad, asv = a
        return reference_query(ref8.block_scaled_mm(ad, asv, pw["wq"], pw["ws"], 1, FP8_BLOCK), cos_h, sin_h, cfg)

    def grad_operands(self, dq2d, cos_h, sin_h, cfg):
        dr, drs, dc, dcs = ref8.grad_operands_fp8_block(dq2d, cos_h, sin_h, cfg, cfg.block_scale)
        return (dr, drs), (dc, dcs)

    def dgrad(self, g_row, pw, cols, cfg, dxn):
        dr, drs = g_row
        part = ref8.block_scaled_mm(dr, drs, pw["wq"][cols].t(), pw["ws"][_blocks(cols)].t(), 1, FP8_BLOCK)
        return part if dxn is None else dxn.add_(part)

    def wgrad(self, g_col, saved, cols, cfg, out, accumulate):
        (dc, dcs), (xc, xcs) = g_col, saved
        store(out, ref8.block_scaled_mm(dc.t(), dcs.t(), xc.t(), xcs.t(), 1, 1), accumulate)


class FP8BlockKernels(_FP8Block, Kernels):
    """Operands as the kernels lay them out: GEMM input (codes [T, K], scale_inv M-major [K/128, T]); saved xn
    (codes transposed [K, T_pad], scale_inv [T/128, K]); the query gradient's (codes [T, n], scale_inv M-major
    [n/128, T]) and (codes transposed [n, T_pad], scale_inv [T/128, n]). Padding codes are zero."""

    def prepare_weight(self, w, cfg, key):
        if isinstance(w, tuple):  # pre-quantized
            wq, ws = self._prequantized(w)
        else:
            from ..kernels.triton.fp8_block_quant import fp8_block_quantize_op

            # [N, K] codes, [N/128, K/128] scale_inv
            wq, ws = fp8_block_quantize_op(w.detach(), FP8_BLOCK, FP8_BLOCK, cfg.block_scale)
        tensors = {"wq": wq, "ws": ws}
        src = None if cute_gemm.serves(cfg, wq.device) else self.fused_rows(cfg, wq.device)
        if src is not None:  # the Triton GEMM's row order, per-row scale
            from ..kernels.triton.qproj_gemm import prepare_fused_weight_fp8

            tensors["fused"], tensors["fused_sinv"] = prepare_fused_weight_fp8(wq, ws, cfg, src)
        if cublas_blockwise(wq.device, cfg.out_features):
            tensors["wq_t"] = wq.t().contiguous()  # [K, N]: dgrad's B operand, column-major as cuBLAS wants
            tensors["ws_t"] = ws.t().contiguous()  # [K/128, N/128]
        return PreparedWeight(key, tensors)

    def norm_quant(self, x2d, norm_weight, cfg, save):
        from ..kernels._op import encoded
        from ..kernels.triton.rmsnorm_fp8_block import rmsnorm_fp8_block_fwd_op
        from .base import norm_arg

        rsigma, ad, asv, cd, cs = rmsnorm_fp8_block_fwd_op(x2d, norm_arg(x2d, norm_weight), encoded(cfg), save)
        return rsigma, (ad, asv), (cd, cs) if save else ()

    def forward_gemm(self, a, pw, cos_h, sin_h, cfg):
        from ..kernels._op import encoded

        ad, asv = a
        T = ad.shape[0]
        if cute_gemm.serves(cfg, ad.device):  # the warp-specialized CuTe DSL kernel (W in its own order)
            return cute_query(cute_gemm.rope_gemm_op(ad, asv, pw["wq"], pw["ws"], cos_h, sin_h, encoded(cfg)))
        if pw.get("fused") is not None:
            from ..kernels.triton.qproj_gemm import qproj_gemm_fp8_fwd_op

            outs = qproj_gemm_fp8_fwd_op(ad, asv, pw["fused"], pw["fused_sinv"], cos_h, sin_h, encoded(cfg))
            return query_outputs(*outs, T, cfg)
        # a geometry the fused epilogue does not cover: an fp32 GEMM, then the RoPE + output kernel
        if cublas_blockwise(ad.device, cfg.q_lora_rank):
            y = torch._scaled_mm(ad, pw["wq"].t(), scale_a=asv.t(), scale_b=pw["ws"].t(), out_dtype=torch.float32)
        else:
            y = ref8.block_scaled_mm(ad, asv.t(), pw["wq"], pw["ws"], 1, FP8_BLOCK)
        return rope_epilogue(y, cos_h, sin_h, cfg)

    def fused_launch(self, a, pw, cos_h, sin_h, cfg, out, config):
        from ..kernels.triton.qproj_gemm import qproj_gemm_fwd

        ad, asv = a
        qproj_gemm_fwd(ad, pw["fused"], cos_h, sin_h, cfg, a_scale_inv=asv, w_scale_inv=pw["fused_sinv"],
                       check=False, config=config, out=out)

    # sequence parallelism: the token-inner tensors (the input's M-major scale_inv [K/128, T], the saved transposed
    # codes [K, T]) are gathered as rank-major rows and re-laid out

    def input_from_wire(self, w, ranks: int, cfg: QProjConfig):
        codes, sinv = w  # sinv of `ranks` ranks as rank-major rows [ranks * K/128, n]
        return codes, rows_to_cols(sinv, ranks)

    def gathered_saved(self, g, par: Parallel, cfg: QProjConfig):
        cd, cs = super().gathered_saved(g, par, cfg)
        # transposed codes [K, T_local] (T_local a multiple of 128: no padding) and scale_inv [T_local/128, K]
        return rows_to_cols(cd, par.world), cs

    def grad_operands(self, dq2d, cos_h, sin_h, cfg):
        from ..kernels._op import encoded
        from ..kernels.triton.rope_fp8_block import rope_fp8_block_bwd_op

        dr, drs, dc, dcs = rope_fp8_block_bwd_op(dq2d, cos_h, sin_h, encoded(cfg))
        return (dr, drs), (dc, dcs)

    def dgrad(self, g_row, pw, cols, cfg, dxn):
        dr, drs = g_row
        nb = _blocks(cols)
        if cublas_blockwise(dr.device, cols.stop - cols.start) and "wq_t" in pw.tensors:
            b, sb = self._dgrad_weight(pw, cols, nb)
            part = torch._scaled_mm(dr, b, scale_a=drs.t(), scale_b=sb, out_dtype=torch.float32)
        else:
            part = ref8.block_scaled_mm(dr, drs.t(), pw["wq"][cols].t(), pw["ws"][nb].t(), 1, FP8_BLOCK)
        return part if dxn is None else dxn.add_(part)

    @staticmethod
    def _dgrad_weight(pw: PreparedWeight, cols: slice, nb: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """dgrad's B operand for the head group `cols` (cached per group): W^T's columns [K, n] as cuBLAS's
        column-major [n, K], and the 128x128 scale_inv as the [n/128, K/128] view of a [K/128, n/128] tensor."""
        key = ("dgrad", cols.start, cols.stop)
        if key not in pw.cache:
            wq_t, ws_t = pw["wq_t"], pw["ws_t"]
            whole = (cols.start, cols.stop) == (0, wq_t.shape[1])
            b = wq_t if whole else wq_t[:, cols].contiguous()
            sb = ws_t if whole else ws_t[:, nb].contiguous()
            pw.cache[key] = (b.t(), sb.t())
        return pw.cache[key]

    def wgrad(self, g_col, saved, cols, cfg, out, accumulate):
        (dc, dcs), (xc, xcs) = g_col, saved
        if cublas_blockwise(dc.device):
            # A = dy^T codes [n, T_pad] (row-major), B = xn^T codes [K, T_pad] as column-major [T_pad, K]; both in
            # 1x128 blocks along T: scale_a [n, T/128] (M-major view), scale_b the [T/128, K] tensor itself
            dw = torch._scaled_mm(dc, xc.t(), scale_a=dcs.t(), scale_b=xcs,
                                  out_dtype=torch.float32 if accumulate else out.dtype)
        else:
            dw = ref8.block_scaled_mm(dc, dcs.t(), xc, xcs.t(), 1, 1)
        store(out, dw, accumulate)


def _blocks(cols: slice) -> slice:
    """The 128-row blocks of W (and of its scale_inv grid) that the columns `cols` of N cover."""
    return slice(cols.start // FP8_BLOCK, -(-cols.stop // FP8_BLOCK))
