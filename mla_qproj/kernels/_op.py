"""What every op file shares: its `torch.library` registration with the eager fast path, the EMULATED switch of its
kernels, and the layer config as the one string an op takes (`QProjConfig.encode`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._config import QProjConfig, interpreter_enabled


def eager_fast(op, eager: Callable) -> Callable:
    """A caller of the registered op `op` while torch.compile traces, of `eager` (the launcher, same arguments)
    otherwise: the custom-op dispatch costs tens of microseconds per call, which shows at small T. `.op` is the
    registered op (for opcheck, and for callers that want the dispatcher)."""

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return eager(*args)

    call.op = op
    return call


def define_op(name: str, impl: Callable, fake: Callable, *, eager: Callable | None = None,
              tags: tuple = ()) -> Callable:
    """Register impl (annotated: the schema is inferred from it) as the functional custom op `name` with the fake
    implementation `fake` (which allocates what impl returns: the same allocation function, on fake tensors), and
    return its `eager_fast` caller (eager: impl unless given)."""
    op = torch.library.custom_op(name, impl, mutates_args=(), tags=tags)
    op.register_fake(fake)
    return eager_fast(op, impl if eager is None else eager)


def emulated(device: torch.device) -> bool:
    """The kernels' EMULATED constexpr (SPEC §2): explicit rounding under the interpreter or for tensors off the GPU,
    hardware conversions on the GPU. Looked up through this module by the launchers, so that the offline compile
    (tools/compile_sm90.py) can compile the GPU form from CPU tensors."""
    return interpreter_enabled() or device.type != "cuda"


_ENCODED: dict[QProjConfig, str] = {}


def encoded(cfg: QProjConfig) -> str:
    """`cfg.encode()`, cached per config in eager mode (encoding costs a few microseconds, a dict lookup a fraction
    of one). While torch.compile traces, the plain `encode()`: dynamo folds it to a constant string, whereas the
    cache's insertion would be a side effect inside the traced graph (which dynamo rejects inside the autograd
    Function's backward)."""
    if torch.compiler.is_compiling():
        return cfg.encode()
    s = _ENCODED.get(cfg)
    if s is None:
        s = _ENCODED[cfg] = cfg.encode()
    return s
