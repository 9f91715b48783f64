"""Multi-process tests: run a worker in `world` spawned ranks and turn any rank's failure into a pytest failure that
shows every rank's traceback.

A rank whose worker returned leaves with `os._exit(0)`, skipping the interpreter's finalization: there, gloo's and the
rendezvous store's C++ threads (the store's server lives in rank 0) can abort a process with "terminate called
without an active exception" after every check has passed and the group has been destroyed, which made the suite
fail now and then for a reason outside the code under test. A worker that raises still exits through
multiprocessing's error path, its traceback written for the report."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import pytest
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, worker, errdir: str, args: tuple) -> None:
    try:
        worker(rank, *args)
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
    with open(os.path.join(errdir, f"rank{rank}.done"), "w"):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker, world: int, errdir, *args) -> None:
    """`worker(rank, *args)` in `world` spawned processes (each initializes and destroys its own process group);
    fails the test, with each rank's traceback and the list of ranks that finished, if any rank raised or died."""
    try:
        mp.spawn(_rank_main, args=(worker, str(errdir), args), nprocs=world, join=True)
        return
    except ProcessException as e:
        first = f"rank {e.error_index}: " + (str(e).strip().splitlines()[0] if isinstance(e, ProcessExitedException)
                                              else "raised")
    errs = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(errdir.glob("rank*.txt")))
    done = sorted(int(p.stem[4:]) for p in errdir.glob("rank*.done"))
    pytest.fail(f"{first} (ranks that finished their checks and teardown: {done})\n{errs}")
