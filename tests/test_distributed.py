"""Tensor and sequence parallelism (SPEC §6) on gloo: world sizes 2 and 4, sequence parallelism on and off, every
precision and output format, against the tp = 1 layer on the same inputs in every rank:
- the local heads' query: byte-identical;
- dW's local rows: identical;
- dx (the local slice under sequence parallelism) and dnorm_weight: equal up to the fp32 summation order of the
  reduction (relative error <= REL_ERR_REDUCTION_ORDER).
Each world size is one spawn of processes running every case (process start-up dominates the time)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _spawn import free_port, spawn_ranks

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor
from mla_qproj import backend as _backend

from _helpers import layer_kwargs, make_config
from _tolerances import REL_ERR_REDUCTION_ORDER, assert_bytes_equal, assert_rel_err

K, H, NOPE, R = 128, 4, 32, 32
D = NOPE + R

# (precision, output_format, columnwise_output, sequence_parallel, backend, tp_comm_overlap, rope_style)
CASES = [(p, o, o == "mxfp8" and p != "bf16", sp, "torch", False, "deepseek")
         for p in ("bf16", "mxfp8", "fp8_block") for o in ("bf16", "mxfp8") for sp in (False, True)]
# the Triton kernels (interpreter on the CPU) for one case per precision (R/2 = 16 deepseek pairs: the general
# GEMM + RoPE kernel path), and the overlapped sequence-parallel forward (the fused GEMM over this rank's rows
# first, then each peer's; gptj pairs: a geometry the fused kernel covers) for each precision
CASES += [("mxfp8", "mxfp8", True, True, "auto", False, "deepseek"),
          ("fp8_block", "bf16", False, True, "auto", False, "deepseek"),
          ("bf16", "bf16", False, False, "auto", False, "deepseek"),
          ("mxfp8", "mxfp8", True, True, "auto", True, "gptj"),
          ("fp8_block", "mxfp8", True, True, "auto", True, "gptj"),
          ("bf16", "bf16", False, True, "auto", True, "gptj")]
# the layer without a norm (SPEC §7): sequence parallel, the reference and the Triton kernels
CASES += [("fp8_block", "bf16", False, True, "auto", False, "deepseek", "cpu", None),
          ("mxfp8", "mxfp8", True, True, "torch", False, "deepseek", "cpu", None),
          ("bf16", "bf16", False, False, "torch", False, "neox", "cpu", None)]


def _q_fields(q):
    if isinstance(q, MXFP8Tensor):
        return {f: getattr(q, f) for f in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
                if getattr(q, f) is not None}
    return {"q": q}


def _check_case(rank: int, world: int, precision: str, output_format: str, columnwise: bool, sp: bool,
                backend: str, overlap: bool, style: str, dev: str = "cpu", norm: str | None = "rmsnorm") -> None:
    tag = (f"[world={world} rank={rank} {precision}/{output_format} col={columnwise} sp={sp} overlap={overlap} "
           f"{style} {backend} {dev} norm={norm}]")
    dev = torch.device(dev)
    kw = layer_kwargs(precision=precision, output_format=output_format, columnwise_output=columnwise,
                      backend=backend, rope_style=style, device=dev, norm=norm)
    torch.manual_seed(1234)  # the same parameters and inputs on every rank
    full = FusedMLAQUpProjection(K, H, NOPE, R, **kw)
    with torch.no_grad():
        if norm is not None:
            full.norm_weight.copy_(1 + 0.2 * torch.randn(K))
    s, b = 64 * world, 2  # [s, b] tokens; a rank's slice along s holds 128 tokens (a whole fp8_block column block)
    x = torch.randn(s, b, K).to(dev)
    dy = torch.randn(s, b, H, D).to(dev)
    pos = torch.arange(s, device=dev)[:, None].expand(s, b)
    tp = FusedMLAQUpProjection(K, H, NOPE, R, tp_group=dist.group.WORLD, sequence_parallel=sp,
                               tp_comm_overlap=overlap, **kw)
    hl = H // world
    rows = slice(rank * hl * D, (rank + 1) * hl * D)
    with torch.no_grad():
        tp.weight.copy_(full.weight[rows])
        if norm is not None:
            tp.norm_weight.copy_(full.norm_weight)

    x_full = x.clone().requires_grad_(True)
    q_full = full(x_full, position_ids=pos)
    (q_full.dequantize() if isinstance(q_full, MXFP8Tensor) else q_full).float().backward(dy)

    sl = slice(rank * s // world, (rank + 1) * s // world)
    x_tp = (x[sl] if sp else x).clone().requires_grad_(True)
    with mock.patch.object(_backend, "_forward_overlapped", wraps=_backend._forward_overlapped) as overlapped:
        q_tp = tp(x_tp, position_ids=pos)
    # the overlapped forward runs where it applies (the Triton kernels: on the CPU under the interpreter; a peer),
    # and only when asked for
    want_overlap = overlap and world > 1 and _backend.resolve_backend(backend, dev)
    assert overlapped.call_count == want_overlap, f"{tag} overlapped forward ran {overlapped.call_count} times"
    assert q_tp.shape == (s, b, hl, D), f"{tag} query shape {tuple(q_tp.shape)}"
    heads = slice(rank * hl, (rank + 1) * hl)
    for f, t in _q_fields(q_tp).items():
        want = _q_fields(q_full)[f]
        want = want[:, heads] if f == "columnwise_scale" else want[:, :, heads]  # [T/32, H, D] vs [s, b, H, ...]
        assert_bytes_equal(t.contiguous(), want.contiguous(), f"{tag} {f}")
    (q_tp.dequantize() if isinstance(q_tp, MXFP8Tensor) else q_tp).float().backward(dy[:, :, heads])
    assert_bytes_equal(tp.weight.grad, full.weight.grad[rows], f"{tag} dW local rows")
    assert_rel_err(x_tp.grad, x_full.grad[sl] if sp else x_full.grad, REL_ERR_REDUCTION_ORDER, f"{tag} dx")
    if norm is not None:
        assert_rel_err(tp.norm_weight.grad, full.norm_weight.grad, REL_ERR_REDUCTION_ORDER, f"{tag} dnorm_weight")
    else:
        assert tp.norm_weight is None and full.norm_weight is None


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


def _worker(rank: int, world: int, port: int, cases: list, backend: str = "gloo") -> None:
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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: minutes on 2 cores
def test_tensor_and_sequence_parallel_match_tp1(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path, world, free_port(), CASES)


@pytest.mark.gpu
def test_nccl_path_world_size_one(tmp_path):
    """The NCCL code path (CUDA tensors, the compiled kernels, cuBLAS blockwise GEMMs) at the world size one GPU
    allows: sequence parallelism over one rank must give the tp = 1 bytes."""
    cases = [(p, o, o == "mxfp8" and p != "bf16", True, "auto", o == "mxfp8", "deepseek", "cuda")
             for p in ("bf16", "mxfp8", "fp8_block") for o in ("bf16", "mxfp8")]
    spawn_ranks(_worker, 1, tmp_path, 1, free_port(), cases, "nccl")


def _fake_ring(wires: list, rank: int):
    """A stand-in for `RingGather` in one process: yields the peers' wire tensors in the ring's arrival order."""

    class FakeRing:
        def __init__(self, tensors, par):
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(tensors, wires[rank], strict=True)), "this rank's wire tensors"

        def __iter__(self):
            for s in range(1, len(wires)):
                j = (rank - s) % len(wires)
                yield j, wires[j]

    return FakeRing


# (precision, output_format, columnwise_output); CPU: interpreter at a small shape, GPU: compiled at DeepSeek-V3's
OVERLAP_CASES = [("mxfp8", "mxfp8", True), ("fp8_block", "bf16", False), ("fp8_block", "mxfp8", True),
                 ("bf16", "bf16", False)]


@pytest.mark.parametrize("precision,fmt,col", OVERLAP_CASES)
def test_overlapped_forward_in_one_process(precision, fmt, col, device):
    """The overlapped sequence-parallel forward of every rank of a group of 3 (CPU) or 4 (GPU), run in one process
    with the peers' gathered tensors handed in the ring's order: the kernels' side of `tp_comm_overlap` (each
    rank's launch into its rows of the query, the wire tensors decoded per rank) gives the bytes of one forward over
    all tokens. The gloo tests above cover the ring itself."""
    from mla_qproj.distributed import Parallel
    from mla_qproj.recipes import get_recipe

    if device.type == "cuda":
        (k, h, p, r, d), world, n = (1536, 32, 128, 64, 192), 4, 4096
    else:
        (k, h, p, r, d), world, n = (128, 2, 32, 64, 96), 3, 32
    cfg = make_config(k, h, p, r, d, output_format=fmt, columnwise_output=col, precision=precision)
    T = n * world
    x = torch.randn(T, k, device=device, dtype=torch.bfloat16)
    nw = (1 + 0.2 * torch.randn(k, device=device)).to(torch.bfloat16)
    w = (torch.randn(cfg.out_features, k, device=device) * k**-0.5).to(torch.bfloat16)
    ang = torch.rand(T, r // 2, device=device) * 6
    cos_h, sin_h = ang.cos(), ang.sin()
    recipe = get_recipe(precision, kernels=True)
    pw = recipe.prepare_weight(w, cfg, ())
    assert pw.get("fused") is not None, "the fused kernel covers this geometry"
    whole = _backend.forward(x, nw, pw, cos_h, sin_h, cfg, recipe, save=False)[0]
    wires = [recipe.wire_input(recipe.norm_quant(x[j * n:(j + 1) * n], nw, cfg, False)[1], cfg)
             for j in range(world)]
    for rank in range(world):
        par = Parallel(None, world, rank, True, True)
        with (mock.patch.object(_backend, "RingGather", _fake_ring(wires, rank)),
              mock.patch.object(_backend, "_forward_overlapped", wraps=_backend._forward_overlapped) as over):
            got = _backend.forward(x[rank * n:(rank + 1) * n], nw, pw, cos_h, sin_h, cfg, recipe, save=False,
                                   par=par)[0]
        assert over.call_count == 1, "the overlapped forward ran"
        for i, (g, want) in enumerate(zip(got, whole, strict=True)):
            assert (g is None) == (want is None), f"rank {rank} output {i}"
            if g is not None:
                assert_bytes_equal(g, want, f"rank {rank} output {i}")


def test_construction_errors():
    with pytest.raises(ValueError, match="tp_group"):
        FusedMLAQUpProjection(K, H, NOPE, R, sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel"):
        FusedMLAQUpProjection(K, H, NOPE, R, sequence_parallel="yes")
    with pytest.raises((ValueError, TypeError), match="tp_group"):
        FusedMLAQUpProjection(K, H, NOPE, R, tp_group=object())
    with pytest.raises(TypeError, match="tp_comm_overlap"):
        FusedMLAQUpProjection(K, H, NOPE, R, tp_comm_overlap="yes")
    with pytest.raises(ValueError, match="tp_comm_overlap=True needs sequence_parallel"):
        FusedMLAQUpProjection(K, H, NOPE, R, tp_group=object(), tp_comm_overlap=True)
