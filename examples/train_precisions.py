"""Train before you trust a precision: one small MLA-style model, trained once per query-path precision.

A precision that passes unit tests (bytes, relative errors) can still hurt training. This script trains the same
small DeepSeek-style MLA model on multi-query associative recall (MQAR) once per precision of the query
up-projection, with the same seed (same initial weights) and the same data order, and compares the loss curves.

Task (MQAR): a sequence lists `--pairs` key/value pairs `k1 v1 k2 v2 ...` (distinct keys from `--keys` tokens,
values from `--values` tokens), then `--queries` of those keys again; at each query the model must predict the
value that followed that key. Only the query positions are scored. Without attention from a query back to its key
the best a model can do is guess among the values in the context, ln(--pairs) nats; below that it needs an
induction-style circuit over two layers (a value position learns its key, the query finds it). At the default
size the bf16 composition climbs to that guessing level (~30 % accuracy) in ~100 steps, stays there, and then
solves the task: 90 % accuracy at step 244 (seeds 1 and 2: 219, 210), loss ~5e-3 at step 500.

Model: token embedding -> L x [RMSNorm -> MLA attention -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm
-> head. The attention follows DeepSeek-V3: the query is `q_b_proj(q_a_layernorm(q_a_proj(h)))` + RoPE on each
head's last `--qk-rope-dim` columns; the key/value path is `kv_a_proj_with_mqa` (a latent plus one shared RoPE key
part), `kv_a_layernorm`, `kv_b_proj`; causal `F.scaled_dot_product_attention`. Only the query's
`[q_a_layernorm + q_b_proj + RoPE]` changes between runs:

- `composition`: the unfused path a user writes in plain torch: nn.RMSNorm -> nn.Linear -> interleaved RoPE
  (HF DeepseekV3 `rope_interleave=True`, tables cast to the activation dtype as HF does), under bf16 autocast;
- `bf16`, `mxfp8`, `fp8_block`: `FusedMLAQUpProjection.from_modules(q_a_layernorm, q_b_proj, ...)` with that
  `precision` (same parameters, shared), `rope_style="deepseek"`, `backend="auto"`. A precision this version of
  mla_qproj does not know (fp8_block before it lands) is skipped with a message.

Numerics of every run: fp32 parameters (the master weights; AdamW state in fp32); the rest of the model (embeddings,
projections, SDPA, MLP, head) in `--compute-dtype`: bf16 autocast by default on CUDA, fp32 by default on the CPU,
where bf16 matmuls without AVX512-BF16 run 20-50x slower than fp32 ones; the loss in fp32. The query path under
test has its own precision whatever the compute dtype: the composition runs under bf16 autocast (its Linear is a
bf16 GEMM of the bf16-cast activation and weight, with a bf16 result), the fused layer with autocast switched off
around it (it takes the activation and the fp32 parameters and rounds as its precision says; under autocast its
pure-PyTorch backend's fp32-accumulated GEMM would be cast to bf16 before RoPE). Both queries are bf16.

    python examples/train_precisions.py                # CPU, default size: ~80 s for three precisions (2 cores)
    python examples/train_precisions.py --precisions composition,mxfp8 --output-format mxfp8 \
        --rope-input position_ids                      # an MXFP8 query (dequantized for SDPA), built-in RoPE tables
    python examples/train_precisions.py --device cuda --steps 1500 --batch-size 256 --pairs 8 --queries 8 \
        --keys 64 --values 64 --d-model 256 --heads 4 --q-lora-rank 256 --kv-lora-rank 128 --qk-nope-dim 64 \
        --qk-rope-dim 32 --v-head-dim 64 --mlp-hidden 512   # GPU: the Triton kernels, a bigger model and task

`--rope-input` picks what the fused layer gets: the model's cos/sin tables (default; the composition and the keys
use them too) or `position_ids` (the layer's built-in tables). `--threads` defaults to 1: the default model's ops
are too small for a second thread to pay, and on a busy machine it costs several times more than it gives.

Writes `--out`/losses.json (config, per-step losses and accuracies, final numbers) and `--out`/loss.png (needs
matplotlib; skipped with a message otherwise); prints a table of final losses. Exit status 0 when every requested
precision trained (or was skipped as not available) with finite losses, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mla_qproj import FusedMLAQUpProjection, MXFP8Tensor

PRECISIONS = ("composition", "bf16", "mxfp8", "fp8_block")
LABELS = {"composition": "bf16 composition (torch)", "bf16": "fused bf16", "mxfp8": "fused mxfp8",
          "fp8_block": "fused fp8_block"}
IGNORE = -100  # cross_entropy's ignore_index: positions that are not scored
SOLVED_ACC = 0.9  # "solved" = first step whose running mean (20 steps) of query accuracy reaches this


@dataclass(frozen=True)
class Config:
    """Everything that defines a run except the precision (all runs of one invocation share it)."""

    steps: int
    batch_size: int
    pairs: int
    queries: int
    keys: int
    values: int
    d_model: int
    layers: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    mlp_hidden: int
    lr: float
    warmup: int
    weight_decay: float
    rope_theta: float
    output_format: str
    rope_input: str
    compute_dtype: str
    backend: str
    seed: int
    eval_batches: int

    @property
    def vocab(self) -> int:
        return self.keys + self.values

    @property
    def seq_len(self) -> int:
        return 2 * self.pairs + self.queries


# ---- data: multi-query associative recall ------------------------------------------------------------------


def mqar_batch(gen: torch.Generator, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, targets [batch, 2 * pairs + queries] (int64, CPU). Keys are tokens [0, keys), values
    [keys, keys + values); targets hold the value at each query position and IGNORE elsewhere."""
    b, p, q = cfg.batch_size, cfg.pairs, cfg.queries
    keys = torch.rand(b, cfg.keys, generator=gen).argsort(-1)[:, :p]  # p distinct keys per sequence
    vals = torch.randint(cfg.values, (b, p), generator=gen) + cfg.keys
    asked = torch.rand(b, p, generator=gen).argsort(-1)[:, :q]  # which pairs are queried, in random order
    tokens = torch.cat([torch.stack([keys, vals], -1).reshape(b, 2 * p), keys.gather(1, asked)], 1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, 2 * p:] = vals.gather(1, asked)
    return tokens, targets


