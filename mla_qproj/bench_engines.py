"""Benchmark the training engines' MLA attention with and without FusedMLAQUpProjection (DeepSeek-V3 shape).

    python -m mla_qproj.bench_engines [--engines megatron,torchtitan] [--tokens 4096,16384]
                                      [--precisions bf16,fp8_block] [--heads 128] [--rounds 3] [--rep 100]
                                      [--warmup 25] [--out results.jsonl] [--device cuda | cpu] [--shape v3 | tiny]

One attention layer of each engine (not a model), forward + backward, bf16 parameters, batch 1, T tokens:
  megatron    Megatron-Core's MLASelfAttention built from its local (non-TransformerEngine) layer spec
              (`get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")`),
              TP = 1 on a one-rank process group; "ours" is the same spec through `mla_qproj.megatron.mla_layer_spec`
              (FusedMLASelfAttention). Core attention (--megatron-attention): "sdpa" (default), a causal
              F.scaled_dot_product_attention behind Megatron's core-attention interface, cuDNN's kernel first (then
              PyTorch's order if cuDNN fails: the output says so), standing in for the TransformerEngine fused
              attention of Megatron's TE spec (not on the machine); "local", Megatron's own DotProductAttention (its
              [b·n, s, s] score matrix: memory grows as T² · heads).
  torchtitan  TorchTitan's DeepSeek-V3 `Attention` (`make_mla_attention_config`, YaRN RoPE as the 671B config);
              "ours" is the same module after `mla_qproj.torchtitan.patch_deepseek_v3`. Inner attention
              (--torchtitan-attention): TorchTitan's FlexAttention with a causal BlockMask (default on CUDA;
              --flex-compile torchtitan keeps its compile options, max-autotune included; "plain" compiles
              flex_attention without autotuning), or SDPA (TorchTitan's ScaledDotProductAttention; always on the
              CPU, where FlexAttention has no backward, and on CUDA when FlexAttention fails: the output says so).
Geometry (--shape v3): hidden 7168, q_lora_rank 1536, 128 heads (--heads), qk_nope 128, qk_rope 64, v_head_dim 128,
kv_lora_rank 512, YaRN (factor 40, original 4096 positions). --shape tiny: hidden 64, q_lora_rank 128, 2 heads, nope
32, rope 16, v 32, kv_lora_rank 32 (the CPU smoke test). Parameters N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1), the
same values in the stock module and in ours; x and the upstream gradient random normal bf16.

Rows per (engine, T): the stock module and ours at each --precisions value (output_format="bf16"), timed --rounds
times round-robin (`mla_qproj.bench.time_row`: triton.testing.do_bench medians, L2 flushed, gradients of x and of
every parameter reset between calls; on the CPU a plain timer: --warmup calls, then the mean of --rep calls). Reported:
the median over the rounds (ms), the spread (max - min over the rounds, of the median), ours / stock = the median over
the rounds of the same round's ratio (lower is faster), peak memory of one step (CUDA), and two checks that the timed
"ours" path is the layer: `fused_query_layer(attn)` is not None and the layer ran once per step (a forward hook), and
the forward output's relative difference ||ours - stock|| / ||stock|| on the same input.
Results: a markdown table, and with --out one JSON line appended to that file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from . import bench

ENGINES = ("megatron", "torchtitan")


@dataclass(frozen=True)
class Geometry:
    hidden: int
    q_lora_rank: int
    heads: int
    nope: int
    rope: int
    v: int
    kv_lora_rank: int


# tiny: valid for both engines and the layer (q_lora_rank a multiple of 128, as fp8_block needs)
SHAPES = {
    "v3": Geometry(hidden=7168, q_lora_rank=1536, heads=128, nope=128, rope=64, v=128, kv_lora_rank=512),
    "tiny": Geometry(hidden=64, q_lora_rank=128, heads=2, nope=32, rope=16, v=32, kv_lora_rank=32),
}
# DeepSeek-V3's YaRN
ROPE_THETA, YARN_FACTOR, YARN_ORIGINAL, BETA_FAST, BETA_SLOW = 10000.0, 40.0, 4096, 32.0, 1.0


class EngineUnavailable(Exception):
    """The engine cannot be imported here: the engine is skipped (its reason printed), the run goes on."""


def _version(dist_name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _params_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters only (TorchTitan's RoPE cache is a complex buffer: Module.to(bf16) would drop
    its imaginary part); the Parameter objects stay the same."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _init_params(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations: matrices N(0, 1/fan_in), vectors 1 + 0.1 N(0, 1) (the norm weights)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(module.named_parameters())):
            gen = torch.Generator(device=p.device).manual_seed(seed * 1000 + i)
            r = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.copy_(1 + 0.1 * r if p.dim() == 1 else r * p.shape[-1] ** -0.5)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ Megatron


class SDPACoreAttention(torch.nn.Module):
    """Megatron's core-attention interface ([s, b, n, d] in, [s, b, n·d_v] out) over a causal
    F.scaled_dot_product_attention, cuDNN's kernel first (TorchTitan's SDPA order, then the memory-efficient one):
    the fused attention a TransformerEngine spec would run (TE's is cuDNN's; TE is not on the machine)."""

    cudnn_first = True  # set to False (PyTorch's own order) when cuDNN's kernel fails (MegatronEngine.probe)

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        ctx = contextlib.nullcontext()
        if SDPACoreAttention.cudnn_first:
            ctx = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                               SDPBackend.MATH], set_priority=True)
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _local_dot_product_attention():
    """Megatron's DotProductAttention accepting the k_channels / v_channels the MLA spec passes (0.16.1's local
    class does not take them)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LocalDotProductAttention


