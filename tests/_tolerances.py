"""One tolerance policy (see README "Numerics"):
- quantizer outputs: bytes exact (rtol = atol = 0) between reference, interpreter and GPU;
- same quantization, different fp32 summation order (GEMM outputs): >= 99.9 % identical output codes, the
  rest one E4M3 step apart at most (|diff| <= 2^-3 relative, the E4M3 epsilon);
- quantized vs unquantized math (fp64 oracle): relative error ||a - b|| / ||b||, bounds per precision:
  bf16 GEMM inputs 3e-2, MXFP8 0.15 (E4M3 epsilon 2^-3, errors of ~8 % rms per operand add in quadrature).
"""

from __future__ import annotations

import torch

REL_ERR_BF16 = 3e-2
REL_ERR_MXFP8 = 0.15
MIN_CODE_MATCH = 0.999


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
    ab = a.detach().cpu().contiguous().view(torch.uint8)
    bb = b.detach().cpu().contiguous().view(torch.uint8)
    diff = ab != bb
    if diff.any():
        idx = diff.nonzero()[0].tolist()
        raise AssertionError(f"{label}: {int(diff.sum())} of {diff.numel()} bytes differ; first at {idx}: "
                             f"{ab[tuple(idx)].item():#04x} vs {bb[tuple(idx)].item():#04x}")


def code_match_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of identical fp8 codes."""
    ab = a.detach().cpu().contiguous().view(torch.uint8)
    bb = b.detach().cpu().contiguous().view(torch.uint8)
    return (ab == bb).float().mean().item() if ab.numel() else 1.0
