"""Probe (temporary): register caps (Triton's maxnreg) on the fp8_block RMSNorm and gradient kernels."""
import dataclasses
import torch
from mla_qproj.kernels.triton import rmsnorm_fp8_block as rn, rope_fp8_block as rp
from mla_qproj.bench_kernels import graph_ms

K, N, H, D, P, R = 1536, 24576, 128, 192, 128, 64
dev = torch.device("cuda")
def bits(outs):
    return [o.view(torch.uint8) if o.dtype.itemsize == 1 else o.view(torch.int32) if o.dtype == torch.float32 else o for o in outs]
print(f"{'T':>6} {'kernel':<28}{'maxnreg':>8}{'warps':>6}{'graph ms':>9}{'of copy':>8}  same bytes")
for T in (4096, 16384, 65536, 4101):
    if T != 4101:
        src = torch.randn(T * N // 2, device=dev); dst = torch.empty_like(src)
        ceil = 2.0 * src.numel() * 4 / graph_ms(lambda: dst.copy_(src))
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    x[1, 2] = float("nan")
    g = torch.rand(K, device=dev) + 0.5
    dq = torch.randn(T, N, device=dev).to(torch.bfloat16)
    c, s = torch.randn(T, R // 2, device=dev), torch.randn(T, R // 2, device=dev)
    kw = dict(num_heads=H, head_dim=D, qk_head_dim=P, rope_dim=R)
    cases = []
    base = rn.default_config(T, K, dev, True)
    for wg, nm in ((g, "rmsnorm train"), (None, "rmsnorm quant only")):
        cases.append((nm, T * K * 4 + 2 * T * K / 32 + 4 * T, base,
                      lambda cfg, wg=wg: rn.rmsnorm_fp8_block_fwd(x, wg, 1e-6, False, "pow2", True, config=cfg)))
    for st in ("deepseek", "gptj", "neox"):
        cases.append((f"gradient {st}", T * N * 4 + 2 * T * N / 32 + 2 * T * R * 2, rp.default_config(P, R, D, st, dev),
                      lambda cfg, st=st: rp.rope_fp8_block_bwd(dq, c, s, rope_style=st, config=cfg, **kw)))
    for name, nb, cfg0, fn in cases:
        ref = bits(fn(cfg0))
        for r in (None, 168, 160, 128):
            cfg = dataclasses.replace(cfg0, maxnreg=r)
            same = all(torch.equal(a, b) for a, b in zip(bits(fn(cfg)), ref))
            gm = graph_ms(lambda: fn(cfg)) if T != 4101 else float("nan")
            print(f"{T:>6} {name:<28}{str(r):>8}{cfg.num_warps:>6}{gm:>9.4f}{(nb / gm / ceil if T != 4101 else 0):>8.2f}  {same}", flush=True)
