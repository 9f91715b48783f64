"""Benchmark FusedMLAQUpProjection against cuBLAS and the unfused compositions users run (DeepSeek-V3 query shape).

    python -m mla_qproj.bench [--tokens 1024,4096,16384,65536] [--out bench_out] [--results bench_results.jsonl]
                              [--shape v3 | v2-lite]

Shape (--shape v3, the default): q_lora_rank K=1536, 128 heads, qk_head_dim 128 + rope 64 = q_head_dim 192
(N = 24576); --shape v2-lite: DeepSeek-V2-Lite's norm-free query (hidden 2048 projected by q_proj to 16 heads of
128 + 64; our layer with norm=None, every peer without its RMSNorm, no accuracy table); x bf16 [T, K]
random normal, parameters bf16, prebuilt cos/sin fp32 [T, 64] (HF layout, positions 0..T-1).

Rows per T (all in one process, same inputs):
  cublas_bf16_gemm              x @ w.t() alone: every forward row's "t/cuBLAS" is its time over this one
  cublas_fp8_tensorwise_gemm    torch._scaled_mm, per-tensor scales, bf16 out (the FP8 rate with no block scales)
  cublas_fp8_blockwise_gemm     torch._scaled_mm, 1x128 (x) x 128x128 (W) blocks, bf16 out: the block-FP8 GEMM alone
  cute_fp8_rope_gemm            the CuTe DSL engine's block-FP8 GEMM with the RoPE epilogue alone, same operands
  cute_bf16_rope_gemm           the CuTe DSL engine's bf16-operand GEMM with the RoPE epilogue alone (bf16 query; the
  cute_bf16_mxfp8_gemm          mxfp8 / bf16 precisions' forward GEMM), on cublas_bf16_gemm's operands; MXFP8 query
  compiled_unfused_mxfp8        torch.compile(RMSNorm fp32 -> bf16 Linear -> DeepSeek RoPE -> MXFP8 rowwise quant)
  unfused_fp8_block             what a TransformerEngine + Megatron user runs for block FP8: torch.compile(RMSNorm ->
                                1x128 quantize), cuBLAS blockwise GEMM with bf16 output, then a compiled RoPE in place
                                on the rope columns only (as Megatron's fused_apply_mla_rope_for_q)
  ours_*                        FusedMLAQUpProjection forward, one knob changed per variant (*_triton: the same layer
                                with the CuTe DSL engine off, MLA_QPROJ_CUTE=0: the Triton kernels)
  ours_*_cudagraph              the same forward replayed from a CUDA graph (no per-call host work: the GPU time)
  compiled_unfused_bf16_fwdbwd  torch.compile(RMSNorm -> bf16 Linear -> DeepSeek RoPE), forward + backward
  unfused_fp8_block_fwdbwd      the block-FP8 trainer's step (TransformerEngine Float8BlockScaling's Linear between a
                                compiled RMSNorm and a compiled RoPE, autograd through them): 1x128 quantizes of xn
                                and of dy (both ways), three cuBLAS blockwise GEMMs (fprop and dgrad 1x128 x 128x128
                                against W's codes and their transpose, wgrad 1x128 x 128x128 against xn's transposed
                                codes); the weight's codes made once, as ours keeps them in its weight cache
  ours_*_fwdbwd                 ours forward + backward
Forward rows run under torch.no_grad() (inference); fwd+bwd rows use a random bf16 upstream gradient and get grads
for x, norm weight and weight. Every row is timed --rounds times round-robin (triton.testing.do_bench medians, L2
flushed before each call); the median over the rounds is reported with its spread; ratios are the median over the
rounds of the same round's ratio (the GPU's clock drifts over a run: same-round rows share it).
"t/cuBLAS" = ms / cublas_bf16_gemm ms; "t/block" = ms / cublas_fp8_blockwise_gemm ms (fp8_block rows);
"speed-up" = ms of the row's peer / ms. Peak memory (fwd+bwd rows): torch.cuda.max_memory_allocated over one call.
Accuracy (--accuracy-tokens): the query and the three gradients of each precision against an fp64 evaluation of the
unquantized math on the same inputs, relative error ||a - ref|| / ||ref||.
Results: printed, written to --out (bench.json, bench.png: forward and forward + backward panels, time relative to
cuBLAS bf16, lower is better) and appended as one JSON line to --results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._constants import DEEPSEEK_V3, E4M3_MAX, FLT_MAX
from .options import MXFP8Query
from .reference.mxfp8 import quantize_rowwise
from .reference.rope import apply_rope, build_rope_tables, rope_inv_freq
from .tensor import MXFP8Tensor

# the query geometries (K, H, qk_head_dim, rope) and whether the layer has its RMSNorm: DeepSeek-V3's normed
# bottleneck, and DeepSeek-V2-Lite's norm-free q_proj (q_lora_rank null: the hidden state, 2048 wide, projected
# straight to 16 heads; the layer built with norm=None, the peers without their RMSNorm)
SHAPES = {"v3": (DEEPSEEK_V3, True), "v2-lite": ((2048, 16, 128, 64), False)}
K, H, NOPE, ROPE = DEEPSEEK_V3
D = NOPE + ROPE
N = H * D
NORM = True
EPS = 1e-6


def set_shape(name: str) -> None:
    """Select the benchmarked geometry (module globals every row reads): one of SHAPES."""
    global K, H, NOPE, ROPE, D, N, NORM
    (K, H, NOPE, ROPE), NORM = SHAPES[name]
    D = NOPE + ROPE
    N = H * D


@dataclass
class Row:
    """One benchmarked configuration: `build(ctx)` returns (fn, tensors whose .grad is reset between calls)."""

    name: str
    kind: str  # "fwd" | "fwdbwd"
    ref: str | None  # peer the speed-up is measured against
    build: Callable[[dict], tuple[Callable[[], object], list[torch.Tensor]]]


# our layer's variants: name -> constructor arguments
VARIANTS = {
    "mxfp8": {},
    "mxfp8_posids": {},
    "mxfp8_colwise_out": {"output_format": MXFP8Query(columnwise=True)},
    "mxfp8_bf16_out": {"output_format": "bf16"},
    "mxfp8_triton": {},  # run with MLA_QPROJ_CUTE=0
    "bf16_gemm": {"precision": "bf16"},
    "bf16_gemm_triton": {"precision": "bf16"},
    "bf16": {"precision": "bf16", "output_format": "bf16"},  # the layer's defaults
    "bf16_triton": {"precision": "bf16", "output_format": "bf16"},
    "fp8_block": {"precision": "fp8_block", "output_format": "bf16"},
    "fp8_block_triton": {"precision": "fp8_block", "output_format": "bf16"},  # run with MLA_QPROJ_CUTE=0
    "fp8_block_mxfp8_out": {"precision": "fp8_block", "output_format": "mxfp8"},
}


def environment() -> dict:
    """Device, software versions and date, for the report and the JSON."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def gpu_state() -> str:
    """SM clock, power draw and temperature from nvidia-smi (empty when it is not there): printed before and after
    the run, since the chip's clock under sustained GEMM load is what moves same-work timings between rows."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader", "-i", str(torch.cuda.current_device())],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ------------------------------------------------------------------------------------------ unfused peers


def _rmsnorm_fp32(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * g in fp32 (x in fp32 for a norm-free shape)."""
    xf = x.float()
    if not NORM:
        return xf
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()