class MegatronEngine:
    name = "megatron"

    def __init__(self, args, device: torch.device) -> None:
        try:
            import megatron.core  # noqa: F401
            from megatron.core.transformer.multi_latent_attention import MLASelfAttention  # noqa: F401

            from . import megatron as _integration  # noqa: F401
        except ImportError as e:
            raise EngineUnavailable(f"megatron-core is not importable: {e}") from e
        self.args, self.device = args, device
        self.notes: list[str] = []
        self.attention = args.megatron_attention
        self._saved_current_device = None
        self._store_dir = None
        self._owns_group = False

    # the process group, parallel state and the no-TE / CPU shims
    def setup(self) -> None:
        import megatron.core.transformer.multi_latent_attention as mla
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        cpu = self.device.type == "cpu"
        if cpu:  # Megatron builds its RoPE tables (and more) on torch.cuda.current_device()
            self._saved_current_device = torch.cuda.current_device
            torch.cuda.current_device = lambda: "cpu"
        if importlib.util.find_spec("transformer_engine") is None:
            mla.HAVE_TE = False  # 0.16.1 sets it from an import that succeeds without Transformer Engine
        if not dist.is_initialized():
            if cpu:  # one rank: loopback is all gloo needs (and a VM's hostname may not resolve to a usable address)
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            self._store_dir = tempfile.mkdtemp(prefix="mla_qproj_bench_")
            dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{self._store_dir}/store",
                                    rank=0, world_size=1)
            self._owns_group = True
        if dist.get_world_size() != 1:
            raise RuntimeError("mla_qproj.bench_engines runs on one rank (world size 1)")
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)  # no gloo beside NCCL
        model_parallel_cuda_manual_seed(self.args.seed, inference_rng_tracker=cpu)
        SDPACoreAttention.cudnn_first = True
        self.notes.append("TP = 1 on a one-rank " + ("gloo" if cpu else "nccl") + " group; local spec; core "
                          "attention: " + ("causal SDPA, cuDNN first (stand-in for TE's fused attention)"
                                           if self.attention == "sdpa" else "Megatron's local DotProductAttention"))

    def teardown(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)
        if self._saved_current_device is not None:
            torch.cuda.current_device = self._saved_current_device

    def _config(self, g: Geometry):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(
            num_layers=1, hidden_size=g.hidden, num_attention_heads=g.heads, q_lora_rank=g.q_lora_rank,
            kv_lora_rank=g.kv_lora_rank, qk_head_dim=g.nope, qk_pos_emb_head_dim=g.rope, v_head_dim=g.v,
            kv_channels=g.v, normalization="RMSNorm", layernorm_epsilon=1e-6, params_dtype=torch.bfloat16, bf16=True,
            use_cpu_initialization=self.device.type == "cpu", perform_initialization=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False, hidden_dropout=0.0,
            attention_dropout=0.0, add_bias_linear=False, rope_type="yarn", rotary_base=ROPE_THETA,
            rotary_scaling_factor=YARN_FACTOR, original_max_position_embeddings=YARN_ORIGINAL, beta_fast=BETA_FAST,
            beta_slow=BETA_SLOW, mscale=1.0, mscale_all_dim=1.0)

    def build(self, g: Geometry, max_tokens: int, precisions: list[str]) -> dict:
        """{"stock": MLASelfAttention, precision: FusedMLASelfAttention, ...}, the same weights, bf16, on device."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module

        from .megatron import mla_layer_spec

        cfg = self._config(g)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = (
            SDPACoreAttention if self.attention == "sdpa" else _local_dot_product_attention())
        specs = {"stock": spec}
        for p in precisions:
            specs[p] = mla_layer_spec(spec, precision=p, output_format="bf16", backend=self.args.backend)
        modules = {}
        for key, s in specs.items():
            attn = build_module(s.submodules.self_attention, config=cfg, layer_number=1)
            # the linears are built on the device in bf16; the norms (torch.nn.RMSNorm) on the CPU in fp32
            _params_to(attn.to(self.device), torch.bfloat16)
            if key == "stock":
                _init_params(attn, self.args.seed)
            else:
                attn.load_state_dict(modules["stock"].state_dict())
            modules[key] = attn
        return modules

    def inputs(self, g: Geometry, T: int, gen: torch.Generator) -> dict:
        dev = self.device
        c = {"x": torch.randn(T, 1, g.hidden, generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True),
             "dy": torch.randn(T, 1, g.hidden, generator=gen, device=dev).to(torch.bfloat16), "mask": None, "T": T}
        if self.attention == "local":  # Megatron's default causal mask is made on CUDA: an explicit one
            c["mask"] = torch.triu(torch.ones(T, T, dtype=torch.bool, device=dev), 1)[None, None]
        return c

    def forward(self, attn, c: dict) -> torch.Tensor:
        out, _ = attn(c["x"], attention_mask=c["mask"])
        return out

    def fused_layer(self, attn):
        from .megatron import fused_query_layer

        return fused_query_layer(attn)

    def probe(self, modules: dict, c: dict) -> None:
        """The SDPA stand-in: one stock forward + backward; if cuDNN's kernel fails, PyTorch's own SDPA order
        (the notes say so)."""
        if self.attention != "sdpa" or not SDPACoreAttention.cudnn_first:
            return
        try:
            self.forward(modules["stock"], c).backward(c["dy"])
        except Exception as e:
            SDPACoreAttention.cudnn_first = False
            self.notes.append(f"core attention: SDPA in PyTorch's default backend order, because cuDNN's kernel "
                              f"failed: {bench._err(e)}")
            print(f"  megatron: cuDNN attention failed, PyTorch's SDPA order instead: {bench._err(e)}", flush=True)
        finally:
            c["x"].grad = None
            for m in modules.values():
                m.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- TorchTitan


def _torch_compat_for_torchtitan() -> list[str]:
    """torchtitan 0.3.0 is pinned to a newer torch than some machines have (2.11: `torch.distributed.fsdp` has no
    `DataParallelMeshDims`, which torchtitan imports for annotations of its MTP / FSDP code, none of it run here):
    such a missing name is stubbed with an empty class; returns the notes saying which."""
    import torch.distributed.fsdp as fsdp

    notes = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        notes.append(f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims (torchtitan "
                     "imports it for its MTP / FSDP annotations): stubbed, unused by the attention")
    return notes


class TorchTitanEngine:
    name = "torchtitan"

    def __init__(self, args, device: torch.device) -> None:
        compat = _torch_compat_for_torchtitan()
        try:
            import torchtitan.models.deepseek_v3 as _ds  # noqa: F401
            from torchtitan.models.deepseek_v3.model import Attention  # noqa: F401

            from . import torchtitan as _integration  # noqa: F401
        except ImportError as e:
            raise EngineUnavailable(f"torchtitan is not importable: {e}") from e
        self.args, self.device = args, device
        self.notes: list[str] = compat
        self.attention = args.torchtitan_attention
        if device.type == "cpu" and self.attention == "flex":
            self.attention = "sdpa"
            self.notes.append("inner attention: SDPA (FlexAttention has no CPU backward)")
        self._saved_flex = None
        self._masks: dict = {}

    def setup(self) -> None:
        from torchtitan.models.common.attention import FlexAttention

        if self.attention == "flex":
            if self.args.flex_compile == "plain":
                from torch.nn.attention.flex_attention import flex_attention

                self._saved_flex = FlexAttention._compiled_flex_attn
                opts = {k: v for k, v in FlexAttention.inductor_configs.items()
                        if k not in ("max_autotune", "coordinate_descent_tuning")}
                FlexAttention._compiled_flex_attn = torch.compile(flex_attention, dynamic=False, options=opts)
                self.notes.append("inner attention: FlexAttention, compiled without max-autotune (--flex-compile "
                                  "plain)")
            else:
                self.notes.append("inner attention: FlexAttention, TorchTitan's compile options (max-autotune)")
        elif not self.notes:
            self.notes.append("inner attention: SDPA (--torchtitan-attention sdpa)")

    def teardown(self) -> None:
        if self._saved_flex is not None:
            from torchtitan.models.common.attention import FlexAttention

            FlexAttention._compiled_flex_attn = self._saved_flex
        self._masks.clear()

    def build(self, g: Geometry, max_tokens: int, precisions: list[str]) -> dict:
        """{"stock": Attention, precision: the patched copy, ...}, the same weights, bf16 parameters, on device."""
        import torchtitan.models.deepseek_v3 as ds
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.common.rope import ComplexRoPE

        from .torchtitan import patch_deepseek_v3

        rope = ComplexRoPE.Config(dim=g.rope, max_seq_len=max_tokens, theta=ROPE_THETA, scaling="yarn",
                                  rope_factor=YARN_FACTOR, beta_fast=BETA_FAST, beta_slow=BETA_SLOW,
                                  original_seq_len=YARN_ORIGINAL)
        cfg = ds.make_mla_attention_config(
            layer_id=0, dim=g.hidden, n_heads=g.heads, q_lora_rank=g.q_lora_rank, kv_lora_rank=g.kv_lora_rank,
            qk_nope_head_dim=g.nope, qk_rope_head_dim=g.rope, v_head_dim=g.v, mscale=1.0, attn_backend="flex",
            linear_init=ds._LINEAR_INIT, norm_init=ds._NORM_INIT, depth_init=ds._depth_init, rope=rope)
        if self.attention == "sdpa":
            cfg.inner_attention = ScaledDotProductAttention.Config()
        self._block_size = getattr(cfg.inner_attention, "block_size", None)
        with torch.device(self.device):
            stock = cfg.build()
        _params_to(stock, torch.bfloat16)
        _init_params(stock, self.args.seed)
        modules = {"stock": stock}
        for p in precisions:
            modules[p] = patch_deepseek_v3(copy.deepcopy(stock), precision=p, output_format="bf16",
                                           backend=self.args.backend)
        return modules

    def _mask(self, T: int):
        if self.attention != "flex":
            return None
        if T not in self._masks:
            from torchtitan.models.common.attention import create_attention_mask, get_causal_mask_mod

            self._masks[T] = create_attention_mask(get_causal_mask_mod(), 1, None, T, T, device=self.device,
                                                   BLOCK_SIZE=self._block_size)
        return self._masks[T]

    def inputs(self, g: Geometry, T: int, gen: torch.Generator) -> dict:
        dev = self.device
        return {"x": torch.randn(1, T, g.hidden, generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True),
                "dy": torch.randn(1, T, g.hidden, generator=gen, device=dev).to(torch.bfloat16),
                "mask": self._mask(T), "T": T}

    def forward(self, attn, c: dict) -> torch.Tensor:
        return attn(c["x"], c["mask"])

    def fused_layer(self, attn):
        from .torchtitan import fused_query_layer

        return fused_query_layer(attn)

    def probe(self, modules: dict, c: dict) -> None:
        """FlexAttention on CUDA: one stock forward + backward (its compile); on failure every module's inner
        attention becomes TorchTitan's SDPA, and the notes say so."""
        if self.attention != "flex":
            return
        try:
            self.forward(modules["stock"], c).backward(c["dy"])
        except Exception as e:
            from torchtitan.models.common.attention import ScaledDotProductAttention

            self.notes[:] = [n for n in self.notes if not n.startswith("inner attention")]
            self.notes.append(f"inner attention: SDPA (TorchTitan's ScaledDotProductAttention), because "
                              f"FlexAttention failed: {bench._err(e)}")
            print(f"  torchtitan: FlexAttention failed, falling back to SDPA: {bench._err(e)}", flush=True)
            self.attention = "sdpa"
            for m in modules.values():
                m.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
            c["mask"] = None
            self._masks.clear()
        finally:
            c["x"].grad = None
            for m in modules.values():
                m.zero_grad(set_to_none=True)


