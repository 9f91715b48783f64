"""Input builders and a comparison shared by several test files: special-value matrices and NaNs of a chosen sign
(the block-scaled FP8 kernels), mostly-subnormal bf16 inputs (the MXFP8 kernels), byte equality that lets a
bf16 / fp32 NaN differ in payload and sign, and a RoPE oracle written from the SPEC (`rope_oracle`)."""

from __future__ import annotations

import torch

from _tolerances import assert_bytes_equal, assert_rel_err

NAN, INF = float("nan"), float("inf")
# log2 magnitudes each dtype holds (fp16: 2^-24 is its smallest subnormal, 2^15 its largest binade)
LOG2_RANGE = {torch.float32: (-140, 120), torch.bfloat16: (-140, 120), torch.float16: (-26, 14)}


def special_matrix(M: int, N: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random signs and magnitudes over the dtype's range, with a zero row (and -0), a NaN row of both signs, inf /
    -inf elements, a NaN column, an inf column, a row and a 128x128 corner of tiny values (fp32 / bf16: amax below
    7 * 2^-122, where 448 / amax overflows to FLT_MAX), fp32 subnormals (bf16 subnormals)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = LOG2_RANGE[dtype]
    x = torch.randn(M, N, generator=g) * torch.exp2(torch.randint(lo, hi, (M, N), generator=g).float())
    tiny = 2.0**-125 if dtype != torch.float16 else 2.0**-20
    sub = 2.0**-138 if dtype != torch.float16 else 2.0**-23

    def put(idx, v):
        try:
            x[idx] = v
        except IndexError:
            pass

    if M > 2:
        x[0] = 0.0
        x[0, 1::3] = -0.0
        x[2] = torch.randn(N, generator=g) * tiny
        if M > 3:
            x[3] = torch.randn(N, generator=g) * sub
    if N > 7:
        x[:, 6] = INF * torch.sign(torch.randn(M, generator=g))
    put((4, 7), -INF)
    if M > 128 and N > 128:
        x[128:, 128:] = torch.randn(M - 128, N - 128, generator=g) * tiny
    x = x.to(dtype)
    if M > 2:
        set_nan(x[1], negative=False)
        set_nan(x[1, ::2], negative=True)
    if N > 7:
        set_nan(x[:, 5], negative=False)
        set_nan(x[::3, 5], negative=True)
    return x


def set_nan(t: torch.Tensor, negative: bool) -> None:
    """Write NaN of the given sign through the bits (torch's fp32 -> bf16 cast and bf16 fills lose a NaN's sign)."""
    if t.dtype == torch.float32:
        t.view(torch.int32).fill_(-0x400000 if negative else 0x7FC00000)
    else:
        q = 0x7FC0 if t.dtype == torch.bfloat16 else 0x7E00
        t.view(torch.int16).fill_(q - 0x10000 + 0x8000 if negative else q)


def bf16_subnormal_heavy(shape, seed: int) -> torch.Tensor:
    """bf16 values that are mostly subnormal (exponent field 0, random mantissa and sign), a few tiny normals and
    zeros: every MX block's scale is small enough that the subnormals decide its codes (SPEC §2 bytes)."""
    gen = torch.Generator().manual_seed(seed)
    mant = torch.randint(0, 0x80, shape, generator=gen, dtype=torch.int32)
    exp = torch.where(torch.rand(shape, generator=gen) < 0.1, torch.randint(1, 4, shape, generator=gen), 0)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int32)
    bits = (sign << 15) | (exp.to(torch.int32) << 7) | mant
    return bits.to(torch.int16).view(torch.bfloat16)


def _same_bytes_or_both_nan(a: torch.Tensor, b: torch.Tensor, label: str) -> None:
    """Bytes equal, except that a NaN may differ in payload/sign from a NaN (bf16 images and bf16/fp32 outputs:
    only MXFP8 codes carry a NaN sign contract, SPEC §2)."""
    if a.dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(a.isnan(), b.isnan()), f"{label}: NaN positions differ"
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    assert_bytes_equal(a, b, label)


