"""Tensor and sequence parallelism (SPEC §6) on gloo: world sizes 2 and 4, sequence parallelism on and off, every
precision and output format, against the tp = 1 layer on the same inputs in every rank:
- the local heads' query: byte-identical;
- dW's local rows: identical;
- dx (the local slice under sequence parallelism) and dnorm_weight: equal up to the fp32 summation order of the
  reduction (relative error <= REL_ERR_REDUCTION_ORDER).
Each world size is one spawn of processes running every case (process start-up dominates the time)."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

from _tolerances import REL_ERR_REDUCTION_ORDER, assert_bytes_equal, assert_rel_err

K, H, NOPE, R = 128, 4, 32, 32
D = NOPE + R

# (precision, output_format, columnwise_output, sequence_parallel, backend)
CASES = [(p, o, o == "mxfp8" and p != "bf16", sp, "torch")
         for p in ("bf16", "mxfp8", "fp8_block") for o in ("bf16", "mxfp8") for sp in (False, True)]
# the Triton kernels (interpreter on the CPU) for one case per precision
CASES += [("mxfp8", "mxfp8", True, True, "auto"), ("fp8_block", "bf16", False, True, "auto"),
          ("bf16", "bf16", False, False, "auto")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _q_fields(q):
    if isinstance(q, MXFP8Tensor):
        return {f: getattr(q, f) for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
                if getattr(q, f) is not None}
    return {"q": q}


def _check_case(rank: int, world: int, precision: str, output_format: str, columnwise: bool, sp: bool,
                backend: str, dev: str = "cpu") -> None:
    tag = f"[world={world} rank={rank} {precision}/{output_format} col={columnwise} sp={sp} {backend} {dev}]"
    dev = torch.device(dev)
    kw = dict(precision=precision, output_format=output_format, columnwise_output=columnwise, backend=backend,
              device=dev)
    torch.manual_seed(1234)  # the same parameters and inputs on every rank
    full = FusedMLAQUpProjection(K, H, NOPE, R, **kw)
    with torch.no_grad():
        full.norm_weight.copy_(1 + 0.2 * torch.randn(K))
    s, b = 64 * world, 2  # [s, b] tokens; a rank's slice along s holds 128 tokens (a whole fp8_block column block)
    x = torch.randn(s, b, K).to(dev)
    dy = torch.randn(s, b, H, D).to(dev)
    pos = torch.arange(s, device=dev)[:, None].expand(s, b)
    tp = FusedMLAQUpProjection(K, H, NOPE, R, tp_group=dist.group.WORLD, sequence_parallel=sp, **kw)
    hl = H // world
    rows = slice(rank * hl * D, (rank + 1) * hl * D)
    with torch.no_grad():
        tp.weight.copy_(full.weight[rows])
        tp.norm_weight.copy_(full.norm_weight)

    x_full = x.clone().requires_grad_(True)
    q_full = full(x_full, position_ids=pos)
    (q_full.dequantize() if isinstance(q_full, MXFP8Tensor) else q_full).float().backward(dy)

    sl = slice(rank * s // world, (rank + 1) * s // world)
    x_tp = (x[sl] if sp else x).clone().requires_grad_(True)
    q_tp = tp(x_tp, position_ids=pos)
    assert q_tp.shape == (s, b, hl, D), f"{tag} query shape {tuple(q_tp.shape)}"
    heads = slice(rank * hl, (rank + 1) * hl)
    for f, t in _q_fields(q_tp).items():
        want = _q_fields(q_full)[f]
        want = want[:, heads] if f == "columnwise_scale" else want[:, :, heads]  # [T/32, H, D] vs [s, b, H, ...]
        assert_bytes_equal(t.contiguous(), want.contiguous(), f"{tag} {f}")
    (q_tp.dequantize() if isinstance(q_tp, MXFP8Tensor) else q_tp).float().backward(dy[:, :, heads])
    assert_bytes_equal(tp.weight.grad, full.weight.grad[rows], f"{tag} dW local rows")
    assert_rel_err(x_tp.grad, x_full.grad[sl] if sp else x_full.grad, REL_ERR_REDUCTION_ORDER, f"{tag} dx")
    assert_rel_err(tp.norm_weight.grad, full.norm_weight.grad, REL_ERR_REDUCTION_ORDER, f"{tag} dnorm_weight")


def _check_norm_weight_sequence_parallel_attribute(rank: int, world: int) -> None:
    """Megatron's convention: a norm weight marked `sequence_parallel` keeps this rank's partial gradient."""
    torch.manual_seed(99)
    kw = dict(precision="bf16", output_format="bf16", backend="torch")
    full = FusedMLAQUpProjection(K, H, NOPE, R, **kw)
    tp = FusedMLAQUpProjection(K, H, NOPE, R, tp_group=dist.group.WORLD, sequence_parallel=True, **kw)
    hl = H // world
    with torch.no_grad():
        tp.weight.copy_(full.weight[rank * hl * D:(rank + 1) * hl * D])
    tp.norm_weight.sequence_parallel = True
    s = 64 * world
    x, dy, pos = torch.randn(s, K), torch.randn(s, H, D), torch.arange(s)
    sl = slice(rank * s // world, (rank + 1) * s // world)
    tp(x[sl], position_ids=pos).float().backward(dy[:, rank * hl:(rank + 1) * hl])
    partial = tp.norm_weight.grad.clone()
    dist.all_reduce(partial)  # what the trainer does for sequence_parallel parameters
    full(x, position_ids=pos).float().backward(dy)
    assert_rel_err(partial, full.norm_weight.grad, REL_ERR_REDUCTION_ORDER, "dnorm_weight (summed by the trainer)")
    assert not torch.allclose(tp.norm_weight.grad, full.norm_weight.grad), "the local gradient should be partial"


def _check_from_modules_and_compile(rank: int, world: int) -> None:
    """Megatron's layout (a column-parallel linear's local rows, the full norm) through from_modules; the
    sequence-parallel layer compiled (aot_eager, fullgraph: the functional collectives are in the graph) gives the
    eager bytes and gradients."""
    from torch import nn

    torch.manual_seed(7)
    hl = H // world
    norm, lin_full = nn.RMSNorm(K, eps=1e-6), nn.Linear(K, H * D, bias=False)
    lin = nn.Linear(K, hl * D, bias=False)
    with torch.no_grad():
        lin.weight.copy_(lin_full.weight[rank * hl * D:(rank + 1) * hl * D])
        norm.weight.uniform_(0.5, 1.5)
    kw = dict(num_heads=H, qk_head_dim=NOPE, qk_pos_emb_head_dim=R, precision="bf16", output_format="bf16",
              backend="torch")
    tp = FusedMLAQUpProjection.from_modules(norm, lin, tp_group=dist.group.WORLD, sequence_parallel=True, **kw)
    full = FusedMLAQUpProjection.from_modules(norm, lin_full, **kw)
    assert tp.weight is lin.weight and tp.norm_weight is norm.weight and tp.cfg.num_heads == hl
    s = 64 * world
    x, dy, pos = torch.randn(s, K), torch.randn(s, hl, D), torch.arange(s)
    sl = slice(rank * s // world, (rank + 1) * s // world)
    assert_bytes_equal(tp(x[sl], position_ids=pos), full(x, position_ids=pos)[:, rank * hl:(rank + 1) * hl],
                       "from_modules query")
    compiled = torch.compile(tp, backend="aot_eager", fullgraph=True)
    grads = []
    for f in (tp, compiled):
        xx = x[sl].clone().requires_grad_(True)
        q = f(xx, position_ids=pos)
        q.float().backward(dy)
        grads.append((q.detach(), xx.grad, lin.weight.grad.clone(), norm.weight.grad.clone()))
        lin.weight.grad = norm.weight.grad = None
    for (a, b), label in zip(zip(*grads, strict=True), ("q", "dx", "dW", "dnorm_weight"), strict=True):
        assert_bytes_equal(a, b, f"compiled vs eager {label}")


def _worker(rank: int, world: int, port: int, cases: list, errdir: str, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        for case in cases:
            _check_case(rank, world, *case)
        if backend == "gloo":
            _check_norm_weight_sequence_parallel_attribute(rank, world)
            _check_from_modules_and_compile(rank, world)
        dist.barrier()  # every rank done before any tears the group down (gloo aborts a peer still sending)
    except Exception:
        with open(os.path.join(errdir, f"rank{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_and_sequence_parallel_match_tp1(world, tmp_path):
    try:
        mp.spawn(_worker, args=(world, _free_port(), CASES, str(tmp_path)), nprocs=world, join=True)
    except mp.ProcessRaisedException:
        errs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt")))
        pytest.fail(f"a rank failed:\n{errs}")


@pytest.mark.gpu
def test_nccl_path_world_size_one(tmp_path):
    """The NCCL code path (CUDA tensors, the compiled kernels, cuBLAS blockwise GEMMs) at the world size one GPU
    allows: sequence parallelism over one rank must give the tp = 1 bytes."""
    cases = [(p, o, o == "mxfp8" and p != "bf16", True, "auto", "cuda") for p in ("bf16", "mxfp8", "fp8_block")
             for o in ("bf16", "mxfp8")]
    try:
        mp.spawn(_worker, args=(1, _free_port(), cases, str(tmp_path), "nccl"), nprocs=1, join=True)
    except mp.ProcessRaisedException:
        errs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt")))
        pytest.fail(f"the rank failed:\n{errs}")


def test_construction_errors():
    with pytest.raises(ValueError, match="tp_group"):
        FusedMLAQUpProjection(K, H, NOPE, R, sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel"):
        FusedMLAQUpProjection(K, H, NOPE, R, sequence_parallel="yes")
    with pytest.raises((ValueError, TypeError), match="tp_group"):
        FusedMLAQUpProjection(K, H, NOPE, R, tp_group=object())