ENGINE_CLASSES = {"megatron": MegatronEngine, "torchtitan": TorchTitanEngine}


# ------------------------------------------------------------------------------------------------- timing


def cpu_time(fn: Callable, grads: list[torch.Tensor], warmup: int, rep: int) -> float:
    """Plain wall-clock timer (CPU): `warmup` calls, then the mean ms of `rep` calls, grads reset before each."""
    def call():
        for t in grads:
            t.grad = None
        fn()

    for _ in range(warmup):
        call()
    total = 0.0
    for _ in range(max(rep, 1)):
        for t in grads:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
    return total / max(rep, 1) * 1e3


def make_timer(device: torch.device, warmup: int, rep: int) -> Callable:
    """(row, fn, grads) -> ms: `bench.time_row`'s do_bench median on CUDA, `cpu_time` on the CPU."""
    if device.type == "cuda":
        return lambda row, fn, grads: bench.time_row(row, fn, grads, warmup, rep)[0]
    return lambda row, fn, grads: cpu_time(fn, grads, warmup, rep)


def _step(engine, attn, c: dict) -> Callable[[], None]:
    def fn():
        engine.forward(attn, c).backward(c["dy"])

    return fn


def _rows(engine, modules: dict) -> list[bench.Row]:
    """One bench.Row per module (fwdbwd; ours measured against the stock module)."""
    def build(key):
        def b(c):
            attn = modules[key]
            return _step(engine, attn, c), [c["x"], *[p for p in attn.parameters() if p.requires_grad]]

        return b

    return [bench.Row("stock" if key == "stock" else f"ours_{key}", "fwdbwd", None if key == "stock" else "stock",
                      build(key)) for key in modules]


