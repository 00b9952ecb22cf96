"""A step of several models and optimizers (``Trainer(models, optimizers, ..., step_fn=...)``) on 2
real gloo ranks: each optimizer's non-finite verdict agreed on every rank, clipping per optimizer,
fp16's scaler shared by two optimizers, a stop and resume that continues both models and both
optimizers bit for bit, and global-batch dropout over several models training what one process
trains. Also the Trainer's ``collate_fn``, in its training and validation loaders."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import LoggingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit._errors import ConfigError
from ddpkit.testing import read_records, run_on_ranks
from tests.trainer_checks import Overflow, same_bits

NOISE = 4


def gan_step(step, bad: Any = None, times: Any = None, raw_d: bool = False) -> None:
    """A GAN's step; ``bad()`` returns what to add to the discriminator's loss (0.0: nothing),
    ``times()`` what to multiply it by; ``raw_d``: its backward() without the helper."""
    g, d = step.models["g"], step.models["d"]
    extra = bad() if bad else 0.0
    factor = times() if times else 1.0
    for (real,) in step.micro_batches():
        fake = g(torch.randn(len(real), NOISE))
        logits = d(torch.cat([real, fake.detach()]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        loss_d = F.binary_cross_entropy_with_logits(logits, labels) * factor + extra
        loss_d.backward() if raw_d else step.backward(loss_d, "d")
    step.optimizer_step("d")
    for (real,) in step.micro_batches():
        logits = d(g(torch.randn(len(real), NOISE)))
        step.backward(F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)), "g")
    step.optimizer_step("g")


def build(
    run_dir: Path,
    step_fn: Any = gan_step,
    sgd: float | None = None,
    d_lr: float = 5e-2,
    **options: Any,
) -> Trainer:
    """A small GAN's Trainer; ``sgd``: both optimizers plain SGD at this learning rate."""
    ddpkit.seed_everything(0)
    g = nn.Sequential(nn.Linear(NOISE, 16), nn.Tanh(), nn.Linear(16, 2))
    d = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizers: dict[str, torch.optim.Optimizer] = {
        "g": torch.optim.Adam(g.parameters(), lr=1e-2),
        "d": torch.optim.SGD(d.parameters(), lr=d_lr, momentum=0.9),
    }
    if sgd is not None:
        optimizers = {
            "g": torch.optim.SGD(g.parameters(), lr=sgd),
            "d": torch.optim.SGD(d.parameters(), lr=sgd),
        }
    data = TensorDataset(torch.randn(96, 2, generator=torch.Generator().manual_seed(1)) + 2.0)
    config = TrainerConfig(
        **{
            "run_dir": str(run_dir), "epochs": 2, "batch_size": 8, "seed": 0, "num_workers": 0,
            "logging": LoggingConfig(progress=False, every_steps=4),
            "snapshot": SnapshotConfig(every_steps=5), } | options
    )  # fmt: skip
    return Trainer({"g": g, "d": d}, optimizers, data, config, step_fn=step_fn)


def state(trainer: Trainer) -> dict[str, Any]:
    full = trainer.strategy.full_state_dict()
    return {
        "model": {k: v.clone() for k, v in full["model"].items()},
        "optim": {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full["optim"].items()
        },
        "step": trainer.step,
        "skipped": trainer.skipped_steps,
    }


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir) if r["kind"] == kind]


def _fit(run_dir: Path, **options: Any) -> dict[str, Any]:
    trainer = build(run_dir, **options)
    trainer.fit()
    return state(trainer)


# --- the non-finite verdict -----------------------------------------------------------------------


def bad_at(call: int, rank: int, value: float, otherwise: float = 0.0):
    """``value`` at the ``call``-th step (from 0) on ``rank``, else ``otherwise``."""
    calls = [0]

    def bad() -> float:
        calls[0] += 1
        return value if (calls[0] - 1, ddpkit.get_runtime().rank) == (call, rank) else otherwise

    return bad


