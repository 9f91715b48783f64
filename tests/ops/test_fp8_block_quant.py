"""The standalone block-scaled FP8 quantizer (kernels/triton/fp8_block_quant.py, SPEC §5) vs reference/fp8_block.py,
byte for byte (codes and scale_inv), and its public function `fp8_block_quantize`; the kernels' scale rule
(kernels/triton/_fp8_block.py `fp8_block_scale`) against the reference's. CPU lane: Triton's interpreter at small sizes;
`gpu` tests at large sizes."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_qproj import fp8_block_quantize
from mla_qproj.kernels.triton._common import cdiv
from mla_qproj.kernels.triton._fp8_block import block_scale_code, fp8_block_scale
from mla_qproj.kernels.triton.fp8_block_quant import Fp8BlockQuantConfig, fp8_block_quantize_2d, fp8_block_quantize_op
from mla_qproj.reference import fp8_block as F

from _helpers import set_nan, special_matrix
from _tolerances import assert_bytes_equal
from conftest import DEVICE, examples

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy under the interpreter
HYP = settings(max_examples=examples(12), deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
B = F.FP8_BLOCK


def check_quant(x2d: torch.Tensor, block_shape, block_scale: str, **kw) -> None:
    data, sinv = fp8_block_quantize_2d(x2d, block_shape, block_scale, **kw)
    rd, rs = F.quantize_blocks(x2d.cpu(), block_shape, block_scale)
    tag = f"{tuple(x2d.shape)} {x2d.dtype} {block_shape} {block_scale}"
    assert_bytes_equal(data, rd, f"{tag} codes")
    assert_bytes_equal(sinv, rs, f"{tag} scale_inv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
@pytest.mark.parametrize("block_shape", F.BLOCK_SHAPES)
def test_quantize_special_values(block_shape, block_scale, dtype):
    check_quant(special_matrix(131, 136, dtype, 1).to(DEVICE), block_shape, block_scale)


@HYP
@given(m=st.sampled_from([1, 17, 128, 129, 300]), n=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]), block_shape=st.sampled_from(F.BLOCK_SHAPES),
       block_scale=st.sampled_from(F.BLOCK_SCALES), seed=st.integers(0, 1000))
def test_quantize_property(m, n, dtype, layout, block_shape, block_scale, seed):
    if layout == "transposed":
        x = special_matrix(n, m, dtype, seed).to(DEVICE).t()
    elif layout == "strided":
        x = special_matrix(m, 2 * n, dtype, seed).to(DEVICE)[:, ::2]
    else:
        x = special_matrix(m, n, dtype, seed).to(DEVICE)
    check_quant(x, block_shape, block_scale)


def test_quantize_config_and_nan_sign_fp16():
    # a non-default tile; fp16 NaN signs come from the input's own bits (the GPU's fp16 -> fp32 cast drops them)
    x = torch.randn(70, 256, dtype=torch.float16)
    set_nan(x[3, 4], negative=True)
    set_nan(x[5, 200], negative=False)
    check_quant(x.to(DEVICE), (1, B), "pow2", config=Fp8BlockQuantConfig(32, B, 4))
    check_quant(x.to(DEVICE), (B, 1), "fp32", config=Fp8BlockQuantConfig(B, 64, 4))
    data, _ = fp8_block_quantize_2d(x.to(DEVICE), (B, B))
    assert data.view(torch.uint8)[3, 4].item() == 0xFF and data.view(torch.uint8)[5, 200].item() == 0x7F
    with pytest.raises(ValueError, match="whole"):
        fp8_block_quantize_2d(x.to(DEVICE), (B, 1), config=Fp8BlockQuantConfig(64, B, 4))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_public_quantizer(backend):
    t = (torch.randn(3, 50, 260) * 10).to(torch.bfloat16).to(DEVICE).transpose(0, 1)  # [50, 3, 260], not contiguous
    for shape in F.BLOCK_SHAPES:
        data, sinv = fp8_block_quantize(t, block_shape=shape, block_scale="fp32", backend=backend)
        rd, rs = F.quantize_blocks(t.reshape(-1, 260).cpu(), shape, "fp32")
        assert data.shape == (150, 260) and sinv.shape == (math.ceil(150 / shape[0]), math.ceil(260 / shape[1]))
        assert data.is_contiguous() and sinv.is_contiguous() and data.device == t.device
        assert_bytes_equal(data, rd, f"{backend} {shape} codes")
        assert_bytes_equal(sinv, rs, f"{backend} {shape} scale_inv")
    data, sinv = fp8_block_quantize(torch.ones(300, device=DEVICE), backend=backend)  # 1-D: [1, 300]
    assert data.shape == (1, 300) and sinv.shape == (1, 3) and sinv.flatten().tolist() == [2.0**-8] * 3
    for shape in F.BLOCK_SHAPES:  # no elements: empty outputs of the SPEC shapes
        data, sinv = fp8_block_quantize(torch.empty(0, 5, 130, device=DEVICE), shape, backend=backend)
        assert data.shape == (0, 130) and sinv.shape == (0, math.ceil(130 / shape[1]))
        data, sinv = fp8_block_quantize(torch.empty(4, 0, device=DEVICE), shape, backend=backend)
        assert data.shape == (4, 0) and sinv.shape == (math.ceil(4 / shape[0]), 0)


def test_public_quantizer_errors():
    t = torch.randn(4, 128)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fp8_block_quantize([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype"):
        fp8_block_quantize(t.double())
    with pytest.raises(TypeError, match="dtype"):
        fp8_block_quantize(t.to(torch.int32))
    for bad in ((32, 32), (1, 64), (128,), "1x128", None):
        with pytest.raises(ValueError, match="block_shape"):
            fp8_block_quantize(t, block_shape=bad)
    with pytest.raises(ValueError, match="block_scale"):
        fp8_block_quantize(t, block_scale="e8m0")
    with pytest.raises(ValueError, match="backend"):
        fp8_block_quantize(t, backend="cuda")
    with pytest.raises(ValueError, match="dimension"):
        fp8_block_quantize(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x2d"):
        fp8_block_quantize_2d(t.long())
    with pytest.raises(ValueError, match="2-D"):
        fp8_block_quantize_2d(t[0])


def test_quantize_op_registration():
    torch.library.opcheck(fp8_block_quantize_op.op, (torch.randn(5, 130, device=DEVICE), 1, B, "pow2"))
    torch.library.opcheck(fp8_block_quantize_op.op, (torch.randn(130, 7, device=DEVICE), B, 1, "fp32"))


@pytest.mark.gpu
@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_gpu_large(block_scale, dtype):
    x = special_matrix(4100, 3000, dtype, 3)
    for shape in F.BLOCK_SHAPES:
        check_quant(x.cuda(), shape, block_scale)
    check_quant(x.cuda().t(), (1, B), block_scale)


@triton.jit
def _scale_kernel(amax_ptr, scale_ptr, sinv_ptr, n, BLOCK_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    scale, sinv = fp8_block_scale(tl.load(amax_ptr + o, mask=m, other=0.0), BLOCK_SCALE)
    tl.store(scale_ptr + o, scale, mask=m)
    tl.store(sinv_ptr + o, sinv, mask=m)


def _amax_samples() -> torch.Tensor:
    """Every biased exponent (subnormals, 0xFF: inf and NaN included) with mantissas at the pow2 rule's edges
    (0x600000 = 1.75 and its neighbours), at 0 and 0x7FFFFF, and random ones; the overflow threshold 7 * 2^-122
    and its neighbours."""
    g = torch.Generator().manual_seed(0)
    exps = torch.arange(256, dtype=torch.int32)
    mants = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF, 0x400000], dtype=torch.int32)
    mants = torch.cat([mants, torch.randint(0, 1 << 23, (57,), generator=g, dtype=torch.int32)])
    bits = (exps[:, None] << 23 | mants[None, :]).flatten()
    edge = torch.tensor([7.0 * 2.0**-122]).view(torch.int32)
    return torch.cat([bits, edge - 1, edge, edge + 1]).view(torch.float32)


@pytest.mark.parametrize("block_scale", F.BLOCK_SCALES)
def test_scale_rule_matches_reference(block_scale):
    """`fp8_block_scale` (the kernels' twin: exponent arithmetic for pow2, div_rn for fp32 and deepseek) equals the
    reference's SPEC-form division on every exponent and the pow2 rule's mantissa edges."""
    amax = _amax_samples().to(DEVICE)
    scale, sinv = torch.empty_like(amax), torch.empty_like(amax)
    _scale_kernel[(cdiv(amax.numel(), 1024),)](amax, scale, sinv, amax.numel(),
                                               BLOCK_SCALE=block_scale_code(block_scale), BLOCK=1024)
    rs, rsi = F.fp8_block_scale(amax.cpu(), block_scale)
    assert_bytes_equal(scale, rs, f"{block_scale} scale")
    assert_bytes_equal(sinv, rsi, f"{block_scale} scale_inv")


def _deepseek_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's activation quantizer (its inference `kernel.py` act_quant, 1x128 blocks) written here in torch
    ops: s = amax / 448 per block, codes = e4m3(x / s), s stored. fp32 throughout, IEEE division."""
    xb = x.float().reshape(x.shape[0], -1, B)
    s = xb.abs().amax(dim=-1, keepdim=True) / 448.0
    return (xb / s).to(torch.float8_e4m3fn).reshape(x.shape), s.squeeze(-1)


@settings(max_examples=examples(10), deadline=None)
@given(m=st.integers(1, 40), nb=st.integers(1, 3), log_scale=st.floats(-30, 30), seed=st.integers(0, 10_000),
       backend=st.sampled_from(["torch", "triton"]))
def test_deepseek_rule_equals_deepseeks_quantizer(m, nb, log_scale, seed, backend):
    """block_scale="deepseek" gives DeepSeek's own bytes (codes and scale_inv) for 1x128 activations on both
    backends, on blocks of any magnitude with no all-zero block (where DeepSeek's rule divides 0 by 0; SPEC §5 then
    stores scale_inv 1.0). The "fp32" rule (TransformerEngine's: scale_inv = 1 / fp32(448 / amax)) is a different
    one: its scale_inv differs from DeepSeek's in some blocks of a large sample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, nb * B, generator=g) * 2.0**log_scale
    x[:, 0] = x[:, 0].abs() + 2.0**log_scale * 1e-3  # no all-zero block
    data, sinv = fp8_block_quantize(x.to(DEVICE), (1, B), block_scale="deepseek", backend=backend)
    dd, ds = _deepseek_act_quant(x)
    assert_bytes_equal(data, dd, "codes against DeepSeek's rule")
    assert_bytes_equal(sinv, ds, "scale_inv against DeepSeek's rule")


def test_fp32_and_deepseek_rules_differ():
    """The two non-power-of-two rules are not the same (so "fp32" is not DeepSeek's): over 4096 blocks their
    scale_inv differ in many blocks (1 ulp), and codes at exact ties."""
    x = torch.randn(4096, B, generator=torch.Generator().manual_seed(1)) * 3.0
    _, s_te = F.quantize_blocks(x, (1, B), "fp32")
    _, s_ds = F.quantize_blocks(x, (1, B), "deepseek")
    differ = (s_te != s_ds).float().mean().item()
    assert 0.05 < differ < 0.95, differ
    assert ((s_te - s_ds).abs() <= torch.finfo(torch.float32).eps * s_ds).all()


def test_block_scale_code_is_host_code():
    """The launchers map block_scale to the kernels' constexpr on the host: a plain function, also outside Triton's
    interpreter (where a @triton.jit function called from Python raises; the CPU lane's interpreter would hide it)."""
    import os
    import subprocess
    import sys

    code = ("from mla_qproj.kernels.triton._fp8_block import block_scale_code;"
            "print([block_scale_code(b) for b in ('pow2', 'fp32', 'deepseek')])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[0, 1, 2]"
    with pytest.raises(ValueError, match="block_scale"):
        block_scale_code("e8m0")
