"""A step of several models and optimizers (``step_fn``) in one process: what it cannot train is
refused when the Trainer is built (a parameter in two optimizers, a scheduler needing a metric with
no validation, or filed under another optimizer), or at the call that goes wrong (``evaluate()``
without a ``metric_fn``, a loss that is not
the micro-batch's mean, a backward after leaving ``micro_batches()``, an optimizer step whose
gradients were never all-reduced), and a skip clears only its own optimizer's gradients. Under
``global_batch_dropout`` each model and each pass over the micro-batches draws masks of its own."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import islice
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.training._config import LoggingConfig, TrainerConfig
from tests.trainer_checks import Overflow

DATA = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)))


def body_head(tmp_path: Any, step_fn: Any = None, **kw: Any):
    """One model, the body's optimizer and the head's; ``scheduler``: a function of the optimizers
    returning the schedulers by name; other options to the config."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizers = {
        "body": torch.optim.SGD(net[0].parameters(), lr=0.1),
        "head": torch.optim.SGD(net[2].parameters(), lr=0.1),
    }
    scheduler = kw.pop("scheduler", None)
    config = TrainerConfig(
        run_dir=str(tmp_path / "run"), epochs=1, batch_size=8, num_workers=0,
        logging=LoggingConfig(progress=False), **kw,
    )  # fmt: skip
    built = ddpkit.Trainer(
        {"net": net},
        optimizers,
        DATA,
        config,
        step_fn=step_fn or body_head_step,
        scheduler=scheduler(optimizers) if scheduler else None,
    )
    return net, optimizers, built


def body_head_step(step: Any) -> None:
    for (x,) in step.micro_batches():
        step.backward(step.models["net"](x).pow(2).mean(), "body", "head")
    step.optimizer_step("body")
    step.optimizer_step("head")


# --- refused when the Trainer is built ------------------------------------------------------------


def test_a_parameter_in_two_optimizers_is_refused_naming_it_and_both(tmp_path):
    # o1 over the whole model, o2 over its head: the head's weight is in both.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizers = {
        "o1": torch.optim.Adam(net.parameters()),
        "o2": torch.optim.Adam(net[2].parameters()),
    }
    config = TrainerConfig(
        run_dir=str(tmp_path / "shared"), epochs=1, batch_size=8, num_workers=0,
        logging=LoggingConfig(progress=False),
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"parameter net\.2\.weight is in optimizers 'o1' and 'o2'"
    ):
        ddpkit.Trainer({"net": net}, optimizers, DATA, config, step_fn=body_head_step)
    # Control: the body's and the head's optimizers over one model, each parameter in one, build.
    net, _, built = body_head(tmp_path)
    assert set(built.strategy.views) == {"body", "head"}  # type: ignore[attr-defined]


def test_a_scheduler_needing_a_metric_or_filed_under_another_optimizer_is_refused(tmp_path):
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    step_lr = torch.optim.lr_scheduler.StepLR
    no_val = r"scheduler=ReduceLROnPlateau steps on a validation metric: pass .*val_data="
    with pytest.raises(ConfigError, match=no_val):
        body_head(tmp_path, scheduler=lambda o: {"head": plateau(o["head"])})
    # per step too: refused before the first step, not at it
    with pytest.raises(ConfigError, match="ReduceLROnPlateau"):
        body_head(
            tmp_path, scheduler=lambda o: {"head": plateau(o["head"])}, scheduler_interval="step"
        )
    with pytest.raises(
        ConfigError, match=r"scheduler=\{'head': StepLR\} was built with optimizer 'body', not"
    ):
        body_head(tmp_path, scheduler=lambda o: {"head": step_lr(o["body"], 2)})
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="an optimizer the Trainer is not given"):
        body_head(tmp_path, scheduler=lambda o: {"head": step_lr(stray, 2)})
    # Control: a scheduler filed under its own optimizer's name builds and steps that optimizer.
    net, optimizers, built = body_head(
        tmp_path, scheduler=lambda o: {"head": step_lr(o["head"], 1, gamma=0.5)}
    )
    built.fit()
    assert optimizers["head"].param_groups[0]["lr"] == 0.05
    assert optimizers["body"].param_groups[0]["lr"] == 0.1


