"""CuTe's own epilogue tile layouts traced on the CPU (imported only where the CuTe DSL is installed)."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

_OUT: dict = {}


@cute.jit
def _trace(width: cutlass.Constexpr):
    y = sm90_utils.make_smem_layout_epi(cutlass.BFloat16, LayoutEnum.ROW_MAJOR, (64, width), 2)
    _OUT["swizzle"] = str(y.inner)
    for eb in (1, 2, 4):
        lay = y.outer if eb == 2 else cute.recast_layout(8 * eb, 16, y.outer)
        _OUT[eb] = ([[cute.crd2idx((r, c, 0), lay) for c in range(width * 2 // eb)] for r in range(64)],
                    cute.crd2idx((0, 0, 1), lay))


@cute.jit
def _trace_tab(rh: cutlass.Constexpr):
    y = sm90_utils.make_smem_layout_epi(cutlass.Float32, LayoutEnum.ROW_MAJOR, (64, rh), 4)
    _OUT["swizzle"] = str(y.inner)
    _OUT[4] = ([[cute.crd2idx((r, c, 0), y.outer) for c in range(rh)] for r in range(64)], cute.crd2idx((0, 0, 1),
                                                                                                       y.outer))


def table_tables(rh: int) -> dict:
    """The RoPE tables' [64, R/2] fp32 stages as the kernel lays them out (four stages): as `epi_tables`, one view
    (element bytes 4)."""
    _OUT.clear()
    _trace_tab(rh)
    return dict(_OUT)


def epi_tables(width: int) -> dict:
    """The [64, width] bf16 epilogue tile as the GEMM kernel builds it (`make_smem_layout_epi`, two slots): its
    swizzle ("S<B,M,S>"), and for each view the kernel stores through (element bytes 1, 2, 4: bytes, 16-bit
    elements, 32-bit words) the element offset of every (row, column) of slot 0 and the slot stride in elements."""
    _OUT.clear()
    _trace(width)
    return dict(_OUT)
