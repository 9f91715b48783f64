"""`FusedMLAQUpProjection`: parameters, validation, RoPE tables and the quantized-weight cache."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import backend as _backend
from ._config import BACKENDS, QProjConfig, validate_choice
from ._constants import FLOAT_DTYPES
from .distributed import Parallel
from .function import _FusedMLAQUpProjFunction, forward_query, query_shape
from .options import Precision, QueryFormat, as_precision
from .recipes import Recipe, get_recipe
from .reference.rope import half_table, normalize_rope_scaling, rope_inv_freq

_ACT_DTYPES = FLOAT_DTYPES

# Fused optimizers (torch.optim.AdamW(fused=True), SGD(fused=True)) update parameters in place without bumping
# `_version`, so the weight cache also listens to every optimizer step: layers whose weight the optimizer owns
# move to a new cache epoch.
_LIVE_LAYERS: weakref.WeakSet = weakref.WeakSet()


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    if not _LIVE_LAYERS:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for layer in list(_LIVE_LAYERS):
        if id(layer.weight) in owned:
            layer._weight_epoch += 1


register_optimizer_step_post_hook(_on_optimizer_step)


_MOVED = {
    "block_scale": "precision=FP8Block(block_scale=...)",
    "scale_mode": "precision=MXFP8(scale_mode=...) for the GEMM inputs, output_format=MXFP8Query(scale_mode=...) "
                  "for the query",
    "columnwise_output": "output_format=MXFP8Query(columnwise=True)",
}


def _refuse_removed(kwargs: dict) -> None:
    """A keyword the constructor does not take: the options that moved into the precision and query objects
    (mla_qproj.options) say where they went."""
    name = next(iter(kwargs))
    if name in _MOVED:
        raise TypeError(f"FusedMLAQUpProjection no longer takes {name}=: pass {_MOVED[name]} (mla_qproj.options)")
    raise TypeError(f"FusedMLAQUpProjection got an unexpected keyword argument {name!r}")


LAYER_OPTIONS = ("precision", "output_format", "backend")  # what the integrations (hf, megatron, torchtitan) pass on


def layer_options(caller: str, kwargs: dict | None, source: str) -> dict:
    """An integration's layer keywords, checked: only LAYER_OPTIONS (the rest comes from the model: `source`)."""
    kwargs = dict(kwargs or {})
    moved = [k for k in kwargs if k in _MOVED]
    if moved:
        raise TypeError(f"{caller}: {moved[0]}= moved into the precision / query objects: pass {_MOVED[moved[0]]} "
                        "(mla_qproj.options)")
    unknown = sorted(set(kwargs) - set(LAYER_OPTIONS))
    if unknown:
        raise TypeError(f"{caller}: unsupported layer argument(s) {unknown}; allowed: {LAYER_OPTIONS} ({source})")
    return kwargs


def _check_rmsnorm(norm) -> None:
    """from_modules computes RMSNorm whatever module it is given: refuse one that computes something else (a
    LayerNorm subtracts the mean and adds a bias). Accepted: torch.nn.RMSNorm, and a class named *RMSNorm (HF's
    DeepseekV3RMSNorm) with `weight` and `eps` or `variance_epsilon`."""
    name = type(norm).__name__
    if getattr(norm, "bias", None) is not None:
        raise ValueError(f"norm ({name}) has a bias: the layer computes RMSNorm, which has none")
    rms = isinstance(norm, nn.RMSNorm) or (name.endswith("RMSNorm") and hasattr(norm, "weight")
                                           and (hasattr(norm, "eps") or hasattr(norm, "variance_epsilon")))
    if not rms:
        raise ValueError(f"norm must be an RMSNorm (torch.nn.RMSNorm, or a class named *RMSNorm with `weight` and "
                         f"`eps` or `variance_epsilon`), got {name}: the layer computes RMSNorm whatever norm it wraps")