def _nonfinite_job(run_dir: Path, on_nonfinite: str, through_helper: bool) -> Any:
    bad = bad_at(3, 1, float("inf"))  # a non-finite loss whose gradients are finite

    # The control: the discriminator's loss backward()ed without the helper.
    step_fn = lambda step: gan_step(step, bad, raw_d=not through_helper)  # noqa: E731
    try:
        return _fit(run_dir, step_fn=step_fn, on_nonfinite=on_nonfinite)
    except (FloatingPointError, ConfigError) as err:
        return str(err)


def test_a_nonfinite_loss_of_one_optimizer_on_one_rank_skips_or_stops_every_rank(tmp_path):
    skip = run_on_ranks(_nonfinite_job, 2, (tmp_path / "skip", "skip", True), timeout=300)
    assert skip[0]["skipped"] == skip[1]["skipped"] == 1 and same_bits(skip[0], skip[1])
    events = [
        r for r in records(tmp_path / "skip", "event") if r.get("event") == "skipped_nonfinite"
    ]
    assert [(e["step"], e["reason"]) for e in events] == [(3, "non-finite loss on 1 rank(s)")]
    stop = run_on_ranks(_nonfinite_job, 2, (tmp_path / "stop", "stop", True), timeout=300)
    assert all(
        isinstance(s, str) and "non-finite loss on 1 rank(s) at optimizer step 3" in s for s in stop
    )
    # Control: the same loss backward()ed past the helper would reach no verdict (the step was
    # taken everywhere): its optimizer step is refused, naming the helper, on every rank.
    raw = run_on_ranks(_nonfinite_job, 2, (tmp_path / "raw", "stop", False), timeout=300)
    assert all("with no step.backward(..., 'd')" in r for r in raw), raw


def _half_step(step) -> None:
    """g's gradients made, and left without its optimizer step."""
    g, d = step.models["g"], step.models["d"]
    for (real,) in step.micro_batches():
        step.backward(d(real).mean(), "d")
        step.backward(d(g(torch.randn(len(real), NOISE))).mean(), "g")
    step.optimizer_step("d")


def _refused_job(run_dir: Path) -> list[str]:
    out = []
    try:
        _fit(run_dir, step_fn=_half_step)
    except RuntimeError as err:
        out.append(str(err))
    for options in ({"strategy": "zero"}, {"compile": True}):
        try:
            build(run_dir / "x", **options)
        except ConfigError as err:
            out.append(str(err))
    return out


def test_a_step_must_step_every_optimizer_and_what_is_unsupported_is_refused(tmp_path):
    unstepped, zero, compiled = run_on_ranks(_refused_job, 2, (tmp_path,), timeout=300)[0]
    assert "did not call step.optimizer_step() for g, which a step.backward() named" in unstepped
    assert "strategy='ddp'" in zero and "compile is not supported with step_fn" in compiled


def _n_critic_job(run_dir: Path) -> dict[str, Any]:
    """A WGAN's rhythm: the critic every step, the generator every second one; between them the
    generator's fakes are made under no_grad, and its optimizer is left out of the step."""
    moved: list[bool] = []

    def step_fn(step) -> None:
        g, d = step.models["g"], step.models["d"]
        train_g = len(moved) % 2 == 1  # decided alike on every rank: by the step
        before = [p.detach().clone() for p in g.parameters()]
        for (real,) in step.micro_batches():
            with torch.no_grad():
                fake = g(torch.randn(len(real), NOISE))
            step.backward(d(fake).mean() - d(real).mean(), "d")
        step.optimizer_step("d")
        if train_g:
            for (real,) in step.micro_batches():
                step.backward(-d(g(torch.randn(len(real), NOISE))).mean(), "g")
            step.optimizer_step("g")
        moved.append(any(not torch.equal(p, b) for p, b in zip(g.parameters(), before)))

    out = _fit(run_dir, step_fn=step_fn, grad_accum_steps=2)
    return out | {"moved": moved}


def test_a_generator_stepped_every_second_step_trains_alike_on_every_rank(tmp_path):
    ranks = run_on_ranks(_n_critic_job, 2, (tmp_path,), timeout=300)
    moved = ranks[0]["moved"]
    assert moved == [i % 2 == 1 for i in range(len(moved))] and len(moved) >= 4
    assert ranks[0]["skipped"] == 0 and same_bits(ranks[0], ranks[1])