def _unfused_y(x, g, w, cos_h, sin_h) -> torch.Tensor:
    """RMSNorm (fp32) -> bf16 Linear -> DeepSeek (interleaved) RoPE in fp32; returns fp32 [T, H, D]."""
    y = F.linear(_rmsnorm_fp32(x, g).to(torch.bfloat16), w).view(x.shape[0], H, D)
    return apply_rope(y.float(), cos_h, sin_h, NOPE, ROPE, "deepseek")


def unfused_mxfp8(x, g, w, cos_h, sin_h) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused composition ending in an MXFP8 rowwise quantization (rceil): (fp8 data, uint8 scales)."""
    return quantize_rowwise(_unfused_y(x, g, w, cos_h, sin_h), "rceil")


def unfused_bf16(x, g, w, cos_h, sin_h) -> torch.Tensor:
    """The unfused composition without quantization: bf16 query [T, H, D]."""
    return _unfused_y(x, g, w, cos_h, sin_h).to(torch.bfloat16)


def quantize_blocks_pow2(t: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 of a 2-D fp32 tensor (dims multiples of the block) with power-of-two scales (TE's Hopper
    default): (codes fp8 [M, N], scale_inv fp32 [M / bm, N / bn]). Plain torch ops, so torch.compile fuses them."""
    M_, N_ = t.shape
    b = t.reshape(M_ // bm, bm, N_ // bn, bn)
    amax = b.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale.clamp(max=FLT_MAX))))
    codes = (b * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(M_, N_).contiguous()
    return codes, (1.0 / scale).reshape(M_ // bm, N_ // bn).contiguous()  # row-major (t may be a transposed view)


def fp8_block_norm_quant(x, g) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm -> 1x128 FP8 of xn (the peer's first, compiled step)."""
    return quantize_blocks_pow2(_rmsnorm_fp32(x, g), 1, 128)


def rope_in_place(q: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor) -> None:
    """DeepSeek RoPE on the rope columns of a bf16 query [T, H, D] in place (the pass-through columns are not
    touched): interleaved pairs in, halves out."""
    r = q[..., NOPE:NOPE + ROPE].float()
    a, b = r[..., 0::2], r[..., 1::2]
    c, s = cos_h[:, None, :], sin_h[:, None, :]
    q[..., NOPE:NOPE + ROPE] = torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(q.dtype)


def blockwise_gemm(a, sa, wq, ws) -> torch.Tensor:
    """cuBLAS 1x128 x 128x128 FP8 GEMM, bf16 out: a [T, K] fp8 with sa [T, K/128] (passed M-major), W [N, K] fp8
    with ws [N/128, K/128] (passed as its [K/128, N/128] view)."""
    return torch._scaled_mm(a, wq.t(), scale_a=sa.t().contiguous().t(), scale_b=ws.t(), out_dtype=torch.bfloat16)


class BlockFp8Linear(torch.autograd.Function):
    """y = xn · Wᵀ with every GEMM operand block-FP8, as TransformerEngine's Float8BlockScaling runs it on Hopper:
    1x128 blocks along each GEMM's K for xn and dy, W in 128x128 blocks, cuBLAS's blockwise GEMMs, bf16 results. The
    wgrad GEMM takes xn's transposed copy in 128x128 blocks (TE: 1x128 along T), as torch._scaled_mm on sm_90 (torch
    2.11, CUDA 13) rejects 1x128 x 128x1 operands. q, q_tile: the compiled 1x128 and 128x128 quantizers."""

    @staticmethod
    def forward(ctx, xn, w, wq, ws, wq_t, q, q_tile):
        a, sa = q(xn)  # [T, K], 1x128 along K
        a_t, ga_t = q_tile(xn.t())  # [K, T] codes, [K/128, T/128]: wgrad's operand
        ctx.save_for_backward(a_t, ga_t, wq_t, ws)
        ctx.q = q
        return blockwise_gemm(a, sa, wq, ws)

    @staticmethod
    def backward(ctx, dy):
        a_t, ga_t, wq_t, ws = ctx.saved_tensors
        d, sd = ctx.q(dy)  # [T, N], 1x128 along N
        dxn = torch._scaled_mm(d, wq_t.t(), scale_a=sd.t().contiguous().t(), scale_b=ws.t().contiguous().t(),
                               out_dtype=torch.bfloat16)
        d_t, sd_t = ctx.q(dy.t())  # [N, T], 1x128 along T
        dw = torch._scaled_mm(d_t, a_t.t(), scale_a=sd_t.t().contiguous().t(), scale_b=ga_t.t(),
                              out_dtype=torch.bfloat16)
        return dxn, dw, None, None, None, None, None


def _rope_bf16(y: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor) -> torch.Tensor:
    """DeepSeek RoPE of a bf16 query [T, H, D] (fp32 math, bf16 out), differentiable."""
    return apply_rope(y.float(), cos_h, sin_h, NOPE, ROPE, "deepseek").to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------- rows


def triton_engine(fn: Callable) -> Callable:
    """fn with the CuTe DSL engine switched off (MLA_QPROJ_CUTE=0) for its calls: the Triton kernels' figures."""
    def call():
        old = os.environ.get("MLA_QPROJ_CUTE")
        os.environ["MLA_QPROJ_CUTE"] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["MLA_QPROJ_CUTE"]
            else:
                os.environ["MLA_QPROJ_CUTE"] = old

    return call


def make_rows(layers: dict, compile_mode: str) -> list[Row]:
    """All rows; `layers` maps variant name -> FusedMLAQUpProjection (or an exception if ours is unavailable)."""
    # the peers' compiled quantizers see several shapes per T (x, dy, their transposes): past dynamo's default of 8
    # recompiles a function falls back to eager, which made the block-FP8 fwd+bwd peer 2.6x slower at the third T
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    c_mx = torch.compile(unfused_mxfp8, dynamic=False, mode=compile_mode)
    c_bf = torch.compile(unfused_bf16, dynamic=False, mode=compile_mode)
    c_nq = torch.compile(fp8_block_norm_quant, dynamic=False, mode=compile_mode)
    c_rope = torch.compile(rope_in_place, dynamic=False, mode=compile_mode)
    c_norm = torch.compile(_rmsnorm_fp32, dynamic=False, mode=compile_mode)
    c_q = torch.compile(lambda t: quantize_blocks_pow2(t.float(), 1, 128), dynamic=False, mode=compile_mode)
    c_q_tile = torch.compile(lambda t: quantize_blocks_pow2(t.float(), 128, 128), dynamic=False, mode=compile_mode)
    c_rope_ad = torch.compile(_rope_bf16, dynamic=False, mode=compile_mode)

    def layer_of(variant: str):
        layer = layers[variant]
        if isinstance(layer, Exception):
            raise layer
        return layer

    def ours(variant: str) -> Callable:
        def build(c):
            layer = layer_of(variant)
            if variant.endswith("_posids"):
                return (lambda: layer(c["x"], position_ids=c["pos"])), []
            if variant.endswith("_triton"):  # the Triton engine of the same layer (the CuTe DSL engine disabled)
                return triton_engine(lambda: layer(c["x"], c["cos"], c["sin"])), []
            return (lambda: layer(c["x"], c["cos"], c["sin"])), []

        return build

    def ours_graph(variant: str) -> Callable:
        """The forward captured in a CUDA graph (what torch.compile(mode="reduce-overhead") or a user's graph gives):
        the GPU time without the per-call host work (Python, launches), which bounds small T."""
        def build(c):
            layer = layer_of(variant)
            with torch.no_grad():
                layer(c["x"], c["cos"], c["sin"])  # compiled kernels and the weight cache exist before capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    q = layer(c["x"], c["cos"], c["sin"])
            c["_graph_" + variant] = (graph, q)  # keep the graph's outputs alive
            return graph.replay, []

        return build

    def ours_fwdbwd(variant: str) -> Callable:
        def build(c):
            layer = layer_of(variant)
            xr = c["x"].detach().clone().requires_grad_(True)

            def fn():
                layer(xr, c["cos"], c["sin"]).backward(c["dy"])  # an MXFP8Tensor takes the dense gradient too

            params = [layer.weight, layer.norm_weight] if NORM else [layer.weight]
            return (triton_engine(fn) if variant.endswith("_triton") else fn), [xr, *params]

        return build

    def compiled_fwdbwd(c):
        xr = c["x"].detach().clone().requires_grad_(True)
        gr = c["g"].detach().clone().requires_grad_(True)
        wr = c["w"].detach().clone().requires_grad_(True)
        return (lambda: c_bf(xr, gr, wr, c["cos_h"], c["sin_h"]).backward(c["dy"])), [xr, gr, wr]

    def tensorwise(c):
        a8 = c["x"].to(torch.float8_e4m3fn)
        w8 = c["w"].to(torch.float8_e4m3fn)
        one = torch.ones((), device=a8.device)
        return (lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), []

    def blockwise(c):
        a, sa = quantize_blocks_pow2(c["x"].float(), 1, 128)
        return (lambda: blockwise_gemm(a, sa, c["wq"], c["ws"])), []

    def cute_gemm(precision: str, query: str = "bf16") -> Callable:
        def build(c):
            """The CuTe DSL engine's GEMM + RoPE epilogue alone: fp8_block codes on cublas_fp8_blockwise_gemm's
            operands, or bf16 ones (the mxfp8 / bf16 forward's) on cublas_bf16_gemm's."""
            from ._config import QProjConfig
            from .kernels.cute import rope_gemm

            cfg = QProjConfig(K, H, NOPE, ROPE, D, precision=precision, output_format=query)
            if not rope_gemm.serves(cfg, c["x"].device):
                raise RuntimeError("the CuTe DSL engine does not serve this config here")
            if precision == "fp8_block":
                a, sa = quantize_blocks_pow2(c["x"].float(), 1, 128)
                args = (a, sa.t().contiguous(), c["wq"], c["ws"])  # scale_inv M-major [K/128, T]
            else:
                args = (c["x"], None, c["w"], None)
            return (lambda: rope_gemm.rope_gemm(*args, c["cos_h"], c["sin_h"], cfg)), []
        return build

    def unfused_fp8(c):
        T = c["x"].shape[0]

        def fn():
            a, sa = c_nq(c["x"], c["g"])
            q = blockwise_gemm(a, sa, c["wq"], c["ws"]).view(T, H, D)
            c_rope(q, c["cos_h"], c["sin_h"])
            return q

        return fn, []

    def unfused_fp8_fwdbwd(c):
        T = c["x"].shape[0]
        xr = c["x"].detach().clone().requires_grad_(True)
        gr = c["g"].detach().clone().requires_grad_(True)
        wr = c["w"].detach().clone().requires_grad_(True)
        wq_t = c["wq"].t().contiguous()  # [K, N]: dgrad's operand, W's codes transposed (the 128x128 grid is too)

        def fn():
            y = BlockFp8Linear.apply(c_norm(xr, gr), wr, c["wq"], c["ws"], wq_t, c_q, c_q_tile)
            c_rope_ad(y.view(T, H, D), c["cos_h"], c["sin_h"]).backward(c["dy"])

        return fn, [xr, gr, wr]

    mx_peer, fp8_peer, bwd_peer = "compiled_unfused_mxfp8", "unfused_fp8_block", "compiled_unfused_bf16_fwdbwd"
    fp8_bwd_peer = "unfused_fp8_block_fwdbwd"
    return [
        Row("cublas_bf16_gemm", "fwd", None, lambda c: ((lambda: c["x"] @ c["w"].t()), [])),
        Row("cublas_fp8_tensorwise_gemm", "fwd", None, tensorwise),
        Row("cublas_fp8_blockwise_gemm", "fwd", None, blockwise),
        Row("cute_fp8_rope_gemm", "fwd", None, cute_gemm("fp8_block")),
        Row("cute_bf16_rope_gemm", "fwd", None, cute_gemm("mxfp8")),
        Row("cute_bf16_mxfp8_gemm", "fwd", None, cute_gemm("mxfp8", "mxfp8")),
        Row(mx_peer, "fwd", None, lambda c: ((lambda: c_mx(c["x"], c["g"], c["w"], c["cos_h"], c["sin_h"])), [])),
        Row(fp8_peer, "fwd", None, unfused_fp8),
        Row("ours_mxfp8", "fwd", mx_peer, ours("mxfp8")),
        Row("ours_mxfp8_triton", "fwd", mx_peer, ours("mxfp8_triton")),
        Row("ours_mxfp8_posids", "fwd", mx_peer, ours("mxfp8_posids")),
        Row("ours_mxfp8_cudagraph", "fwd", mx_peer, ours_graph("mxfp8")),
        Row("ours_mxfp8_colwise_out", "fwd", None, ours("mxfp8_colwise_out")),
        Row("ours_mxfp8_bf16_out", "fwd", None, ours("mxfp8_bf16_out")),
        Row("ours_bf16_gemm", "fwd", mx_peer, ours("bf16_gemm")),
        Row("ours_bf16_gemm_triton", "fwd", mx_peer, ours("bf16_gemm_triton")),
        Row("ours_bf16", "fwd", None, ours("bf16")),
        Row("ours_bf16_triton", "fwd", None, ours("bf16_triton")),
        Row("ours_fp8_block", "fwd", fp8_peer, ours("fp8_block")),
        Row("ours_fp8_block_cudagraph", "fwd", fp8_peer, ours_graph("fp8_block")),
        Row("ours_fp8_block_triton", "fwd", fp8_peer, ours("fp8_block_triton")),
        Row("ours_fp8_block_mxfp8_out", "fwd", fp8_peer, ours("fp8_block_mxfp8_out")),
        Row(bwd_peer, "fwdbwd", None, compiled_fwdbwd),
        Row("ours_mxfp8_fwdbwd", "fwdbwd", bwd_peer, ours_fwdbwd("mxfp8")),
        Row("ours_bf16_gemm_fwdbwd", "fwdbwd", bwd_peer, ours_fwdbwd("bf16_gemm")),
        Row(fp8_bwd_peer, "fwdbwd", bwd_peer, unfused_fp8_fwdbwd),
        Row("ours_fp8_block_fwdbwd", "fwdbwd", fp8_bwd_peer, ours_fwdbwd("fp8_block")),
        Row("ours_fp8_block_triton_fwdbwd", "fwdbwd", fp8_bwd_peer, ours_fwdbwd("fp8_block_triton")),
    ]


def make_layers(device: torch.device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Our layer in each variant, all with the same random bf16 weight and norm weight; returns (layers, w, g).
    A variant that fails to construct is stored as its exception (reported per row)."""
    w = (torch.randn(N, K, device=device) * K**-0.5).to(torch.bfloat16)
    g = (1.0 + 0.1 * torch.randn(K, device=device)).to(torch.bfloat16)
    layers: dict = {}
    try:
        from . import FusedMLAQUpProjection
    except Exception as e:  # the module is not there: the peers still run
        return {v: e for v in VARIANTS}, w, g
    for variant, kw in VARIANTS.items():
        try:
            kw = {"precision": "mxfp8", "output_format": "mxfp8", **kw}
            layer = FusedMLAQUpProjection(K, H, NOPE, ROPE, device=device, dtype=torch.bfloat16,
                                          norm="rmsnorm" if NORM else None, **kw)
            with torch.no_grad():
                layer.weight.copy_(w)
                if NORM:
                    layer.norm_weight.copy_(g)
            layers[variant] = layer
        except Exception as e:
            layers[variant] = e
    return layers, w, g


def measure_peak(fn: Callable, grads: list[torch.Tensor]) -> tuple[float, float]:
    """(peak MiB, peak minus baseline MiB) of one call of fn, grads cleared first."""
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    for t in grads:
        t.grad = None
    return peak / 2**20, (peak - base) / 2**20


def build_row(row: Row, c: dict) -> tuple[Callable | None, list[torch.Tensor], str | None]:
    """(fn, tensors whose .grad is reset, None) or (None, [], error message): a failing build is a result."""
    try:
        fn, grads = row.build(c)
        return fn, grads, None
    except Exception as e:  # a failing peer (compile error, OOM, missing module) is a result, not a crash
        return None, [], _err(e)


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def time_row(row: Row, fn: Callable, grads: list[torch.Tensor], warmup: int, rep: int) -> tuple[float, float, float]:
    """do_bench (median, p20, p80) of one row, under no_grad for forward rows."""
    from triton.testing import do_bench

    ctx = torch.no_grad() if row.kind == "fwd" else torch.enable_grad()
    with ctx:
        return tuple(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads or None, quantiles=[0.5, 0.2, 0.8]))


def bench_T(rows: list[Row], c: dict, warmup: int, rep: int, rounds: int) -> list[dict]:
    """Every row at one T, `rounds` times round-robin (the GPU's clock and thermal state drift over a run: each
    round times every row once, so a row and its peer see the same conditions); ms = median over the rounds of
    each round's do_bench median, ms_rounds keeps them all. Errors are recorded, never raised."""
    T = c["x"].shape[0]
    built = [(row, *build_row(row, c)) for row in rows]
    res = {row.name: {"T": T, "name": row.name, "kind": row.kind, "ref": row.ref, "ms_rounds": [],
                      "p20_ms_rounds": [], "p80_ms_rounds": []} for row in rows}
    for rnd in range(rounds):
        for row, fn, grads, err in built:
            r = res[row.name]
            if err is not None or "error" in r:
                r.setdefault("error", err)
                continue
            try:
                ms, p20, p80 = time_row(row, fn, grads, warmup, rep)
                r["ms_rounds"].append(ms)
                r["p20_ms_rounds"].append(p20)
                r["p80_ms_rounds"].append(p80)
                print(f"  T={T:<6} round {rnd} {row.name:<30} {ms:.3f} ms", flush=True)
            except Exception as e:
                r["error"] = _err(e)
                print(f"  T={T:<6} round {rnd} {row.name:<30} {r['error']}", flush=True)
    out = []
    for row, fn, grads, _ in built:
        r = res[row.name]
        if "error" not in r:
            try:
                if row.kind == "fwdbwd":
                    with torch.enable_grad():
                        r["peak_mib"], r["peak_extra_mib"] = measure_peak(fn, grads)
                v = r["ms_rounds"]
                r["ms"] = _median(v)
                r["spread"] = (max(v) - min(v)) / r["ms"]
                gemms = 1 if row.kind == "fwd" else 3
                r["tflops"] = gemms * 2 * T * K * N / (r["ms"] * 1e-3) / 1e12
            except Exception as e:
                r["error"] = _err(e)
        torch.cuda.synchronize()
        out.append(r)
    return out


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def _same_round_ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's time over b's time in the same round."""
    return _median([x / y for x, y in zip(a["ms_rounds"], b["ms_rounds"], strict=False)])


def add_ratios(results: list[dict]) -> None:
    """t/cuBLAS (forward rows), t/block (fp8_block rows) and the speed-up over the row's peer, in place."""
    by = {(r["T"], r["name"]): r for r in results}
    for r in results:
        if "ms" not in r:
            continue
        cub, blk = by.get((r["T"], "cublas_bf16_gemm"), {}), by.get((r["T"], "cublas_fp8_blockwise_gemm"), {})
        ref = by.get((r["T"], r["ref"]), {})
        if "ms" in cub:
            # fwd+bwd rows: relative to the forward GEMM too (the chart's common unit)
            r["vs_cublas"] = _same_round_ratio(r, cub)
        if ("fp8_block" in r["name"] or r["name"] == "cute_fp8_rope_gemm") and r["kind"] == "fwd" and "ms" in blk:
            r["vs_blockwise"] = _same_round_ratio(r, blk)
        if "ms" in ref:
            r["speedup"] = 1.0 / _same_round_ratio(r, ref)


def format_table(results: list[dict]) -> str:
    """Fixed-width plain-text table (errors listed below it)."""
    head = (f"{'T':>6}  {'impl':<30}{'ms':>9}{'spread':>8}{'TFLOP/s':>9}{'t/cuBLAS':>9}{'t/block':>8}{'speed-up':>9}"
            f"{'peak MiB':>10}{'+MiB':>9}")
    lines, errs = [head, "-" * len(head)], []
    for r in results:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"

        if "error" in r:
            errs.append(f"  T={r['T']} {r['name']}: {r['error']}")
            lines.append(f"{r['T']:>6}  {r['name']:<30}{'ERROR (see below)':>18}")
            continue
        spread = f"{100 * r['spread']:.1f}%" if "spread" in r else "-"
        lines.append(f"{r['T']:>6}  {r['name']:<30}{f('ms', '.3f'):>9}{spread:>8}{f('tflops', '.1f'):>9}"
                     f"{f('vs_cublas', '.2f'):>9}{f('vs_blockwise', '.2f'):>8}{f('speedup', '.2f'):>9}"
                     f"{f('peak_mib', '.0f'):>10}{f('peak_extra_mib', '.0f'):>9}")
    return "\n".join(lines + (["errors:"] + errs if errs else []))


def _style(name: str) -> dict:
    """Bar colour and hatch: peers in greys (hatched), ours by precision."""
    if not name.startswith("ours"):
        greys = {"cublas_bf16_gemm": "0.1", "cublas_fp8_tensorwise_gemm": "0.3", "cublas_fp8_blockwise_gemm": "0.45",
                 "compiled_unfused_mxfp8": "0.6", "unfused_fp8_block": "0.8", "cute_fp8_rope_gemm": "0.9",
                 "unfused_fp8_block_fwdbwd": "0.5", "cute_bf16_rope_gemm": "0.7", "cute_bf16_mxfp8_gemm": "0.35"}
        return {"color": greys.get(name, "0.75"), "hatch": "//" if name.startswith(("compiled", "unfused")) else ""}
    palette = {"fp8_block": "tab:red", "bf16_gemm": "tab:green", "mxfp8": "tab:blue", "bf16": "tab:olive"}
    color = next(c for key, c in palette.items() if key in name)
    # one knob, one hatch
    hatches = {"cudagraph": "..", "posids": "\\\\", "colwise": "oo", "_out": "xx", "triton": "--"}
    return {"color": color, "hatch": next((h for key, h in hatches.items() if key in name), "")}


def plot(results: list[dict], path: str, device: str) -> str | None:
    """Two panels (forward; forward + backward): time relative to the cuBLAS bf16 GEMM of the same T (lower is
    better), one bar per row and T. Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    Ts = sorted({r["T"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(4 + 3.6 * len(Ts), 7), gridspec_kw={"width_ratios": [2.5, 1]})
    for ax, kind, title in zip(axes, ("fwd", "fwdbwd"), ("forward", "forward + backward"), strict=True):
        names = list(dict.fromkeys(r["name"] for r in results if r["kind"] == kind and "vs_cublas" in r))
        val = {(r["T"], r["name"]): r["vs_cublas"] for r in results if "vs_cublas" in r}
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(Ts))]
            ax.bar(xs, [val.get((t, name), 0.0) for t in Ts], width, label=name, edgecolor="white", linewidth=0.3,
                   **_style(name))
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(Ts)), [f"T={t}" for t in Ts])
        note = "\n(forward + backward is three GEMMs of work)" if kind == "fwdbwd" else ""
        ax.set_ylabel(f"time / cuBLAS bf16 GEMM of the same T, lower is better{note}")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3 if kind == "fwd" else 1)
    fig.suptitle(f"MLA query up-projection, K={K}, H={H}, D={D} ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- accuracy


def accuracy(layers: dict, w: torch.Tensor, g: torch.Tensor, T: int) -> list[dict]:
    """Relative error of the query and of dx, dnorm_weight, dweight of each precision (bf16 query) against fp64
    evaluations of the unquantized math on the same inputs and upstream gradient."""
    dev = w.device
    c = make_inputs(T, w, g, dev)
    x64 = c["x"].double().requires_grad_(True)
    g64 = c["g"].double().requires_grad_(True)
    w64 = c["w"].double().requires_grad_(True)
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * g64
    y = apply_rope((xn @ w64.t()).view(T, H, D), c["cos_h"].double(), c["sin_h"].double(), NOPE, ROPE, "deepseek")
    y.backward(c["dy"].double())
    ref = {"q": y.detach(), "dx": x64.grad, "dnorm_weight": g64.grad, "dweight": w64.grad}
    out = []
    for variant in ("mxfp8_bf16_out", "bf16_gemm", "fp8_block", "mxfp8"):
        layer = layers.get(variant)
        if layer is None or isinstance(layer, Exception):
            out.append({"variant": variant, "error": _err(layer) if layer is not None else "missing"})
            continue
        xr = c["x"].detach().clone().requires_grad_(True)
        q = layer(xr, c["cos"], c["sin"])
        qd = q.dequantize(torch.float32) if isinstance(q, MXFP8Tensor) else q.float()
        layer.zero_grad(set_to_none=True)
        qd.backward(c["dy"].float())
        got = {"q": qd.detach(), "dx": xr.grad, "dnorm_weight": layer.norm_weight.grad, "dweight": layer.weight.grad}
        rec = {"variant": variant, "T": T}
        for k, v in got.items():
            rec[k] = ((v.double() - ref[k]).norm() / ref[k].norm()).item()
        layer.zero_grad(set_to_none=True)
        out.append(rec)
    return out


def format_accuracy(acc: list[dict]) -> str:
    lines = [f"{'variant':<20}{'q':>10}{'dx':>10}{'dnorm_w':>10}{'dweight':>10}   (rel. error vs fp64)"]
    for r in acc:
        if "error" in r:
            lines.append(f"{r['variant']:<20}{r['error']}")
        else:
            lines.append(f"{r['variant']:<20}" + "".join(f"{r[k]:>10.2e}" for k in ("q", "dx", "dnorm_weight",
                                                                                       "dweight")))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main


def make_inputs(T: int, w: torch.Tensor, g: torch.Tensor, device: torch.device) -> dict:
    """Random inputs for one T: x bf16 [T, K], upstream grad dy bf16 [T, H, D], positions and fp32 tables, and
    the weight's 128x128 block FP8 for the cuBLAS rows."""
    pos = torch.arange(T, device=device)
    inv_freq, scaling = rope_inv_freq(ROPE, 10000.0, None)
    cos, sin = build_rope_tables(pos, inv_freq, scaling)  # fp32 [T, 64], HF cat(freqs, freqs)
    wq, ws = quantize_blocks_pow2(w.float(), 128, 128)
    return {
        "x": torch.randn(T, K, device=device).to(torch.bfloat16),
        "dy": torch.randn(T, H, D, device=device).to(torch.bfloat16),
        "w": w, "g": g, "pos": pos, "cos": cos, "sin": sin, "wq": wq, "ws": ws,
        "cos_h": cos[:, : ROPE // 2].contiguous(), "sin_h": sin[:, : ROPE // 2].contiguous(),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m mla_qproj.bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default="1024,4096,16384,65536", help="comma-separated T values")
    p.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    p.add_argument("--results", default="bench_results.jsonl", help="JSON-lines file the run is appended to ('' "
                   "to skip)")
    p.add_argument("--quick", action="store_true", help="T in {1024, 4096} only")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of the peers")
    p.add_argument("--rounds", type=int, default=3, help="times every row is timed, round-robin (median reported)")
    p.add_argument("--accuracy-tokens", type=int, default=4096, help="T of the accuracy table (0 to skip)")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
    p.add_argument("--shape", default="v3", choices=sorted(SHAPES),
                   help="v3: DeepSeek-V3's query (RMSNorm, K 1536, 128 heads); v2-lite: DeepSeek-V2-Lite's norm-free "
                   "q_proj (K 2048, 16 heads; no accuracy table)")
    args = p.parse_args(argv)
    set_shape(args.shape)
    if not NORM:
        args.accuracy_tokens = 0  # its fp64 reference is the normed layer's
    if not torch.cuda.is_available():
        print("mla_qproj.bench: no CUDA GPU found; this benchmark needs one.", file=sys.stderr)
        return 2
    tokens = [1024, 4096] if args.quick else [int(t) for t in args.tokens.split(",") if t.strip()]
    device = torch.device("cuda")
    torch.manual_seed(0)
    env = environment()
    for k in ("device", "capability", "torch", "triton", "cuda", "date"):
        print(f"{k:>10}: {env[k]}")
    env["gpu_state_before"] = gpu_state()
    print(f"gpu state (sm clock, max sm clock, power, temperature): {env['gpu_state_before']}")
    layers, w, g = make_layers(device)
    rows = make_rows(layers, args.compile_mode)
    if args.rows:
        keep = set(args.rows.split(","))
        rows = [r for r in rows if r.name in keep or r.name == "cublas_bf16_gemm"]
    results = []
    for T in tokens:
        c = make_inputs(T, w, g, device)
        results += bench_T(rows, c, args.warmup, args.rep, args.rounds)
        del c
        torch.cuda.empty_cache()
    add_ratios(results)
    env["gpu_state_after"] = gpu_state()
    print(f"gpu state after: {env['gpu_state_after']}")
    acc = accuracy(layers, w, g, args.accuracy_tokens) if args.accuracy_tokens else []
    os.makedirs(args.out, exist_ok=True)
    png = plot(results, os.path.join(args.out, "bench.png"), env["device"])
    meta = {"shape": args.shape, "norm": NORM, "K": K, "H": H, "qk_head_dim": NOPE, "rope_dim": ROPE,
            "q_head_dim": D, "N": N,
            "warmup_ms": args.warmup, "rep_ms": args.rep, "rounds": args.rounds, "compile_mode": args.compile_mode,
            "forward_rows_under": "torch.no_grad()", "command": " ".join(["python -m mla_qproj.bench"] + (argv or
                                                                                                   sys.argv[1:])),
            "ours_layer_errors": {v: repr(e) for v, e in layers.items() if isinstance(e, Exception)}}
    record = {"environment": env, "settings": meta, "results": results, "accuracy": acc}
    with open(os.path.join(args.out, "bench.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    if args.results:
        with open(args.results, "a") as fh:
            fh.write(json.dumps({"run": env["date"] + " " + env["device"], **record}, sort_keys=True,
                                separators=(",", ":")) + "\n")
    print(f"wrote {os.path.join(args.out, 'bench.json')}" + (f" and {png}" if png else " (no matplotlib: no PNG)")
          + (f"; appended to {args.results}" if args.results else ""))
    print(f"forward rows under torch.no_grad(); median over {args.rounds} round-robin rounds of do_bench medians "
          "(spread: max - min over the rounds, of the median); ratios: median of the same round's ratios\n")
    print(format_table(results))
    if acc:
        print(f"\naccuracy at T = {args.accuracy_tokens} (bf16 query unless the variant says mxfp8):")
        print(format_accuracy(acc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
