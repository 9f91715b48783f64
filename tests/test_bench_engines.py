"""mla_qproj.bench_engines on the CPU at the tiny shape, one engine per subprocess (Megatron's CPU shims patch torch
globally): a table row per (engine, precision) with finite positive times, and the record's checks that the timed
"ours" step is the fused layer (fused_query_layer(attn) is not None and the layer ran once per step) and that the
attention's forward output with the layer agrees with the stock module's on the same input (bf16 within 2 %,
fp8_block within 15 %: loose bounds, a sanity check, not the layer's accuracy tests). No timing claims."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_MODULES = {"megatron": "megatron.core", "torchtitan": "torchtitan.models.deepseek_v3"}
PRECISIONS = ("bf16", "fp8_block")
REL_DIFF_BOUND = {"bf16": 0.02, "fp8_block": 0.15}


def _run(engine: str, tmp_path) -> tuple[str, dict]:
    out = tmp_path / "engines.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    # TRITON_INTERPRET=1 comes from conftest on a machine without CUDA: the layer's Triton kernels, interpreted
    cmd = [sys.executable, "-m", "mla_qproj.bench_engines", "--device", "cpu", "--shape", "tiny", "--tokens", "64",
           "--rounds", "1", "--rep", "1", "--warmup", "0", "--engines", engine, "--precisions", ",".join(PRECISIONS),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 1, lines
    return proc.stdout, json.loads(lines[0])


@pytest.mark.parametrize("engine", sorted(ENGINE_MODULES))
def test_bench_engines_cpu_tiny(engine, tmp_path):
    pytest.importorskip(ENGINE_MODULES[engine], reason=f"{engine} is not installed "
                        "(pip install 'mla_qproj[integrations]')")
    stdout, record = _run(engine, tmp_path)
    assert "lower is faster" in stdout, stdout
    assert record["engines"][engine].get("error") is None, record["engines"]
    assert "skipped" not in record["engines"][engine], record["engines"]
    # the markdown table: one row per (engine, precision), times finite and positive
    for precision in PRECISIONS:
        m = re.search(rf"^\| {engine} \| 64 \| 2 \| {precision} \| ([^|]+) \| ([^|]+) \| ([^|]+) \|", stdout, re.M)
        assert m, f"no table row for {engine} {precision}:\n{stdout}"
        stock_ms, ours_ms, ratio = (float(g) for g in m.groups())
        for v in (stock_ms, ours_ms, ratio):
            assert math.isfinite(v) and v > 0, m.group(0)
    rows = {r["name"]: r for r in record["results"] if r["engine"] == engine}
    assert set(rows) == {"stock", *(f"ours_{p}" for p in PRECISIONS)}, sorted(rows)
    assert all("error" not in r for r in rows.values()), [r.get("error") for r in rows.values()]
    assert rows["stock"]["ms"] > 0
    for precision in PRECISIONS:
        r = rows[f"ours_{precision}"]
        assert r["T"] == 64 and r["precision"] == precision
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["ratio"] > 0
        # the timed "with" path is the layer: fused_query_layer(attn) is set and the layer ran once per step
        assert r["layer_calls_per_step"] == 1, r
        assert f"precision={precision}" in r["layer"], r["layer"]
        # with and without the layer the attention's forward agrees (a loose bound: the layer's roundings only)
        assert 0 <= r["rel_diff_fwd"] < REL_DIFF_BOUND[precision], (precision, r["rel_diff_fwd"])
    assert record["settings"]["geometry"]["heads"] == 2


def test_missing_engine_is_skipped(tmp_path, monkeypatch):
    """An engine that cannot be imported is skipped with its reason; the run exits 0."""
    import builtins

    from mla_qproj import bench_engines

    real_import = builtins.__import__

    def no_engines(name, *args, **kwargs):
        if name.split(".")[0] in ("megatron", "torchtitan"):
            raise ImportError(f"No module named {name!r} (test)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_engines)
    out = tmp_path / "r.jsonl"
    assert bench_engines.main(["--device", "cpu", "--shape", "tiny", "--tokens", "64", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    for engine in ("megatron", "torchtitan"):
        assert "not importable" in record["engines"][engine]["skipped"]
    assert record["results"] == []
