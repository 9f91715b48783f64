"""Host (Python) time of the layer's no-grad forward on a machine without a GPU: the Triton kernels are replaced by
no-op launches, so what remains is the module's, the autograd-free path's and the launchers' own Python (argument
checks, allocations, tensor descriptors, the query object). Triton's launch itself is not included; on the GPU
`tools/profile_layer.py` measures the whole thing (host time per call included).

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
from mla_qproj.kernels import qproj_gemm as qg  # noqa: E402
from mla_qproj.kernels import rmsnorm_fp8_block as r8  # noqa: E402
from mla_qproj.kernels import rmsnorm_quant as rq  # noqa: E402
from mla_qproj.recipes.base import PreparedWeight  # noqa: E402

T, K, H, P, R = 4096, 1536, 128, 128, 64
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
    layer._prepared_weight = lambda use_triton: pw
    return layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the layers' forward")
    args = ap.parse_args()
    qg._qproj_gemm_fwd_kernel = _NoLaunch()
    rq._rmsnorm_quant_fwd_kernel = _NoLaunch()
    rq._rsigma_kernel = _NoLaunch()
    r8._rsigma_kernel = _NoLaunch()
    r8._rmsnorm_fp8_block_kernel = _NoLaunch()
    r8._rmsnorm_fp8_block_packed_kernel = _NoLaunch()
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
