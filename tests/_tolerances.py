"""One tolerance policy (see README "Numerics"):
- quantizer outputs: bytes exact (rtol = atol = 0) between reference, interpreter and GPU;
- same quantization, different fp32 summation order (GEMM outputs): >= 99.9 % identical output codes and scale
  bytes; the dense results of such paths (MXFP8 decodes, bf16 output, gradients) relative error <= 1e-2. (A
  different fp32 order in the RMSNorm can flip an input code or scale of xn, which moves a whole token row
  by ~1e-3 of its magnitude: small elements then differ by more than one E4M3 step, so no per-element bound);
  bf16-only paths emulated with the same roundings: <= 2^-8 (bf16 epsilon; rare one-ulp flips of an operand);
- quantized vs unquantized math (fp64 oracle): relative error ||a - b|| / ||b||, bounds per precision:
  bf16 GEMM inputs 3e-2, MXFP8 0.15 (E4M3 epsilon 2^-3, errors of ~8 % rms per operand add in quadrature);
  block-scaled FP8 (SPEC §5) 0.08: one fp32 scale per 128 elements puts an operand's amax near 448, so an element's
  rounding error is at most half a step of 2^-3 relative (rms <= 2^-3 / sqrt(12) = 3.6 %), two operands in
  quadrature <= 5.1 %, with margin for the few elements in the E4M3 subnormal range.
"""

from __future__ import annotations

import torch

REL_ERR_BF16 = 3e-2
REL_ERR_MXFP8 = 0.15
REL_ERR_FP8_BLOCK = 0.08
MIN_CODE_MATCH = 0.999
# FP8 tensor cores (sm_90 QGMMA) keep fewer accumulator bits than fp32 inside each 128-long block (DeepSeek-V3's
# reason to promote once per block), so a GEMM output next to a rounding boundary flips more often than under an fp32
# summation-order change: 0.993-0.997 identical codes measured on an H200 (fused fp8_block GEMM vs the fp32
# reference); the scale bytes and the decoded values keep the same-quantization bounds
MIN_CODE_MATCH_FP8_TC = 0.99
# the same FP8 GEMM split differently (head groups, tensor-parallel shards): its blocks' reduced-precision
# accumulation changes with the split (H200: 1.2e-4 relative on dxn)
REL_ERR_FP8_TC_ORDER = 1e-3
REL_ERR_SAME_QUANT = 1e-2
REL_ERR_BF16_ROUNDING = 2.0**-8
# the same fp32 values summed in another order (a tensor-parallel reduction): a few fp32 ulps
REL_ERR_REDUCTION_ORDER = 1e-5
# a tile whose codes flipped together because one of its rows' inputs sat on a rounding boundary (the two backends'
# xn of one token, a hair apart, took different E8M0 bytes for one 32-block: that token's whole query requantized,
# 11 % of a [128, 128] tile's codes differing at 1.4 % relative in value; H200, V3, T = 4096): the tile's decoded
# values stay this close, where a wrong tile (wrong pairs, scale, rows) is off by its own size
REL_ERR_TILE_REQUANT = 0.05


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_rel_err(a: torch.Tensor, b: torch.Tensor, bound: float, label: str) -> None:
    assert torch.isfinite(a).all(), f"{label}: non-finite values"
    e = rel_err(a, b)
    assert e <= bound, f"{label} rel err {e:.4g} > {bound}"


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, label: str) -> None:
    """Byte-identical tensors; on failure report how many differ and the first mismatch."""
    assert a.shape == b.shape, f"{label}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{label}: dtype {a.dtype} vs {b.dtype}"
    # a copy in the standard strides: `.contiguous()` keeps a size-1 dimension's odd stride, which `.view` rejects
    ab = torch.empty(a.shape, dtype=a.dtype).copy_(a.detach()).view(torch.uint8)
    bb = torch.empty(b.shape, dtype=b.dtype).copy_(b.detach()).view(torch.uint8)
    diff = ab != bb
    if diff.any():
        idx = diff.nonzero()[0].tolist()
        raise AssertionError(f"{label}: {int(diff.sum())} of {diff.numel()} bytes differ; first at {idx}: "
                             f"{ab[tuple(idx)].item():#04x} vs {bb[tuple(idx)].item():#04x}")


