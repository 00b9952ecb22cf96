"""Reading a strategy's state changes nothing: torch's distributed state dicts give an optimizer
that has not stepped a made-up state (one step at lr 0: Adam's step count 1, zero moments), which
the next real step would train on; ddpkit clears it again after the read."""

from __future__ import annotations

import copy

import torch

import ddpkit


def _train(tmp_path, name: str, before=None) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    config = ddpkit.TrainerConfig(
        run_dir=str(tmp_path / name), batch_size=8, logging=ddpkit.LoggingConfig(progress=False)
    )
    trainer = ddpkit.Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), data, config)
    if before is not None:
        before(trainer)
    trainer.fit()
    return model.weight.detach().clone()


def test_a_state_read_before_the_first_step_leaves_training_as_it_was(tmp_path):
    plain = _train(tmp_path, "plain")
    read = _train(tmp_path, "read", lambda t: t.state_dict())
    assert torch.equal(read, plain)


def test_control_torchs_own_read_before_the_first_step_changes_adams_training(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    plain = _train(tmp_path, "plain")
    made_up = _train(tmp_path, "made-up", lambda t: get_state_dict(t.model, t.optimizer))
    assert (made_up - plain).abs().max() > 1e-4


def _resumed_from_a_state_read_before_the_first_step(tmp_path, name: str, keep_marker: bool):
    source = {}  # a copy: the state holds the live tensors, which the source's training changes
    _train(tmp_path, f"{name}-source", lambda t: source.update(state=copy.deepcopy(t.state_dict())))
    state = source["state"]
    if not keep_marker:  # control: the read's state as torch gives it (Adam's made-up step 1)
        state = {k: v for k, v in state.items() if k != "strategy"}
        state["strategy"] = {
            k: v for k, v in source["state"]["strategy"].items() if k != "unstepped"
        }
    return _train(tmp_path, name, lambda t: t.load_state_dict(state))


def test_a_resume_from_a_state_read_before_the_first_step_trains_as_an_uninterrupted_run(tmp_path):
    plain = _train(tmp_path, "plain")
    assert torch.equal(_resumed_from_a_state_read_before_the_first_step(tmp_path, "r", True), plain)
    made_up = _resumed_from_a_state_read_before_the_first_step(tmp_path, "control", False)
    assert (made_up - plain).abs().max() > 1e-4


def test_the_optimizers_that_had_not_stepped_are_named_and_cleared_by_name_in_any_order():
    from ddpkit.strategies._base import UNSTEPPED, clear_unstepped, made_up_state_cleared

    def with_unstepped(state, optimizers):
        with made_up_state_cleared(optimizers) as unstepped:
            return {**state, UNSTEPPED: unstepped}

    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    optimizers = {"g": torch.optim.Adam(g.parameters()), "d": torch.optim.Adam(d.parameters())}
    d(torch.randn(3, 2)).sum().backward()
    optimizers["d"].step()
    state = with_unstepped({}, optimizers)
    assert state["unstepped"] == ["g"]
    # a resume whose dict lists them the other way round: g's made-up state goes, d's stays
    swapped = {"d": optimizers["d"], "g": optimizers["g"]}
    optimizers["g"].state[next(iter(g.parameters()))] = {"step": torch.tensor(1.0)}
    clear_unstepped(swapped, state)
    assert not optimizers["g"].state and optimizers["d"].state
    # control: by position, the swapped order clears d, which had stepped, and keeps g's made-up one
    by_position = with_unstepped({}, list(optimizers.values()))
    optimizers["g"].state[next(iter(g.parameters()))] = {"step": torch.tensor(1.0)}
    clear_unstepped(list(swapped.values()), by_position)
    assert optimizers["g"].state and not optimizers["d"].state
