"""Pointer stores vs TMA stores in the fused forward GEMM's epilogue at small T (GPU): host time per call, GPU time
per call (CUDA-graph replays) and the eager do_bench time, for each store path. Decides whether the TMA-store
epilogue, off below `qproj_gemm.TMA_STORE_MIN_T` tokens because of its host cost, should be used where the host cost
does not count (CUDA-graph capture).

    python scripts/store_probe.py [--T 1024 2048 4096 8192]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from profile_layer import host_and_wall_ms  # noqa: E402

from mla_qproj._config import QProjConfig  # noqa: E402
from mla_qproj.bench_kernels import graph_ms  # noqa: E402
from mla_qproj.kernels import qproj_gemm as qg  # noqa: E402

K, H, P, R, D = 1536, 128, 128, 64, 192


def host_ms(fn) -> float:
    """Python time per call of back-to-back calls (no synchronization inside: the GPU queue absorbs them)."""
    return host_and_wall_ms(fn, n=200, warmup=1)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = QProjConfig.make(K, H, P, R, D)
    w = (torch.randn(H * D, K, device=dev) * K**-0.5).to(torch.bfloat16)
    wp = qg.prepare_fused_weight(w, cfg)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for T in args.T:
        a = torch.randn(T, K, device=dev).to(torch.bfloat16)
        c, s = torch.randn(T, R // 2, device=dev), torch.randn(T, R // 2, device=dev)
        configs = {tma: dataclasses.replace(qg.default_config(T, dev, cfg), TMA_STORE=tma) for tma in (False, True)}
        base = qg.qproj_gemm_fwd(a, wp, c, s, cfg, config=configs[False])
        for tma in (False, True):
            def fn(a=a, c=c, s=s, config=configs[tma]):
                return qg.qproj_gemm_fwd(a, wp, c, s, cfg, config=config)

            out = fn()
            same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(out, base, strict=True)
                       if x is not None)
            cub = do_bench(lambda: a @ w.t(), warmup=25, rep=100, return_mode="median")  # noqa: B023
            rows.append((T, "tma" if tma else "pointer", same, host_ms(fn), graph_ms(fn),
                         do_bench(fn, warmup=25, rep=100, return_mode="median"), cub))
    host_breakdown(dev, w)
    print(f"{'T':>6} {'stores':<8} {'same':<5} {'host ms':>8} {'graph ms':>9} {'eager ms':>9} {'cuBLAS':>8}")
    for T, name, same, h, g, e, cub in rows:
        print(f"{T:>6} {name:<8} {str(same):<5} {h:>8.3f} {g:>9.3f} {e:>9.3f} {cub:>8.3f}")


def host_breakdown(dev, w, T: int = 4096) -> None:
    """Python time per call of the layer's forward (no grad) and of its pieces at T tokens."""
    from mla_qproj import FusedMLAQUpProjection
    from mla_qproj.kernels.rmsnorm_quant import rmsnorm_quant_fwd
    from mla_qproj.kernels.rope_quant import rope_quant
    from mla_qproj.tensor import MXFP8Tensor

    layer = FusedMLAQUpProjection(K, H, P, R, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    cos, sin = torch.randn(T, R, device=dev), torch.randn(T, R, device=dev)
    cfg = QProjConfig.make(K, H, P, R, D)
    wp = qg.prepare_fused_weight(w, cfg)
    a = torch.randn(T, K, device=dev).to(torch.bfloat16)
    c, s = cos[:, : R // 2].contiguous(), sin[:, : R // 2].contiguous()
    g = torch.ones(K, device=dev, dtype=torch.bfloat16)
    y = torch.randn(T, H * D, device=dev).to(torch.bfloat16)
    q = layer(x, cos, sin)
    pieces = {
        "layer forward (no grad)": lambda: layer(x, cos, sin),
        "rmsnorm_quant_fwd (2 launches)": lambda: rmsnorm_quant_fwd(x, g, 1e-6, False, "mxfp8", "rceil"),
        "qproj_gemm_fwd (1 launch)": lambda: qg.qproj_gemm_fwd(a, wp, c, s, cfg),
        "rope_quant inverse (1 launch)": lambda: rope_quant(y, c, s, num_heads=H, head_dim=D, qk_head_dim=P,
                                                            rope_dim=R, rope_style="deepseek", inverse=True,
                                                            mode="mxfp8_images", columnwise=True, scale_mode="rceil"),
        "torch.empty x4": lambda: [torch.empty(T, K, device=dev) for _ in range(4)],
        "MXFP8Tensor(...)": lambda: MXFP8Tensor(shape=q.shape, dtype=torch.bfloat16, scale_mode="rceil",
                                               rowwise_data=q.rowwise_data, rowwise_scale=q.rowwise_scale,
                                               columnwise_data=None, columnwise_scale=None),
    }
    with torch.no_grad():
        for name, fn in pieces.items():
            print(f"host T={T} {name:<34} {host_ms(fn):.3f} ms/call")


if __name__ == "__main__":
    main()