# --- clipping per optimizer -----------------------------------------------------------------------


def _clip_job(run_dir: Path, clip: float | None) -> list[tuple[float, float]]:
    """Each step's update norms of g's and d's parameters, and their gradients' norms before
    clipping."""
    seen: list[tuple[float, float]] = []

    def step_fn(step) -> None:
        before = {n: [p.detach().clone() for p in m.parameters()] for n, m in step.models.items()}
        gan_step(step)
        # SGD without momentum on both: an update is lr x the clipped gradient.
        moved = {
            n: torch.linalg.vector_norm(
                torch.cat([(p.detach() - b).flatten() for p, b in zip(m.parameters(), before[n])])
            )
            for n, m in step.models.items()
        }
        seen.append((float(moved["g"]) / 0.5, float(moved["d"]) / 0.5))

    build(run_dir, step_fn=step_fn, clip_grad_norm=clip, epochs=1, sgd=0.5).fit()
    return seen


def test_each_optimizer_is_clipped_to_its_own_norm(tmp_path):
    unclipped = run_on_ranks(_clip_job, 2, (tmp_path / "free", None), timeout=300)[0]
    clip = min(min(g, d) for g, d in unclipped) / 2  # below every step's norm of either model
    clipped = run_on_ranks(_clip_job, 2, (tmp_path / "clipped", clip), timeout=300)[0]
    # Each model's update is clip long: its own norm was clipped, whatever the other's.
    for g, d in clipped:
        assert g == pytest.approx(clip, rel=1e-4) and d == pytest.approx(clip, rel=1e-4)
    # Control: one norm over both optimizers would leave the model with the smaller gradients
    # shorter than clip.
    g, d = unclipped[0]
    joint = (g * g + d * d) ** 0.5
    assert min(g, d) * clip / joint < clip * 0.99


# --- fp16: one scaler, two optimizers -------------------------------------------------------------


def _fp16_job(run_dir: Path, overflow: bool) -> dict[str, Any]:
    # The discriminator's loss x 1e6 at step 2 on rank 0: x 65536 (the scale) overflows fp16's
    # gradients.
    times = bad_at(2, 0, 1e6, otherwise=1.0) if overflow else None
    trainer = build(
        run_dir, step_fn=lambda step: gan_step(step, times=times), precision="fp16", epochs=1
    )
    trainer.fit()
    return state(trainer) | {"scale": trainer.scaler.get_scale() if trainer.scaler else None}


def test_fp16_one_scaler_for_two_optimizers_skips_alike_and_updates_once_a_step(tmp_path):
    clean = run_on_ranks(_fp16_job, 2, (tmp_path / "clean", False), timeout=300)
    over = run_on_ranks(_fp16_job, 2, (tmp_path / "over", True), timeout=300)
    # the scaler's business, not a skip
    assert same_bits(over[0], over[1]) and over[0]["skipped"] == 0
    overflows = [
        r for r in records(tmp_path / "over", "event") if r.get("event") == "fp16_overflow"
    ]
    assert [r["step"] for r in overflows] == [2]
    # One update a step: the overflow halves the scale once, and the discriminator's step alone is
    # not taken.
    assert over[0]["scale"] == clean[0]["scale"] / 2 and over[0]["step"] == clean[0]["step"] - 1
    # Control: without the overflow no event, no step lost.
    assert not [
        r for r in records(tmp_path / "clean", "event") if r.get("event") == "fp16_overflow"
    ]


# --- stop and resume ------------------------------------------------------------------------------


def _resume_job(run_dir: Path, max_steps: int | None, forget_d: bool) -> dict[str, Any]:
    trainer = build(run_dir, max_steps=max_steps)
    # the control: a resume that restores the models and g's optimizer, not d's momentum
    if forget_d:
        load = trainer.strategy.load_state_dict

        def load_without_d(state: dict[str, Any]) -> None:
            load(state)
            trainer.strategy.optimizers["d"].state.clear()

        trainer.strategy.load_state_dict = load_without_d  # type: ignore[method-assign]
    trainer.fit()
    return state(trainer)


