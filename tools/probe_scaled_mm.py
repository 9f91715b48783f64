# ruff: noqa: B023  (every lambda runs inside the loop iteration that made it)
"""One-off probe (H200): which torch._scaled_mm block-scaled FP8 layouts the block-FP8 backward can use, their
output dtypes, alignment rules and times at the DeepSeek-V3 query shape. Prints a table last."""
from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

K, N = 1536, 24576
torch.manual_seed(0)
dev = "cuda"


def q_blocks(t, bm, bn):
    M_, N_ = t.shape
    pm, pn = -M_ % bm, -N_ % bn
    tp = torch.nn.functional.pad(t, (0, pn, 0, pm))
    b = tp.reshape((M_ + pm) // bm, bm, (N_ + pn) // bn, bn)
    amax = b.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    codes = (b * scale).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(M_ + pm, N_ + pn)[:M_, :N_]
    return codes.contiguous(), (1.0 / scale).reshape((M_ + pm) // bm, (N_ + pn) // bn)


def deq(codes, sinv, bm, bn):
    s = sinv.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[: codes.shape[0], : codes.shape[1]]
    return codes.float() * s


rows = []


def run(name, fn, ref):
    try:
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
        rows.append((name, f"{ms:.3f}", f"{err:.2e}", str(out.dtype)))
    except Exception as e:  # noqa: BLE001
        rows.append((name, "ERR", type(e).__name__, str(e).splitlines()[0][:150]))


w = torch.randn(N, K, device=dev) * K**-0.5
wq, ws = q_blocks(w, 128, 128)
wd = deq(wq, ws, 128, 128)
wqt = wq.t().contiguous()  # [K, N]
for T in (16384, 4096, 1000):
    x = torch.randn(T, K, device=dev)
    xq, xs = q_blocks(x, 1, 128)  # xs [T, K/128]
    xd = deq(xq, xs, 1, 128)
    ref = xd @ wd.t()
    for od in (torch.bfloat16, torch.float32):
        run(f"fwd T={T} 1x128.128x128 out={od}", lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(), out_dtype=od), ref)
    dy = torch.randn(T, N, device=dev)
    dq_, dsx = q_blocks(dy, 1, 128)  # [T, N/128]
    dref = deq(dq_, dsx, 1, 128) @ wd
    for od in (torch.bfloat16, torch.float32):
        run(f"dgrad T={T} out={od}", lambda: torch._scaled_mm(
            dq_, wqt.t(), scale_a=dsx.t().contiguous().t(), scale_b=ws.t().contiguous().t(), out_dtype=od), dref)
    # dgrad on half the columns (head groups / TP): column slice of dy codes and W rows
    h = N // 2
    dref2 = deq(dq_[:, :h], dsx[:, : h // 128], 1, 128) @ wd[:h]
    run(f"dgrad-half T={T} out=fp32", lambda: torch._scaled_mm(
        dq_[:, :h].contiguous(), wqt[:, :h].contiguous().t(), scale_a=dsx[:, : h // 128].t().contiguous().t(),
        scale_b=ws[: h // 128].t().contiguous().t(), out_dtype=torch.float32), dref2)
    # wgrad: dW [N, K] = dy^T [N, T] @ xn [T, K], 128x1 blocks along T for both
    Tp = -(-T // 16) * 16
    dyc, dyc_s = q_blocks(dy, 128, 1)  # [T, N], [ceil(T/128), N]
    xc, xc_s = q_blocks(x, 128, 1)
    wref = deq(dyc, dyc_s, 128, 1).t() @ deq(xc, xc_s, 128, 1)
    dyT = torch.zeros(N, Tp, dtype=torch.float8_e4m3fn, device=dev)
    dyT[:, :T] = dyc.t()
    xT = torch.zeros(K, Tp, dtype=torch.float8_e4m3fn, device=dev)
    xT[:, :T] = xc.t()
    for od in (torch.bfloat16, torch.float32):
        run(f"wgrad T={T} 1x128.1x128 out={od}", lambda: torch._scaled_mm(
            dyT, xT.t(), scale_a=dyc_s.t(), scale_b=xc_s, out_dtype=od), wref)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    run(f"cublas bf16 fwd T={T}", lambda: xb @ wb.t(), x @ w.t())
    dyb = dy.to(torch.bfloat16)
    run(f"cublas bf16 wgrad T={T}", lambda: dyb.t() @ xb, dy.t() @ x)

print(f"{'case':<40}{'ms':>9}{'rel err':>12}  dtype / error")
for r in rows:
    print(f"{r[0]:<40}{r[1]:>9}{r[2]:>12}  {r[3]}")
sys.exit(0)
