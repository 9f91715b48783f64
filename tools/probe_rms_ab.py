"""A/B probe: the fp8_block RMSNorm + quantize kernels of two prebuilt folders, timed round-robin (bench_kernels'
graph_ms), outputs compared. python tools/probe_rms_ab.py A_DIR B_DIR [--tokens ...]"""
import argparse

import torch
import tvm_ffi

from mla_qproj.bench_kernels import graph_ms
from mla_qproj.kernels.cute import rmsnorm_fp8_block as cr
from mla_qproj.kernels.cute.rope_gemm import _load_runtime
from mla_qproj.kernels.triton.rmsnorm_fp8_block import rmsnorm_fp8_block_outputs

p = argparse.ArgumentParser()
p.add_argument("dirs", nargs="+")
p.add_argument("--tokens", default="4096,16384,65536")
p.add_argument("--check", default="1,129,4113,16384")
p.add_argument("--rounds", type=int, default=3)
a = p.parse_args()
K = 1536
_load_runtime(a.dirs[0])
fns = {}
for d in a.dirs:
    for cw in (True, False):
        k = cr.key(K, cw, torch.float32, False, "pow2")
        fns[(d, cw)] = tvm_ffi.load_module(f"{d}/{k}.so")[cr.FUNCTION]
ph = cr._placeholders(torch.device("cuda"))


def run(d, cw, x, g):
    outs = rmsnorm_fp8_block_outputs(x, cw)
    rs, rd, rsc, cd, cs = outs
    if not cw:
        cd, cs = ph
    fns[(d, cw)](x, g, rs, rd, rsc, cd, cs, 1e-6)
    return outs


torch.manual_seed(0)
g = torch.rand(K, device="cuda") + 0.5
for T in (int(t) for t in a.check.split(",")):
    x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    for cw in (True, False):
        ref = run(a.dirs[0], cw, x, g)
        for d in a.dirs[1:]:
            o = run(d, cw, x, g)
            rsd = ((o[0] - ref[0]).abs() / ref[0].abs()).max().item()
            same_rs = o[0] == ref[0]
            def raw(u):
                return u.view(torch.uint8) if u.dtype == torch.float8_e4m3fn else u
            eq = [torch.equal(raw(u), raw(v)) for u, v in zip(o[1:], ref[1:], strict=True)]
            rowsame = (o[1].view(torch.uint8) == ref[1].view(torch.uint8)).all(1)
            print(f"check T={T} cw={cw} {d}: rsigma max rel diff {rsd:.2e}, equal rsigma {same_rs.float().mean():.4f}, "
                  f"outputs equal {eq}, row codes equal on rows of equal rsigma: "
                  f"{bool(rowsame[same_rs].all())}", flush=True)
copy = {}
for T in (int(t) for t in a.tokens.split(",")):
    x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    src = torch.randn(T * 24576 // 2, device="cuda")
    dst = torch.empty_like(src)
    res = {}
    for r in range(a.rounds):
        res.setdefault("copy", []).append(graph_ms(lambda: dst.copy_(src)))
        for d in a.dirs:
            for cw in (True, False):
                res.setdefault((d, cw), []).append(graph_ms(lambda: run(d, cw, x, g)))
    cm = sorted(res["copy"])[len(res["copy"]) // 2]
    for k, v in res.items():
        if k == "copy":
            continue
        d, cw = k
        nb = T * K * (4 if cw else 3) + (2 if cw else 1) * T * K / 32 + 4 * T
        med = sorted(v)[len(v) // 2]
        ofc = nb / med / (2.0 * src.numel() * 4 / cm)
        print(f"T={T:>6} {'train' if cw else 'infer'} {d:<22} ms " + " ".join(f"{t:.4f}" for t in v)
              + f"  median {med:.4f}  of copy {ofc:.3f}", flush=True)
