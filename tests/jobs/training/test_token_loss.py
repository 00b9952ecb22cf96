"""Per-token losses: with ``count_fn`` a step follows the mean over every token of its global batch,
whatever the ranks and micro-batches that hold the tokens (padding makes their token counts
differ)."""

from __future__ import annotations

import pytest

from tests.jobs.scripts.token_loss_job import first_batch_token_mean, train_on_ranks
from tests.trainer_checks import max_abs_diff

pytestmark = pytest.mark.slow  # real jobs, ~10 s each


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    # One process, no accumulation: each step's global batch of 8 sequences in one forward, one
    # token mean.
    return train_on_ranks(1, tmp_path_factory.mktemp("tokens") / "one")


def test_ranks_and_accumulation_follow_the_token_mean_of_the_global_batch(tmp_path, one_process):
    # 2 ranks x 2 micro-batches of 2 sequences: four micro-batches with different token counts per
    # step.
    ranks = train_on_ranks(2, tmp_path / "ranks", grad_accum=2)
    assert ranks["step"] == one_process["step"] == 12
    diff = max_abs_diff(ranks, one_process)
    print(f"2 ranks x 2 micro-batches vs 1 process: max |dw| {diff:.1e}")
    assert diff < 1e-5
    # The records follow the token mean too: the first step's, taken with the initial weights, is
    # the mean over the first global batch's tokens computed here in one piece.
    expected = first_batch_token_mean()
    assert ranks["first_loss"] == pytest.approx(expected, rel=1e-6)
    assert one_process["first_loss"] == pytest.approx(expected, rel=1e-6)
    assert ranks["train/epoch_loss"] == pytest.approx(one_process["train/epoch_loss"], rel=1e-5)


def test_control_micro_batch_means_weighed_by_samples_train_another_model(tmp_path, one_process):
    # Without count_fn each micro-batch's token mean counts by its samples: short sequences weigh
    # more.
    control = train_on_ranks(2, tmp_path / "control", grad_accum=2, count=False)
    diff = max_abs_diff(control, one_process)
    print(f"per-micro-batch means vs 1 process: max |dw| {diff:.1e}")
    assert diff > 1e-3
    assert control["first_loss"] != pytest.approx(first_batch_token_mean(), rel=1e-3)