# ---- model ---------------------------------------------------------------------------------------------------


def rope_tables(seq_len: int, rope_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style tables cos, sin [seq_len, rope_dim] = cat(freqs, freqs), fp32 (no scaling)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim)
    freqs = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def rope_deepseek(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (SPEC §3 "deepseek"): pair i is columns (2i, 2i+1) of t [..., R]; the rotated pair lands in
    columns i and R/2 + i. cos, sin broadcast against t, HF layout cat(freqs, freqs)."""
    t = torch.cat([t[..., 0::2], t[..., 1::2]], -1)  # de-interleave: a's then b's
    a, b = t.chunk(2, -1)
    return t * cos + torch.cat([-b, a], -1) * sin


class MLAAttention(nn.Module):
    """DeepSeek-V3-style attention. The query path under test is either the composition of q_a_layernorm,
    q_b_proj and RoPE (self.fused_query is None) or a FusedMLAQUpProjection sharing their parameters."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        h, nope, rope, v = cfg.heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.q_a_proj = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.d_model, cfg.kv_lora_rank + rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (nope + v), bias=False)
        self.o_proj = nn.Linear(h * v, cfg.d_model, bias=False)
        self.fused_query: FusedMLAQUpProjection | None = None

    def use_fused_query(self, precision: str) -> None:
        """Route the query through FusedMLAQUpProjection (raises the layer's ValueError for an unknown precision)."""
        cfg = self.cfg
        self.fused_query = FusedMLAQUpProjection.from_modules(
            self.q_a_layernorm, self.q_b_proj, num_heads=cfg.heads, qk_head_dim=cfg.qk_nope_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_dim, rope_style="deepseek", precision=precision,
            output_format=cfg.output_format, rope_theta=cfg.rope_theta, backend=cfg.backend)

    def query(self, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              position_ids: torch.Tensor) -> torch.Tensor:
        """c_q [B, S, q_lora_rank] -> q [B, S, H, nope + rope] (bf16)."""
        cfg = self.cfg
        if self.fused_query is None:  # the user's composition in bf16, whatever the model's compute dtype
            with torch.autocast(c_q.device.type, dtype=torch.bfloat16):
                q = self.q_b_proj(self.q_a_layernorm(c_q)).unflatten(-1, (cfg.heads, -1))
            q_pass, q_rot = q.split([cfg.qk_nope_dim, cfg.qk_rope_dim], -1)
            q_rot = rope_deepseek(q_rot, cos.to(q_rot.dtype)[:, None], sin.to(q_rot.dtype)[:, None])
            return torch.cat([q_pass, q_rot], -1)
        with torch.autocast(c_q.device.type, enabled=False):  # the layer rounds as its precision says
            if cfg.rope_input == "position_ids":
                q = self.fused_query(c_q, position_ids=position_ids)  # [S] broadcasts over the batch
            else:
                q = self.fused_query(c_q, cos, sin)  # [S, R] tables broadcast over the batch
        if isinstance(q, MXFP8Tensor):  # output_format="mxfp8": SDPA takes the dense image
            q = q.dequantize(torch.bfloat16)
        return q

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        q = self.query(self.q_a_proj(h), cos, sin, position_ids)  # [B, S, H, nope + rope]
        c_kv, k_rot = self.kv_a_proj_with_mqa(h).split([cfg.kv_lora_rank, cfg.qk_rope_dim], -1)
        k_rot = rope_deepseek(k_rot, cos.to(k_rot.dtype), sin.to(k_rot.dtype))  # [B, S, R], shared by all heads
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).unflatten(-1, (cfg.heads, -1))
        k_pass, v = kv.split([cfg.qk_nope_dim, cfg.v_head_dim], -1)  # [B, S, H, nope], [B, S, H, v]
        k = torch.cat([k_pass, k_rot[:, :, None].expand(-1, -1, cfg.heads, -1)], -1)
        q, k, v = (t.to(v.dtype).transpose(1, 2) for t in (q, k, v))  # [B, H, S, .]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.attn = MLAAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, h, cos, sin, position_ids):
        h = h + self.attn(self.attn_norm(h), cos, sin, position_ids)
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)


