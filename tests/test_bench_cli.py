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
