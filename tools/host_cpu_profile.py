"""Host (Python) time of the layer's no-grad forward on a machine without a GPU: the Triton kernels are replaced by
no-op launches, so what remains is the module's, the autograd-free path's and the launchers' own Python (argument
checks, allocations, tensor descriptors, the query object). Triton's launch itself is not included; on the GPU
`tools/profile_layer.py` measures the whole thing (host time per call included).

Beside it, in the same run, the eager unfused composition a user would otherwise call (RMSNorm, Linear, DeepSeek
RoPE in plain torch ops, as HF transformers writes them) on tensors small enough that its time is its host time: the
ratio is the layer's host cost against the composition's. Forward + backward is timed the same way at the
composition's small geometry (every Triton kernel stubbed, a bf16 query; the GEMMs that torch runs on the CPU at that
size cost about what the composition's Linear does), against the composition's forward + backward under autograd.

    python tools/host_cpu_profile.py [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path (whose kernels are stubbed below)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mla_qproj import FusedMLAQUpProjection  # noqa: E402
from mla_qproj._constants import DEEPSEEK_V3  # noqa: E402
from mla_qproj.kernels.triton import qproj_gemm as qg  # noqa: E402
from mla_qproj.kernels.triton import rmsnorm_quant as rq  # noqa: E402
from mla_qproj.recipes.base import PreparedWeight  # noqa: E402

T = 4096
K, H, P, R = DEEPSEEK_V3
N = H * (P + R)


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _layer(precision: str) -> FusedMLAQUpProjection:
    """The V3-shape layer with a stand-in prepared weight in the fused kernel's layout (quantizing W would run the
    interpreter)."""
    layer = FusedMLAQUpProjection(K, H, P, R, dtype=torch.bfloat16, precision=precision, output_format="bf16"
                                  if precision == "fp8_block" else "mxfp8")
    cfg = layer.cfg
    if precision == "fp8_block":
        src = qg.fused_row_source(cfg, "fp8_block")
        wq, ws = torch.zeros(N, K, dtype=torch.float8_e4m3fn), torch.ones(N // 128, K // 128)
        fused, fused_sinv = qg.prepare_fused_weight_fp8(wq, ws, cfg, src)
        pw = PreparedWeight((), {"wq": wq, "ws": ws, "fused": fused, "fused_sinv": fused_sinv})
    else:
        pw = PreparedWeight((), {"fused": torch.zeros(qg.fused_layout(cfg)[2], K, dtype=torch.bfloat16)})
    layer._prepared_weight = lambda recipe: pw
    return layer


def composition(x, g, w, cos, sin, H: int, P: int, R: int):
    """RMSNorm (fp32) -> Linear -> DeepSeek RoPE on the rope columns, eager torch ops (HF DeepseekV3's order: the
    interleaved pairs de-interleaved, then rotate_half)."""
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()).to(x.dtype)
    q = torch.nn.functional.linear(xn, w).view(x.shape[0], H, -1)
    q_nope, q_pe = q[..., :P], q[..., P:P + R]
    q_pe = q_pe.reshape(*q_pe.shape[:-1], R // 2, 2).transpose(-1, -2).reshape(q_pe.shape)
    c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
    rot = torch.cat((-q_pe[..., R // 2:], q_pe[..., : R // 2]), dim=-1)
    return torch.cat((q_nope, q_pe * c + rot * s), dim=-1)


def _stub_all_kernels() -> None:
    """Every Triton kernel of the package (`*_kernel` JIT functions, in every module that holds a name for one)
    becomes a no-op launch."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import mla_qproj.kernels.triton as kp

    for m in pkgutil.iter_modules(kp.__path__):
        if m.ispkg:
            continue
        mod = importlib.import_module(f"mla_qproj.kernels.triton.{m.name}")
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") and isinstance(obj, (JITFunction, InterpretedFunction)):
                setattr(mod, name, _NoLaunch())