def _check_fp8_weight(linear: nn.Module, lw: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """A checkpoint's pre-quantized Linear (E4M3 codes in `weight`, the 128x128 `weight_scale_inv` beside them, as
    DeepSeek-V3 ships q_b_proj and transformers' fine-grained FP8 loads it): its scale_inv, checked; None for a
    high-precision Linear."""
    if lw.dtype != torch.float8_e4m3fn:
        return None
    if as_precision(kwargs.get("precision", "bf16")).name != "fp8_block":
        raise ValueError(f"linear.weight is float8_e4m3fn (pre-quantized): precision must be 'fp8_block' or "
                         f"FP8Block(...), got {kwargs.get('precision', 'bf16')!r}")
    si = getattr(linear, "weight_scale_inv", None)
    N, K = lw.shape
    want = (-(-N // 128), -(-K // 128))
    if not isinstance(si, torch.Tensor) or si.dtype != torch.float32 or tuple(si.shape) != want:
        raise ValueError(f"linear.weight is float8_e4m3fn: linear.weight_scale_inv must be float32 {list(want)} "
                         f"(128x128 blocks), got {None if si is None else (si.dtype, tuple(si.shape))}")
    block = getattr(linear, "block_size", None) or getattr(linear, "weight_block_size", None)
    if block is not None and tuple(block) != (128, 128):
        raise ValueError(f"linear's weight blocks are {tuple(block)}: the layer reads 128x128 blocks only")
    if lw.requires_grad:
        raise ValueError("linear.weight is float8_e4m3fn codes with requires_grad=True: a pre-quantized weight has "
                         "no high-precision master to train, so the layer computes no weight gradient; set "
                         "weight.requires_grad_(False) (train a bf16 / fp32 weight instead)")
    return si


class FusedMLAQUpProjection(nn.Module):
    """q = RoPE(W_uq · RMSNorm(x)) for Multi-head Latent Attention in one layer (SPEC §1).

    Args:
        q_lora_rank: K, width of the latent x (multiple of 32).
        num_heads: H.
        qk_head_dim: per-head columns that pass through (no RoPE).
        qk_pos_emb_head_dim: R, per-head RoPE columns (even, > 0), starting at column qk_head_dim.
        q_head_dim: D, per-head width (default qk_head_dim + R); trailing columns past nope + R pass through.
        The rest by keyword only:
        norm: "rmsnorm" (default) or None: no norm, the input (already normalized: a model's `q_proj`, whose width
            K is then the hidden size) quantized as it is; no `norm_weight` parameter (SPEC §7).
        eps, zero_centered_gamma: RMSNorm (g = 1 + norm_weight when zero-centered).
        rope_style: "deepseek" (interleaved pairs, de-interleaved output), "neox" or "gptj" (SPEC §3).
        rope_theta, rope_scaling: built-in tables for `position_ids` (None or a YaRN dict, HF or DeepSeek form).
        precision: the GEMM inputs, an object of `mla_qproj.options` carrying its options, or its name for the
            defaults: `BF16()` / "bf16" (default: the bf16 layer, no quantization), `FP8Block(block_scale="pow2")`
            / "fp8_block" (DeepSeek-V3 / TransformerEngine Float8BlockScaling: 1x128 and 128x128 blocks, FP8
            tensor cores; needs q_lora_rank % 128 == 0), `MXFP8(scale_mode="rceil")` / "mxfp8" (on bf16 tensor
            cores on Hopper).
        output_format: the query, `BF16Query()` / "bf16" (default: a bf16 tensor) or `MXFP8Query(scale_mode="rceil",
            columnwise=False)` / "mxfp8" (an MXFP8Tensor; columnwise: also its 32-blocks along T).
        backend: "auto" (Triton on CUDA, or on CPU under TRITON_INTERPRET=1; else PyTorch), "triton", "torch".
        tp_group: a torch.distributed process group for tensor parallelism over heads (SPEC §6): num_heads is the
            global count and this rank holds heads [r·H/tp, (r+1)·H/tp) (Megatron's column-parallel layout:
            `weight` is the local shard [H/tp · D, K], `norm_weight` the full [K]).
        sequence_parallel: x is this rank's slice of the first dimension (Megatron's sequence parallelism); the
            query covers every token of the group. Needs tp_group.
        tp_comm_overlap: with sequence_parallel, overlap the forward's all-gather with the GEMM (Megatron's
            `tp_comm_overlap`): the fused GEMM first covers this rank's own tokens while the peers' travel, then
            theirs, writing each rank's rows of the query in place. Same bytes as without; eager calls of the fused
            kernel only (compiled graphs and other GEMM paths gather first). Default False.

    Shapes: x [..., K] (any leading layout) -> q [..., H, D] (H/tp local heads; under sequence parallelism the first
    dimension is tp times x's); cos/sin broadcast against [..., R] (or [..., R/2]) and position_ids to the
    query's leading dims (leading dims of size 1 beyond them dropped: HF's [1, T] for x [T, K]).

    Example:
        >>> layer = FusedMLAQUpProjection(1536, 128, 128, 64, precision="fp8_block")
        >>> q = layer(x, position_ids=torch.arange(x.shape[0]))   # x: [T, 1536] -> bf16 [T, 128, 192]
    """

    def __init__(self, q_lora_rank: int, num_heads: int, qk_head_dim: int, qk_pos_emb_head_dim: int,
                 q_head_dim: int | None = None, *, norm: str | None = "rmsnorm", eps: float = 1e-6,
                 zero_centered_gamma: bool = False, rope_style: str = "deepseek", rope_theta: float = 10000.0,
                 rope_scaling: dict | None = None, precision: str | Precision = "bf16",
                 output_format: str | QueryFormat = "bf16", backend: str = "auto", tp_group=None,
                 sequence_parallel: bool = False, tp_comm_overlap: bool = False, device=None, dtype=None,
                 **removed) -> None:
        super().__init__()
        if removed:
            _refuse_removed(removed)
        if norm not in ("rmsnorm", None):
            raise ValueError(f"norm must be 'rmsnorm' or None (no norm: the input is quantized as it is), got {norm!r}")
        if norm is None and eps != 1e-6:
            raise ValueError(f"eps is an RMSNorm option: a layer with norm=None has no norm (got eps={eps!r})")
        self.par = Parallel.make(tp_group, sequence_parallel, tp_comm_overlap)
        self.tp_size = 1 if self.par is None else self.par.world
        global_cfg = QProjConfig.make(q_lora_rank, num_heads, qk_head_dim, qk_pos_emb_head_dim, q_head_dim, eps,
                                      zero_centered_gamma, rope_style, precision, output_format, norm is not None)
        if num_heads % self.tp_size:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by the tp_group size ({self.tp_size})")
        self.num_heads = num_heads  # global; self.cfg describes this rank's heads (what its kernels compute)
        self.cfg = global_cfg.with_heads(num_heads // self.tp_size)
        self.backend = validate_choice("backend", backend, BACKENDS)
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
            raise ValueError(f"rope_theta must be a positive number, got {rope_theta!r}")
        self.rope_theta = float(rope_theta)
        self.rope_scaling = normalize_rope_scaling(rope_scaling)
        inv_freq, self.attention_scaling = rope_inv_freq(self.cfg.rope_dim, self.rope_theta, self.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        factory_kwargs = {"device": device, "dtype": dtype}
        param_dtype = torch.get_default_dtype() if dtype is None else dtype
        if param_dtype not in _ACT_DTYPES:
            raise TypeError(f"dtype must be one of {_ACT_DTYPES} (the parameters' dtype), got {param_dtype}")
        self.weight = nn.Parameter(torch.empty(self.cfg.out_features, q_lora_rank, **factory_kwargs))
        # a pre-quantized weight's 128x128 scale_inv (from_modules of a checkpoint's FP8 Linear): weight then holds
        # its E4M3 codes as they are (SPEC §5)
        self.register_parameter("weight_scale_inv", None)
        if norm is None:  # no parameter: a model's q_proj has only its weight (SPEC §7)
            self.register_parameter("norm_weight", None)
        else:
            self.norm_weight = nn.Parameter(torch.empty(q_lora_rank, **factory_kwargs))
        self._wcache: _backend.PreparedWeight | None = None
        self._weight_epoch = 0
        _LIVE_LAYERS.add(self)
        self.reset_parameters()

    def __setstate__(self, state) -> None:
        # copies (copy.deepcopy, pickle) listen to optimizer steps too: their weight is a new parameter
        super().__setstate__(state)
        _LIVE_LAYERS.add(self)

    def _apply(self, fn, recurse=True):
        # `module.to(dtype)` / `.half()` cast every floating buffer; the RoPE frequencies stay fp32 (SPEC §3), so a
        # cast buffer is rebuilt in fp32 from the constructor's arguments (casting back would keep the rounding)
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            inv_freq, _ = rope_inv_freq(self.cfg.rope_dim, self.rope_theta, self.rope_scaling)
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        # a cast to a dtype the layer does not run (`.double()`) is refused here, not at the next forward
        for name, p in self._own_params():
            if p.dtype not in _ACT_DTYPES and not (name == "weight" and self.weight_scale_inv is not None):
                raise TypeError(f"FusedMLAQUpProjection parameters must be one of {_ACT_DTYPES}; the cast made "
                                f"{name} {p.dtype}")
        return self

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default
        if self.norm_weight is None:
            pass
        elif self.cfg.zero_centered_gamma:
            nn.init.zeros_(self.norm_weight)
        else:
            nn.init.ones_(self.norm_weight)
        self._wcache = None

    # ------------------------------------------------------------------------------------ construction

    @classmethod
    def from_modules(cls, norm: nn.Module | None, linear: nn.Module, *, num_heads: int, qk_head_dim: int,
                     qk_pos_emb_head_dim: int, **kwargs) -> FusedMLAQUpProjection:
        """Wrap an existing RMSNorm and bias-free Linear, sharing (not copying) their weights. Another norm (a
        LayerNorm, a norm with a bias) raises ValueError. norm=None wraps a Linear alone (a model's `q_proj`,
        whose input is already normalized): the layer without a norm (SPEC §7).

        eps comes from the norm's `eps` or `variance_epsilon` (unless given); q_head_dim defaults to
        linear.out_features // num_heads. With `tp_group` the linear is this rank's column-parallel shard
        (Megatron's ColumnParallelLinear: out_features = num_heads / tp * q_head_dim) and num_heads is the global
        count. Raises ValueError when the shapes do not fit.
        """
        lw = getattr(linear, "weight", None)
        if not isinstance(lw, nn.Parameter) or lw.dim() != 2:
            raise ValueError("linear must have a 2-D `weight` parameter [out_features, in_features]")
        if getattr(linear, "bias", None) is not None:
            raise ValueError("linear must have no bias (the MLA query up-projection has none)")
        si = _check_fp8_weight(linear, lw, kwargs)
        nw = None
        if norm is None:
            kwargs["norm"] = None
        else:
            _check_rmsnorm(norm)
            nw = getattr(norm, "weight", None)
            if not isinstance(nw, nn.Parameter) or nw.dim() != 1:
                raise ValueError("norm must have a 1-D `weight` parameter (an RMSNorm with elementwise affine)")
            if lw.shape[1] != nw.shape[0]:
                raise ValueError(f"linear in_features ({lw.shape[1]}) must equal norm size ({nw.shape[0]})")
        if nw is not None and "eps" not in kwargs:
            eps = getattr(norm, "eps", None)
            if eps is None:
                eps = getattr(norm, "variance_epsilon", None)
            if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
                eps = torch.finfo(nw.dtype).eps
            kwargs["eps"] = float(eps)
        # with tensor parallelism the linear is Megatron's column-parallel shard: its rows are this rank's heads
        tp = Parallel.make(kwargs.get("tp_group"), kwargs.get("sequence_parallel", False),
                           kwargs.get("tp_comm_overlap", False))
        tp = 1 if tp is None else tp.world
        if not isinstance(num_heads, int) or num_heads <= 0 or num_heads % tp or lw.shape[0] % (num_heads // tp):
            raise ValueError(f"linear out_features ({lw.shape[0]}) must be a multiple of the local head count "
                             f"(num_heads {num_heads} / tp {tp})")
        kwargs.setdefault("q_head_dim", lw.shape[0] // (num_heads // tp))
        if kwargs["q_head_dim"] * (num_heads // tp) != lw.shape[0]:
            raise ValueError(f"num_heads / tp * q_head_dim must equal linear out_features ({lw.shape[0]})")
        # built on the meta device: its own parameters are replaced at once, so they are never allocated
        param_dtype = lw.dtype if si is None else (nw.dtype if nw is not None else torch.bfloat16)
        layer = cls(lw.shape[1], num_heads, qk_head_dim, qk_pos_emb_head_dim, device="meta", dtype=param_dtype,
                    **kwargs)
        layer.weight = lw  # shared: the user's optimizer and state dict keep working
        if si is not None:
            layer.weight_scale_inv = si
        if nw is not None:
            layer.norm_weight = nw
        layer.inv_freq = rope_inv_freq(layer.cfg.rope_dim, layer.rope_theta, layer.rope_scaling)[0].to(lw.device)
        return layer

    def extra_repr(self) -> str:
        c = self.cfg
        s = (f"{'q_lora_rank' if c.norm else 'in_features'}={c.q_lora_rank}, num_heads={self.num_heads}, "
             f"qk_head_dim={c.qk_head_dim}, qk_pos_emb_head_dim={c.rope_dim}, q_head_dim={c.q_head_dim}, "
             f"{f'eps={c.eps}, ' if c.norm else ''}rope_style={c.rope_style}, "
             f"precision={c.precision_options}, output_format={c.query_format}")
        if self.par is not None:
            s += f", tp_size={self.tp_size}, local_heads={c.num_heads}, sequence_parallel={self.par.sequence_parallel}"
            if self.par.overlap:
                s += ", tp_comm_overlap=True"
        if c.zero_centered_gamma:
            s += ", zero_centered_gamma=True"
        if not c.norm:
            s += ", norm=None"
        if self.rope_scaling is not None:
            s += f", rope_scaling={self.rope_scaling.get('rope_type', self.rope_scaling.get('type'))}"
        return s + f", backend={self.backend}"

    # ------------------------------------------------------------------------------------------ forward

    def refresh_weight_cache(self) -> None:
        """Drop the cached quantized weight; needed only after writing the weight through `weight.data` or a
        kernel outside torch (in-place torch ops and torch.optim steps are detected)."""
        self._wcache = None

    def _prepared_weight(self, recipe: Recipe) -> _backend.PreparedWeight:
        w = self.weight
        si = self.weight_scale_inv
        if si is not None:  # pre-quantized: its codes and scale_inv as they are
            w = (w, si)
        if torch.compiler.is_compiling():
            # under torch.compile the weight's quantization is part of the graph, every call: a Python-side
            # cache would be baked into the graph (stale after an update) or break it
            return recipe.prepare_weight(w, self.cfg, ())
        # _version moves with in-place torch ops; _weight_epoch with torch.optim steps (fused ones included);
        # the storage pointer with re-assignment of .data or a new Parameter
        wt = self.weight
        key = (wt._version, self._weight_epoch, wt.data_ptr(), wt.dtype, wt.device, tuple(wt.shape), recipe.kernels,
               None if si is None else (si._version, si.data_ptr()))
        if self._wcache is None or self._wcache.key != key:
            self._wcache = recipe.prepare_weight(w, self.cfg, key)
        return self._wcache

    def _pair_tables(self, x: torch.Tensor, lead: torch.Size, cos, sin,
                     position_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, R/2] pair tables for the query's tokens (lead: its leading dims)."""
        T = math.prod(lead)
        half = self.cfg.rope_dim // 2
        if position_ids is not None:
            if cos is not None or sin is not None:
                raise ValueError("pass either (cos, sin) or position_ids, not both")
            if not isinstance(position_ids, torch.Tensor):
                raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
            pdt = position_ids.dtype
            if pdt.is_floating_point or pdt.is_complex or pdt == torch.bool:
                raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
            if position_ids.device != x.device:
                raise ValueError(f"position_ids is on {position_ids.device}, x on {x.device}")
            pos = position_ids
            if pos.shape != lead:
                while pos.dim() > len(lead) and pos.shape[0] == 1:  # HF's [1, T] for a flattened x [T, K]
                    pos = pos[0]
                try:
                    fits = torch.broadcast_shapes(pos.shape, lead) == lead
                except RuntimeError:
                    fits = False
                if not fits:
                    raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} does not broadcast to the "
                                     f"query's leading dims {tuple(lead)} (leading dims of size 1 dropped)")
            freqs = pos.float().unsqueeze(-1) * self.inv_freq.to(x.device)
            c, s = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        else:
            if cos is None or sin is None:
                raise ValueError("pass both cos and sin (or position_ids)")
            for name, t in (("cos", cos), ("sin", sin)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
                if not t.dtype.is_floating_point:
                    raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
                if t.device != x.device:
                    raise ValueError(f"{name} is on {t.device}, x on {x.device}")
                if t.requires_grad:
                    raise ValueError(f"{name} requires grad, but the cos/sin tables get no gradient from the layer; "
                                     f"pass detached tables ({name}.detach())")
                if t.dim() == 0 or t.shape[-1] not in (self.cfg.rope_dim, half):
                    raise ValueError(f"{name} last dim must be qk_pos_emb_head_dim ({self.cfg.rope_dim}) or half of "
                                     f"it ({half}), got shape {tuple(t.shape)}")
                try:  # (torch.broadcast_shapes costs tens of microseconds: only when the shapes differ)
                    if t.shape[:-1] != lead and torch.broadcast_shapes(t.shape[:-1], lead) != lead:
                        raise RuntimeError
                except RuntimeError as e:
                    raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast against the query's "
                                     f"leading dims + (rope_dim,) = {tuple(lead) + (self.cfg.rope_dim,)}") from e
            c, s = half_table(cos, self.cfg.rope_dim), half_table(sin, self.cfg.rope_dim)
        # [T, R/2] views where the layout allows (a full-width HF table, a broadcast row): no copies on the host
        # path; the kernels take a row stride (shared by cos and sin) and a unit inner stride
        if c.shape[:-1] != lead or c.dim() != 2:  # (a [T, R/2] table needs no view)
            c = c.expand(lead + (half,)).reshape(T, half)
        if s.shape[:-1] != lead or s.dim() != 2:
            s = s.expand(lead + (half,)).reshape(T, half)
        if c.dtype != s.dtype or c.stride() != s.stride() or c.stride(-1) != 1:
            c, s = c.float().contiguous(), s.float().contiguous()
        return c, s

    def _check_x(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _ACT_DTYPES:
            raise TypeError(f"x dtype must be one of {_ACT_DTYPES}, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.cfg.q_lora_rank:
            raise ValueError(f"x last dim must be {'q_lora_rank' if self.cfg.norm else 'the input width'} "
                             f"({self.cfg.q_lora_rank}), got shape {tuple(x.shape)}")
        for name, p in self._own_params():
            if p.device != x.device:
                raise ValueError(f"x is on {x.device} but {name} is on {p.device}")
            if name == "weight" and self.weight_scale_inv is not None:
                if p.dtype != torch.float8_e4m3fn or p.requires_grad:
                    raise TypeError("a pre-quantized weight must stay float8_e4m3fn codes without requires_grad "
                                    f"(got {p.dtype}, requires_grad={p.requires_grad}): it has no master weight")
            elif p.dtype not in _ACT_DTYPES:
                raise TypeError(f"{name} dtype must be one of {_ACT_DTYPES}, got {p.dtype}")

    def _own_params(self) -> tuple[tuple[str, torch.Tensor], ...]:
        if self.norm_weight is None:
            return (("weight", self.weight),)
        return (("weight", self.weight), ("norm_weight", self.norm_weight))

    def _check_sequence_parallel(self, x: torch.Tensor, needs_grad: bool) -> None:
        if x.dim() < 2:
            raise ValueError(f"sequence_parallel=True needs x of shape [s/tp, ..., K] or [T/tp, K], got "
                             f"{tuple(x.shape)}")
        block = get_recipe(self.cfg.precision).col_block
        if needs_grad and math.prod(x.shape[:-1]) % block:
            raise ValueError(f"sequence_parallel=True with precision={self.cfg.precision!r}: this rank's token count "
                             f"({math.prod(x.shape[:-1])}) must be a multiple of {block} when a backward is needed "
                             f"(a columnwise block of the saved xn may not span two ranks)")

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None):
        """x [..., K] -> q [..., H, D]: an MXFP8Tensor (output_format='mxfp8') or a bf16 tensor. With
        sequence_parallel, x is this rank's slice of the first dimension and q covers every rank's tokens."""
        self._check_x(x)
        par = self.par
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad or (
            self.norm_weight is not None and self.norm_weight.requires_grad))
        if par is not None and par.sequence_parallel:
            self._check_sequence_parallel(x, needs_grad)
        lead = torch.Size(query_shape(x, self.cfg, par)[:-2])
        cos_h, sin_h = self._pair_tables(x, lead, cos, sin, position_ids)
        recipe = _backend.select(self.cfg, self.backend, x.device)  # the kernels or the reference, once per call
        pw = self._prepared_weight(recipe)
        if not needs_grad and not torch.compiler.is_compiling():  # inference: no autograd bookkeeping
            return forward_query(x, self.norm_weight, cos_h, sin_h, pw, self.cfg, recipe, False, par)[0]
        return _FusedMLAQUpProjFunction.apply(x, self.norm_weight, self.weight, cos_h, sin_h, pw, self.cfg,
                                              recipe, par)
