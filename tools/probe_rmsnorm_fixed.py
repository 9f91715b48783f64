"""Probe (temporary): where the fp8_block RMSNorm + quantize launch's fixed time goes, over T (graph ms)."""

import torch

from mla_qproj.bench_kernels import graph_ms
from mla_qproj.kernels import _op
from mla_qproj.kernels.triton import rmsnorm_fp8_block as rn
from mla_qproj.kernels.triton._common import cdiv

K = 1536
dev = torch.device("cuda")
print(f"{'T':>6} {'copy x':>8} {'copy 2x':>8} {'empty':>8} {'rsigma':>8} {'quant':>8} {'train':>8} {'infer':>8}")
rows = []
for T in (1024, 2048, 4096, 8192, 16384, 32768, 65536):
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    g = torch.randn(K, device=dev)
    src = torch.empty(T * K * 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    src2 = torch.empty(T * K * 4, dtype=torch.uint8, device=dev)
    dst2 = torch.empty_like(src2)
    rs = torch.empty(T, device=dev)
    cfg = rn.default_config(T, K, dev, True)
    tiny = torch.empty(1, device=dev)

    def rsigma(x=x, rs=rs, cfg=cfg, T=T):
        rn._rsigma_kernel[(cdiv(T, cfg.rs_rows),)](x_ptr=x, stride_x=x.stride(0), rsigma_ptr=rs, T=T, eps=1e-6, K=K,
                                                   ROWS=cfg.rs_rows, BLOCK_K=cfg.rs_block_k,
                                                   EMULATED=_op.emulated(dev), num_warps=cfg.rs_warps)

    t = [graph_ms(lambda: dst.copy_(src)), graph_ms(lambda: dst2.copy_(src2)), graph_ms(lambda: tiny.zero_()),
         graph_ms(rsigma),
         graph_ms(lambda: rn.rmsnorm_fp8_block_fwd(x, None, 1e-6, False, "pow2", True, config=cfg)),
         graph_ms(lambda: rn.rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", True, config=cfg)),
         graph_ms(lambda: rn.rmsnorm_fp8_block_fwd(x, g, 1e-6, False, "pow2", False,
                                                   config=rn.default_config(T, K, dev, False)))]
    rows.append((T, t))
    print(f"{T:>6} " + " ".join(f"{v:>8.4f}" for v in t), flush=True)
# least-squares a + b T over T >= 4096 for each column
ts = [r for r in rows if r[0] >= 4096]
for j, name in enumerate(("copy x", "copy 2x", "empty", "rsigma", "quant", "train", "infer")):
    n = len(ts)
    sx = sum(r[0] for r in ts)
    sy = sum(r[1][j] for r in ts)
    sxx = sum(r[0] ** 2 for r in ts)
    sxy = sum(r[0] * r[1][j] for r in ts)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    a = (sy - b * sx) / n
    print(f"{name:>8}: fixed {a * 1000:7.2f} us, {b * 1e6:7.3f} ns a token")