def test_a_run_stopped_by_max_steps_resumes_both_models_and_optimizers_bitwise(tmp_path):
    whole = run_on_ranks(_resume_job, 2, (tmp_path / "whole", None, False), timeout=300)
    first = run_on_ranks(_resume_job, 2, (tmp_path / "stopped", 7, False), timeout=300)
    assert first[0]["step"] == 7
    resumed = run_on_ranks(_resume_job, 2, (tmp_path / "stopped", None, False), timeout=300)
    assert resumed[0]["step"] == whole[0]["step"] == 12 and same_bits(resumed[0], whole[0])
    assert same_bits(resumed[1], whole[1])

    # The records of each loss agree too (the losses not yet agreed at the stop are each rank's own
    # in it).
    def losses(d: Path) -> list[tuple[int, float, float]]:
        return [(r["step"], r["train/loss_d"], r["train/loss_g"]) for r in records(d, "train")]

    assert losses(tmp_path / "stopped")[-1] == losses(tmp_path / "whole")[-1]
    # Control: d's optimizer state lost at the resume gives another run.
    run_on_ranks(_resume_job, 2, (tmp_path / "forgot", 7, False), timeout=300)
    forgot = run_on_ranks(_resume_job, 2, (tmp_path / "forgot", None, True), timeout=300)
    assert not same_bits(forgot[0], whole[0])
    # Every optimizer is in the run's record: a resume with the second optimizer's lr changed is
    # refused, naming it.
    refused = run_on_ranks(_changed_lr_job, 2, (tmp_path / "stopped",), timeout=300)
    expected = 'optimizer "d" param group 0 lr: 0.05 in the snapshot, 0.07 now'
    assert all(expected in r for r in refused), refused


