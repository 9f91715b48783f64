"""RMSNorm backward (kernels/triton/rmsnorm_bwd.py) vs the reference: dx and dnorm_weight within their bounds over the
program / row-chunk / partial-sum geometries, and run to run bit identical on the GPU (the serial interpreter
cannot differ run to run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_qproj.kernels.triton.rmsnorm_bwd import RMSNormBwdConfig, rmsnorm_bwd
from mla_qproj.reference import qproj as RQ

from _tolerances import assert_bytes_equal, assert_rel_err
from conftest import DEVICE


@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("T, K, small_sum", [(45, 96, False), (700, 96, False), (700, 96, True),
                                             pytest.param(1500, 96, True, marks=pytest.mark.slow),  # 16 s each
                                             (300, 128, False), (700, 128, True)])
def test_rmsnorm_bwd(zc, T, K, small_sum):
    """T = 700 with one program per SM's worth (132): 8 rows per program (the last one partial), the next row
    prefetched; 1500 (the full tier: 16 s per case on 2 cores): 16 per
    program. K = 96 is a row as two chunks (64 + 32), K = 128 one. small_sum: the partials
    summed [16 partials, 16 columns] at a time (several unrolled steps)."""
    x = torch.randn(T, K, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(K, device=DEVICE)
    dxn = torch.randn(T, K, device=DEVICE)
    _, rs = RQ.rmsnorm_fwd(x, w, 1e-6, zc)
    conf = RMSNormBwdConfig(num_warps=4, progs_per_sm=4 if T < 132 else 1)
    if small_sum:
        conf = dataclasses.replace(conf, SUM_BLOCK_P=16, SUM_BLOCK_K=16)
    dx, dg = rmsnorm_bwd(dxn, x, rs, w, zc, config=conf)
    rdx, rdg = RQ.rmsnorm_bwd(dxn, x, rs, w, zc)
    assert_rel_err(dx.float(), rdx.float(), 1e-2, "dx")
    assert_rel_err(dg, rdg, 1e-5, "dnorm_weight")
    if DEVICE.type == "cuda":  # run to run: only compiled kernels, whose programs race, can differ
        dx2, dg2 = rmsnorm_bwd(dxn, x, rs, w, zc, config=conf)
        assert_bytes_equal(dg2, dg, "dnorm_weight determinism")
        assert_bytes_equal(dx2, dx, "dx determinism")
