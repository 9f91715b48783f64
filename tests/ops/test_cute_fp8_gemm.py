"""The CuTe DSL engine's fp8_block forward GEMM (mla_qproj/kernels/cute/): compiled offline for sm_90a on any machine
(its SASS checked: FP8 WGMMA, TMA, register reallocation, no local memory), and on an H200 its query against this
test's own block-scaled reference, tile by tile: every [128 tokens, head] tile of the query within bf16 rounding of
the fp32 reference, so one wrong tile fails however large the tensor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mla_qproj import FusedMLAQUpProjection
from mla_qproj._config import QProjConfig
from mla_qproj.kernels.cute import fp8_gemm

from _helpers import rope_oracle
from _tolerances import REL_ERR_BF16_ROUNDING
from conftest import HAS_CUDA

F8 = torch.float8_e4m3fn
HAS_DSL = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("tvm_ffi") is not None
V3 = (1536, 128, 128, 64, 192)  # K, H, qk_head_dim, rope, q_head_dim
# the offline compile covers DeepSeek-V3, another head count and K, and q_head_dim > nope + rope (trailing columns)
OFFLINE = [(V3, "deepseek"), ((512, 16, 128, 64, 192), "neox"), ((512, 8, 96, 64, 176), "gptj")]


def _cfg(geom, style="deepseek") -> QProjConfig:
    K, H, P, R, D = geom
    return QProjConfig(K, H, P, R, D, rope_style=style, precision="fp8_block", output_format="bf16")


def _tools():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import build_cute_kernels

    return build_cute_kernels


def test_supported_geometries():
    assert fp8_gemm.supported(_cfg(V3))
    assert fp8_gemm.supported(_cfg((512, 8, 96, 64, 176), "gptj"))
    assert not fp8_gemm.supported(QProjConfig(*V3, precision="fp8_block", output_format="mxfp8"))  # Triton's
    assert not fp8_gemm.supported(QProjConfig(*V3, precision="mxfp8", output_format="bf16"))
    assert not fp8_gemm.supported(_cfg((1536, 4, 128, 128, 256)))  # D > 192: two 64 x D fp32 tiles do not fit
    assert not fp8_gemm.supported(_cfg((1536, 4, 124, 68, 192)))  # an 8-column group both passes and rotates
    assert not fp8_gemm.supported(_cfg((1536, 4, 128, 36, 192), "neox"))  # neox partner not in the same thread
    for style in ("deepseek", "gptj"):  # R/2 = 36: the tables' rows cannot be laid out in shared memory (the Triton
        assert not fp8_gemm.supported(_cfg((1536, 4, 64, 72, 136), style))  # kernel serves it)
    assert fp8_gemm.key(_cfg(V3), 132) == "fp8rope_k1536_h128_d192_p128_r64_deepseek_sm132"


def test_off_gpu_the_engine_never_serves():
    assert not fp8_gemm.serves(_cfg(V3), torch.device("cpu"))


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (pip install 'mla_qproj[cute]')")
@pytest.mark.parametrize("geom,style", OFFLINE, ids=["v3", "h16_neox", "trailing_gptj"])
def test_offline_compile_sass(geom, style, tmp_path):
    """The sm_90a kernel compiled without a GPU: FP8 WGMMA (QGMMA), TMA loads (A, W, and the RoPE tables' rows, which
    reach shared memory by TMA instead of per-thread loads in the epilogue) and stores, setmaxnreg in both directions
    (producer down, consumers up), no local memory in the main loop (a spill shows as LDL / STL), and at most a few
    spilled words per tile outside it."""
    tools = _tools()
    _, cubin = tools.compile_one(_cfg(geom, style), 132, str(tmp_path))
    rep = tools.sass_report(cubin)
    assert rep["QGMMA"] >= 4 and rep["HGMMA"] == 0, rep
    assert rep["UTMALDG"] >= 4 and rep["UTMASTG"] >= 1, rep
    assert rep["USETMAXREG"] >= 2 and "USETMAXREG.DEALLOC" in rep["sass"] and "USETMAXREG.TRY_ALLOC" in rep["sass"]
    assert rep["LOOP_LDL_STL"] == 0, rep["LOOP_LDL_STL"]
    assert rep["STACK"] <= 32 and rep["LDL"] + rep["STL"] <= 8, {k: rep[k] for k in ("LDL", "STL", "STACK")}
    assert "E4M3.E4M3" in rep["sass"]


# ------------------------------------------------------------------------------------------------------------ GPU


def _blocks(x: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This test's own SPEC §5 quantizer (pow2 scales) for a finite x [M, N]: (codes, scale_inv [M/bm, N/bn])."""
    M, N = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -N % bn, 0, -M % bm))
    amax = xp.reshape(xp.shape[0] // bm, bm, xp.shape[1] // bn, bn).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    s = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :N]
    return (x.float() * s).clamp(-448.0, 448.0).to(F8), 1.0 / scale


def _case(T: int, cfg: QProjConfig, device):
    K, N = cfg.q_lora_rank, cfg.out_features
    a, sa = _blocks(torch.randn(T, K, device=device), 1, 128)  # sa [T, K/128]
    w, sw = _blocks(torch.randn(N, K, device=device) * K**-0.5, 128, 128)  # sw [N/128, K/128]
    ang = torch.rand(T, cfg.rope_dim // 2, device=device) * 6.0
    cos_h, sin_h = ang.cos(), ang.sin()
    y = torch.zeros(T, N, device=device)
    sw_rows = sw.repeat_interleave(128, 0)[:N]
    for kb in range(K // 128):
        ks = slice(kb * 128, (kb + 1) * 128)
        y += (a[:, ks].float() @ w[:, ks].float().t()) * sa[:, kb, None] * sw_rows[None, :, kb]
    ref = rope_oracle(y.view(T, cfg.num_heads, cfg.q_head_dim), cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim,
                      cfg.rope_style)
    return (a, sa.t().contiguous(), w, sw, cos_h, sin_h), ref


def _worst_tile(q: torch.Tensor, ref: torch.Tensor) -> tuple[float, tuple[int, int]]:
    """Largest relative error over the [128 tokens, one head] tiles of q [T, H, D] against ref, and where."""
    T, H, D = ref.shape
    pad = -T % 128
    d = torch.nn.functional.pad((q.double() - ref.double()), (0, 0, 0, 0, 0, pad)).view(-1, 128, H, D)
    r = torch.nn.functional.pad(ref.double(), (0, 0, 0, 0, 0, pad)).view(-1, 128, H, D)
    err = d.pow(2).sum(dim=(1, 3)).sqrt() / r.pow(2).sum(dim=(1, 3)).sqrt().clamp_min(1e-30)
    i = int(err.argmax())
    return float(err.flatten()[i]), divmod(i, H)


def _needs_engine(cfg: QProjConfig) -> None:
    if not fp8_gemm.serves(cfg, torch.device("cuda")):
        pytest.skip(f"the CuTe DSL engine has no kernel for {fp8_gemm.key(cfg, 132)} here")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("style", ["deepseek", "neox", "gptj"])
@pytest.mark.parametrize("T", [4096, 1000, 1])
def test_v3_vs_reference(style, T):
    """DeepSeek-V3's geometry, a partial last row tile (T = 1000) and a single token."""
    cfg = _cfg(V3, style)
    _needs_engine(cfg)
    args, ref = _case(T, cfg, torch.device("cuda"))
    q = fp8_gemm.rope_gemm_fp8(*args, cfg)
    assert q.shape == ref.shape and q.dtype == torch.bfloat16
    err, (tm, h) = _worst_tile(q, ref)
    assert err <= REL_ERR_BF16_ROUNDING, f"tile (tokens {128 * tm}.., head {h}): rel err {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("geom,style,T", [((256, 4, 128, 64, 192), "deepseek", 33),
                                          ((512, 8, 96, 64, 176), "gptj", 300),
                                          ((640, 4, 128, 64, 192), "deepseek", 200),
                                          ((128, 4, 128, 64, 192), "neox", 130),
                                          ((384, 4, 64, 64, 128), "deepseek", 257),
                                          ((256, 4, 48, 64, 128), "deepseek", 77)],
                         ids=["k2", "k4_d176", "k5", "k1", "k3_d128", "rope_across_halves"])
def test_small_geometries(geom, style, T):
    """K blocks even and odd (the main loop runs two per step: 1, 2, 3, 4 and 5 blocks), D = 128 (one sub-tile: the
    loop without overlap), and deepseek's a' columns [P, P + R/2) across the epilogue's two column halves (P = 48,
    D = 128: a' of the first pairs in the first half, their b' in the second)."""
    cfg = _cfg(geom, style)
    _needs_engine(cfg)
    args, ref = _case(T, cfg, torch.device("cuda"))
    err, where = _worst_tile(fp8_gemm.rope_gemm_fp8(*args, cfg), ref)
    assert err <= REL_ERR_BF16_ROUNDING, f"tile {where}: rel err {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_layer_runs_the_engine_and_matches_triton(monkeypatch):
    """The layer's fp8_block forward with a bf16 query goes through the engine (checked by counting calls), and its
    query agrees tile by tile with the Triton engine's (MLA_QPROJ_CUTE=0) on the same weights; the backward runs."""
    cfg = _cfg(V3)
    _needs_engine(cfg)
    torch.manual_seed(0)
    layer = FusedMLAQUpProjection(*V3[:4], precision="fp8_block", output_format="bf16", device="cuda",
                                  dtype=torch.bfloat16)
    x = torch.randn(2048, V3[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(2048, device="cuda")
    calls = []
    real = fp8_gemm.rope_gemm_fp8

    def counting(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(fp8_gemm, "rope_gemm_fp8", counting)
    q = layer(x, position_ids=pos)
    assert calls, "the layer did not run the CuTe DSL engine"
    monkeypatch.setenv(fp8_gemm.ENV_DISABLE, "0")
    layer.refresh_weight_cache()
    q_tri = layer(x, position_ids=pos)
    assert len(calls) == 1
    err, where = _worst_tile(q.float(), q_tri.float())
    assert err <= 2 * REL_ERR_BF16_ROUNDING, f"tile {where}: engines differ by {err:.3g}"
    monkeypatch.delenv(fp8_gemm.ENV_DISABLE)
    q.float().pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_compiled_layer_uses_the_engine():
    """torch.compile(fullgraph=True) traces the engine's custom op and gives the eager query's bytes."""
    cfg = _cfg(V3)
    _needs_engine(cfg)
    layer = FusedMLAQUpProjection(*V3[:4], precision="fp8_block", output_format="bf16", device="cuda",
                                  dtype=torch.bfloat16)
    x = torch.randn(512, V3[0], device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(512, device="cuda")
    with torch.no_grad():
        eager = layer(x, position_ids=pos)
        comp = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, position_ids=pos)
    assert torch.equal(eager.view(torch.int16), comp.view(torch.int16))
