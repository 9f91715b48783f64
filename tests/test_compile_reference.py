"""torch.compile(fullgraph=True) of the layer on the pure-PyTorch path (SPEC §4: `backend="auto"` on a CPU without
TRITON_INTERPRET runs the reference): no host syncs and no branches on tensor values, so the graph traces for every
precision and output format, and the compiled query and gradients equal eager's bit for bit.

The conftest sets TRITON_INTERPRET=1 for the whole test process on a machine without CUDA, which sends CPU tensors
through the Triton interpreter instead; so the check runs in a child process whose environment lacks it (CPU tensors,
`aot_eager`: AOTAutograd without code generation, no C++ compiler needed). One child runs every case and reports each
one; the tests read its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mla_qproj

pytestmark = pytest.mark.slow  # a child process compiling 12 configurations: about 40 s on two cores (CI's full tier)

PRECISIONS = ("mxfp8", "fp8_block", "bf16")
OUTPUT_FORMATS = ("mxfp8", "bf16")
TABLES = ("position_ids", "cos_sin")

_CHILD = r"""
import json, sys, traceback
import torch
import mla_qproj
from mla_qproj import FusedMLAQUpProjection, MXFP8Query, MXFP8Tensor
from mla_qproj.backend import resolve_backend

assert not resolve_backend("auto", torch.device("cpu")), "backend='auto' should run the reference here"
K, H, NOPE, R, T = 128, 2, 32, 32, 40  # fp8_block needs K % 128 == 0; T not a multiple of 32: partial blocks


def bits(t):
    return None if t is None else t.detach().contiguous().view(torch.uint8)


def same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


def fields(q):
    if isinstance(q, MXFP8Tensor):
        return {n: bits(getattr(q, n)) for n in ("rowwise_data", "rowwise_scale", "columnwise_data",
                                                   "columnwise_scale")}
    return {"q": bits(q)}


def run(layer, forward, x, tables, dy):
    x.grad = layer.weight.grad = layer.norm_weight.grad = None
    q = forward(x, **tables)
    q.backward(dy)
    return q, fields(q), {n: bits(t.grad) for n, t in (("dx", x), ("dweight", layer.weight),
                                                        ("dnorm_weight", layer.norm_weight))}


def check(precision, output_format, table):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = FusedMLAQUpProjection(K, H, NOPE, R, precision=precision, backend="auto",
                                  output_format=MXFP8Query(columnwise=True) if output_format == "mxfp8" else "bf16")
    with torch.no_grad():
        layer.norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(T, K, requires_grad=True)
    if table == "position_ids":
        tables = {"position_ids": torch.arange(3, 3 + T)}
    else:
        tables = {"cos": torch.randn(T, R), "sin": torch.randn(T, R)}
    dy = torch.randn(T, H, NOPE + R)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q_e, out_e, grads_e = run(layer, layer, x, tables, dy)
    q_c, out_c, grads_c = run(layer, compiled, x, tables, dy)
    bad = [] if type(q_c) is type(q_e) else [f"query type {type(q_c).__name__} != {type(q_e).__name__}"]
    bad += [f"{n} differs" for n in out_e if not same(out_c[n], out_e[n])]
    bad += [f"{n} differs" for n in grads_e if not same(grads_c[n], grads_e[n])]
    return "; ".join(bad) or "ok"


report = {}
for case in json.loads(sys.argv[1]):
    try:
        report["/".join(case)] = check(*case)
    except Exception as e:  # report every case, not only the first failure
        last = traceback.format_exception_only(type(e), e)
        report["/".join(case)] = f"{type(e).__name__}: " + " ".join(" ".join(last).split())[:600]
print("REPORT " + json.dumps(report))
"""

CASES = [(p, o, t) for p in PRECISIONS for o in OUTPUT_FORMATS for t in TABLES]


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(mla_qproj.__file__).resolve().parents[1])  # the child imports the package this process tests
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"child failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("output_format", OUTPUT_FORMATS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_compiled_reference_matches_eager(report, precision, output_format, table):
    assert report[f"{precision}/{output_format}/{table}"] == "ok"
