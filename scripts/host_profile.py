"""Host (Python) time of the layer per call: cProfile of forward + backward at T = 4096 (DeepSeek-V3 shape), where
the step is host-bound on some machines. Prints the functions with the most own time and cumulative time.

    python scripts/host_profile.py
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from profile_layer import NOPE, ROPE, H, host_and_wall_ms, make  # noqa: E402

T = 4096


def main() -> None:
    layer, x, _, cos, sin = make(T)
    dy = torch.randn(T, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    for name, step in (("fwd", lambda: layer(x.detach(), cos, sin)),
                       ("fwd+bwd", lambda: layer(x, cos, sin).backward(dy))):
        host, wall = host_and_wall_ms(step, warmup=5)
        print(f"{name}: host {host:.3f} ms/step, wall {wall:.3f}")
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
