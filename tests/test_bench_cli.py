"""The benchmark CLIs: --help shows defaults; without a GPU they exit non-zero with their message."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.parametrize("module", ["mla_qproj.bench", "mla_qproj.bench_kernels"])
def test_help_shows_defaults(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(default:" in out.stdout, out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
@pytest.mark.parametrize("module", ["mla_qproj.bench", "mla_qproj.bench_kernels"])
def test_exits_nonzero_without_gpu(module):
    out = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "no CUDA GPU" in out.stderr, out.stderr


def test_bench_tp_gloo_smoke(tmp_path):
    """The multi-GPU benchmark's code path on two gloo ranks (CPU, tiny shape, no timing claims): it runs every row
    and reports the bytes each collective moves per token."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, installed or not
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",  # the reference backend: quick on the CPU
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "mla_qproj.bench_tp", "--device", "cpu", "--tokens", "512", "--heads", "4", "--k", "128",
                          "--no-compile", "--warmup", "1", "--rep", "1", "--results", str(tmp_path / "r.jsonl"),
                          "--precisions", "fp8_block,mxfp8,bf16"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for row in ("megatron_unfused", "ours_fp8_block", "ours_fp8_block_overlap", "ours_mxfp8_tp1", "gather_bf16"):
        assert row in out.stdout, out.stdout
    assert "132, 132, 512" in out.stdout, "fp8_block at K = 128: 128 code bytes + one fp32 scale per token"
    assert (tmp_path / "r.jsonl").read_text().count("\n") == 1


def test_chart_tells_every_row_apart():
    """Each panel of the chart (forward rows; forward + backward rows) gives every row its own colour and hatch."""
    from mla_qproj.bench import _style, make_rows

    rows = make_rows({}, "default")
    for kind in ("fwd", "fwdbwd"):
        names = [r.name for r in rows if r.kind == kind]
        styles = [(_style(n)["color"], _style(n)["hatch"]) for n in names]
        assert len(names) > 3
        assert len(set(styles)) == len(styles), dict(zip(names, styles, strict=True))


def test_host_cpu_profile_tool_runs(tmp_path):
    """tools/host_cpu_profile.py runs on the CPU (kernels stubbed) and prints the layer's host time beside the eager
    composition's, as a ratio per precision (no timing claim here: it is a measuring tool)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "host_cpu_profile.py")], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for precision in ("mxfp8", "fp8_block"):
        m = re.search(rf"composition's, {precision}: ([0-9.]+)", out.stdout)
        assert m and float(m.group(1)) > 0, out.stdout
    assert "eager unfused composition" in out.stdout


@pytest.mark.parametrize("case,kernels,max_regs", [
    ("rmsnorm_fp8_block T=16384 (train)", {"_rsigma_kernel", "_rmsnorm_fp8_block_packed_kernel"}, 168),
    ("rope_fp8_block (default)", {"_rope_fp8_block_packed_kernel"}, 168),
])
def test_compile_sm90_tool_compiles_without_spills(tmp_path, case, kernels, max_regs):
    """tools/compile_sm90.py on this machine (no GPU): the block-FP8 RMSNorm + quantize launch (the rsigma kernel and
    the word-packed quantizer) and the gradient quantizer's default launch compile for sm_90 with no spill stack and
    no local memory, the word-packed quantizer and the gradient kernel within their 168-register caps on Triton 3.6
    (uncapped, ptxas gives them 211 / 198; Triton 3.9's code needs 243 / 253 and runs uncapped), and the tool writes
    each kernel's SASS where asked."""
    import os
    import re

    import triton

    if not triton.__version__.startswith("3.6."):
        max_regs = 255

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_sm90.py"), "-k", case,
                          "--sass", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith(case)]
    assert {ln[len(case):].split()[0] for ln in rows} == kernels, out.stdout
    for ln in rows:
        stats = dict(re.findall(r"(\w+)=(\d+)", ln))
        assert stats["stack"] == "0" and stats["LDL"] == "0" and stats["STL"] == "0", ln
        assert 0 < int(stats["regs"]) <= max_regs and int(stats["instr"]) > 0, ln
    assert "0 case(s) failed to compile" in out.stdout
    assert len(list(tmp_path.glob("*.sass"))) == len(kernels)


def test_v2_lite_shape_builds_norm_free_rows():
    """--shape v2-lite: every variant of our layer is built norm-free at DeepSeek-V2-Lite's query geometry (hidden
    2048, 16 heads of 128 + 64), the peers' RMSNorm becomes the identity, and the forward and training rows exist;
    the module's globals go back to V3 afterwards."""
    from mla_qproj import bench

    try:
        bench.set_shape("v2-lite")
        layers, w, g = bench.make_layers(torch.device("cpu"))
        assert tuple(w.shape) == (16 * 192, 2048)
        for variant, layer in layers.items():
            assert not isinstance(layer, Exception), (variant, layer)
            assert not layer.cfg.norm and layer.norm_weight is None, variant
            assert (layer.cfg.q_lora_rank, layer.cfg.num_heads, layer.cfg.q_head_dim) == (2048, 16, 192), variant
        x = torch.randn(4, 2048)
        assert torch.equal(bench._rmsnorm_fp32(x, g), x)
        names = {r.name for r in bench.make_rows(layers, "default")}
        assert {"cublas_bf16_gemm", "unfused_fp8_block", "ours_fp8_block", "unfused_fp8_block_fwdbwd",
                "ours_fp8_block_fwdbwd", "compiled_unfused_bf16_fwdbwd", "ours_mxfp8"} <= names
    finally:
        bench.set_shape("v3")
    assert (bench.K, bench.H, bench.NORM) == (1536, 128, True)