def test_evaluate_with_step_fn_and_no_metric_fn_is_refused_saying_to_pass_one(tmp_path):
    _, _, built = body_head(tmp_path)
    built.fit()
    with pytest.raises(
        ConfigError, match=r"needs a metric_fn: pass metric_fn=lambda models, batch"
    ):
        built.evaluate(DATA)
    # Control: one model's Trainer evaluates the same data.
    model = nn.Linear(4, 1)
    config = TrainerConfig(
        run_dir=str(tmp_path / "one"), epochs=1, batch_size=8, num_workers=0,
        logging=LoggingConfig(progress=False),
    )  # fmt: skip
    one = ddpkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DATA,
        config,
        batch_loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )
    assert set(one.evaluate(DATA)) == {"test/loss"}


# --- refused at the call --------------------------------------------------------------------------


def test_a_loss_that_is_not_the_micro_batchs_mean_is_refused_at_backward(tmp_path):
    def per_sample(step: Any) -> None:
        for (x,) in step.micro_batches():
            step.backward(step.models["net"](x).pow(2).squeeze(1), "body", "head")

    with pytest.raises(ConfigError, match=r"a loss of shape \(8,\): pass the micro-batch's mean"):
        body_head(tmp_path, per_sample)[2].fit()

    # Control: a one-element loss of shape (1,) trains as its 0-dim value would.
    def one_element(step: Any) -> None:
        for (x,) in step.micro_batches():
            step.backward(step.models["net"](x).pow(2).mean().reshape(1), "body", "head")
        step.optimizer_step("body")
        step.optimizer_step("head")

    net_a, _, a = body_head(tmp_path / "a", one_element)
    net_b, _, b = body_head(tmp_path / "b")
    a.fit()
    b.fit()
    assert all(torch.equal(p, q) for p, q in zip(net_a.parameters(), net_b.parameters()))


def _left_early(how: str) -> Callable[[Any], None]:
    def step_fn(step: Any) -> None:
        net = step.models["net"]
        if how == "break":
            for (x,) in step.micro_batches():
                out = net(x)
                break
            step.backward(out.pow(2).mean(), "body", "head")
        elif how == "next":
            (x,) = next(iter(step.micro_batches()))
            step.backward(net(x).pow(2).mean(), "body", "head")
        elif how == "islice":
            # a backward inside the loop, on the first of the two micro-batches only
            for (x,) in islice(step.micro_batches(), 1):
                step.backward(net(x).pow(2).mean(), "body", "head")
        step.optimizer_step("body")
        step.optimizer_step("head")

    return step_fn


@pytest.mark.parametrize("how", ["break", "next"])
def test_a_backward_after_leaving_the_micro_batches_early_is_refused(tmp_path, how):
    with pytest.raises(RuntimeError, match="step.backward\\(\\) runs inside"):
        body_head(tmp_path, _left_early(how), grad_accum_steps=2)[2].fit()


def test_an_optimizer_step_whose_last_micro_batch_had_no_backward_is_refused(tmp_path):
    # Its backward ran under no_sync() only: under DDP each rank would step with its own gradients.
    with pytest.raises(RuntimeError, match="the gradients of 'body' were never all-reduced"):
        body_head(tmp_path, _left_early("islice"), grad_accum_steps=2)[2].fit()
    # Control: with one micro-batch a step, that one is the last (its backward synchronises).
    _, _, built = body_head(tmp_path / "one", _left_early("islice"))
    built.fit()
    assert built.step == 4
    # Control: the whole loop, two micro-batches a step, trains.
    _, _, built = body_head(tmp_path / "two", grad_accum_steps=2)
    built.fit()
    assert built.step == 2


# --- a skip: its own optimizer's gradients only ---------------------------------------------------