def fwd_bwd_host(t: int, k: int, h: int, p: int, r: int) -> dict[str, float]:
    """us per forward + backward: the layer (both precisions, bf16 query, kernels stubbed) and the composition."""
    torch.manual_seed(0)
    xs = torch.randn(t, k).to(torch.bfloat16).requires_grad_(True)
    gs = torch.ones(k, dtype=torch.bfloat16, requires_grad=True)
    ws = torch.randn(h * (p + r), k).to(torch.bfloat16).requires_grad_(True)
    cs, ss = torch.randn(t, r), torch.randn(t, r)
    dy = torch.randn(t, h, p + r).to(torch.bfloat16)

    def comp():
        composition(xs, gs, ws, cs, ss, h, p, r).backward(dy)

    got = {"composition": per_call_us(comp, n=500)}
    for prec in ("mxfp8", "fp8_block"):
        layer = FusedMLAQUpProjection(k, h, p, r, dtype=torch.bfloat16, precision=prec, output_format="bf16")
        got[prec] = per_call_us(lambda layer=layer: layer(xs, cs, ss).backward(dy), n=500)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the layers' forward")
    args = ap.parse_args()
    _stub_all_kernels()
    x = torch.randn(T, K).to(torch.bfloat16)
    cos, sin = torch.randn(T, R), torch.randn(T, R)
    layers = {p: _layer(p) for p in ("mxfp8", "fp8_block")}
    with torch.no_grad():
        for p, layer in layers.items():
            print(f"no-grad layer forward, {p}: {per_call_us(lambda layer=layer: layer(x, cos, sin)):.1f} us/call "
                  "(kernels stubbed)")
        cfg = layers["mxfp8"].cfg
        a, wp = torch.empty(T, K, dtype=torch.bfloat16), layers["mxfp8"]._prepared_weight(True)["fused"]
        c, s = cos[:, : R // 2].contiguous(), sin[:, : R // 2].contiguous()
        g = torch.ones(K, dtype=torch.bfloat16)
        print(f"qproj_gemm_fwd launcher: {per_call_us(lambda: qg.qproj_gemm_fwd(a, wp, c, s, cfg)):.1f} us/call")
        print(f"rmsnorm_quant_fwd launcher: "
              f"{per_call_us(lambda: rq.rmsnorm_quant_fwd(x, g, 1e-6, False, 'mxfp8', 'rceil', False)):.1f} us/call")
        # the composition's host time: 16 tokens, K = 128, 2 heads of 32 + 32 (its arithmetic is negligible there)
        t, k, h, p, r = 16, 128, 2, 32, 32
        xs, gs = torch.randn(t, k).to(torch.bfloat16), torch.ones(k, dtype=torch.bfloat16)
        ws = torch.randn(h * (p + r), k).to(torch.bfloat16)
        cs, ss = torch.randn(t, r), torch.randn(t, r)
        comp = per_call_us(lambda: composition(xs, gs, ws, cs, ss, h, p, r))
        print(f"eager unfused composition (RMSNorm + Linear + RoPE, torch ops, 16 tokens): {comp:.1f} us/call")
        for p_, layer in layers.items():
            ours = per_call_us(lambda layer=layer: layer(x, cos, sin), n=500)
            print(f"  layer forward host time / composition's, {p_}: {ours / comp:.2f}")
    fb = fwd_bwd_host(16, 128, 2, 32, 32)
    print(f"eager unfused composition forward + backward (16 tokens, K = 128): {fb['composition']:.1f} us/call")
    for p_ in ("mxfp8", "fp8_block"):
        print(f"  layer forward + backward ({p_}, bf16 query, same geometry, kernels stubbed): {fb[p_]:.1f} us/call,"
              f" {fb[p_] / fb['composition']:.2f} x the composition's")
    with torch.no_grad():
        if args.profile:
            for p, layer in layers.items():
                print(f"--- {p}")
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(2000):
                    layer(x, cos, sin)
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
