"""examples/train_precisions.py: a few training steps per precision in-process, its query paths against each
other, its argument checks. On the CPU lane conftest sets TRITON_INTERPRET=1, so backend="auto" runs the fused
layer's Triton kernels under the interpreter here (the script's own CPU default is the PyTorch reference, which
the tests pick with --backend torch where the kernels add nothing but time)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "examples" / "train_precisions.py"
_spec = importlib.util.spec_from_file_location("train_precisions", _PATH)
tp = importlib.util.module_from_spec(_spec)
sys.modules["train_precisions"] = tp  # dataclasses resolve the module of Config by name
_spec.loader.exec_module(tp)

# small enough that three steps of every precision take seconds under the interpreter; q_lora_rank 128 so that
# fp8_block (K % 128 == 0) can run once it exists
TINY = ["--batch-size", "4", "--pairs", "4", "--queries", "2", "--keys", "8", "--values", "8", "--d-model", "32",
        "--layers", "2", "--heads", "2", "--q-lora-rank", "128", "--kv-lora-rank", "32", "--qk-nope-dim", "32",
        "--qk-rope-dim", "32", "--v-head-dim", "32", "--mlp-hidden", "32", "--eval-batches", "1", "--log-every", "0"]


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _run(tmp_path: Path, *extra: str, steps: int = 3) -> dict:
    rc = tp.main(["--steps", str(steps), "--out", str(tmp_path), *TINY, *extra])
    assert rc == 0, f"main returned {rc}"
    report = json.loads((tmp_path / "losses.json").read_text())
    assert (tmp_path / "loss.png").exists() == _has_matplotlib()
    return report


def test_main_trains_every_available_precision(tmp_path):
    report = _run(tmp_path, "--layers", "1")  # the fused layer's Triton kernels, interpreted: ~1 s a step
    results = report["results"]
    assert list(results) == list(tp.PRECISIONS)
    for name in tp.PRECISIONS:  # every precision the package has trains (losing one fails here)
        assert results[name]["status"] == "ok", (name, results[name])
    trained = {k: r for k, r in results.items() if r["status"] == "ok"}
    for name, r in trained.items():
        assert len(r["losses"]) == 3 and len(r["accs"]) == 3, name
        assert all(math.isfinite(v) for v in r["losses"] + [r["final_loss"], r["eval_loss"]]), (name, r["losses"])
    # the same initial weights and the same first batch: the step-0 losses differ by the query's rounding only
    first = {k: r["losses"][0] for k, r in trained.items()}
    ref = first["composition"]
    assert all(abs(v - ref) <= 2e-2 * ref for v in first.values()), first
    assert math.log(8) / 2 < ref < 2 * math.log(8 + 8), first  # near chance (ln(values)) at the start


def test_main_mxfp8_output_and_position_ids(tmp_path):
    report = _run(tmp_path, "--precisions", "mxfp8,composition", "--output-format", "mxfp8",
                  "--rope-input", "position_ids", "--backend", "torch", steps=2)
    assert report["config"]["output_format"] == "mxfp8" and report["config"]["rope_input"] == "position_ids"
    assert list(report["results"]) == ["mxfp8", "composition"]
    for r in report["results"].values():
        assert r["status"] == "ok" and all(math.isfinite(v) for v in r["losses"])


def _tiny_cfg(*extra: str):
    return tp.config_from_args(tp.parse_args([*TINY, *extra]), torch.device("cpu"))


@pytest.mark.parametrize("rope_input", ["tables", "position_ids"])
def test_fused_query_matches_the_composition(rope_input):
    """The script's torch query path (interleaved RoPE written out) and the fused bf16 layer compute the same
    query: both round RMSNorm(x) and W to bf16 and accumulate in fp32; the composition also rounds y to bf16
    before a bf16 RoPE (a few bf16 ulps)."""
    cfg = _tiny_cfg("--rope-input", rope_input)
    attn = tp.build_model(cfg, "composition", torch.device("cpu")).blocks[0].attn
    torch.nn.init.normal_(attn.q_a_layernorm.weight, 1.0, 0.2)  # not the all-ones init: the gain is applied
    s = 24
    c_q = torch.randn(3, s, cfg.q_lora_rank) * 2.0
    cos, sin = tp.rope_tables(s, cfg.qk_rope_dim, cfg.rope_theta, c_q.device)
    pos = torch.arange(s)
    q_ref = attn.query(c_q, cos, sin, pos).float()
    attn.use_fused_query("bf16")
    q = attn.query(c_q, cos, sin, pos).float()
    assert q.shape == q_ref.shape == (3, s, cfg.heads, cfg.qk_nope_dim + cfg.qk_rope_dim)
    rope = q_ref[..., cfg.qk_nope_dim:]
    assert rope[:, 1:].abs().amax() > 0.1  # RoPE columns carry signal (and position > 0 rotates them)
    err = ((q - q_ref).norm() / q_ref.norm()).item()
    assert err < 1e-2, f"fused bf16 vs composition: relative error {err:.2e}"
    err_rope = ((q - q_ref)[..., cfg.qk_nope_dim:].norm() / rope.norm()).item()
    assert err_rope < 1e-2, f"RoPE columns: relative error {err_rope:.2e}"


def test_rope_deepseek_layout_by_hand():
    """SPEC §3 deepseek: pair i = input columns (2i, 2i+1); a' lands in column i, b' in column R/2 + i."""
    t = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # pairs (1, 2) and (3, 4)
    c, s = 0.6, 0.8
    cos = torch.tensor([[c, 1.0, c, 1.0]])  # cat(freqs, freqs): pair 0 rotated, pair 1 not (angle 0)
    sin = torch.tensor([[s, 0.0, s, 0.0]])
    out = tp.rope_deepseek(t, cos, sin)
    expected = torch.tensor([[1 * c - 2 * s, 3.0, 2 * c + 1 * s, 4.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_unknown_precision_is_reported_as_unavailable():
    with pytest.raises(tp.PrecisionUnavailable):
        tp.build_model(_tiny_cfg(), "fp3_not_a_precision", torch.device("cpu"))


def test_other_layer_errors_are_not_taken_for_an_unavailable_precision():
    # q_head_dim 48 is not a multiple of 32: the layer's ValueError for mxfp8 output is a real failure
    cfg = _tiny_cfg("--output-format", "mxfp8", "--qk-nope-dim", "16")
    with pytest.raises(ValueError, match="q_head_dim"):
        tp.build_model(cfg, "mxfp8", torch.device("cpu"))


@pytest.mark.parametrize("argv", [["--queries", "5", "--pairs", "4"], ["--precisions", "mxfp8,fp9"],
                                  ["--precisions", "bf16,bf16"], ["--keys", "3", "--pairs", "4"],
                                  ["--qk-rope-dim", "31"], ["--steps", "0"],
                                  ["--device", "not-a-device"]])
def test_bad_arguments_exit_2(argv, tmp_path, capsys):
    assert tp.main([*argv, "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_failing_run_exits_1(tmp_path):
    # mxfp8 output needs q_head_dim % 32 == 0: that precision fails, the composition still trains
    rc = tp.main(["--steps", "2", "--out", str(tmp_path), *TINY, "--precisions", "composition,mxfp8",
                  "--output-format", "mxfp8", "--qk-nope-dim", "16"])
    assert rc == 1
    results = json.loads((tmp_path / "losses.json").read_text())["results"]
    assert results["composition"]["status"] == "ok"
    assert results["mxfp8"]["status"] == "failed" and "q_head_dim" in results["mxfp8"]["reason"]


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tp.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = [a for a in tp.parse_args([]).__dict__]
    assert text.count("(default:") == len(options), text
    assert "--steps STEPS" in text and "(default: 500)" in text


def test_mqar_batch_asks_for_the_value_after_each_queried_key():
    cfg = _tiny_cfg("--pairs", "6", "--queries", "4", "--keys", "10", "--values", "7", "--batch-size", "16")
    tokens, targets = tp.mqar_batch(torch.Generator().manual_seed(3), cfg)
    assert tokens.shape == targets.shape == (16, 2 * 6 + 4)
    for row, tgt in zip(tokens.tolist(), targets.tolist(), strict=True):
        keys, vals = row[0:12:2], row[1:12:2]
        assert len(set(keys)) == 6 and all(0 <= k < 10 for k in keys)  # distinct keys from [0, keys)
        assert all(10 <= v < 17 for v in vals)  # values from [keys, keys + values)
        assert tgt[:12] == [tp.IGNORE] * 12  # the context is not scored
        queries = row[12:]
        assert len(set(queries)) == 4 and set(queries) <= set(keys)
        assert tgt[12:] == [vals[keys.index(k)] for k in queries]


@pytest.mark.gpu
@pytest.mark.parametrize("output_format", ["bf16", "mxfp8"])
def test_main_on_cuda(tmp_path, output_format):
    """The compiled Triton path inside bf16 autocast (the CUDA default compute dtype): a few steps train."""
    rc = tp.main(["--device", "cuda", "--steps", "5", "--out", str(tmp_path), "--output-format", output_format,
                  "--log-every", "0"])
    assert rc == 0
    report = json.loads((tmp_path / "losses.json").read_text())
    assert report["config"]["compute_dtype"] == "bf16"
    trained = {k: r for k, r in report["results"].items() if r["status"] == "ok"}
    assert {"composition", "bf16", "mxfp8"} <= set(trained)
    ref = trained["composition"]["losses"][0]
    for name, r in trained.items():
        assert all(math.isfinite(v) for v in r["losses"]), (name, r["losses"])
        assert abs(r["losses"][0] - ref) <= 2e-2 * ref, (name, r["losses"][0], ref)


def test_readme_api_snippet_runs_as_written():
    """README's API block runs as written on a CPU (a subprocess without TRITON_INTERPRET: a CPU user's default,
    the PyTorch reference) and gives what its comments say."""
    import os
    import re
    import subprocess

    readme = (_PATH.parents[1] / "README.md").read_text()
    block = re.search(r"^## API.*?```python\n(.*?)```", readme, re.S | re.M).group(1)
    check = ("\nassert q.shape == (8, 4, 192) and q.dtype == torch.bfloat16\n"
             "assert x.grad is not None and layer.weight.grad is not None and layer.norm_weight.grad is not None\n"
             "assert data.shape == (300, 256) and data.dtype == torch.float8_e4m3fn and scale_inv.shape == (300, 2)\n"
             "assert isinstance(qt, MXFP8Tensor)\n"
             "assert tuple(layer2.weight.shape) == (4 * 192, 256)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(_PATH.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", block + check], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