class MQARModel(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2-style init; residual outputs scaled by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("o_proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab]."""
        s = tokens.shape[1]
        cos, sin = rope_tables(s, self.cfg.qk_rope_dim, self.cfg.rope_theta, tokens.device)
        position_ids = torch.arange(s, device=tokens.device)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin, position_ids)
        return self.head(self.norm(h))


# ---- training ------------------------------------------------------------------------------------------------


class PrecisionUnavailable(Exception):
    """This version of mla_qproj does not know the precision."""


def build_model(cfg: Config, precision: str, device: torch.device) -> MQARModel:
    """The same initial weights for every precision (seeded); fused precisions wrap each block's query modules."""
    torch.manual_seed(cfg.seed)
    model = MQARModel(cfg)
    if precision != "composition":
        for block in model.blocks:
            try:
                block.attn.use_fused_query(precision)
            except ValueError as e:  # the layer names the argument first: "precision must be one of (...)"
                if str(e).startswith("precision") and repr(precision) in str(e):
                    raise PrecisionUnavailable(str(e)) from e
                raise
    return model.to(device)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up, then cosine decay to 10 % of --lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))


def scored_loss(model: MQARModel, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross entropy (fp32) and accuracy over the query positions."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=model.cfg.compute_dtype == "bf16"):
        logits = model(tokens)
    m = targets != IGNORE
    logits, targets = logits[m].float(), targets[m]
    return F.cross_entropy(logits, targets), (logits.argmax(-1) == targets).float().mean()


def train_one(cfg: Config, precision: str, device: torch.device, log_every: int) -> dict:
    model = build_model(cfg, precision, device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)  # the same data order for every precision
    losses, accs = [], []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        tokens, targets = (t.to(device) for t in mqar_batch(gen, cfg))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, acc = scored_loss(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append(acc.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"non-finite loss {losses[-1]} at step {step}")
        if log_every and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"  [{precision}] step {step:5d}  loss {losses[-1]:.4f}  acc {accs[-1]:.3f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0

    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)  # held out: not a batch the model trained on
    eval_loss = eval_acc = 0.0
    with torch.no_grad():
        for _ in range(cfg.eval_batches):
            loss, acc = scored_loss(model, *(t.to(device) for t in mqar_batch(eval_gen, cfg)))
            eval_loss += loss.item() / cfg.eval_batches
            eval_acc += acc.item() / cfg.eval_batches
    tail = losses[-min(20, len(losses)):]
    solved = next((i for i, a in enumerate(running_mean(accs)) if a >= SOLVED_ACC), None)
    return {"status": "ok", "label": LABELS[precision], "losses": losses, "accs": accs,
            "final_loss": sum(tail) / len(tail), "eval_loss": eval_loss, "eval_acc": eval_acc,
            "solved_step": solved, "wall_s": wall}


# ---- output --------------------------------------------------------------------------------------------------


def running_mean(values: list[float], window: int = 20) -> list[float]:
    """Mean of the last `window` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict, cfg: Config, path: Path) -> bool:
    """loss.png: training loss (log y), query accuracy, and each fused run's loss relative to the composition's
    (20-step running means), one curve per trained precision."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping loss.png (pip install matplotlib)")
        return False
    trained = {k: r for k, r in results.items() if r["status"] == "ok"}
    base = trained.get("composition")
    fig, axes = plt.subplots(1, 3 if base else 2, figsize=(17 if base else 12, 4.5))
    ax_loss, ax_acc = axes[0], axes[1]
    for name, r in trained.items():
        steps = range(1, len(r["losses"]) + 1)
        color = f"C{PRECISIONS.index(name)}"  # one color per precision in every figure
        ax_loss.plot(steps, r["losses"], label=r["label"], color=color, linewidth=1.2, alpha=0.85)
        ax_acc.plot(steps, r["accs"], label=r["label"], color=color, linewidth=1.2, alpha=0.85)
        if base and r is not base:
            ratio = [a / b for a, b in zip(running_mean(r["losses"]), running_mean(base["losses"]), strict=True)]
            axes[2].plot(steps, ratio, label=r["label"], color=color, linewidth=1.2)
    ax_loss.axhline(math.log(cfg.pairs), color="gray", linestyle=":", linewidth=1,
                    label=f"ln(pairs) = {math.log(cfg.pairs):.2f}: guess among the context's values")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("cross entropy at query positions (nats, log scale)")
    ax_loss.set_title("training loss")
    ax_acc.set_xlabel("training step")
    ax_acc.set_ylabel("accuracy at query positions")
    ax_acc.set_ylim(0.0, 1.02)
    ax_acc.set_title("query accuracy (training batch)")
    if base:
        axes[2].axhline(1.0, color=f"C{PRECISIONS.index('composition')}", linewidth=1, label=base["label"])
        axes[2].set_xlabel("training step")
        axes[2].set_ylabel("loss ratio to the composition (20-step running means)")
        axes[2].set_title(f"relative to the {base['label']}")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"MQAR ({cfg.pairs} pairs, {cfg.queries} queries), MLA model d={cfg.d_model} L={cfg.layers} "
                 f"H={cfg.heads}, batch {cfg.batch_size}, seed {cfg.seed}, query output {cfg.output_format}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(results: dict) -> None:
    print(f"\n{'precision':<26} {'final loss':>10} {'eval loss':>10} {'eval acc':>9} {'solved at':>10} {'time s':>8}")
    for r in results.values():
        if r["status"] != "ok":
            print(f"{r['label']:<26} {r['status']}: {r['reason']}")
            continue
        solved = "-" if r["solved_step"] is None else str(r["solved_step"])
        print(f"{r['label']:<26} {r['final_loss']:>10.4f} {r['eval_loss']:>10.4f} {r['eval_acc']:>9.3f} "
              f"{solved:>10} {r['wall_s']:>8.1f}")
    print(f"(final loss: mean of the last 20 steps; solved at: first step whose 20-step running accuracy reaches "
          f"{SOLVED_ACC})")


