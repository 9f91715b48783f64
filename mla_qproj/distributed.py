"""Tensor and sequence parallelism of the layer (SPEC §6): the process-group bookkeeping and the three collectives it
needs, through torch.distributed only (NCCL on CUDA, gloo on CPU).

- column-parallel over heads: rank r holds heads [r·H/tp, (r+1)·H/tp) of the weight; without sequence parallelism
  every rank sees all tokens and the backward all-reduces dxn (fp32) before the RMSNorm backward;
- sequence parallel (Megatron's convention): x is the rank's slice of the first dimension; the forward all-gathers the
  *quantized* xn (codes and scales: about half the bytes of a bf16 all-gather of x) and the GEMM covers every token;
  the backward reduce-scatters dxn back to the local tokens and all-gathers the saved columnwise xn for the weight
  gradient (the columnwise blocks never straddle two ranks: the local token count is a multiple of the block).

Collectives go through torch.distributed's functional collectives, which eager mode runs as usual and torch.compile
traces into its graph. Quantized codes travel as raw bytes (uint8 views), reductions in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class Parallel:
    """The layer's tensor-parallel group: world size, this rank, and whether x is sequence-parallel."""

    group: dist.ProcessGroup
    world: int
    rank: int
    sequence_parallel: bool

    @staticmethod
    def make(tp_group, sequence_parallel: bool) -> Parallel | None:
        """None without a group (or a group of one rank and no sequence parallelism: nothing to communicate)."""
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
        if tp_group is None:
            if sequence_parallel:
                raise ValueError("sequence_parallel=True needs a tp_group")
            return None
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tp_group given but torch.distributed is not initialized")
        if not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a torch.distributed ProcessGroup, got {type(tp_group).__name__}")
        world = dist.get_world_size(tp_group)
        if world == 1 and not sequence_parallel:
            return None
        return Parallel(tp_group, world, dist.get_rank(tp_group), sequence_parallel)


# torch 2.13 renamed the tensor-in/tensor-out collectives (`*_single`) and deprecates the old names; 2.11 has only those
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 view of t (fp8 and fp32 alike travel as bytes), last dim in bytes."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def gather_rows(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """All-gather t [n, ...] along dim 0 in rank order -> [world * n, ...], same dtype (bytes on the wire)."""
    out = _wait(_all_gather(_as_bytes(t), 0, par.group))
    return out.view(t.dtype) if t.dtype != torch.uint8 else out


def gather_cols(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """All-gather t [m, n] along dim 1 in rank order -> [m, world * n] (the transposed columnwise FP8 codes, whose
    token axis is the inner one): gathered as rows, then re-laid out once."""
    m, n = t.shape
    g = gather_rows(t, par).view(par.world, m, n)
    return g.permute(1, 0, 2).reshape(m, par.world * n)


def all_reduce_sum(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over the group (fp32 in, fp32 out)."""
    return _wait(funcol.all_reduce(t, "sum", par.group))


def reduce_scatter_rows(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over the group of t [world * n, ...], this rank keeping rows [rank * n, (rank + 1) * n)."""
    return _wait(_reduce_scatter(t, "sum", 0, par.group))
