"""Probe (temporary): the fp8_block RMSNorm + quantize kernel with rsigma in-kernel (sibling sync) vs the split form."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import torch
from mla_qproj.kernels.triton.rmsnorm_fp8_block import RMSNormFp8BlockConfig as C, rmsnorm_fp8_block_fwd as fwd
from mla_qproj.bench_kernels import graph_ms, _bench
from ops.test_rmsnorm_fp8_block import check_rmsnorm

K, N = 1536, 24576
dev = "cuda"
def same(a, b):
    return all(torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int32) if x.dtype == torch.float32 else x, 
                           y.view(torch.uint8) if y.dtype.itemsize == 1 else y.view(torch.int32) if y.dtype == torch.float32 else y)
               for x, y in zip(a, b))
fused = {"fused 128/4 ticket": C(num_warps=4, packed=True, rsigma=1),
         "fused 128/4 no ticket": C(num_warps=4, packed=True, rsigma=1, ticket=False),
         "fused 128/8 ticket": C(num_warps=8, packed=True, rsigma=1),
         "fused 256/8 ticket": C(block_k=256, num_warps=8, packed=True, rsigma=1),
         "fused 256/16 ticket": C(block_k=256, num_warps=16, packed=True, rsigma=1)}
ok = True
t0 = time.time()
for T in (1, 17, 130, 4097, 16384, 65539):
    x = (torch.randn(T, K, device=dev) * 3).to(torch.bfloat16)
    x[0, 3] = float("nan")
    g = torch.rand(K, device=dev) + 0.5
    for name, cfg in fused.items():
        import dataclasses
        for cw in (True, False):
            a = fwd(x, g, 1e-6, False, "pow2", cw, config=cfg)
            b = fwd(x, g, 1e-6, False, "pow2", cw, config=dataclasses.replace(cfg, rsigma=2))
            rep = all(same(a, fwd(x, g, 1e-6, False, "pow2", cw, config=cfg)) for _ in range(5))
            if not (same(a, b) and rep):
                ok = False
                print("MISMATCH", T, name, cw, same(a, b), rep)
    for bs in ("pow2", "fp32", "deepseek"):
        check_rmsnorm(x, g, bs == "fp32", bs, config=fused["fused 128/4 ticket"])
print("bits: sync == local, repeatable, reference:", ok, f"{time.time() - t0:.1f}s", flush=True)

print(f"{'T':>6} {'config':<34}{'eager ms':>9}{'graph ms':>9}{'of copy':>8}")
for T in (4096, 16384, 65536):
    src = torch.randn(T * N // 2, device=dev); dst = torch.empty_like(src)
    ceil = 2.0 * src.numel() * 4 / graph_ms(lambda: dst.copy_(src))
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    g = torch.rand(K, device=dev) + 0.5
    train_b = T * K * (2 + 1 + 1) + 2 * T * K / 32 + 4 * T
    inf_b = T * K * (2 + 1) + T * K / 32 + 4 * T
    rows = [("train: split (before)", train_b, C(num_warps=4, packed=True, rsigma=0), True)]
    rows += [("train: " + n, train_b, c, True) for n, c in fused.items()]
    rows += [("train: local (each program sums)", train_b, C(num_warps=4, packed=True, rsigma=2), True),
             ("inference: byte kernel (before)", inf_b, C(num_warps=4), False),
             ("inference: split packed", inf_b, C(num_warps=4, packed=True, rsigma=0), False),
             ("inference: fused 128/4 ticket", inf_b, C(num_warps=4, packed=True, rsigma=1), False),
             ("inference: fused 256/8 ticket", inf_b, C(block_k=256, num_warps=8, packed=True, rsigma=1), False)]
    for name, nb, cfg, cw in rows:
        fn = lambda: fwd(x, g, 1e-6, False, "pow2", cw, config=cfg)
        e, gm = _bench(fn), graph_ms(fn)
        print(f"{T:>6} {name:<34}{e:>9.4f}{gm:>9.4f}{nb / gm / ceil:>8.2f}", flush=True)