TILE = 128  # per-tile bounds: tiles of TILE x TILE of a tensor's 2-D view [rows, last dim]


def code_match_fraction(a: torch.Tensor, b: torch.Tensor, min_frac: float | None = None, label: str = "",
                        dense: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Fraction of identical fp8 codes (or bytes). With min_frac, also no single TILE x TILE tile of the 2-D view
    may hold more differing codes than 4 x its share of the whole-tensor budget (at least 4): a bound that a large
    tensor's average cannot hide (one wrong [128, 128] tile of a DeepSeek-V3 query is 1/24576 of it). dense: the
    decoded values (same shape as the codes); a tile over the code budget then passes if its decoded values agree
    within REL_ERR_TILE_REQUANT (requantized rows, not wrong ones)."""
    # a copy in the standard strides: `.contiguous()` keeps a size-1 dimension's odd stride, which `.view` rejects
    ab = torch.empty(a.shape, dtype=a.dtype).copy_(a.detach()).view(torch.uint8)
    bb = torch.empty(b.shape, dtype=b.dtype).copy_(b.detach()).view(torch.uint8)
    if not ab.numel():
        return 1.0
    diff = ab != bb
    if min_frac is not None:
        d2 = diff.reshape(-1, diff.shape[-1]) if diff.dim() else diff.reshape(1, 1)
        r, c = d2.shape
        per_tile = _per_tile_sum(d2.to(torch.int32))
        allowed = max(4, int(4 * (1.0 - min_frac) * TILE * TILE))
        over = per_tile > allowed
        if dense is not None and over.any():
            da, db = (t.detach().cpu().double().reshape(r, c) for t in dense)
            tile_err = _per_tile_sum((da - db).pow(2)).sqrt() / _per_tile_sum(db.pow(2)).sqrt().clamp_min(1e-300)
            over &= ~(tile_err <= REL_ERR_TILE_REQUANT)
        if over.any():
            bad = torch.where(over, per_tile, -1)
            raise AssertionError(f"{label}: a {TILE}x{TILE} tile has {int(bad.max())} differing codes (at most "
                                 f"{allowed}{', decoded values off by more than REL_ERR_TILE_REQUANT' if dense else ''}"
                                 f"), at tile {divmod(int(bad.argmax()), per_tile.shape[1])}")
    return 1.0 - diff.float().mean().item()


def _per_tile_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums over the TILE x TILE tiles of a 2-D tensor (zero-padded at the edges)."""
    r, c = t.shape
    p = torch.nn.functional.pad(t, (0, -c % TILE, 0, -r % TILE))
    return p.reshape(p.shape[0] // TILE, TILE, p.shape[1] // TILE, TILE).sum(dim=(1, 3))


def rel_err_bound(precision: str, output_format: str = "bf16") -> float:
    """Quantized vs fp64 oracle: the bound of the coarsest quantization on the path (an MXFP8 query output is
    coarser than block-scaled FP8 GEMM inputs)."""
    if output_format == "mxfp8" or precision == "mxfp8":
        return REL_ERR_MXFP8
    return REL_ERR_FP8_BLOCK if precision == "fp8_block" else REL_ERR_BF16


def assert_mxfp8_close(data_a, scale_a, dense_a, data_b, scale_b, dense_b, label: str,
                       min_codes: float = MIN_CODE_MATCH, min_scales: float = MIN_CODE_MATCH) -> None:
    """Same quantization, different fp32 summation order: >= min_codes identical codes (MIN_CODE_MATCH_FP8_TC when
    one side ran on FP8 tensor cores), >= min_scales identical scale bytes (likewise), and the dense decodes within
    REL_ERR_SAME_QUANT; per tile, the code budget (or decoded values within REL_ERR_TILE_REQUANT)."""
    codes = code_match_fraction(data_a, data_b, min_codes, f"{label} codes", dense=(dense_a, dense_b))
    scales = code_match_fraction(scale_a, scale_b, min_scales, f"{label} scale bytes")
    assert codes >= min_codes, f"{label}: only {codes:.5f} of the codes identical"
    assert scales >= min_scales, f"{label}: only {scales:.5f} of the scale bytes identical"
    assert_rel_err(dense_a.float(), dense_b.float(), REL_ERR_SAME_QUANT, f"{label} decoded")
