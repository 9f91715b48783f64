"""Benchmark FusedMLAQUpProjection against cuBLAS and torch.compile peers at the DeepSeek-V3 query shape.

    python -m mla_qproj.bench [--tokens 1024,4096,16384,65536] [--out bench_out] [--quick]

Shape: q_lora_rank K=1536, 128 heads, qk_head_dim 128 + rope 64 = q_head_dim 192 (N = 24576); x bf16 [T, K]
random normal, parameters bf16, prebuilt cos/sin fp32 [T, 64] (HF layout, positions 0..T-1).

Rows per T (all in one process, same inputs):
  cublas_bf16_gemm              x @ w.t() alone (the GEMM floor)
  compiled_unfused_mxfp8        torch.compile(RMSNorm fp32 -> bf16 Linear -> DeepSeek RoPE -> MXFP8 rowwise quant),
                                quantizer = mla_qproj.reference.mxfp8 (plain torch ops)
  ours_*                        FusedMLAQUpProjection forward, one knob changed per variant
  ours_mxfp8_cudagraph          ours_mxfp8 replayed from a CUDA graph (no per-call host work: the GPU time)
  compiled_unfused_bf16_fwdbwd  torch.compile(RMSNorm -> bf16 Linear -> DeepSeek RoPE), forward + backward
  ours_mxfp8_fwdbwd             ours (mxfp8 in, mxfp8 out) forward + backward
Forward rows run under torch.no_grad() (inference); fwd+bwd rows use a random bf16 upstream gradient and get
grads for x, norm weight and weight. Times: every row is timed --rounds times round-robin (triton.testing.do_bench
medians, L2 flushed before each call) and the median over the rounds is reported with its spread; ratios are the
median over the rounds of the same round's ratio (the GPU's clock drifts over a run: same-round rows share it).
FLOPs: 2*T*K*N per GEMM (forward 1 GEMM, fwd+bwd 3). "t/cuBLAS" = ms / cublas_bf16_gemm ms (forward rows);
"speed-up" = ms of the unfused compiled peer of the same kind / ms. Peak memory (fwd+bwd rows) is
torch.cuda.max_memory_allocated over one call after reset, in MiB; "+MiB" is that peak minus what was
allocated before the call (inputs, parameters and ours' cached quantized weight are in the baseline).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference.mxfp8 import quantize_rowwise
from .reference.rope import apply_rope, build_rope_tables, rope_inv_freq

K, H, NOPE, ROPE = 1536, 128, 128, 64
D = NOPE + ROPE
N = H * D
EPS = 1e-6


@dataclass
class Row:
    """One benchmarked configuration: `build(ctx)` returns (fn, tensors whose .grad is reset between calls)."""

    name: str
    kind: str  # "fwd" | "fwdbwd"
    ref: str | None  # peer the speed-up is measured against
    build: Callable[[dict], tuple[Callable[[], object], list[torch.Tensor]]]


def environment() -> dict:
    """Device, software versions and date, for the report and the JSON."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def gpu_state() -> str:
    """SM clock, power draw and temperature from nvidia-smi (empty when it is not there): printed before and after
    the run, since the chip's clock under sustained GEMM load is what moves same-work timings between rows."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader", "-i", str(torch.cuda.current_device())],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _rmsnorm_fp32(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * g in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()


def _unfused_y(x, g, w, cos_h, sin_h) -> torch.Tensor:
    """RMSNorm (fp32) -> bf16 Linear -> DeepSeek (interleaved) RoPE in fp32; returns fp32 [T, H, D]."""
    y = F.linear(_rmsnorm_fp32(x, g).to(torch.bfloat16), w).view(x.shape[0], H, D)
    return apply_rope(y.float(), cos_h, sin_h, NOPE, ROPE, "deepseek")


def unfused_mxfp8(x, g, w, cos_h, sin_h) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused composition ending in an MXFP8 rowwise quantization (rceil): (fp8 data, uint8 scales)."""
    return quantize_rowwise(_unfused_y(x, g, w, cos_h, sin_h), "rceil")


def unfused_bf16(x, g, w, cos_h, sin_h) -> torch.Tensor:
    """The unfused composition without quantization: bf16 query [T, H, D]."""
    return _unfused_y(x, g, w, cos_h, sin_h).to(torch.bfloat16)


