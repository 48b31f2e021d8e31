"""The batched sampler's pieces against torch's own definitions."""

import pytest
import torch

from runtime import sampler
from runtime.sampler import greedy


@pytest.fixture(params=["chunked", "argmax"])
def greedy_path(request, monkeypatch):
    """Every greedy test on both of greedy()'s paths: the chunked one for all rows, and one argmax
    for rows up to ARGMAX_ROWS (the default)."""
    if request.param == "chunked":
        monkeypatch.setattr(sampler, "ARGMAX_ROWS", 0)
    return request.param


@pytest.mark.parametrize("rows,vocab", [(1, 50257), (64, 50257), (5, 512), (3, 300), (2, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_is_argmax(rows, vocab, dtype, greedy_path):
    logits = torch.randn(rows, vocab, dtype=dtype, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(greedy(logits), logits.argmax(-1))


def test_greedy_takes_the_first_of_tied_maxima_across_and_within_chunks(greedy_path):
    logits = torch.randint(0, 3, (64, 50257), generator=torch.Generator().manual_seed(0)).float()
    assert torch.equal(greedy(logits), logits.argmax(-1))
    logits = torch.zeros(4, 1000)
    logits[0, [300, 700]] = 1.0  # two chunks hold the max
    logits[1, [999, 998]] = 2.0  # the short last chunk
    logits[2, 511] = logits[2, 512] = 3.0  # both sides of a chunk boundary
    assert greedy(logits).tolist() == [300, 998, 511, 0]


def test_greedy_treats_nan_as_the_max_like_argmax(greedy_path):
    logits = torch.randn(2, 1000)
    logits[0, 600] = float("nan")
    logits[1, 999] = float("nan")
    assert greedy(logits).tolist() == logits.argmax(-1).tolist() == [600, 999]
