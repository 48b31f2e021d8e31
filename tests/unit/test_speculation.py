"""Prompt-lookup proposals and the flat batch of a step that verifies them, without a model."""

import pytest
import torch

from models.step import Sequence, StepInput
from runtime.speculation import PromptLookup, matched


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(longest=3)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    # the latest occurrence of (1, 2) wins over an earlier one
    assert PromptLookup().propose([1, 2, 3, 1, 2, 4, 1, 2], 5) == [4, 1, 2]
    # a 3-gram match wins over a later 1-gram one
    assert PromptLookup().propose([7, 8, 9, 5, 9, 6, 7, 8, 9], 2) == [5, 9]
    assert PromptLookup().propose([1, 2, 3], 4) == []  # nothing seen before
    assert PromptLookup(shortest=2).propose([1, 2, 3, 5, 3], 4) == []  # a one-token match is too short here
    assert PromptLookup().propose([1, 2, 1, 2], 0) == []


def test_the_index_grows_with_the_tokens():
    lookup, tokens = PromptLookup(), [5, 6, 7, 8]
    assert lookup.propose(tokens, 3) == []
    tokens += [5, 6]
    assert lookup.propose(tokens, 3) == [7, 8, 5]
    tokens += [7, 8, 5, 6, 7]
    assert lookup.propose(tokens, 3) == [8, 5, 6]  # the latest earlier (5, 6, 7) is at 4..6


def test_matched_counts_the_proposals_greedy_decoding_confirms():
    assert matched([4, 5, 6], [4, 5, 6, 7]) == 3
    assert matched([4, 5, 6], [4, 9, 6, 7]) == 1
    assert matched([4, 5, 6], [1, 5, 6, 7]) == 0
    assert matched([], [8]) == 0


def test_a_verifying_sequence_is_laid_out_as_rows_among_the_decodes():
    block = 4
    decode = Sequence([50], 9, [0, 1, 2], True)            # context 10
    verify = Sequence([60, 61, 62], 8, [3, 4, 5], True, None, 3)  # contexts 9, 10, 11
    other = Sequence([70], 5, [6, 7], True)               # context 6
    prefill = Sequence([80, 81, 82, 83], 0, [8], True)
    step = StepInput.flatten([decode, other, verify, prefill], block, torch.device("cpu"))
    assert step.verifies and len(step.prefills) == 1
    # rows sorted by context, longest first (ties keep their order): 62, 50, 61, 60, 70; then the chunk
    assert step.input_ids.tolist() == [62, 50, 61, 60, 70, 80, 81, 82, 83]
    assert step.positions.tolist() == [10, 9, 9, 8, 5, 0, 1, 2, 3]
    assert [g.context_lens.tolist() for g in step.decode_groups] == [[11, 10, 10, 9, 6]]
    # sampled rows in the sequences' order, a verifying sequence's in the order of its tokens
    assert step.sample_indices.tolist() == [1, 4, 3, 2, 0, 8]
    slots = step.slot_mapping.tolist()
    assert slots[:4] == [5 * block + 2, 2 * block + 1, 5 * block + 1, 5 * block + 0]
    assert step.lengths == [11, 10, 11, 11, 6, 4]


def test_a_plain_step_is_unchanged_and_num_sampled_is_checked():
    step = StepInput.flatten([Sequence([5], 3, [0], True), Sequence([6, 7, 8], 0, [1], True)], 4, torch.device("cpu"))
    assert not step.verifies and step.sample_indices.tolist() == [0, 3]
    chunk = StepInput.flatten([Sequence([6, 7, 8], 0, [1], True, None, 2)], 4, torch.device("cpu"))
    assert chunk.prefills and chunk.sample_indices.tolist() == [1, 2]  # a chunk's last two
    with pytest.raises(ValueError, match="num_sampled must be in"):
        StepInput.flatten([Sequence([6, 7], 0, [1], True, None, 3)], 4, torch.device("cpu"))


@pytest.mark.parametrize("draft", ["drawn from q", "certain"])
def test_rejection_sampling_gives_the_targets_distribution_whatever_the_proposal(draft):
    """sampler.verify over many rows of one (p, q) on a tiny vocabulary: a proposal x drawn from q
    (a draft model's) kept with min(1, p(x)/q(x)), else a draw from max(0, p - q), and one that came
    with certainty (q one-hot) kept with p(x), else a draw from p without x: either way each token
    comes as often as p says (total variation within sampling noise), and the p/q rule keeps
    sum min(p, q) of the proposals."""
    from runtime.sampler import verify
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])  # far from p, with mass where p has none
    rows = 200_000
    if draft == "certain":
        proposed = torch.full((rows,), 3)
        drafted = None
    else:
        proposed = torch.multinomial(q, rows, replacement=True, generator=generator)
        drafted = q.expand(rows, -1)
    tokens = verify(p.expand(rows, -1), proposed, generator, drafted)
    observed = torch.bincount(tokens, minlength=len(p)).double() / rows
    assert (observed - p).abs().sum() / 2 < 0.006  # sampling noise: ~0.002
    kept = (tokens == proposed).double().mean().item()
    expected = torch.minimum(p, q).sum().item() if drafted is not None else p[3].item()
    assert kept == pytest.approx(expected, abs=0.01)