def test_a_skip_clears_its_own_optimizers_gradients_and_those_of_no_optimizer_only(tmp_path):
    # body: net[0]; head: net[3]; net[4] in no optimizer. The body's gradients overflow at step 1.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), Overflow(), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 1))
    optimizers = {
        "body": torch.optim.SGD(net[0].parameters(), lr=0.1),
        "head": torch.optim.SGD(net[3].parameters(), lr=0.1),
    }
    seen: list[tuple[bool, bool, bool, bool]] = []

    def step_fn(step: Any) -> None:
        Overflow.ON[0] = len(seen) == 1
        for (x,) in step.micro_batches():
            step.backward(step.models["net"](x).pow(2).mean(), "body", "head")
        Overflow.ON[0] = False
        head = [p.detach().clone() for p in net[3].parameters()]
        body = step.optimizer_step("body")
        outside = all(p.grad is None for p in net[4].parameters())
        taken = step.optimizer_step("head")
        moved = any(not torch.equal(p, h) for p, h in zip(net[3].parameters(), head))
        seen.append((body, taken, moved, outside))

    config = TrainerConfig(
        run_dir=str(tmp_path / "run"), epochs=1, batch_size=8, num_workers=0,
        on_nonfinite="skip", logging=LoggingConfig(progress=False),
    )  # fmt: skip
    built = ddpkit.Trainer({"net": net}, optimizers, DATA, config, step_fn=step_fn)
    built.fit()
    # The body's step is skipped; the head's, whose gradients are finite, is taken and moves it.
    # The parameters of no optimizer lose their gradients with the skip (no infinity stays).
    skip = seen[1]
    assert skip[0] is False and skip[1] is True and skip[3] is True
    assert all(head for _, head, _, _ in seen)
    # Control: the head's step after the skip moved the head, as every other step's does.
    assert all(moved for _, _, moved, _ in seen)
    # Control: without a skip, the parameters of no optimizer keep their gradients.
    assert not seen[0][3] and built.skipped_steps == 1


