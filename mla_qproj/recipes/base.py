"""The recipe seam: everything that depends on the GEMM precision, behind one small interface.

A recipe owns the block geometry and scale encoding of its operands, how the weight is prepared (and cached by the
module), how RMSNorm's output becomes the forward GEMM's input and what of it backward keeps, which GEMMs run, and
how the query's gradient becomes the backward GEMMs' operands. The precision-independent flow (RMSNorm backward, the
head-group walk of the backward, tensor/sequence-parallel communication, the query object) lives in `backend`.

Each precision has two implementations of the interface, chosen once per call (`recipes.get_recipe`): the
kernels (`kernels = True`: Triton, the CuTe DSL engine and cuBLAS where the recipe says so) and the pure-PyTorch
reference in `mla_qproj/reference/` (`kernels = False`). Both compute the same function (quantization bytes
identical, GEMMs up to the fp32 summation order). Operands travel as tuples of tensors so that the flow can gather,
slice and save them without knowing their layout, which is the implementation's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .._config import QProjConfig
from .._constants import MX_BLOCK
from ..distributed import Gather, Parallel, gather_rows, start_gathers, wait_gathered

Operands = tuple  # of tensors; the layout is the recipe's


def norm_arg(x2d: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
    """The norm weight as the RMSNorm + quantize custom ops take it: a tensor (an empty one for a layer without a
    norm, whose config tells the op so)."""
    return x2d.new_empty(0) if norm_weight is None else norm_weight


@dataclass
class PreparedWeight:
    """What the GEMMs read of W, derived once per weight version (the module caches it under `key`)."""

    key: tuple
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    cache: dict = field(default_factory=dict)  # per-call-shape derived operands (e.g. head-group slices)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)


class Recipe:
    """Interface of a GEMM precision. `col_block`: tokens per block of the columnwise xn that backward saves (the
    local token count of a sequence-parallel rank must be a multiple; 1 = no token blocks). `n_align`: columns of N
    a head group of the backward must be a multiple of (the query gradient's row blocks must not straddle groups).
    `fused_operands`: the operand kind of the fused forward GEMM (`kernels.triton.qproj_gemm`: "bf16" images or
    "fp8_block" codes), which fixes the row order of its weight. `k_block`: q_lora_rank must be a multiple of it (the
    operands' blocks along K, SPEC §4 and §5; `QProjConfig` checks it)."""

    name: ClassVar[str]
    option_type: ClassVar[type]  # the public object carrying this precision's options (mla_qproj.options)
    kernels: ClassVar[bool]  # True: the GPU kernels (the interpreter on the CPU); False: the PyTorch reference
    col_block: ClassVar[int] = 1
    n_align: ClassVar[int] = 1
    fused_operands: ClassVar[str] = "bf16"
    k_block: ClassVar[int] = MX_BLOCK

    def rmsnorm_bwd(self, dxn: torch.Tensor, x2d: torch.Tensor, rsigma: torch.Tensor, norm_weight: torch.Tensor,
                    zero_centered_gamma: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx in x's dtype, dnorm_weight in the parameter's dtype) from dxn fp32 [T, K] (precision-independent)."""
        raise NotImplementedError

    def prepare_weight(self, w: torch.Tensor, cfg: QProjConfig, key: tuple) -> PreparedWeight:
        """What the GEMMs read of W (or of a pre-quantized (codes, scale_inv) pair), tagged with the cache key."""
        raise NotImplementedError

    def norm_quant(self, x2d: torch.Tensor, norm_weight: torch.Tensor, cfg: QProjConfig,
                   save: bool) -> tuple[torch.Tensor, Operands, Operands]:
        """RMSNorm and the forward GEMM's input: (rsigma fp32 [T], GEMM input, what wgrad reads of xn); the last is
        empty when save is False (inference)."""
        raise NotImplementedError

    def forward_gemm(self, a: Operands, pw: PreparedWeight, cos_h: torch.Tensor, sin_h: torch.Tensor,
                     cfg: QProjConfig) -> tuple:
        """The query: (bf16 [T, H, D], None, None, None) or (row data, row scale, col data | None, col scale | None)
        as `reference.qproj.quantize_output` lays them out."""
        raise NotImplementedError

    def grad_operands(self, dq2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, cfg: QProjConfig
                       ) -> tuple[Operands, Operands]:
        """Inverse RoPE of dq2d [T, cfg.out_features] (a run of whole heads: cfg has their count), then (dgrad
        operand, wgrad operand)."""
        raise NotImplementedError

    def dgrad(self, g_row: Operands, pw: PreparedWeight, cols: slice, cfg: QProjConfig,
              dxn: torch.Tensor | None) -> torch.Tensor:
        """dxn [T, K] fp32 (+)= g_row · W[cols]: a new tensor when dxn is None, else accumulated into it."""
        raise NotImplementedError

    def wgrad(self, g_col: Operands, saved: Operands, cols: slice, cfg: QProjConfig,
              out: torch.Tensor, accumulate: bool) -> None:
        """out [len(cols), K] = g_col^T · xn (rounded once to out's dtype), or += when accumulate (main_grad)."""
        raise NotImplementedError

    # ---- the overlapped sequence-parallel forward (`tp_comm_overlap`): the query written a row range at a time,
    # each range's tokens multiplied as they arrive. Only kernel implementations whose fused GEMM runs offer it.

    def writes_rows(self, pw: PreparedWeight) -> bool:
        """The forward can write the query a row range at a time for this prepared weight."""
        return False

    def query_buffers(self, T: int, cfg: QProjConfig, like: torch.Tensor) -> tuple:
        """The query of T tokens, unwritten, with what every range's launch shares (the launch config of the whole
        T, so that the bytes are those of one launch over all tokens)."""
        raise NotImplementedError

    def write_rows(self, a: Operands, pw: PreparedWeight, cos_h: torch.Tensor, sin_h: torch.Tensor,
                   cfg: QProjConfig, buffers: tuple, rows: slice) -> None:
        """The query's tokens `rows` (a holds their GEMM input; cos_h / sin_h cover all T) into `buffers`."""
        raise NotImplementedError

    def query_of_buffers(self, buffers: tuple) -> tuple:
        """The written buffers as `forward_gemm` returns its query (4 entries)."""
        raise NotImplementedError

    # ---- sequence parallelism: the tensors that cross ranks. A gather is started, and its result read later, so
    # that work not reading it runs while it travels. Defaults: every operand is token-major ([T, ...]) and travels
    # as it is.

    def wire_input(self, a: Operands, cfg: QProjConfig) -> tuple[torch.Tensor, ...]:
        """What crosses the ranks of this rank's GEMM input a: tensors whose first dimension is gathered."""
        return a

    def input_from_wire(self, w: tuple[torch.Tensor, ...], ranks: int, cfg: QProjConfig) -> Operands:
        """The GEMM input of the tokens of `ranks` consecutive ranks from their `wire_input` tensors, each rank's
        stacked along the first dimension in rank order (an all-gather's layout)."""
        return w

    def gather_input(self, a: Operands, par: Parallel, cfg: QProjConfig) -> Operands:
        """The GEMM input of every rank's tokens, in rank order."""
        w = tuple(gather_rows(t, par) for t in self.wire_input(a, cfg))
        return self.input_from_wire(w, par.world, cfg)

    def start_gather_saved(self, saved: Operands, par: Parallel, cfg: QProjConfig) -> tuple[Gather, ...]:
        """Start the all-gather of what wgrad reads of xn."""
        return start_gathers(saved, par)

    def gathered_saved(self, g: tuple[Gather, ...], par: Parallel, cfg: QProjConfig) -> Operands:
        """What wgrad reads of xn, for every rank's tokens (from g = `start_gather_saved`)."""
        return tuple(wait_gathered(t) for t in g)


class Reference(Recipe):
    """What every reference implementation shares: the pure-PyTorch RMSNorm backward."""

    kernels = False

    def rmsnorm_bwd(self, dxn, x2d, rsigma, norm_weight, zero_centered_gamma):
        from ..reference import qproj as ref

        return ref.rmsnorm_bwd(dxn, x2d, rsigma, norm_weight, zero_centered_gamma)


class Kernels(Recipe):
    """What every kernel implementation shares: the Triton RMSNorm backward, and the overlapped forward's row
    writes through the Triton fused GEMM (`kernels.triton.qproj_gemm`, W in its row order under pw["fused"])."""

    kernels = True

    def fused_rows(self, cfg: QProjConfig, device: torch.device) -> torch.Tensor | None:
        """The Triton fused GEMM's row order of W on `device` (kept per config and device), or None when that
        kernel does not cover the geometry or does not run on the device (then the forward is a plain GEMM
        followed by the RoPE + output kernel)."""
        from ..kernels._op import encoded
        from ..kernels.triton import qproj_gemm

        if not (qproj_gemm.fused_gemm_supported(cfg) and qproj_gemm.fused_runs_on(device)):
            return None
        return qproj_gemm.fused_rows(encoded(cfg), self.fused_operands, device)

    def fused_launch(self, a: Operands, pw: PreparedWeight, cos_h: torch.Tensor, sin_h: torch.Tensor,
                     cfg: QProjConfig, out: tuple, config) -> None:
        """The fused GEMM writing into out (`qproj_gemm_outputs`' layout, or row slices of it) with the launch
        config `config`."""
        raise NotImplementedError

    def writes_rows(self, pw):
        return pw.get("fused") is not None

    def query_buffers(self, T, cfg, like):
        from ..kernels.triton.qproj_gemm import default_config, qproj_gemm_outputs

        return qproj_gemm_outputs(T, cfg, like), default_config(T, like.device, cfg, self.fused_operands)

    def write_rows(self, a, pw, cos_h, sin_h, cfg, buffers, rows):
        from ..kernels.triton.qproj_gemm import output_rows

        outs, config = buffers
        self.fused_launch(a, pw, cos_h[rows], sin_h[rows], cfg, output_rows(outs, rows.start, rows.stop), config)

    def query_of_buffers(self, buffers):
        outs = buffers[0]
        return (outs[0], None, None, None) if len(outs) == 1 else outs

    def rmsnorm_bwd(self, dxn, x2d, rsigma, norm_weight, zero_centered_gamma):
        from ..kernels.triton.rmsnorm_bwd import rmsnorm_bwd_op

        return rmsnorm_bwd_op(dxn, x2d, rsigma, norm_weight, zero_centered_gamma)