def late_g_step(step) -> None:
    """The GAN's step, with the generator's Adam stepping from step 3 on (``n_critic`` style)."""
    if step.step >= 3:
        gan_step(step)
        return
    for (real,) in step.micro_batches():
        fake = step.models["g"](torch.randn(len(real), NOISE)).detach()
        logits = step.models["d"](torch.cat([real, fake]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        step.backward(F.binary_cross_entropy_with_logits(logits, labels), "d")
    step.optimizer_step("d")


def _late_g_job(run_dir: Path, max_steps: int | None, forget_marker: bool) -> dict[str, Any]:
    trainer = build(run_dir, step_fn=late_g_step, max_steps=max_steps)
    if forget_marker:  # control: the snapshot's state as torch reads it (g's Adam made up: step 1)
        load = trainer.strategy.load_state_dict
        trainer.strategy.load_state_dict = lambda s: load(  # type: ignore[method-assign]
            {k: v for k, v in s.items() if k != "unstepped"}
        )
    trainer.fit()
    return state(trainer)


def test_a_resume_from_a_snapshot_before_an_optimizers_first_step_is_bitwise(tmp_path):
    # stopped at step 2, before g's Adam ever stepped: its state in the snapshot is torch's
    # made-up one, which the resume must not train on
    whole = run_on_ranks(_late_g_job, 2, (tmp_path / "whole", None, False), timeout=300)
    run_on_ranks(_late_g_job, 2, (tmp_path / "stopped", 2, False), timeout=300)
    resumed = run_on_ranks(_late_g_job, 2, (tmp_path / "stopped", None, False), timeout=300)
    assert same_bits(resumed[0], whole[0]) and same_bits(resumed[1], whole[1])
    run_on_ranks(_late_g_job, 2, (tmp_path / "control", 2, False), timeout=300)
    control = run_on_ranks(_late_g_job, 2, (tmp_path / "control", None, True), timeout=300)
    assert not same_bits(control[0], whole[0])


def _changed_lr_job(run_dir: Path) -> str:
    try:
        build(run_dir, d_lr=0.07).fit()
    except ConfigError as err:
        return str(err)
    return "resumed"


# --- other shapes: a frozen teacher, two optimizers over one model --------------------------------


def _shapes_job(run_dir: Path) -> dict[str, Any]:
    ddpkit.seed_everything(0)
    teacher, student = nn.Linear(2, 1).requires_grad_(False), nn.Linear(2, 1)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizers = {
        "student": torch.optim.SGD(student.parameters(), lr=0.1),
        "body": torch.optim.SGD(net[0].parameters(), lr=0.1),
        "head": torch.optim.Adam(net[2].parameters(), lr=1e-2),
    }
    before = {k: v.clone() for k, v in teacher.state_dict().items()}

    def step_fn(step) -> None:
        m = step.models
        for (x,) in step.micro_batches():
            with torch.no_grad():
                target = m["teacher"](x)
            step.backward(F.mse_loss(m["student"](x), target), "student")
            # one loss, two optimizers
            step.backward(F.mse_loss(m["net"](x), target), "body", "head")
        for name in ("student", "body", "head"):
            step.optimizer_step(name)

    data = TensorDataset(torch.randn(64, 2, generator=torch.Generator().manual_seed(1)))
    config = TrainerConfig(
        run_dir=str(run_dir),
        epochs=2,
        batch_size=8,
        num_workers=0,
        logging=LoggingConfig(progress=False),
    )
    models = {"teacher": teacher, "student": student, "net": net}
    trainer = Trainer(models, optimizers, data, config, step_fn=step_fn)
    trainer.fit()
    wrapped = {name: type(m).__name__ for name, m in trainer.strategy.models.items()}  # type: ignore[attr-defined]
    unchanged = all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    return state(trainer) | {"wrapped": wrapped, "teacher_unchanged": unchanged}


def test_a_frozen_teacher_and_two_optimizers_over_one_model(tmp_path):
    ranks = run_on_ranks(_shapes_job, 2, (tmp_path,), timeout=300)
    assert ranks[0]["wrapped"] == {
        "teacher": "Linear",  # nothing to all-reduce: not wrapped
        "student": "DistributedDataParallel",
        "net": "DistributedDataParallel",
    }
    assert ranks[0]["teacher_unchanged"] and ranks[0]["step"] == 8 and same_bits(ranks[0], ranks[1])
    assert any(k.startswith("state.net.2.") and k.endswith("exp_avg") for k in ranks[0]["optim"])
    names = {"train/loss_student", "train/loss_body+head"}
    assert all(names <= set(r) for r in records(tmp_path, "train"))


def _bn_teacher_job(run_dir: Path, sync_batchnorm: bool, by_hand: bool) -> dict[str, Any]:
    """A frozen teacher with BatchNorm left in training mode, built unlike on each rank (seeded by
    rank); ``by_hand``: the control, the teacher's forwards outside ddpkit. Its state and its
    BatchNorm's class on this rank."""
    rank = ddpkit.init().rank
    torch.manual_seed(rank)
    teacher = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)).requires_grad_(False)
    ddpkit.seed_everything(0)
    student = nn.Linear(2, 4)
    data = TensorDataset(torch.randn(64, 2, generator=torch.Generator().manual_seed(1)))
    if by_hand:
        for (x,) in torch.utils.data.DataLoader(data, batch_size=8):
            teacher(x[rank::2])
    else:

        def step_fn(step) -> None:
            for (x,) in step.micro_batches():
                with torch.no_grad():
                    target = step.models["teacher"](x)
                step.backward(F.mse_loss(step.models["student"](x), target), "student")
            step.optimizer_step("student")

        config = TrainerConfig(
            run_dir=str(run_dir), epochs=1, batch_size=8, num_workers=0,
            sync_batchnorm=sync_batchnorm, logging=LoggingConfig(progress=False),
        )  # fmt: skip
        optimizers = {"student": torch.optim.SGD(student.parameters(), lr=0.1)}
        models = {"teacher": teacher, "student": student}
        trainer = Trainer(models, optimizers, data, config, step_fn=step_fn)
        trainer.fit()
        teacher = trainer.strategy.models["teacher"]  # type: ignore[attr-defined]
    return {
        "state": {k: v.clone() for k, v in teacher.state_dict().items()},
        "norm": type(teacher[1]).__name__,
    }


