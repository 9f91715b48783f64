"""Probe: how the L2 flush before each call moves the memory-bound figures of `mla_qproj.bench_kernels`.

    python tools/probe_flush.py          # GPU

`bench_kernels.graph_ms` zeroes a 256 MB buffer before each call: the call then starts with the L2 full of dirty
lines, whose write-back it pays, where the flush-only graph's next flush paid it. A 1.6 GB copy barely notices; a
75 MB kernel may. Times the fp8_block RMSNorm + quantize (inference and training forms) and two copies (the gradient's
size, the ceiling bench_kernels uses; and one moving the kernel's own bytes) under a write flush (zero_) and a read
flush (a reduction over the same buffer: clean lines), three rounds, T = 4096, 16384, 65536.
"""

from __future__ import annotations

import torch

from mla_qproj.bench_kernels import K, N

_BUF: list = []


def graph_ms(fn, flush, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush()
                if with_fn:
                    fn()
        graphs.append(g)
    times = []
    for g in graphs:
        ts = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        times.append(sorted(ts)[3])
    return (times[0] - times[1]) / n


def main() -> None:
    from mla_qproj.kernels.triton.rmsnorm_fp8_block import rmsnorm_fp8_block_fwd

    print(torch.cuda.get_device_name(), torch.__version__)
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    buf32 = buf.view(torch.float32)
    sink = torch.empty((), device="cuda")
    flushes = {"write": lambda: buf.zero_(), "read": lambda: torch.amax(buf32, dim=0, out=sink)}
    for T in (4096, 16384, 65536):
        x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
        g = torch.rand(K, device="cuda") + 0.5
        nb_inf = T * K * (2 + 1) + T * K / 32 + 4 * T
        nb_trn = T * K * (2 + 1 + 1) + 2 * T * K / 32 + 4 * T
        big = torch.randn(T * N // 2, device="cuda")
        big_d = torch.empty_like(big)
        own = torch.randn(int(nb_inf // 8), device="cuda")  # fp32: read + written = the inference kernel's bytes
        own_d = torch.empty_like(own)
        for rnd in range(3):
            for fname, fl in flushes.items():
                t_big = graph_ms(lambda: big_d.copy_(big), fl)
                t_own = graph_ms(lambda: own_d.copy_(own), fl)
                t_inf = graph_ms(lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", False), fl)
                t_trn = graph_ms(lambda: rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", True), fl)
                bw_big = big.numel() * 8 / t_big / 1e9
                bw_own = own.numel() * 8 / t_own / 1e9
                bw_inf, bw_trn = nb_inf / t_inf / 1e9, nb_trn / t_trn / 1e9
                print(f"T={T:>6} r{rnd} {fname:>5}: copy(grad) {t_big * 1e3:7.1f} us {bw_big:5.2f} TB/s | "
                      f"copy(own) {t_own * 1e3:6.1f} us {bw_own:5.2f} | inference {t_inf * 1e3:6.1f} us "
                      f"{bw_inf:5.2f} = {bw_inf / bw_big:.3f} of copy(grad), {bw_inf / bw_own:.3f} of copy(own) | "
                      f"training {t_trn * 1e3:6.1f} us {bw_trn / bw_big:.3f} / {bw_trn / bw_own:.3f}", flush=True)


if __name__ == "__main__":
    main()