def test_a_step_counts_once_among_the_skipped_however_many_optimizers_skip(tmp_path):
    """``skipped_steps`` counts steps: a NaN loss for both optimizers of one step is one skipped
    step, as its two events say; two steps each with one optimizer skipped are two (control)."""
    nan_at: dict[int, tuple[str, ...]] = {}
    calls = [0]

    def step_fn(step: Any) -> None:
        names = nan_at.get(calls[0], ())
        calls[0] += 1
        for (x,) in step.micro_batches():
            for name in ("body", "head"):
                bad = float("nan") if name in names else 0.0
                step.backward(step.models["net"](x).pow(2).mean() + bad, name)
        step.optimizer_step("body")
        step.optimizer_step("head")

    nan_at.update({1: ("body", "head")})
    _, _, both = body_head(tmp_path / "both", step_fn, on_nonfinite="skip")
    both.fit()
    assert both.skipped_steps == 1
    events = [
        json.loads(line)
        for line in (tmp_path / "both" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [e["skipped"] for e in events if e.get("event") == "skipped_nonfinite"] == [1, 1]
    nan_at.clear()
    nan_at.update({1: ("body",), 2: ("head",)})
    calls[0] = 0
    _, _, apart = body_head(tmp_path / "apart", step_fn, on_nonfinite="skip")
    apart.fit()
    assert apart.skipped_steps == 2


def test_an_optimizer_a_step_does_not_train_is_not_stepped(tmp_path):
    """A WGAN's generator steps once every ``n_critic`` steps: on the others it has no backward and
    no gradients, and is left out of the step, with its per-step scheduler. An optimizer step with
    no backward for it is refused, naming it (control)."""
    moved: list[bool] = []

    def n_critic_step(step: Any) -> None:
        net = step.models["net"]  # a world of one: the module itself
        train_head = len(moved) % 2 == 1
        head = [p.detach().clone() for p in net[2].parameters()]
        for (x,) in step.micro_batches():
            if train_head:
                step.backward(net(x).pow(2).mean(), "body", "head")
            else:  # the body alone: no gradient reaches the head
                step.backward(net[0](x).pow(2).mean(), "body")
        step.optimizer_step("body")
        if train_head:
            step.optimizer_step("head")
        moved.append(any(not torch.equal(p, h) for p, h in zip(net[2].parameters(), head)))

    _, optimizers, built = body_head(
        tmp_path / "n",
        n_critic_step,
        scheduler=lambda o: {"head": torch.optim.lr_scheduler.StepLR(o["head"], 1, gamma=0.5)},
        scheduler_interval="step",
    )
    built.fit()
    assert built.step == 4 and built.skipped_steps == 0
    assert moved == [False, True, False, True]
    assert optimizers["head"].param_groups[0]["lr"] == 0.1 * 0.5**2  # stepped with it, twice

    def stepped_without_backward(step: Any) -> None:
        for (x,) in step.micro_batches():
            step.backward(step.models["net"][0](x).pow(2).mean(), "body")
        step.optimizer_step("body")
        step.optimizer_step("head")

    _, _, refused = body_head(tmp_path / "r", stepped_without_backward)
    with pytest.raises(ConfigError, match=r"optimizer_step\('head'\) in a step with no step"):
        refused.fit()


def test_an_optimizer_a_step_does_not_name_is_left_out_though_another_loss_reached_it(tmp_path):
    """A GAN whose discriminator trains every second step: the generator's loss puts gradients on
    the discriminator too, yet no step.backward() named it, so it is left out of the step (those
    gradients are not its own); stepping it there is refused, naming step.backward (control)."""
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    optimizers = {
        "g": torch.optim.SGD(g.parameters(), lr=0.1),
        "d": torch.optim.SGD(d.parameters(), lr=0.1),
    }
    moved: list[bool] = []

    def step_fn(step: Any) -> None:
        g, d = step.models["g"], step.models["d"]
        train_d = len(moved) % 2 == 0
        before = [p.detach().clone() for p in d.parameters()]
        for (x,) in step.micro_batches():
            if train_d:
                step.backward(d(g(x).detach()).mean() - d(x).mean(), "d")
            step.backward(-d(g(x)).mean(), "g")  # reaches d's parameters too
        if train_d:
            step.optimizer_step("d")
        step.optimizer_step("g")
        moved.append(any(not torch.equal(p, b) for p, b in zip(d.parameters(), before)))

    def build(fn: Any, run: str) -> Any:
        config = TrainerConfig(
            run_dir=str(tmp_path / run), epochs=1, batch_size=8, num_workers=0,
            logging=LoggingConfig(progress=False),
        )  # fmt: skip
        return ddpkit.Trainer({"g": g, "d": d}, optimizers, DATA, config, step_fn=fn)

    built = build(step_fn, "gan")
    built.fit()
    assert moved == [True, False, True, False] and built.step == 4

    def steps_d_on_gs_loss(step: Any) -> None:
        for (x,) in step.micro_batches():
            step.backward(-step.models["d"](step.models["g"](x)).mean(), "g")
        step.optimizer_step("g")
        step.optimizer_step("d")

    with pytest.raises(ConfigError, match=r"optimizer_step\('d'\) in a step with no step"):
        build(steps_d_on_gs_loss, "refused").fit()


def test_global_batch_dropout_draws_a_mask_per_model_and_per_pass_and_again_on_a_rerun(tmp_path):
    """Under ``global_batch_dropout`` each model's dropout has a layer id of its own, and each pass
    over a step's micro-batches draws masks of its own; the same run draws the same masks."""

    def run(name: str) -> tuple[list[int], list[torch.Tensor]]:
        torch.manual_seed(0)
        models = {m: nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)) for m in ("a", "b")}
        kept: list[torch.Tensor] = []

        def step_fn(step: Any) -> None:
            for _ in range(2):
                for (x,) in step.micro_batches():
                    for m in ("a", "b"):
                        out = step.models[m](x)
                        kept.append(out != 0)
                        step.backward(out.pow(2).mean(), m)
            step.optimizer_step("a")
            step.optimizer_step("b")

        config = TrainerConfig(
            run_dir=str(tmp_path / name), epochs=1, batch_size=8, num_workers=0, max_steps=1,
            global_batch_dropout=True, logging=LoggingConfig(progress=False),
        )  # fmt: skip
        optimizers = {m: torch.optim.SGD(models[m].parameters(), lr=0.1) for m in models}
        built = ddpkit.Trainer(models, optimizers, DATA, config, step_fn=step_fn)
        built.fit()
        wrapped = built.strategy.models  # type: ignore[attr-defined]
        layers = [ddpkit.unwrap(wrapped[m])[1] for m in ("a", "b")]
        assert all(isinstance(d, ddpkit.nn.GlobalBatchDropout) for d in layers)
        return [d.layer_id for d in layers], kept

    ids, (a0, b0, a1, b1) = run("first")
    assert ids[0] != ids[1]
    assert not torch.equal(a0, b0) and not torch.equal(a0, a1) and not torch.equal(b0, b1)
    assert all(map(torch.equal, run("again")[1], (a0, b0, a1, b1)))
