"""Tensor and sequence parallelism of the layer (SPEC §6): the process-group bookkeeping and the three collectives it
needs, through torch.distributed only (NCCL on CUDA, gloo on CPU).

- column-parallel over heads: rank r holds heads [r·H/tp, (r+1)·H/tp) of the weight; without sequence parallelism
  every rank sees all tokens and the backward all-reduces dxn (fp32) before the RMSNorm backward;
- sequence parallel (Megatron's convention): x is the rank's slice of the first dimension; the forward all-gathers the
  *quantized* xn (codes and scales: about half the bytes of a bf16 all-gather of x) and the GEMM covers every token;
  the backward reduce-scatters dxn back to the local tokens and all-gathers the saved columnwise xn for the weight
  gradient (the columnwise blocks never straddle two ranks: the local token count is a multiple of the block).
  Token-inner tensors (the transposed columnwise codes, fp8_block's M-major scales) are gathered as rank-major rows
  and re-laid out (`rows_to_cols`).

Collectives go through torch.distributed's functional collectives, which eager mode runs as usual and torch.compile
traces into its graph. Quantized codes travel as raw bytes (uint8 views), reductions in fp32. A gather is started
(`start_gather`) and waited on (`wait_gathered`) separately, so that work which does not read the gathered rows runs
while they travel: the backward's inverse RoPE and dgrad GEMM run before the saved xn's gather is waited on, and
with `overlap` (Megatron's `tp_comm_overlap`) the forward GEMM covers this rank's own rows first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    overlap: bool = False  # sequence parallel forward: the GEMM starts on this rank's rows while the rest travel
    # several collectives may be in flight at once: NCCL queues them on its stream; gloo does not allow it (two
    # functional all-gathers in flight corrupt the heap under torch 2.13: `start_gathers`)
    concurrent: bool = False

    @staticmethod
    def make(tp_group, sequence_parallel: bool, overlap: bool = False) -> Parallel | None:
        """None without a group (or a group of one rank and no sequence parallelism: nothing to communicate)."""
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"tp_comm_overlap must be a bool, got {type(overlap).__name__}")
        if overlap and not sequence_parallel:
            raise ValueError("tp_comm_overlap=True needs sequence_parallel=True (it overlaps the forward's all-gather "
                             "of xn with the GEMM; without sequence parallelism the forward communicates nothing)")
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
        return Parallel(tp_group, world, dist.get_rank(tp_group), sequence_parallel, overlap,
                        dist.get_backend(tp_group) == "nccl")


# torch 2.13 renamed the tensor-in/tensor-out collectives (`*_single`) and deprecates the old names; 2.11 has only those
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 view of t (fp8 and fp32 alike travel as bytes), last dim in bytes."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _from_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `_as_bytes`: the uint8 tensor t viewed as dtype."""
    return t.view(dtype) if dtype != torch.uint8 else t


class Gather(NamedTuple):
    """An all-gather in flight (`start_gather`): the gathered bytes, not yet waited on, and the dtype they hold."""

    data: torch.Tensor
    dtype: torch.dtype


def start_gather(t: torch.Tensor, par: Parallel) -> Gather:
    """Start the all-gather of t [n, ...] along dim 0 in rank order; `wait_gathered` gives the result."""
    return Gather(_all_gather(_as_bytes(t), 0, par.group), t.dtype)


def wait_gathered(g: Gather) -> torch.Tensor:
    """The result of `start_gather`: [world * n, ...] in the gathered tensor's dtype."""
    return _from_bytes(_wait(g.data), g.dtype)


def start_gathers(ts, par: Parallel) -> tuple[Gather, ...]:
    """Start the all-gathers of the tensors ts: all at once where collectives may run concurrently (NCCL), else one
    at a time with only the last left in flight."""
    gs: list[Gather] = []
    for t in ts:
        if gs and not par.concurrent:
            gs[-1] = Gather(_wait(gs[-1].data), gs[-1].dtype)
        gs.append(start_gather(t, par))
    return tuple(gs)


def gather_rows(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """All-gather t [n, ...] along dim 0 in rank order -> [world * n, ...], same dtype (bytes on the wire)."""
    return wait_gathered(start_gather(t, par))


def rows_to_cols(g: torch.Tensor, world: int) -> torch.Tensor:
    """Gathered rows [world * m, n] (rank j's [m, n] block j) -> [m, world * n]: an all-gather along dim 1."""
    m, n = g.shape[0] // world, g.shape[1]
    return g.view(world, m, n).permute(1, 0, 2).reshape(m, world * n)


def all_reduce_sum(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over the group (fp32 in, fp32 out)."""
    return _wait(funcol.all_reduce(t, "sum", par.group))


def reduce_scatter_rows(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over the group of t [world * n, ...], this rank keeping rows [rank * n, (rank + 1) * n)."""
    return _wait(_reduce_scatter(t, "sum", 0, par.group))


class RingGather:
    """An all-gather along dim 0 as a ring of point-to-point steps, for a consumer that uses each rank's rows as they
    arrive (the overlapped sequence-parallel forward): step s sends the rows received at step s - 1 (this rank's own
    at step 1) to the next rank and receives rank (r - s)'s from the previous one, so the consumer's work on one
    rank's rows runs while the next rank's travel. Constructing it starts step 1; iterating yields (rank j, rank j's
    tensors) for every peer in arrival order. Eager only (c10d point-to-point ops with their work handles)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], par: Parallel):
        self.par = par
        self.dtypes = [t.dtype for t in tensors]
        local = [_as_bytes(t) for t in tensors]
        self.rows = [t.shape[0] for t in local]
        # rank j's rows of tensor i land in bufs[i][j * rows_i:(j + 1) * rows_i] (the all-gather's layout)
        self.bufs = [t.new_empty((par.world * t.shape[0],) + tuple(t.shape[1:])) for t in local]
        self.next = dist.get_global_rank(par.group, (par.rank + 1) % par.world)
        self.prev = dist.get_global_rank(par.group, (par.rank - 1) % par.world)
        self.work = self._step(local, (par.rank - 1) % par.world)

    def _chunk(self, j: int) -> list[torch.Tensor]:
        return [b[j * n:(j + 1) * n] for b, n in zip(self.bufs, self.rows, strict=True)]

    def _step(self, send: list[torch.Tensor], j: int) -> list:
        """Send `send` to the next rank and receive rank j's rows from the previous one (tag: the tensor's index,
        so that gloo pairs each send with its receive)."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.par.group, tag=i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.par.group, tag=i) for i, t in enumerate(self._chunk(j))]
        return dist.batch_isend_irecv(ops)

    def __iter__(self):
        r, world = self.par.rank, self.par.world
        for s in range(1, world):
            j = (r - s) % world
            for w in self.work:
                w.wait()
            got = self._chunk(j)
            if s < world - 1:  # forward what just arrived while the consumer works on it
                self.work = self._step(got, (r - s - 1) % world)
            yield j, tuple(_from_bytes(t, d) for t, d in zip(got, self.dtypes, strict=True))