def make_rows(layers: dict, compile_mode: str) -> list[Row]:
    """All rows; `layers` maps variant name -> FusedMLAQUpProjection (or an exception if ours is unavailable)."""
    c_mx = torch.compile(unfused_mxfp8, dynamic=False, mode=compile_mode)
    c_bf = torch.compile(unfused_bf16, dynamic=False, mode=compile_mode)

    def ours(variant: str) -> Callable:
        def build(c):
            layer = layers[variant]
            if isinstance(layer, Exception):
                raise layer
            if variant == "mxfp8_posids":
                return (lambda: layer(c["x"], position_ids=c["pos"])), []
            return (lambda: layer(c["x"], c["cos"], c["sin"])), []

        return build

    def ours_graph(c):
        """The forward captured in a CUDA graph (what torch.compile(mode="reduce-overhead") or a user's graph gives):
        the GPU time without the per-call host work (Python, launches), which bounds small T."""
        layer = layers["mxfp8"]
        if isinstance(layer, Exception):
            raise layer
        with torch.no_grad():
            layer(c["x"], c["cos"], c["sin"])  # compiled kernels and the weight cache exist before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                q = layer(c["x"], c["cos"], c["sin"])
        c["_graph"] = (graph, q)  # keep the graph's outputs alive
        return graph.replay, []

    def ours_fwdbwd(c):
        layer = layers["mxfp8"]
        if isinstance(layer, Exception):
            raise layer
        xr = c["x"].detach().clone().requires_grad_(True)

        def fn():
            q = layer(xr, c["cos"], c["sin"])
            c["_backward"](q, c["dy"])

        return fn, [xr, layer.weight, layer.norm_weight]

    def compiled_fwdbwd(c):
        xr = c["x"].detach().clone().requires_grad_(True)
        gr = c["g"].detach().clone().requires_grad_(True)
        wr = c["w"].detach().clone().requires_grad_(True)
        return (lambda: c_bf(xr, gr, wr, c["cos_h"], c["sin_h"]).backward(c["dy"])), [xr, gr, wr]

    peer = "compiled_unfused_mxfp8"
    return [
        Row("cublas_bf16_gemm", "fwd", None, lambda c: ((lambda: c["x"] @ c["w"].t()), [])),
        Row(peer, "fwd", None, lambda c: ((lambda: c_mx(c["x"], c["g"], c["w"], c["cos_h"], c["sin_h"])), [])),
        Row("ours_mxfp8", "fwd", peer, ours("mxfp8")),
        Row("ours_mxfp8_posids", "fwd", peer, ours("mxfp8_posids")),
        Row("ours_mxfp8_cudagraph", "fwd", peer, ours_graph),
        Row("ours_mxfp8_colwise_out", "fwd", None, ours("mxfp8_colwise_out")),
        Row("ours_mxfp8_bf16_out", "fwd", None, ours("mxfp8_bf16_out")),
        Row("ours_bf16_gemm", "fwd", peer, ours("bf16_gemm")),
        Row("compiled_unfused_bf16_fwdbwd", "fwdbwd", None, compiled_fwdbwd),
        Row("ours_mxfp8_fwdbwd", "fwdbwd", "compiled_unfused_bf16_fwdbwd", ours_fwdbwd),
    ]


