"""The layer's forward and backward, independent of the GEMM precision (which the recipe supplies, recipes/), for
either implementation of the recipe (the kernels or the pure-PyTorch reference, picked once per call by `select`)
and with the tensor- and sequence-parallel communication of SPEC §6 (`par`, see distributed.py).

Forward: RMSNorm + the recipe's quantization of xn -> [sequence parallel: all-gather the quantized xn] -> the
recipe's GEMM with the RoPE + output epilogue. Backward, per head group (columns C_g of N): the recipe's inverse RoPE
+ gradient quantization of dq[:, C_g]; dxn += dgrad; dW[C_g] = wgrad (or main_grad[C_g] += ...) -> [tensor parallel:
all-reduce dxn; sequence parallel: reduce-scatter dxn] -> RMSNorm backward.
"""

from __future__ import annotations

import torch

from ._config import QProjConfig, interpreter_enabled
from ._constants import MX_BLOCK
from .distributed import Parallel, RingGather, all_reduce_sum, reduce_scatter_rows
from .recipes import PreparedWeight, Recipe, get_recipe


def resolve_backend(backend: str, device: torch.device) -> bool:
    """True when the Triton kernels run: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    triton_ok = device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())
    if backend == "torch":
        return False
    if backend == "triton" and not triton_ok:
        raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (got device {device})")
    return triton_ok


def select(cfg: QProjConfig, backend: str, device: torch.device) -> Recipe:
    """The implementation of cfg's precision that runs for tensors on `device` under `backend` ("auto", "triton",
    "torch"): the kernels or the reference."""
    return get_recipe(cfg.precision, resolve_backend(backend, device))


def forward(x2d, norm_weight, pw: PreparedWeight, cos_h, sin_h, cfg: QProjConfig, recipe: Recipe,
            save: bool = True, par: Parallel | None = None):
    """Returns (the query's four outputs as `reference.qproj.quantize_output` lays them out, None for absent ones;
    rsigma; what the backward reads of xn). save=False (inference) skips the latter."""
    rsigma, a, saved = recipe.norm_quant(x2d, norm_weight, cfg, save)
    if par is not None and par.sequence_parallel:
        if overlap_ok(x2d.shape[0], pw, cfg, recipe, par):
            return _forward_overlapped(recipe, a, pw, cos_h, sin_h, cfg, par), rsigma, saved
        a = recipe.gather_input(a, par, cfg)
    return recipe.forward_gemm(a, pw, cos_h, sin_h, cfg), rsigma, saved


def overlap_ok(n: int, pw: PreparedWeight, cfg: QProjConfig, recipe: Recipe, par: Parallel) -> bool:
    """The sequence-parallel forward overlaps its gather with the GEMM (`tp_comm_overlap`) when the recipe can write
    the query a row range at a time, eagerly (point-to-point steps with work handles, and launches writing each
    rank's rows into the query in place; traced graphs keep the functional all-gather), there is a peer, and rank
    edges fall on columnwise output blocks."""
    return (par.overlap and par.world > 1 and n > 0 and recipe.writes_rows(pw)
            and not (cfg.columnwise_output and n % MX_BLOCK) and not torch.compiler.is_compiling())


def _forward_overlapped(recipe: Recipe, a, pw: PreparedWeight, cos_h, sin_h, cfg: QProjConfig,
                        par: Parallel) -> tuple:
    """Sequence-parallel forward with the gather in flight (a ring of point-to-point steps): the fused GEMM covers
    this rank's own tokens while the first peer's travel, then each peer's tokens as they arrive while the next
    peer's travel, every launch writing its rows of the query (a row's result depends on that row only)."""
    ring = RingGather(recipe.wire_input(a, cfg), par)
    n = a[0].shape[0]
    buffers = recipe.query_buffers(n * par.world, cfg, a[0])
    recipe.write_rows(a, pw, cos_h, sin_h, cfg, buffers, slice(par.rank * n, (par.rank + 1) * n))
    for j, wire in ring:
        recipe.write_rows(recipe.input_from_wire(wire, 1, cfg), pw, cos_h, sin_h, cfg, buffers,
                          slice(j * n, (j + 1) * n))
    return recipe.query_of_buffers(buffers)


# T * N at or above which the backward walks the heads in groups (2, then 4 past 4x this): the [T, N] gradient
# operands of one group at a time, so the peak holds a fraction of them (T = 16384 at DeepSeek-V3: 2 groups).
GROUP_ELEMENTS = 1 << 28


def head_groups(T: int, cfg: QProjConfig) -> int:
    """How many head groups the Triton backward uses: whole heads per group, and group edges on the boundaries of
    the gradient's row blocks (else 1). Only the fp32 summation order of dxn depends on it."""
    n = T * cfg.out_features
    groups = 4 if n >= 4 * GROUP_ELEMENTS else 2 if n >= GROUP_ELEMENTS else 1
    align = get_recipe(cfg.precision).n_align
    while groups > 1 and (cfg.num_heads % groups or (cfg.num_heads // groups * cfg.q_head_dim) % align):
        groups //= 2
    return groups


def backward(dq2d, x2d, rsigma, saved, norm_weight, pw: PreparedWeight, cos_h, sin_h, cfg: QProjConfig,
             recipe: Recipe, main_grad: torch.Tensor | None = None, dw_dtype: torch.dtype = torch.float32,
             par: Parallel | None = None, need_dw: bool = True):
    """Returns (dx, dnorm_weight, dW in dw_dtype rounded once from the fp32 sum, or None when accumulated into
    main_grad or not needed: need_dw False skips the wgrad GEMMs, a frozen weight). With sequence parallelism dq2d
    covers every rank's tokens and x2d this rank's."""
    sp = par is not None and par.sequence_parallel
    gather = sp and need_dw  # the saved xn of every rank: only the wgrad reads it
    if gather:  # in flight while the first group's inverse RoPE and dgrad run; waited on by its wgrad
        pending = recipe.start_gather_saved(saved, par, cfg)
    T, N = dq2d.shape
    groups = head_groups(T, cfg) if recipe.kernels else 1
    ng, gcfg = N // groups, cfg.with_heads(cfg.num_heads // groups)
    dw = None if main_grad is not None or not need_dw else torch.empty(N, cfg.q_lora_rank, dtype=dw_dtype,
                                                                       device=dq2d.device)
    dxn = None
    for g in range(groups):
        cols = slice(g * ng, (g + 1) * ng)
        g_row, g_col = recipe.grad_operands(dq2d[:, cols], cos_h, sin_h, gcfg)
        dxn = recipe.dgrad(g_row, pw, cols, cfg, dxn)
        del g_row  # [T, N / groups]: freed before the wgrad (lower peak memory)
        if gather and g == 0:
            saved = recipe.gathered_saved(pending, par, cfg)
        if need_dw:
            out = main_grad[cols] if main_grad is not None else dw[cols]
            recipe.wgrad(g_col, saved, cols, cfg, out, accumulate=main_grad is not None)
        del g_col
    if par is not None:  # dxn holds this rank's heads' share: sum it over the group (fp32)
        dxn = reduce_scatter_rows(dxn, par) if sp else all_reduce_sum(dxn, par)
    if not cfg.norm:  # no RMSNorm: dx is dxn (SPEC §7)
        return dxn.to(x2d.dtype), None, dw
    # with sequence parallelism dnorm_weight covers this rank's tokens: summed over the group in fp32 (a parameter
    # marked `sequence_parallel`, Megatron's convention, is left to the trainer, which reduces such gradients)
    reduce_dg = sp and not getattr(norm_weight, "sequence_parallel", False)
    dx, dg = recipe.rmsnorm_bwd(dxn, x2d, rsigma, norm_weight.float() if reduce_dg else norm_weight,
                                cfg.zero_centered_gamma)
    if reduce_dg:
        dg = all_reduce_sum(dg, par).to(norm_weight.dtype)
    return dx, dg, dw

