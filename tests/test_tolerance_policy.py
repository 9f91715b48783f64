"""The tolerance policy's own checks can fail where they must: one wrong [128, 128] tile of a DeepSeek-V3-sized
query fails the code-match bound that the whole tensor's average would pass."""

from __future__ import annotations

import pytest
import torch

from _tolerances import MIN_CODE_MATCH, MIN_CODE_MATCH_FP8_TC, code_match_fraction


@pytest.mark.parametrize("min_frac", [MIN_CODE_MATCH, MIN_CODE_MATCH_FP8_TC])
def test_one_wrong_tile_fails_at_full_size(min_frac):
    a = torch.randint(0, 255, (4096, 128 * 192), dtype=torch.uint8)
    b = a.clone()
    b[1024:1152, 256:384] ^= 0x5A  # one tile, every code wrong
    assert 1.0 - (a != b).float().mean().item() >= min_frac  # the average alone would pass
    with pytest.raises(AssertionError, match="tile"):
        code_match_fraction(a, b, min_frac, "query")
    c = a.clone()  # the same number of differing codes spread over the tensor passes
    idx = torch.randperm(a.numel())[: 128 * 128]
    c.view(-1)[idx] ^= 0x5A
    assert code_match_fraction(a, c, min_frac, "query") >= min_frac


def test_requantized_rows_pass_wrong_tiles_do_not():
    """With the decoded values: a tile whose codes all changed but whose values agree to a few percent (one row's
    input crossed a rounding boundary and the row was requantized) passes; the same codes with values off by their
    own size (a wrong tile) fail."""
    torch.manual_seed(0)
    vals = torch.randn(1024, 512)
    a = torch.randint(0, 255, (1024, 512), dtype=torch.uint8)
    b = a.clone()
    b[256:384, 128:256] ^= 0x5A
    close = vals.clone()
    close[256:384, 128:256] *= 1.01
    assert code_match_fraction(a, b, MIN_CODE_MATCH, "q", dense=(close, vals)) < 1.0
    wrong = vals.clone()
    wrong[256:384, 128:256] = torch.randn(128, 128)
    with pytest.raises(AssertionError, match="tile"):
        code_match_fraction(a, b, MIN_CODE_MATCH, "q", dense=(wrong, vals))
