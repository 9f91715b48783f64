"""Multi-GPU benchmark of the tensor/sequence-parallel layer (SPEC §6), one process per GPU:

    torchrun --nproc-per-node 8 -m mla_qproj.bench_tp [--tokens 4096,16384] [--precisions fp8_block,mxfp8,bf16]

DeepSeek-V3 query shape (K = 1536, 128 heads, D = 128 + 64). `--tokens` is the token count of the whole
sequence-parallel group (each rank holds T / tp of x and tp-local heads). Rows per T, timed on every rank (the table
shows the slowest rank's median, as a step waits for it):
  megatron_unfused   Megatron-style composition: all-gather of bf16 x, then a compiled RMSNorm -> bf16 GEMM with the
                     local weight shard -> RoPE (backward: reduce-scatter of dx); bf16 query
  ours_<precision>   FusedMLAQUpProjection(tp_group, sequence_parallel=True): the quantized xn is gathered
  ours_<p>_overlap   the same with tp_comm_overlap=True: the GEMM covers this rank's tokens while the gather runs
                     (its query is checked to be the bytes of ours_<p> before it is timed)
  ours_<p>_tp1       the same layer at tp = 1 on all T tokens and all heads (the work a single GPU would do)
  gather_bf16_x / gather_<p>   the all-gathers alone (what the GEMM could hide)
Forward rows run under torch.no_grad(); fwd+bwd rows use a random upstream gradient. Bytes on the wire per token are
counted from the tensors each collective moves (an all-gather of n bytes per token delivers n·(tp-1)/tp per token to
each rank; the table reports n). Results: printed on rank 0 and appended to --results as one JSON line.
Works with gloo on CPU tensors too (--device cpu, tiny sizes: the CI smoke test), where the timings mean little.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from .bench import EPS, NOPE, ROPE, D, H, K


def wire_bytes(name: str, k: int) -> dict[str, int]:
    """Bytes per token of the tensors each collective moves (the gathered / reduce-scattered tensor's size)."""
    row = {"bf16": 2 * k, "mxfp8": k + k // 32, "fp8_block": k + 4 * (k // 128)}
    if name == "megatron_unfused":  # bf16 x gathered twice (forward, and again for wgrad), bf16 dx reduce-scattered
        return {"fwd gather": 2 * k, "bwd gather": 2 * k, "bwd reduce-scatter": 2 * k}
    # ours: the quantized xn (forward) and its columnwise form (backward) gathered, dxn reduce-scattered in fp32
    return {"fwd gather": row[name], "bwd gather": row[name], "bwd reduce-scatter": 4 * k}


# torch 2.13 deprecates the *_tensor names for *_single; 2.11 has only the former
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSP(torch.autograd.Function):
    """Megatron's sequence-parallel region entry: all-gather along dim 0, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group),) + tuple(x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((g.shape[0] // dist.get_world_size(ctx.group),) + tuple(g.shape[1:]))
        _reduce_scatter(out, g.contiguous(), group=ctx.group)
        return out, None


def _local_query(x, g, w, cos_h, sin_h):
    """RMSNorm (fp32) -> bf16 GEMM -> DeepSeek RoPE (in place on the rope columns), bf16 query [T, H_l, D]."""
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).to(torch.bfloat16)
    q = (xn @ w.t()).view(x.shape[0], -1, D)
    r = q[..., NOPE:NOPE + ROPE].float()
    a, b = r[..., 0::2], r[..., 1::2]
    c, s = cos_h[:, None, :], sin_h[:, None, :]
    return torch.cat([q[..., :NOPE], torch.cat([a * c - b * s, b * c + a * s], -1).to(q.dtype)], -1)


def _timer(device: torch.device, warmup: int, rep: int):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def cpu_time(fn, n: int = 3) -> float:
        import time

        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    return cpu_time


def run(args) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    w_full = (torch.randn(args.heads * D, args.k, device=device) * args.k**-0.5).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(args.k, device=device)).to(torch.bfloat16)
    peer = torch.compile(_local_query, dynamic=False) if args.compile else _local_query
    rows: list[dict] = []
    for T in args.tokens:
        rows += _bench_T(T, args, rank, world, device, w_full, g, peer)
    return rows


def _bench_T(T, args, rank, world, device, w_full, g, peer) -> list[dict]:
    """Every row at one T (the group's token count)."""
    from .reference.rope import build_rope_tables, rope_inv_freq

    group = dist.group.WORLD
    time_ms = _timer(device, args.warmup, args.rep)
    hl, tl_ = args.heads // world, T // world
    w_local = w_full[rank * hl * D:(rank + 1) * hl * D].contiguous()
    x = torch.randn(T, args.k, device=device).to(torch.bfloat16)
    x_local = x[rank * tl_:(rank + 1) * tl_].contiguous()
    cos, sin = build_rope_tables(torch.arange(T, device=device), *rope_inv_freq(ROPE, 10000.0, None))
    cos_h, sin_h = cos[:, : ROPE // 2].contiguous(), sin[:, : ROPE // 2].contiguous()
    dy = torch.randn(T, hl, D, device=device).to(torch.bfloat16)
    dy_full = torch.randn(T, args.heads, D, device=device).to(torch.bfloat16)
    rows = []

    def rec(name, kind, ms, wire=None):
        t = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank bounds the step
        rows.append({"T": T, "name": name, "kind": kind, "ms": t.item(), "tp": world,
                     "wire_bytes_per_token": wire or {}})

    xr, wr, gr = (t.clone().requires_grad_(True) for t in (x_local, w_local, g))

    def mega_fwd():
        with torch.no_grad():
            return peer(_GatherSP.apply(x_local, group), g, w_local, cos_h, sin_h)

    def mega_fwdbwd():
        peer(_GatherSP.apply(xr, group), gr, wr, cos_h, sin_h).backward(dy)

    mega = wire_bytes("megatron_unfused", args.k)
    rec("megatron_unfused", "fwd", time_ms(mega_fwd), mega)
    rec("megatron_unfused", "fwdbwd", time_ms(mega_fwdbwd), mega)
    xg = torch.empty_like(x)
    rec("gather_bf16_x", "comm", time_ms(lambda: _all_gather(xg, x_local, group=group)), mega)
    for p in args.precisions:
        rows += _bench_ours(p, T, args, device, w_local, w_full, g, x, x_local, cos, sin, dy, dy_full, time_ms, rec)
    return rows


def _bench_ours(p, T, args, device, w_local, w_full, g, x, x_local, cos, sin, dy, dy_full, time_ms, rec) -> list:
    from . import FusedMLAQUpProjection

    group = dist.group.WORLD
    kw = dict(precision=p, output_format="bf16", device=device, dtype=torch.bfloat16)
    layer = FusedMLAQUpProjection(args.k, args.heads, NOPE, ROPE, tp_group=group, sequence_parallel=True, **kw)
    over = FusedMLAQUpProjection(args.k, args.heads, NOPE, ROPE, tp_group=group, sequence_parallel=True,
                                 tp_comm_overlap=True, **kw)
    ref = FusedMLAQUpProjection(args.k, args.heads, NOPE, ROPE, **kw)
    with torch.no_grad():
        for m, w in ((layer, w_local), (over, w_local), (ref, w_full)):
            m.weight.copy_(w)
            m.norm_weight.copy_(g)
    xl, xf = x_local.clone().requires_grad_(True), x.clone().requires_grad_(True)

    def fwd(m=layer):
        with torch.no_grad():
            return m(x_local, cos, sin)

    def fwd_tp1():
        with torch.no_grad():
            return ref(x, cos, sin)

    wire = wire_bytes(p, args.k)
    rec(f"ours_{p}", "fwd", time_ms(fwd), wire)
    rec(f"ours_{p}", "fwdbwd", time_ms(lambda: layer(xl, cos, sin).backward(dy)), wire)
    if not torch.equal(fwd(over).view(torch.int16), fwd().view(torch.int16)):
        raise RuntimeError(f"{p}: the overlapped forward's query differs from the plain one's")
    rec(f"ours_{p}_overlap", "fwd", time_ms(lambda: fwd(over)), wire)
    rec(f"ours_{p}_overlap", "fwdbwd", time_ms(lambda: over(xl, cos, sin).backward(dy)), wire)
    rec(f"ours_{p}_tp1", "fwd", time_ms(fwd_tp1))
    rec(f"ours_{p}_tp1", "fwdbwd", time_ms(lambda: ref(xf, cos, sin).backward(dy_full)))
    n = wire["fwd gather"]
    buf = torch.empty(x_local.shape[0], n, dtype=torch.uint8, device=device)
    out = torch.empty(T, n, dtype=torch.uint8, device=device)
    rec(f"gather_{p}", "comm", time_ms(lambda: _all_gather(out, buf, group=group)), wire)
    return []


def format_rows(rows: list[dict]) -> str:
    head = (f"{'T':>6} {'tp':>3}  {'row':<24}{'kind':<8}{'ms':>9}  bytes per token moved (fwd gather, bwd gather, "
            f"bwd reduce-scatter)")
    out = [head, "-" * len(head)]
    for r in rows:
        wire = r["wire_bytes_per_token"]
        w = ", ".join(str(wire[k]) for k in ("fwd gather", "bwd gather", "bwd reduce-scatter")) if wire else ""
        out.append(f"{r['T']:>6} {r['tp']:>3}  {r['name']:<24}{r['kind']:<8}{r['ms']:>9.3f}  {w}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun ... -m mla_qproj.bench_tp", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default="4096,16384", help="comma-separated T of the whole group")
    p.add_argument("--precisions", default="fp8_block,mxfp8,bf16", help="comma-separated precisions of ours")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo (smoke test)")
    p.add_argument("--heads", type=int, default=H, help="global head count")
    p.add_argument("--k", type=int, default=K, help="q_lora_rank")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="run the peer eagerly")
    p.add_argument("--results", default="bench_results.jsonl", help="JSON-lines file to append to ('' to skip)")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    args.precisions = [s for s in args.precisions.split(",") if s.strip()]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mla_qproj.bench_tp: no CUDA GPU found (use --device cpu for the gloo smoke test).", file=sys.stderr)
        return 2
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            print("mla_qproj.bench_tp: start it with torchrun (RANK / WORLD_SIZE unset).", file=sys.stderr)
            return 2
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=600))
    world = dist.get_world_size()
    for t in args.tokens:
        if t % world or (t // world) % 128:
            print(f"mla_qproj.bench_tp: T = {t} must split into whole 128-token blocks over {world} ranks",
                  file=sys.stderr)
            return 2
    if args.heads % world:
        print(f"mla_qproj.bench_tp: --heads {args.heads} must be divisible by {world}", file=sys.stderr)
        return 2
    rows = run(args)
    if dist.get_rank() == 0:
        print(format_rows(rows))
        if args.results:
            with open(args.results, "a") as fh:
                fh.write(json.dumps({"run": datetime.datetime.now().isoformat(timespec="seconds") + " bench_tp",
                                     "settings": {k: v for k, v in vars(args).items()}, "results": rows},
                                    separators=(",", ":")) + "\n")
    dist.barrier()  # every rank done before any tears the group down (gloo aborts a peer still sending)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