def _check_ours(engine, attn, c: dict, fn: Callable, stock_out: torch.Tensor | None) -> dict:
    """The timed "ours" step goes through the layer: fused_query_layer is set and ran once in one step (hook);
    and the forward's relative difference from the stock module's on the same input."""
    layer = engine.fused_layer(attn)
    if layer is None:
        raise RuntimeError("fused_query_layer(attn) is None: the engine's own query path would be timed")
    calls = []
    handle = layer.register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:
        fn()  # also the first (compiling) call
    finally:
        handle.remove()
    if not calls:
        raise RuntimeError("the fused layer did not run in the timed step")
    rec = {"layer_calls_per_step": len(calls), "layer": f"{type(layer).__name__}(precision={layer.cfg.precision}, "
           f"output_format=bf16, backend={layer.backend})"}
    if c["x"].is_cuda:
        try:  # the forward GEMM: the CuTe DSL engine's kernel, or the Triton one
            from .kernels.cute import rope_gemm

            rec["cute_gemm"] = bool(rope_gemm.serves(layer.cfg, c["x"].device))
        except Exception as e:
            rec["cute_gemm"] = f"unknown ({bench._err(e)})"
    if stock_out is not None:
        rec["rel_diff_fwd"] = _rel_diff(engine.forward(attn, c), stock_out)
    extra = f", CuTe GEMM: {rec['cute_gemm']}" if "cute_gemm" in rec else ""
    print(f"  {engine.name:<10} T={c['T']:<6} check  {rec['layer']}: {len(calls)} layer call(s) per step, rel. diff "
          f"fwd {rec.get('rel_diff_fwd', float('nan')):.2e}{extra}", flush=True)
    return rec


