"""Test lanes: on a machine without CUDA the Triton kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set here before anything imports triton); with CUDA they run compiled.
Tests marked `gpu` need CUDA and are skipped without it; tests marked `slow` (minutes on a 2-core machine) run with
MLA_QPROJ_TESTS=full, as CI runs them."""

from __future__ import annotations

import os
import random

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

# Hypothesis explores: every run draws new examples from a seed printed in the report header (reproduce a run with
# `--hypothesis-seed=N`). HYPOTHESIS_PROFILE=thorough multiplies every property's example count by 10 (local runs);
# the default profile ("ci") keeps each property's own count, sized to its cost.
hypothesis.settings.register_profile("ci", deadline=None, database=None, print_blob=True,
                                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
hypothesis.settings.register_profile("thorough", parent=hypothesis.settings.get_profile("ci"))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
hypothesis.settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A property's example count: n in the CI profile, 10 n under HYPOTHESIS_PROFILE=thorough."""
    return n * (10 if PROFILE == "thorough" else 1)


def pytest_configure(config):
    seed = config.getoption("hypothesis_seed", None)
    if seed is None:  # draw one seed for the whole run, so that the header's seed reproduces it
        seed = random.SystemRandom().randrange(2**32)
        import hypothesis.core

        hypothesis.core.global_force_seed = seed
    config._mla_hypothesis_seed = seed


def _seed_line(config) -> str:
    seed = getattr(config, "_mla_hypothesis_seed", None)
    return f"hypothesis profile {PROFILE}, seed {seed} (reproduce with --hypothesis-seed={seed})"


def pytest_report_header(config):
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_seed_line(config))  # also under -q, where the header is not printed
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


FULL = os.environ.get("MLA_QPROJ_TESTS", "") == "full"  # the slow tier too (CI sets it)


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.skip(reason="slow tier: MLA_QPROJ_TESTS=full runs it (CI does)")
    gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not FULL:
            item.add_marker(slow)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return DEVICE