# ---- command line --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="training steps per precision")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda: the Triton kernels)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma list out of {', '.join(PRECISIONS)}")
    p.add_argument("--out", default="train_precisions_out", help="folder for loss.png and losses.json")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order (the same for every run)")
    p.add_argument("--output-format", choices=("bf16", "mxfp8"), default="bf16",
                   help="the fused layer's query format (mxfp8: dequantized to bf16 for SDPA)")
    p.add_argument("--rope-input", choices=("tables", "position_ids"), default="tables",
                   help="what the fused layer gets: the model's cos/sin tables or position_ids")
    p.add_argument("--compute-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the rest of the model (auto: bf16 autocast on CUDA, fp32 on the CPU)")
    p.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                   help="the fused layer's backend (auto: Triton on CUDA, the PyTorch reference on CPU unless "
                        "TRITON_INTERPRET=1)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--pairs", type=int, default=4, help="key/value pairs per sequence")
    p.add_argument("--queries", type=int, default=4, help="queried keys per sequence (<= pairs)")
    p.add_argument("--keys", type=int, default=32, help="key vocabulary (>= pairs)")
    p.add_argument("--values", type=int, default=32, help="value vocabulary")
    p.add_argument("--d-model", type=int, default=64, help="residual width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=2, help="attention heads")
    p.add_argument("--q-lora-rank", type=int, default=128, help="the fused layer's K (fp8_block: K %% 128 == 0)")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="width of the key/value latent")
    p.add_argument("--qk-nope-dim", type=int, default=32, help="per-head query/key columns without RoPE")
    p.add_argument("--qk-rope-dim", type=int, default=32, help="per-head query/key RoPE columns")
    p.add_argument("--v-head-dim", type=int, default=32, help="per-head value width")
    p.add_argument("--mlp-hidden", type=int, default=128, help="SwiGLU hidden width")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="on 2-D weights only")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches scored after training")
    p.add_argument("--log-every", type=int, default=100, help="print every N steps (0: never)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (the default model's ops are too small to gain from more; 0: torch's)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, device: torch.device) -> Config:
    """Validate the arguments (ValueError naming the flag) and freeze them into a Config."""
    for flag in ("steps", "batch_size", "pairs", "queries", "keys", "values", "d_model", "layers", "heads",
                 "q_lora_rank", "kv_lora_rank", "qk_rope_dim", "v_head_dim", "mlp_hidden", "warmup",
                 "eval_batches"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.qk_nope_dim < 0:
        raise ValueError(f"--qk-nope-dim must be >= 0, got {args.qk_nope_dim}")
    if args.queries > args.pairs:
        raise ValueError(f"--queries ({args.queries}) must be <= --pairs ({args.pairs})")
    if args.keys < args.pairs:
        raise ValueError(f"--keys ({args.keys}) must be >= --pairs ({args.pairs}): keys are distinct")
    if args.qk_rope_dim % 2:
        raise ValueError(f"--qk-rope-dim must be even, got {args.qk_rope_dim}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    compute_dtype = args.compute_dtype
    if compute_dtype == "auto":
        compute_dtype = "bf16" if device.type == "cuda" else "fp32"
    return Config(steps=args.steps, batch_size=args.batch_size, pairs=args.pairs, queries=args.queries,
                  keys=args.keys, values=args.values, d_model=args.d_model, layers=args.layers, heads=args.heads,
                  q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_nope_dim=args.qk_nope_dim,
                  qk_rope_dim=args.qk_rope_dim, v_head_dim=args.v_head_dim, mlp_hidden=args.mlp_hidden,
                  lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, rope_theta=args.rope_theta,
                  output_format=args.output_format, rope_input=args.rope_input, backend=args.backend,
                  compute_dtype=compute_dtype,
                  seed=args.seed, eval_batches=args.eval_batches)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        cfg = config_from_args(args, device)
        precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
        unknown = [s for s in precisions if s not in PRECISIONS]
        if not precisions or unknown:
            raise ValueError(f"--precisions must be a comma list out of {PRECISIONS}, got {args.precisions!r}")
        if len(set(precisions)) != len(precisions):
            raise ValueError(f"--precisions lists a precision twice: {args.precisions!r}")
    except (ValueError, RuntimeError) as e:  # RuntimeError: torch.device of a malformed string
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _train_all(cfg, precisions, device, Path(args.out), args.log_every)
    finally:  # main() may run inside a caller's process (the tests): leave its thread count as it was
        torch.set_num_threads(threads)


def _train_all(cfg: Config, precisions: list[str], device: torch.device, out: Path, log_every: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {cfg.steps} steps, batch {cfg.batch_size} x {cfg.seq_len} "
          f"tokens, vocab {cfg.vocab}, compute dtype {cfg.compute_dtype}; chance loss ln(values) = "
          f"{math.log(cfg.values):.2f}, context-values guess ln(pairs) = {math.log(cfg.pairs):.2f}")

    results: dict[str, dict] = {}
    failed = []
    for precision in precisions:
        print(f"{LABELS[precision]}:", flush=True)
        try:
            results[precision] = train_one(cfg, precision, device, log_every)
        except PrecisionUnavailable as e:
            print(f"  skipped: {precision} not available in this version ({e})")
            results[precision] = {"status": "skipped", "label": LABELS[precision],
                                  "reason": "not available in this version"}
        except Exception as e:  # report, go on with the other precisions, exit non-zero at the end
            print(f"  FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            results[precision] = {"status": "failed", "label": LABELS[precision],
                                  "reason": f"{type(e).__name__}: {e}"}
            failed.append(precision)

    (out / "losses.json").write_text(json.dumps({"config": asdict(cfg), "device": name,
                                                 "torch": torch.__version__, "results": results}, indent=1))
    print_table(results)
    if plot(results, cfg, out / "loss.png"):
        print(f"wrote {out / 'loss.png'}")
    print(f"wrote {out / 'losses.json'}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