def make_layers(device: torch.device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Our layer in each variant, all with the same random bf16 weight and norm weight; returns (layers, w, g).
    A variant that fails to construct is stored as its exception (reported per row)."""
    w = (torch.randn(N, K, device=device) * K**-0.5).to(torch.bfloat16)
    g = (1.0 + 0.1 * torch.randn(K, device=device)).to(torch.bfloat16)
    variants = {
        "mxfp8": {},
        "mxfp8_posids": {},
        "mxfp8_colwise_out": {"columnwise_output": True},
        "mxfp8_bf16_out": {"output_format": "bf16"},
        "bf16_gemm": {"precision": "bf16"},
    }
    layers: dict = {}
    try:
        from . import FusedMLAQUpProjection
    except Exception as e:  # the module is not there: the peers still run
        return {v: e for v in variants}, w, g
    for variant, kw in variants.items():
        try:
            kw = {"precision": "mxfp8", "output_format": "mxfp8", **kw}
            layer = FusedMLAQUpProjection(K, H, NOPE, ROPE, device=device, dtype=torch.bfloat16, **kw)
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.norm_weight.copy_(g)
            layers[variant] = layer
        except Exception as e:
            layers[variant] = e
    return layers, w, g


def pick_backward(layer, c: dict) -> str:
    """Prefer `q.backward(dy)` on the MXFP8Tensor output; fall back to `q.dequantize().backward(dy)`
    (dequantize is recorded as a copy, so the gradient is the same). Sets c["_backward"], returns its name."""
    if isinstance(layer, Exception):
        c["_backward"] = None
        return "n/a"
    xr = c["x"][:64].detach().clone().requires_grad_(True)
    try:
        layer(xr, c["cos"][:64], c["sin"][:64]).backward(c["dy"][:64])
        c["_backward"] = lambda q, dy: q.backward(dy)
        return "q.backward(dy)"
    except Exception as e:
        c["_backward"] = lambda q, dy: q.dequantize().backward(dy)
        return f"q.dequantize().backward(dy) (q.backward(dy) raised {type(e).__name__}: {e})"[:300]
    finally:
        layer.zero_grad(set_to_none=True)


def measure_peak(fn: Callable, grads: list[torch.Tensor]) -> tuple[float, float]:
    """(peak MiB, peak minus baseline MiB) of one call of fn, grads cleared first."""
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    for t in grads:
        t.grad = None
    return peak / 2**20, (peak - base) / 2**20


def build_row(row: Row, c: dict) -> tuple[Callable | None, list[torch.Tensor], str | None]:
    """(fn, tensors whose .grad is reset, None) or (None, [], error message): a failing build is a result."""
    try:
        fn, grads = row.build(c)
        return fn, grads, None
    except Exception as e:  # a failing peer (compile error, OOM, missing module) is a result, not a crash
        return None, [], _err(e)


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def time_row(row: Row, fn: Callable, grads: list[torch.Tensor], warmup: int, rep: int) -> tuple[float, float, float]:
    """do_bench (median, p20, p80) of one row, under no_grad for forward rows."""
    from triton.testing import do_bench

    ctx = torch.no_grad() if row.kind == "fwd" else torch.enable_grad()
    with ctx:
        return tuple(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads or None, quantiles=[0.5, 0.2, 0.8]))


def bench_T(rows: list[Row], c: dict, warmup: int, rep: int, rounds: int) -> list[dict]:
    """Every row at one T, `rounds` times round-robin (the GPU's clock and thermal state drift over a run: each
    round times every row once, so a row and its peer see the same conditions); ms = median over the rounds of
    each round's do_bench median, ms_rounds keeps them all. Errors are recorded, never raised."""
    T = c["x"].shape[0]
    built = [(row, *build_row(row, c)) for row in rows]
    res = {row.name: {"T": T, "name": row.name, "kind": row.kind, "ref": row.ref, "ms_rounds": [],
                      "p20_ms_rounds": [], "p80_ms_rounds": []} for row in rows}
    for rnd in range(rounds):
        for row, fn, grads, err in built:
            r = res[row.name]
            if err is not None or "error" in r:
                r.setdefault("error", err)
                continue
            try:
                ms, p20, p80 = time_row(row, fn, grads, warmup, rep)
                r["ms_rounds"].append(ms)
                r["p20_ms_rounds"].append(p20)
                r["p80_ms_rounds"].append(p80)
                print(f"  T={T:<6} round {rnd} {row.name:<30} {ms:.3f} ms", flush=True)
            except Exception as e:
                r["error"] = _err(e)
                print(f"  T={T:<6} round {rnd} {row.name:<30} {r['error']}", flush=True)
    out = []
    for row, fn, grads, _ in built:
        r = res[row.name]
        if "error" not in r:
            try:
                if row.kind == "fwdbwd":
                    with torch.enable_grad():
                        r["peak_mib"], r["peak_extra_mib"] = measure_peak(fn, grads)
                v = r["ms_rounds"]
                r["ms"] = _median(v)
                r["spread"] = (max(v) - min(v)) / r["ms"]
                gemms = 1 if row.kind == "fwd" else 3
                r["tflops"] = gemms * 2 * T * K * N / (r["ms"] * 1e-3) / 1e12
            except Exception as e:
                r["error"] = _err(e)
        torch.cuda.synchronize()
        out.append(r)
    return out


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def add_ratios(results: list[dict]) -> None:
    """t/cuBLAS for forward rows and speed-up vs the row's compiled peer, in place: the median over rounds of the
    same round's ratio (both timed under the same conditions)."""
    by = {(r["T"], r["name"]): r for r in results}
    for r in results:
        cub, ref = by.get((r["T"], "cublas_bf16_gemm"), {}), by.get((r["T"], r["ref"]), {})
        if "ms" in r and r["kind"] == "fwd" and "ms" in cub:
            r["vs_cublas"] = _median([a / b for a, b in zip(r["ms_rounds"], cub["ms_rounds"], strict=False)])
        if "ms" in r and "ms" in ref:
            r["speedup"] = _median([b / a for a, b in zip(r["ms_rounds"], ref["ms_rounds"], strict=False)])


def format_table(results: list[dict]) -> str:
    """Fixed-width plain-text table (errors listed below it)."""
    head = (f"{'T':>6}  {'impl':<30}{'ms':>9}{'spread':>8}{'TFLOP/s':>9}{'t/cuBLAS':>9}{'speed-up':>9}"
            f"{'peak MiB':>10}{'+MiB':>9}")
    lines, errs = [head, "-" * len(head)], []
    for r in results:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"

        if "error" in r:
            errs.append(f"  T={r['T']} {r['name']}: {r['error']}")
            lines.append(f"{r['T']:>6}  {r['name']:<30}{'ERROR (see below)':>18}")
            continue
        spread = f"{100 * r['spread']:.1f}%" if "spread" in r else "-"
        lines.append(f"{r['T']:>6}  {r['name']:<30}{f('ms', '.3f'):>9}{spread:>8}{f('tflops', '.1f'):>9}"
                     f"{f('vs_cublas', '.2f'):>9}{f('speedup', '.2f'):>9}{f('peak_mib', '.0f'):>10}"
                     f"{f('peak_extra_mib', '.0f'):>9}")
    return "\n".join(lines + (["errors:"] + errs if errs else []))


def plot(results: list[dict], path: str, device: str) -> str | None:
    """Grouped bar chart of TFLOP/s per T; returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(dict.fromkeys(r["name"] for r in results))
    Ts = sorted({r["T"] for r in results})
    val = {(r["T"], r["name"]): r.get("tflops", 0.0) for r in results}
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(Ts)), 6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(Ts))]
        ax.bar(xs, [val.get((t, name), 0.0) for t in Ts], width, label=name)
    ax.set_xticks(range(len(Ts)), [f"T={t}" for t in Ts])
    ax.set_ylabel("TFLOP/s (fwd: 1 GEMM, fwd+bwd: 3 GEMMs)")
    ax.set_title(f"MLA query up-projection, K={K}, H={H}, D={D} ({device})")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_inputs(T: int, w: torch.Tensor, g: torch.Tensor, device: torch.device) -> dict:
    """Random inputs for one T: x bf16 [T, K], upstream grad dy bf16 [T, H, D], positions and fp32 tables."""
    pos = torch.arange(T, device=device)
    inv_freq, scaling = rope_inv_freq(ROPE, 10000.0, None)
    cos, sin = build_rope_tables(pos, inv_freq, scaling)  # fp32 [T, 64], HF cat(freqs, freqs)
    return {
        "x": torch.randn(T, K, device=device).to(torch.bfloat16),
        "dy": torch.randn(T, H, D, device=device).to(torch.bfloat16),
        "w": w, "g": g, "pos": pos, "cos": cos, "sin": sin,
        "cos_h": cos[:, : ROPE // 2].contiguous(), "sin_h": sin[:, : ROPE // 2].contiguous(),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m mla_qproj.bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default="1024,4096,16384,65536", help="comma-separated T values")
    p.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    p.add_argument("--quick", action="store_true", help="T in {1024, 4096} only")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of the peers")
    p.add_argument("--rounds", type=int, default=3, help="times every row is timed, round-robin (median reported)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_qproj.bench: no CUDA GPU found; this benchmark needs one.", file=sys.stderr)
        return 2
    tokens = [1024, 4096] if args.quick else [int(t) for t in args.tokens.split(",") if t.strip()]
    device = torch.device("cuda")
    torch.manual_seed(0)
    env = environment()
    for k in ("device", "capability", "torch", "triton", "cuda", "date"):
        print(f"{k:>10}: {env[k]}")
    env["gpu_state_before"] = gpu_state()
    print(f"gpu state (sm clock, max sm clock, power, temperature): {env['gpu_state_before']}")
    layers, w, g = make_layers(device)
    rows = make_rows(layers, args.compile_mode)
    results, backward_call = [], None
    for T in tokens:
        c = make_inputs(T, w, g, device)
        backward_call = pick_backward(layers["mxfp8"], c)
        results += bench_T(rows, c, args.warmup, args.rep, args.rounds)
        del c
        torch.cuda.empty_cache()
    add_ratios(results)
    env["gpu_state_after"] = gpu_state()
    print(f"gpu state after: {env['gpu_state_after']}")
    os.makedirs(args.out, exist_ok=True)
    png = plot(results, os.path.join(args.out, "bench.png"), env["device"])
    meta = {"K": K, "H": H, "qk_head_dim": NOPE, "rope_dim": ROPE, "q_head_dim": D, "N": N,
            "warmup_ms": args.warmup, "rep_ms": args.rep, "rounds": args.rounds, "compile_mode": args.compile_mode,
            "ours_backward_call": backward_call, "forward_rows_under": "torch.no_grad()",
            "ours_layer_errors": {v: repr(e) for v, e in layers.items() if isinstance(e, Exception)}}
    with open(os.path.join(args.out, "bench.json"), "w") as fh:
        json.dump({"environment": env, "settings": meta, "results": results}, fh, indent=1)
    print(f"wrote {os.path.join(args.out, 'bench.json')}" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    print(f"ours fwd+bwd via {backward_call}; forward rows under torch.no_grad(); median over {args.rounds} "
          "round-robin rounds of do_bench medians (spread: max - min over the rounds, of the median); ratios: median "
          "of the same round's ratios\n")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
