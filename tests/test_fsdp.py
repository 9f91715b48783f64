"""FSDP2 (`torch.distributed.fsdp.fully_shard`) around the layer: two gloo ranks on the CPU, a few AdamW steps.

The sharded run must train like one process that sees both ranks' batches (gradients averaged over the ranks, as
FSDP2 reduces them), and the layer's output must not be a view (FSDP2 warns about returned views: an in-place op
on one would drop its pre-backward hook). The ranks are spawned processes that meet through a file store (no port
to pick); gloo connects them over the loopback interface."""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _spawn import spawn_ranks

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

WORLD = 2
STEPS = 3
GEOMS = {"mxfp8": (64, 2, 32, 32, 64), "fp8_block": (128, 2, 32, 32, 64)}  # K, H, nope, R, D (SPEC §5: K % 128)
T = 16
CASES = (("mxfp8", "mxfp8"), ("mxfp8", "bf16"), ("fp8_block", "mxfp8"), ("fp8_block", "bf16"))  # precision, output
BACKEND = "torch"  # the reference path: FSDP2 sees the same module, Function and outputs; the interpreter is ~3x slower

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


class _Block(torch.nn.Module):
    def __init__(self, precision: str, output_format: str) -> None:
        super().__init__()
        self.q = FusedMLAQUpProjection(*GEOMS[precision], precision=precision, output_format=output_format,
                                       backend=BACKEND)

    def forward(self, x, cos, sin):
        return self.q(x, cos, sin)


def _model(precision: str, output_format: str) -> _Block:
    torch.manual_seed(0)  # the same initial parameters on every rank and in the single-process run
    m = _Block(precision, output_format)
    with torch.no_grad():
        m.q.norm_weight.uniform_(0.5, 1.5)  # not all ones: its gradient path is exercised
    return m


def _batch(precision: str, step: int, rank: int):
    """Rank `rank`'s batch at `step`: x, cos, sin and a random upstream gradient for the query."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    K, H, _, R, D = GEOMS[precision]
    return (torch.randn(T, K, generator=g), torch.randn(T, R, generator=g), torch.randn(T, R, generator=g),
            torch.randn(T, H, D, generator=g))


def _train_step(m, opt, batches, scale: float) -> list[bool]:
    """Forward + backward of each batch (gradients accumulate, times `scale`), one optimizer step. Returns, per
    forward, whether the query came back as a view."""
    views = []
    for x, cos, sin, dy in batches:
        q = m(x, cos, sin)
        views.append(q._base is not None)
        dense = q.dequantize(torch.float32) if isinstance(q, MXFP8Tensor) else q.float()
        dense.backward(dy * scale)
    opt.step()
    opt.zero_grad()
    return views


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks talk over the loopback interface only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))  # CPU parameters also on a machine with a GPU

        result = {}
        for precision, output_format in CASES:
            m = _model(precision, output_format)
            fully_shard(m, mesh=mesh)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            views = []
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always")
                for step in range(STEPS):
                    views += _train_step(m, opt, [_batch(precision, step, rank)], 1.0)
            params = {name: p.full_tensor().detach().clone() for name, p in m.named_parameters()}
            result[precision, output_format] = dict(params=params, views=views,
                                         warnings=[f"{w.filename}:{w.lineno}: {w.message}" for w in records])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank done before any tears the group down (gloo aborts a peer still sending)
    finally:
        dist.destroy_process_group()


def test_fully_shard_trains_like_one_process(tmp_path):
    spawn_ranks(_worker, WORLD, tmp_path, str(tmp_path / "store"), str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for precision, output_format in CASES:
        m = _model(precision, output_format)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        views = []
        for step in range(STEPS):  # FSDP2 averages the ranks' gradients: accumulate both batches, scaled by 1/2
            views += _train_step(m, opt, [_batch(precision, step, r) for r in range(WORLD)], 1.0 / WORLD)
        expected = dict(m.named_parameters())
        for rank, res in enumerate(results):
            got = res[precision, output_format]
            label = f"{precision} GEMMs, {output_format} query, rank {rank}"
            assert not any("view" in w for w in got["warnings"]), f"{label}: {got['warnings']}"
            assert got["views"] == [False] * STEPS, f"{label}: the layer returned a view"
            assert got["params"].keys() == expected.keys()
            for name, p in got["params"].items():
                torch.testing.assert_close(p, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, name=name, label=label: f"{label}, {name}: {m}")
                assert not torch.equal(p, _model(precision, output_format).get_parameter(name).detach()), \
                    f"{label}: {name} never moved"
        assert views == [False] * (STEPS * WORLD), f"{precision}, {output_format}: the layer returned a view (one " \
            "process)"
