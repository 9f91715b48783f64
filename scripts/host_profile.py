"""Host (Python) time of the layer per call: cProfile of forward + backward at T = 4096 (DeepSeek-V3 shape), where
the step is host-bound on some machines. Prints the functions with the most own time and cumulative time.

    python scripts/host_profile.py
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mla_qproj import FusedMLAQUpProjection  # noqa: E402

K, H, NOPE, ROPE, T = 1536, 128, 128, 64, 4096


def main() -> None:
    layer = FusedMLAQUpProjection(K, H, NOPE, ROPE, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ang = torch.arange(T, device="cuda").float()[:, None] * layer.inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    dy = torch.randn(T, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    for name, step in (("fwd", lambda: layer(x.detach(), cos, sin)),
                       ("fwd+bwd", lambda: layer(x, cos, sin).backward(dy))):
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name}: host {1e3 * (t1 - t0) / 20:.3f} ms/step, wall {1e3 * (time.perf_counter() - t0) / 20:.3f}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(22)
        st.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