def bench_engine_T(engine, modules: dict, c: dict, timer: Callable, rounds: int, cuda: bool) -> list[dict]:
    """Every row of one engine at one T, `rounds` times round-robin; errors are results, never raised."""
    T = c["T"]
    engine.probe(modules, c)
    rows = _rows(engine, modules)
    built = [(row, *bench.build_row(row, c)) for row in rows]
    res = {row.name: {"engine": engine.name, "T": T, "name": row.name, "kind": row.kind, "ref": row.ref,
                      "precision": None if row.ref is None else row.name[len("ours_"):], "ms_rounds": []}
           for row in rows}
    stock_out = None
    try:  # forwards with grad enabled, as the timed steps (a compiled inner attention: no inference-graph compile)
        stock_out = engine.forward(modules["stock"], c).detach()
    except Exception as e:
        res["stock"]["error"] = bench._err(e)
    for row, fn, _, err in built:  # checks (and the first call of each step) before any timing
        r = res[row.name]
        if err is not None:
            r["error"] = err
            continue
        try:
            if row.ref is None:
                fn()
            else:
                r.update(_check_ours(engine, modules[row.name[len("ours_"):]], c, fn, stock_out))
        except Exception as e:
            r["error"] = bench._err(e)
        c["x"].grad = None
        modules[row.name[len("ours_"):] if row.ref else "stock"].zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
    del stock_out
    for rnd in range(rounds):
        for row, fn, grads, _ in built:
            r = res[row.name]
            if "error" in r:
                continue
            try:
                ms = timer(row, fn, grads)
                r["ms_rounds"].append(ms)
                print(f"  {engine.name:<10} T={T:<6} round {rnd} {row.name:<16} {ms:9.3f} ms", flush=True)
            except Exception as e:
                r["error"] = bench._err(e)
                print(f"  {engine.name:<10} T={T:<6} round {rnd} {row.name:<16} {r['error']}", flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    out = []
    for row, fn, grads, _ in built:
        r = res[row.name]
        if "error" not in r and r["ms_rounds"]:
            v = r["ms_rounds"]
            r["ms"] = bench._median(v)
            r["spread"] = (max(v) - min(v)) / r["ms"] if r["ms"] > 0 else 0.0
            if cuda:
                try:
                    with torch.enable_grad():
                        r["peak_mib"], r["peak_extra_mib"] = bench.measure_peak(fn, grads)
                except Exception as e:
                    r["peak_error"] = bench._err(e)
        out.append(r)
    stock = res["stock"]
    for r in out:
        if r["ref"] is not None and "ms" in r and "ms" in stock:
            r["ratio"] = bench._same_round_ratio(r, stock)  # ours / stock, lower is faster
            r["stock_ms"] = stock["ms"]
    return out


# ------------------------------------------------------------------------------------------------ report


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        env = bench.environment()
        env["gpu_state_before"] = bench.gpu_state()
    else:
        import triton

        env = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
               "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
               "date": datetime.datetime.now().isoformat(timespec="seconds")}
    env["megatron_core"] = _version("megatron-core")
    env["torchtitan"] = _version("torchtitan")
    env["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    return env


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def format_table(results: list[dict], heads: dict, header: bool = True) -> str:
    """Markdown: one line per (engine, T, precision)."""
    lines = ["ours / stock: time of the engine's attention forward + backward with the fused layer over the time of "
             "the stock module (lower is faster; < 1: the layer makes the step faster)", ""] if header else []
    lines += ["| engine | T | heads | precision | stock ms | ours ms | ours / stock | spread (ours) | rel. diff fwd "
             "| peak MiB stock / ours |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    errors = []
    by = {(r["engine"], r["T"], r["name"]): r for r in results}
    for r in results:
        if r["name"] == "stock":
            if "error" in r:
                errors.append(f"- {r['engine']} T={r['T']} stock: {r['error']}")
            continue
        stock = by.get((r["engine"], r["T"], "stock"), {})
        if "error" in r:
            errors.append(f"- {r['engine']} T={r['T']} {r['name']}: {r['error']}")
        spread = f"{100 * r['spread']:.1f}%" if "spread" in r else "-"
        peak = f"{_fmt(stock.get('peak_mib'), '.0f')} / {_fmt(r.get('peak_mib'), '.0f')}"
        lines.append(f"| {r['engine']} | {r['T']} | {heads[r['engine']]} | {r['precision']} | "
                     f"{_fmt(stock.get('ms'), '.3f')} | {_fmt(r.get('ms'), '.3f')} | {_fmt(r.get('ratio'), '.3f')} | "
                     f"{spread} | {_fmt(r.get('rel_diff_fwd'), '.2e')} | {peak} |")
    return "\n".join(lines + (["", "errors:"] + errors if errors else []))


# -------------------------------------------------------------------------------------------------- main


def _csv(s: str) -> list[str]:
    return [t.strip() for t in s.split(",") if t.strip()]


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m mla_qproj.bench_engines", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: megatron, torchtitan")
    p.add_argument("--tokens", default="4096,16384", help="comma-separated T values (batch 1)")
    p.add_argument("--precisions", default="bf16,fp8_block", help="comma-separated precisions of ours "
                   "(output_format='bf16')")
    p.add_argument("--shape", default="v3", choices=sorted(SHAPES), help="v3: DeepSeek-V3; tiny: the CPU smoke test")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: the shape's; fewer if memory "
                   "requires)")
    p.add_argument("--rounds", type=int, default=3, help="times every row is timed, round-robin (median reported)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms (CPU: timed calls)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (CPU: untimed calls)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: tiny sizes, a plain timer")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"], help="the layer's backend")
    p.add_argument("--megatron-attention", default="sdpa", choices=["sdpa", "local"],
                   help="Megatron's core attention: causal SDPA, or its local DotProductAttention (T² · heads memory)")
    p.add_argument("--torchtitan-attention", default="flex", choices=["flex", "sdpa"],
                   help="TorchTitan's inner attention (the CPU always runs SDPA)")
    p.add_argument("--flex-compile", default="torchtitan", choices=["torchtitan", "plain"],
                   help="FlexAttention's compile: TorchTitan's options (max-autotune), or without autotuning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON-lines file the run is appended to (optional)")
    args = p.parse_args(argv)
    args.engines = _csv(args.engines)
    args.tokens = [int(t) for t in _csv(args.tokens)]
    args.precisions = _csv(args.precisions)
    bad = [e for e in args.engines if e not in ENGINES]
    if bad:
        p.error(f"unknown engine(s) {bad}; choose from {ENGINES}")
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens needs positive T values")
    return args