@pytest.mark.parametrize("sync_batchnorm", [False, True], ids=["broadcast", "sync"])
def test_a_frozen_teachers_weights_and_batchnorm_statistics_are_the_same_on_every_rank(
    tmp_path, sync_batchnorm
):
    ranks = run_on_ranks(_bn_teacher_job, 2, (tmp_path, sync_batchnorm, False), timeout=300)
    # rank 0's weights everywhere; its running statistics too under SyncBatchNorm, else (as DDP's
    # own) rank 0's before each forward, each rank's batch after it
    weights = ("0.weight", "0.bias", "1.weight", "1.bias")
    same = [k for k in ranks[0]["state"] if torch.equal(ranks[0]["state"][k], ranks[1]["state"][k])]
    assert set(same) == set(ranks[0]["state"]) if sync_batchnorm else set(weights) <= set(same)
    assert ranks[0]["norm"] == ("CPUSyncBatchNorm" if sync_batchnorm else "BatchNorm1d")
    # control: the same teacher's forwards on each rank's batches, outside ddpkit, drift apart
    apart = run_on_ranks(_bn_teacher_job, 2, (tmp_path, False, True), timeout=300)
    assert not any(torch.equal(apart[0]["state"][k], apart[1]["state"][k]) for k in weights[:2])


# --- two optimizers over one model: a skip of one -------------------------------------------------


def _body_head_job(run_dir: Path, order: tuple[str, str], accum: int = 1, how: str = "") -> Any:
    """One model, the body's optimizer and the head's; the body's gradients overflow on rank 1 at
    the step function's call 2. Each call's (body taken, head taken, head moved), and the final
    state; ``how``: the micro-batches' loop left early (``break``: a backward after it; ``islice``:
    a backward on the first micro-batch only), returning the error."""
    ddpkit.seed_everything(0)
    net = nn.Sequential(nn.Linear(2, 8), Overflow(), nn.Tanh(), nn.Linear(8, 1))
    optimizers = {
        "body": torch.optim.SGD(net[0].parameters(), lr=0.1),
        "head": torch.optim.SGD(net[3].parameters(), lr=0.1, momentum=0.9),
    }
    calls: list[tuple[bool, bool, bool]] = []

    def step_fn(step) -> None:
        model = step.models["net"]
        Overflow.ON[0] = (len(calls), ddpkit.get_runtime().rank) == (2, 1)
        if how == "break":
            for (x,) in step.micro_batches():
                out = model(x)
                break
            step.backward(out.pow(2).mean(), "body", "head")
        elif how == "islice":
            for (x,) in itertools.islice(step.micro_batches(), 1):
                step.backward(model(x).pow(2).mean(), "body", "head")
        else:
            for (x,) in step.micro_batches():
                step.backward(model(x).pow(2).mean(), "body", "head")
        Overflow.ON[0] = False
        head = [p.detach().clone() for p in net[3].parameters()]
        taken = {name: step.optimizer_step(name) for name in order}
        moved = any(not torch.equal(p, h) for p, h in zip(net[3].parameters(), head))
        calls.append((taken["body"], taken["head"], moved))

    data = TensorDataset(torch.randn(64, 2, generator=torch.Generator().manual_seed(1)))
    config = TrainerConfig(
        run_dir=str(run_dir), epochs=1, batch_size=8, num_workers=0, on_nonfinite="skip",
        grad_accum_steps=accum, logging=LoggingConfig(progress=False),
    )  # fmt: skip
    trainer = Trainer({"net": net}, optimizers, data, config, step_fn=step_fn)
    try:
        trainer.fit()
    except RuntimeError as err:
        return str(err)
    return state(trainer) | {"calls": calls}


