"""TrainBatch: padding, response alignment, sub-batches (micro-batches must keep rows aligned)."""

from __future__ import annotations

import pytest
import torch

from relax_core.algorithms.logprobs import response_positions
from relax_core.samples import Sample, SampleStatus, TrainBatch

PAD = 0


def sample(group: int, idx: int, prompt: list[int], response: list[int], reward: float = 0.0) -> Sample:
    r = len(response)
    return Sample(
        group_id=group,
        index_in_group=idx,
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=[-0.1 * (j + 1) for j in range(r)],
        loss_mask=[1] * (r - 1) + [0] if r > 1 else [1] * r,
        reward=reward,
        policy_version=group,
    )


@pytest.fixture
def samples() -> list[Sample]:
    return [
        sample(0, 0, [5, 6, 7], [11, 12], 1.0),
        sample(0, 1, [5, 6, 7], [13, 14, 15, 16], 0.5),
        sample(3, 0, [8], [17, 18, 19], 0.0),
        sample(3, 1, [8], [], 0.25),  # empty response (e.g. immediate abort)
        sample(4, 0, [9, 9, 9, 9, 9], [20], 0.75),
    ]


def test_from_samples_pads_and_aligns_response_positions(samples: list[Sample]) -> None:
    batch = TrainBatch.from_samples(samples, pad_token_id=PAD)
    assert len(batch) == 5
    assert batch.input_ids.shape == (5, 7)  # longest prompt+response: 3+4
    assert batch.loss_mask.shape == (5, 4)  # longest response
    assert batch.prompt_lens.tolist() == [3, 3, 1, 1, 5]
    assert batch.response_lens.tolist() == [2, 4, 3, 0, 1]
    assert batch.group_ids.tolist() == [0, 0, 3, 3, 4]
    assert batch.policy_versions.tolist() == [0, 0, 3, 3, 4]
    assert batch.rewards.tolist() == [1.0, 0.5, 0.0, 0.25, 0.75]
    for i, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        assert batch.input_ids[i, :n].tolist() == s.prompt_ids + s.response_ids
        assert (batch.input_ids[i, n:] == PAD).all()
        assert batch.attention_mask[i].tolist() == [1] * n + [0] * (7 - n)
        r = len(s.response_ids)
        assert batch.loss_mask[i, :r].tolist() == s.loss_mask
        assert (batch.loss_mask[i, r:] == 0).all()
        assert batch.rollout_logprobs[i, :r].tolist() == pytest.approx(s.rollout_logprobs)
        # the logit at response_positions[i, j] predicts response token j, i.e. input_ids at pos + 1
        pos = response_positions(batch)[i, :r]
        assert batch.input_ids[i, pos + 1].tolist() == s.response_ids


def test_from_samples_rejects_empty() -> None:
    with pytest.raises(ValueError):
        TrainBatch.from_samples([], pad_token_id=PAD)


def test_select_trims_to_own_longest_rows_and_keeps_extras(samples: list[Sample]) -> None:
    batch = TrainBatch.from_samples(samples, pad_token_id=PAD)
    batch.extras["advantages"] = torch.arange(20, dtype=torch.float).view(5, 4)
    batch.extras["values_seq"] = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0])
    sub = batch.select([2, 4])
    assert sub.input_ids.shape == (2, 6)  # row 4 has 5+1 tokens
    assert sub.loss_mask.shape == (2, 3)  # row 2 has 3 response tokens
    assert sub.input_ids[0, :4].tolist() == [8, 17, 18, 19]
    assert sub.group_ids.tolist() == [3, 4]
    assert sub.extras["advantages"].tolist() == [[8.0, 9.0, 10.0], [16.0, 17.0, 18.0]]
    assert sub.extras["values_seq"].tolist() == [12.0, 14.0]
    assert len(sub.multimodal_inputs) == 2
    # the response tokens are still where response_positions says
    for row, s in enumerate([samples[2], samples[4]]):
        pos = response_positions(sub)[row, : len(s.response_ids)]
        assert sub.input_ids[row, pos + 1].tolist() == s.response_ids


def test_select_of_only_empty_responses_keeps_one_column() -> None:
    batch = TrainBatch.from_samples([sample(0, 0, [1, 2], []), sample(0, 1, [1], [])], pad_token_id=PAD)
    sub = batch.select([0, 1])
    assert sub.loss_mask.shape == (2, 1)
    assert float(sub.loss_mask.sum()) == 0.0


def test_micro_batches_cover_rows_in_order_with_same_tokens(samples: list[Sample]) -> None:
    batch = TrainBatch.from_samples(samples, pad_token_id=PAD)
    micro = batch.micro_batches(2)
    assert [len(m) for m in micro] == [2, 2, 1]
    assert torch.cat([m.group_ids for m in micro]).tolist() == batch.group_ids.tolist()
    # every micro-batch row holds the same tokens and per-token values as the full batch row
    row = 0
    for m in micro:
        for j in range(len(m)):
            r = int(m.response_lens[j])
            n = int(m.attention_mask[j].sum())
            assert m.input_ids[j, :n].tolist() == batch.input_ids[row, :n].tolist()
            assert m.loss_mask[j, :r].tolist() == batch.loss_mask[row, :r].tolist()
            assert m.rollout_logprobs[j, :r].tolist() == batch.rollout_logprobs[row, :r].tolist()
            row += 1
    assert micro[-1].input_ids.shape == (1, 6)


def test_sample_uid_and_default_status() -> None:
    s = sample(7, 3, [1], [2])
    assert s.uid == "7:3"
    assert s.status is SampleStatus.COMPLETED