def run(args) -> tuple[list[dict], dict, dict]:
    """(results, per-engine info, environment)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    geom = SHAPES[args.shape]
    if args.heads is not None:
        geom = replace(geom, heads=args.heads)
    env = environment(device)
    for k in ("device", "capability", "torch", "triton", "cuda", "megatron_core", "torchtitan", "date"):
        if k in env:
            print(f"{k:>14}: {env[k]}")
    if cuda:
        print(f"gpu state (sm clock, max sm clock, power, temperature): {env['gpu_state_before']}")
    print(f"geometry: {asdict(geom)}, tokens {args.tokens}, precisions {args.precisions}, rounds {args.rounds}, "
          f"rep {args.rep}, warmup {args.warmup}", flush=True)
    timer = make_timer(device, args.warmup, args.rep)
    results: list[dict] = []
    info: dict = {}
    for name in args.engines:
        try:
            engine = ENGINE_CLASSES[name](args, device)
        except EngineUnavailable as e:
            print(f"{name}: skipped ({e})", flush=True)
            info[name] = {"skipped": str(e)}
            continue
        info[name] = {"notes": engine.notes, "heads": geom.heads}
        modules = None
        mine: list[dict] = []
        try:
            engine.setup()
            modules = engine.build(geom, max(args.tokens), args.precisions)
            gen = torch.Generator(device=device)
            for T in args.tokens:
                gen.manual_seed(args.seed + T)
                c = engine.inputs(geom, T, gen)
                mine += bench_engine_T(engine, modules, c, timer, args.rounds, cuda)
                del c
                if cuda:
                    torch.cuda.empty_cache()
        except Exception as e:  # a setup / build failure of one engine is reported; the other still runs
            import traceback

            traceback.print_exc()
            info[name]["error"] = bench._err(e)
            print(f"{name}: failed ({info[name]['error']})", flush=True)
        finally:
            del modules
            with contextlib.suppress(Exception):
                engine.teardown()
            if cuda:
                torch.cuda.empty_cache()
        for note in engine.notes:
            print(f"{name}: {note}", flush=True)
        if mine:  # this engine's rows now (the whole table comes at the end)
            print(format_table(mine, {name: geom.heads}, header=False) + "\n", flush=True)
        results += mine
    if cuda:
        env["gpu_state_after"] = bench.gpu_state()
        print(f"gpu state after: {env['gpu_state_after']}")
    return results, info, env


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mla_qproj.bench_engines: no CUDA GPU found (--device cpu --shape tiny runs the smoke test).",
              file=sys.stderr)
        return 2
    results, info, env = run(args)
    heads = {name: i.get("heads", "-") for name, i in info.items()}
    print("\n" + ", ".join(f"{k} {env[k]}" for k in ("device", "capability", "torch", "triton", "cuda",
                                                       "megatron_core", "torchtitan") if env.get(k)))
    for name, i in info.items():
        if "skipped" in i:
            print(f"{name}: skipped ({i['skipped']})")
            continue
        if "error" in i:
            print(f"{name}: failed ({i['error']})")
        for note in i.get("notes", []):
            print(f"{name}: {note}")
    print(f"median over {args.rounds} round-robin rounds of "
          f"{'do_bench medians (L2 flushed)' if args.device == 'cuda' else 'plain-timer means'}; ours / stock: the "
          "median of the same round's ratios; rel. diff fwd: ||ours - stock|| / ||stock|| of the forward output\n")
    print(format_table(results, heads))
    if args.out:
        settings = {k: v for k, v in vars(args).items()}
        settings["geometry"] = asdict(replace(SHAPES[args.shape], heads=args.heads or SHAPES[args.shape].heads))
        settings["command"] = " ".join(["python -m mla_qproj.bench_engines"] + (sys.argv[1:] if argv is None
                                                                                  else list(argv)))
        record = {"run": f"{env['date']} {env['device']} bench_engines", "environment": env, "settings": settings,
                  "engines": info, "results": results}
        with open(args.out, "a") as fh:
            fh.write(json.dumps(record, sort_keys=True, separators=(",", ":"), default=str) + "\n")
        print(f"\nappended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