def test_a_skip_by_one_of_two_optimizers_over_one_model_leaves_the_others_step(tmp_path):
    ranks = run_on_ranks(_body_head_job, 2, (tmp_path / "body", ("body", "head")), timeout=300)
    # The body's step is skipped on every rank; the head's, with finite gradients, is taken and
    # moves the head (its gradients were not cleared by the body's skip).
    calls = ranks[0]["calls"]
    assert [c[:2] for c in calls] == [(True, True), (True, True), (False, True), (True, True)]
    assert all(moved for _, _, moved in calls)
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1 and same_bits(ranks[0], ranks[1])
    # Control: the head stepped first gives the same run, bit for bit.
    head_first = run_on_ranks(_body_head_job, 2, (tmp_path / "head", ("head", "body")), timeout=300)
    assert same_bits(head_first[0], ranks[0]) and head_first[0]["calls"] == ranks[0]["calls"]


def test_leaving_the_micro_batches_early_is_refused_on_every_rank(tmp_path):
    # Two micro-batches a step: the first's forward and backward run under no_sync(), so a backward
    # after a break, or none on the last micro-batch, would leave each rank its own gradients.
    broke = run_on_ranks(_body_head_job, 2, (tmp_path / "b", ("body", "head"), 2, "break"))
    assert all(isinstance(r, str) and "step.backward() runs inside" in r for r in broke)
    sliced = run_on_ranks(_body_head_job, 2, (tmp_path / "s", ("body", "head"), 2, "islice"))
    assert all(
        isinstance(r, str) and "the gradients of 'body' were never all-reduced" in r for r in sliced
    )
    # Control: the whole loop keeps the ranks' replicas equal.
    whole = run_on_ranks(_body_head_job, 2, (tmp_path / "w", ("body", "head"), 2))
    assert same_bits(whole[0], whole[1]) and whole[0]["step"] == 2


# --- the step function knows its step -------------------------------------------------------------


def _rhythm_job(run_dir: Path, max_steps: int | None, by: str) -> dict[str, Any]:
    """The generator every third step, by ``step.step`` (``by="step"``) or by a counter of the
    script's own (``by="counter"``, which starts again at 0 in a resumed process)."""
    calls = [0]

    def step_fn(step) -> None:
        n = step.step if by == "step" else calls[0]
        calls[0] += 1
        g, d = step.models["g"], step.models["d"]
        for (real,) in step.micro_batches():
            with torch.no_grad():
                fake = g(torch.randn(len(real), NOISE))
            step.backward(d(fake).mean() - d(real).mean(), "d")
        step.optimizer_step("d")
        if n % 3 == 2:
            for (real,) in step.micro_batches():
                step.backward(-d(g(torch.randn(len(real), NOISE))).mean(), "g")
            step.optimizer_step("g")

    trainer = build(run_dir, step_fn=step_fn, max_steps=max_steps)
    trainer.fit()
    return state(trainer)


@pytest.mark.parametrize("by", ["step", "counter"], ids=["step.step", "control-counter"])
def test_a_step_functions_rhythm_by_step_step_resumes_bitwise(tmp_path, by):
    whole = run_on_ranks(_rhythm_job, 2, (tmp_path / "whole", None, by), timeout=300)
    run_on_ranks(_rhythm_job, 2, (tmp_path / "stopped", 7, by), timeout=300)
    resumed = run_on_ranks(_rhythm_job, 2, (tmp_path / "stopped", None, by), timeout=300)
    # a counter of the script's own restarts at 0 in the resumed process: another rhythm
    assert same_bits(resumed[0], whole[0]) == (by == "step")


# --- global-batch dropout in the step function ---------------------------------------------------


class _Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.drop, self.head = nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.body(x)))
        return self.head(F.dropout(h, 0.2, self.training))  # the forward's own dropout


