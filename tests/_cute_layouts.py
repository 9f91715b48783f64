"""The GEMM kernel's swizzled shared-memory layouts, traced on the CPU (imported only with the CuTe DSL)."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

_OUT: dict = {}


@cute.jit
def _trace(fp32: cutlass.Constexpr, width: cutlass.Constexpr, stages: cutlass.Constexpr):
    dtype = cutlass.Float32 if fp32 else cutlass.BFloat16
    y = sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, (64, width), stages)
    _OUT["swizzle"] = str(y.inner)
    bytes_ = 4 if fp32 else 2
    for eb in ((4,) if fp32 else (1, 2, 4)):
        lay = y.outer if eb == bytes_ else cute.recast_layout(8 * eb, 8 * bytes_, y.outer)
        _OUT[eb] = ([[cute.crd2idx((r, c, 0), lay) for c in range(width * bytes_ // eb)] for r in range(64)],
                    cute.crd2idx((0, 0, 1), lay))


def layout_tables(fp32: bool, width: int, stages: int) -> dict:
    """A [64, width] tile as the kernel lays it out (`make_smem_layout_epi` with `stages` stages): the epilogue's
    output tiles (bf16, two stages) or the RoPE tables' rows (fp32, four stages). Its swizzle ("S<B,M,S>"), and for
    each view the kernel accesses it through (element bytes 1, 2, 4 for bf16: bytes, 16-bit elements, 32-bit words;
    4 for fp32) the element offset of every (row, column) of stage 0 and the stage stride in elements."""
    _OUT.clear()
    _trace(fp32, width, stages)
    return dict(_OUT)