def assert_op_matches(caller, args: tuple, want: tuple) -> None:
    """caller: an op file's `_op.define_op` caller. Its registered op passes torch.library.opcheck (schema, fake
    allocation) on args, and the op and the eager caller both give want's bytes."""
    torch.library.opcheck(caller.op, args)
    for got_op, got_eager, w in zip(caller.op(*args), caller(*args), want, strict=True):
        assert_bytes_equal(got_op, w, "op")
        assert_bytes_equal(got_eager, w, "eager caller")


def rope_oracle(y: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, P: int, R: int, style: str) -> torch.Tensor:
    """RoPE of y [..., H, D] written from SPEC §3's published definitions, without the package (an oracle independent
    of `mla_qproj.reference.rope`): pair (a, b) -> (a·c - b·s, b·c + a·s) with c, s = cos_h[..., i], sin_h[..., i]
    (half tables [..., R/2], broadcast over heads). deepseek: pair i = columns (2i, 2i + 1), written half-split
    (a' to i, b' to R/2 + i); neox: (i, i + R/2) in place; gptj: (2i, 2i + 1) in place."""
    r = y[..., P:P + R]
    c, s = cos_h.unsqueeze(-2), sin_h.unsqueeze(-2)
    a, b = (r[..., : R // 2], r[..., R // 2:]) if style == "neox" else (r[..., 0::2], r[..., 1::2])
    ra, rb = a * c - b * s, b * c + a * s
    rot = torch.stack((ra, rb), dim=-1).flatten(-2) if style == "gptj" else torch.cat((ra, rb), dim=-1)
    return torch.cat((y[..., :P], rot, y[..., P + R:]), dim=-1)


def sgd_side_by_side(fused, stock, loss_of, steps: int, lr: float, bound: float, tag: str) -> None:
    """`steps` plain SGD steps of two models (loss_of(model) -> scalar loss, its backward filling p.grad): the fused
    model's loss within `bound` of the stock model's at every step, and both models train."""
    stock_losses = []
    for step in range(steps):
        losses = []
        for model in (fused, stock):
            model.zero_grad(set_to_none=True)
            loss = loss_of(model)
            loss.backward()
            losses.append(loss.detach())
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        assert_rel_err(losses[0], losses[1], bound, f"{tag} loss at step {step}")
        stock_losses.append(losses[1])
    assert stock_losses[-1] < stock_losses[0], f"{tag} the stock model did not train: {stock_losses}"
    assert losses[0] < stock_losses[0], f"{tag} the fused model did not train"


_FLAT_OPTIONS = ("precision", "output_format", "columnwise_output", "scale_mode", "block_scale")


def layer_kwargs(kw: dict | None = None, **more) -> dict:
    """Layer keywords from the flat numeric options the tests are parametrized with: `precision` and
    `output_format` names (default "mxfp8" for both: the MXFP8 path these tests cover unless they say otherwise),
    `columnwise_output`, `scale_mode` (the MXFP8 inputs' and the MXFP8 query's alike) and `block_scale`, turned into
    the layer's precision and query objects (mla_qproj.options); every other keyword passes through."""
    from mla_qproj import BF16, MXFP8, BF16Query, FP8Block, MXFP8Query

    kw = {**(kw or {}), **more}
    flat = {k: kw.pop(k) for k in _FLAT_OPTIONS if k in kw}
    precision, fmt = flat.get("precision", "mxfp8"), flat.get("output_format", "mxfp8")
    mode = flat.get("scale_mode", "rceil")
    if isinstance(precision, str):
        precision = {"mxfp8": lambda: MXFP8(mode), "bf16": BF16,
                     "fp8_block": lambda: FP8Block(flat.get("block_scale", "pow2"))}[precision]()
    if isinstance(fmt, str):
        fmt = BF16Query() if fmt == "bf16" else MXFP8Query(mode, bool(flat.get("columnwise_output", False)))
    return {**kw, "precision": precision, "output_format": fmt}


def make_config(*args, **kw):
    """`QProjConfig.make` with the flat numeric options of `layer_kwargs` (MXFP8 inputs and query by default)."""
    from mla_qproj._config import QProjConfig

    return QProjConfig.make(*args, **layer_kwargs(kw))