def _distill(run_dir: Path, global_dropout: bool) -> dict[str, torch.Tensor]:
    """A student distilled from a frozen teacher that keeps its dropout on; 2 micro-batches a
    step, the teacher's targets in a first pass over them and the student in a second, and an
    uneven last step (drop_last=False). The weights, by model."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.4), nn.Linear(16, 1))
    teacher.requires_grad_(False)
    student = _Student()

    def step_fn(step) -> None:
        t, s = step.models["teacher"], step.models["student"]
        with torch.no_grad():
            targets = [t(x) for (x,) in step.micro_batches()]
        for (x,), target in zip(step.micro_batches(), targets):
            step.backward(F.mse_loss(s(x), target), "student")
        step.optimizer_step("student")

    data = TensorDataset(torch.randn(56, 4, generator=torch.Generator().manual_seed(1)))
    config = TrainerConfig(
        run_dir=str(run_dir), epochs=2, global_batch_size=16, grad_accum_steps=2, seed=3,
        drop_last=False, num_workers=0, global_batch_dropout=global_dropout,
        logging=LoggingConfig(progress=False), snapshot=SnapshotConfig(every_epochs=0),
    )  # fmt: skip
    optimizers = {"student": torch.optim.SGD(student.parameters(), lr=0.2, momentum=0.9)}
    trainer = Trainer(
        {"teacher": teacher, "student": student}, optimizers, data, config, step_fn=step_fn
    )
    trainer.fit()
    return {k: v.clone() for k, v in trainer.strategy.full_state_dict()["model"].items()}


@pytest.mark.parametrize("how", ["covered", "control-per-rank"])
def test_two_ranks_train_what_one_process_trains_with_dropout_in_a_step_function(tmp_path, how):
    on = how == "covered"
    one = _distill(tmp_path / "one", on)
    two = run_on_ranks(_distill, 2, (tmp_path / "two", on), timeout=300)
    dw = max(float((two[0][k] - one[k]).abs().max()) for k in one)
    if on:
        assert dw <= 1e-5, dw
    else:  # each rank draws its own masks
        assert dw > 1e-3, dw


# --- the Trainer's collate_fn ---------------------------------------------------------------------


class _Sequences(torch.utils.data.Dataset):
    """Sequences of lengths 1 to ``n``, each with its mean as the target."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs = [torch.randn(1 + i, generator=g) for i in range(n)]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seqs[i], self.seqs[i].mean()


def pad(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """(padded sequences, lengths, targets)."""
    seqs, targets = zip(*samples)
    lengths = torch.tensor([len(s) for s in seqs])
    return nn.utils.rnn.pad_sequence(list(seqs), batch_first=True), lengths, torch.stack(targets)


class _MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.scale((x.sum(1) / lengths).unsqueeze(1)).squeeze(1)


def _padded_job(run_dir: Path, collate: Any) -> Any:
    """Trains on variable-length sequences with validation; the error without ``collate``."""
    torch.manual_seed(0)
    model = _MaskedMean()
    config = TrainerConfig(
        run_dir=str(run_dir), epochs=2, batch_size=4, eval_batch_size=5, num_workers=0,
        collate_fn=collate, logging=LoggingConfig(progress=False),
    )  # fmt: skip
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.3), _Sequences(32, 1), config,
        val_data=_Sequences(12, 2), batch_loss_fn=lambda m, b: F.mse_loss(m(b[0], b[1]), b[2]),
    )  # fmt: skip
    try:
        before = trainer.evaluate(_Sequences(12, 2), "val")["val/loss"]
        last = trainer.fit()
    except RuntimeError as err:
        return str(err)
    recorded = json.loads((run_dir / "config.json").read_text())["collate_fn"]
    weights = {k: v.clone() for k, v in ddpkit.unwrap(trainer.model).state_dict().items()}
    return {
        "before": before, "after": last["val/loss"], "step": trainer.step, "weights": weights,
        "recorded": recorded,
    }  # fmt: skip


def test_a_collate_fn_pads_variable_length_sequences_in_training_and_validation(tmp_path):
    ranks = run_on_ranks(_padded_job, 2, (tmp_path / "pad", pad), timeout=300)
    assert ranks[0]["step"] == 8 and ranks[0]["recorded"] == "pad"
    assert ranks[0]["after"] < ranks[0]["before"]
    assert all(torch.equal(v, ranks[1]["weights"][k]) for k, v in ranks[0]["weights"].items())
    # Control: torch's default collate cannot stack sequences of different lengths.
    plain = run_on_ranks(_padded_job, 2, (tmp_path / "plain", None), timeout=300)
    assert all(isinstance(r, str) and "stack expects each tensor to be equal size" in r
               for r in plain)  # fmt: skip
