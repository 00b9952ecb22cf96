"""The Trainer's parts in one process: a rank's share of the loss, the non-finite checks, the loss
window, the configs' errors, the default loss's refusals, and best.pt across a fresh and a resumed
run."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.strategies._ddp import FiniteCheck as _FiniteCheck
from ddpkit.strategies._ddp import (
    nan_gradient_if_nonfinite as _nan_gradient_if_nonfinite,
)
from ddpkit.training._config import EarlyStoppingConfig, LoggingConfig, SnapshotConfig
from ddpkit.training._step import LossWindow as _LossWindow
from ddpkit.training._step import loss_divisor
from ddpkit.training._trainer import TrainerConfig


def test_a_ranks_loss_share_weighs_samples_not_ranks():
    # Full steps: the number of micro-batches, as before. 13 samples as 7/6 on 2 ranks: the rank
    # with 7 divides by 13/14 (counts more), the one with 6 by 13/12; DDP's mean of the two then
    # gives sum(loss_i) / 13.
    assert loss_divisor(12, 2, 24) == 1.0 and loss_divisor(12, 2, 48) == 2.0
    shares = [loss_divisor(n, 2, 13) for n in (7, 6)]
    assert shares == [13 / 14, 13 / 12]
    # A sample's weight in the step: 1/n in its rank's mean, 1/divisor, 1/2 in DDP's average over
    # the ranks.
    assert [1 / (n * d * 2) for n, d in zip((7, 6), shares)] == pytest.approx([1 / 13] * 2)
    # Two micro-batches a step, the second short (12 then 7 samples over 2 ranks: 6/6, then 4/3).
    weights = [1 / (n * loss_divisor(n, 2, 19) * 2) for n in (6, 6, 4, 3)]
    assert weights == pytest.approx([1 / 19] * 4)
    # The control: each rank's mean counted alike gives a sample of the rank with 6 more weight than
    # one of 7.
    assert 1 / (6 * 2) > 1 / (7 * 2)


@pytest.mark.parametrize("on_host", [True, False])
def test_a_nonfinite_loss_puts_a_nan_into_the_anchor_gradient_and_a_finite_one_changes_nothing(
    on_host,
):
    # on_host=False is the accelerator path (no read of the value); both must agree on the CPU.
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    anchor = torch.tensor([[5.0, 6.0]], requires_grad=True)

    def grads(loss):
        w.grad = anchor.grad = None
        loss.backward()
        return w.grad, anchor.grad

    gw, ga = grads(_nan_gradient_if_nonfinite((w * 3).sum() * anchor.sum(), anchor, on_host))
    assert torch.equal(gw, torch.tensor([33.0, 33.0])) and torch.equal(
        ga, torch.tensor([[9.0, 9.0]])
    )
    # Controls: a non-finite loss can have finite gradients (inf added; NaN behind a ReLU that masks
    # it).
    assert torch.isfinite(grads((w * 3).sum() + float("inf"))[0]).all()
    masked = torch.relu(-w).sum() * float("nan")
    assert torch.isfinite(grads(masked)[0]).all()
    for bad in ((w * 3).sum() + float("inf"), torch.relu(-w).sum() * float("nan")):
        _, ga = grads(_nan_gradient_if_nonfinite(bad, anchor, on_host))
        assert torch.isnan(ga[0, 0])


def _all_finite(tensors: list) -> bool:
    return _FiniteCheck(tensors)(tensors)


def test_all_finite_reads_every_tensor_of_every_dtype_and_changes_none():
    tensors = [
        torch.randn(5),
        torch.randn(3, dtype=torch.bfloat16),
        torch.randn(2, dtype=torch.float64),
    ]
    before = [t.clone() for t in tensors]
    assert _all_finite(tensors) and all(torch.equal(a, b) for a, b in zip(tensors, before))
    for i, bad in [(0, float("nan")), (1, float("inf")), (2, float("-inf"))]:
        broken = [t.clone() for t in tensors]
        broken[i][-1] = bad
        assert not _all_finite(broken)


@pytest.mark.parametrize(
    "kind", ["one dtype", "mixed dtypes", "sparse", "complex", "sparse among dense"]
)
def test_a_finite_check_kept_from_step_to_step_forgets_a_bad_step(kind):
    """The check keeps its flag from one call to the next: a bad step must not stick, whichever
    path found it (one fused call; the grouped one, for mixed dtypes, complex parameters, and sparse
    gradients after the fused kernel refused them)."""

    def make(bad: bool) -> list:
        dense = [torch.randn(4), torch.randn(3)]
        if bad:
            dense[1][0] = float("nan")
        return {
            "one dtype": dense,
            "mixed dtypes": [dense[0], dense[1].double()],
            "sparse": [dense[0].to_sparse(), dense[1].to_sparse()],
            "complex": [dense[0], torch.complex(dense[1], dense[1])],
            "sparse among dense": [dense[0], dense[1].to_sparse()],
        }[kind]

    good, bad = make(False), make(True)
    check = _FiniteCheck([t.to_dense() for t in good])
    assert [check(good), check(bad), check(good), check(bad)] == [True, False, True, False]
    # Control: the flag is read as the last call left it (not zeroed before each call), so one left
    # set would call the good step bad. (A sparse gradient, refused by the fused kernel, clears it
    # on its way to the grouped path.)
    if "sparse" not in kind:
        for flag, _ in check._flags.values():
            flag.fill_(1.0)
        assert check(good) is False


def test_a_sparse_gradient_is_refused_by_the_fused_kernel_once_not_every_step(monkeypatch):
    """nn.Embedding(sparse=True) has a dense parameter and a sparse gradient: the fused call is
    tried on the parameters' word and refused; from then on the grouped path goes first (a refusal
    costs tens of us: torch's error message is kilobytes)."""
    import ddpkit.strategies._ddp as ddp_module

    refused = []
    real = ddp_module.any_non_finite

    def counted(group, flag, one):
        try:
            return real(group, flag, one)
        except NotImplementedError:
            refused.append(1)
            raise

    monkeypatch.setattr(ddp_module, "any_non_finite", counted)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    linear = torch.nn.Linear(4, 1)
    params = [embedding.weight, *linear.parameters()]
    check = _FiniteCheck(params)

    def step(bad: bool) -> list:
        for p in params:
            p.grad = None
        out = linear(embedding(torch.tensor([1, 2, 3]))).sum()
        (out * float("nan") if bad else out).backward()
        assert embedding.weight.grad.is_sparse
        return [p.grad for p in params]

    assert [check(step(False)), check(step(True)), check(step(False))] == [True, False, True]
    assert len(refused) == 1
    # Control: a check that tries the fused call every step is refused every step.
    again = _FiniteCheck(params)
    for _ in range(3):
        again._one_group = True
        again(step(False))
    assert len(refused) == 4


@pytest.mark.parametrize("on_host", [True, False])
def test_loss_window_keeps_taken_steps_and_drops_skipped_ones(on_host):
    window = _LossWindow(on_host)
    window.add(torch.tensor(2.0), 4)  # step 1: two micro-batches, taken
    window.add(torch.tensor([1.0]), 2)
    window.end_step(taken=True)
    window.add(torch.tensor(float("nan")), 3)  # step 2: skipped
    assert not window.step_is_finite()
    window.end_step(taken=False)
    window.add(torch.tensor(0.5, dtype=torch.bfloat16), 4)  # step 3: taken
    assert window.step_is_finite()
    window.end_step(taken=True)
    assert window.steps == 2 and window.tried == 3 and sum(window.sizes) == 10
    total = window.local_sum(torch.device("cpu"))
    assert total.dtype == torch.float64 and total.item() == 2.0 * 4 + 1.0 * 2 + 0.5 * 4


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({}, "batch_size"),
        ({"batch_size": 4, "global_batch_size": 8}, "batch_size"),
        ({"batch_size": 4, "precision": "fp8"}, "precision"),
        ({"batch_size": 4, "grad_accum_steps": 0}, "grad_accum_steps"),
        ({"batch_size": 4, "on_nonfinite": "ignore"}, "on_nonfinite"),
    ],
)
def test_config_errors_name_the_option(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainerConfig(**kwargs)


def test_global_batch_must_divide(tmp_path):
    with pytest.raises(ConfigError, match="pick a multiple of 6"):
        TrainerConfig(global_batch_size=20, grad_accum_steps=2).per_rank_batch(3)


def test_plain_python_trainer_clips_gradients(tmp_path):
    # A world of one with no process group, as under `python train.py`; SGD so the update is lr x
    # gradient.
    def one_step(clip):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        start = [p.detach().clone() for p in model.parameters()]
        data = torch.utils.data.TensorDataset(torch.randn(8, 4) * 100, torch.randn(8, 1))
        config = TrainerConfig(
            run_dir=str(tmp_path / f"clip{clip}"),
            batch_size=8,
            max_steps=1,
            clip_grad_norm=clip,
            logging=LoggingConfig(progress=False),
            num_workers=0,
        )
        trainer = ddpkit.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            data,
            config,
            loss_fn=torch.nn.functional.mse_loss,
        )
        trainer.fit()
        return (
            torch.cat([(p.detach() - s).flatten() for p, s in zip(model.parameters(), start)])
            .norm()
            .item()
        )

    assert one_step(None) > 1.0  # control: the raw gradient is large
    assert one_step(1e-3) == pytest.approx(1e-3, rel=1e-4)


def _regression_trainer(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    config = TrainerConfig(
        run_dir=str(tmp_path / "run"),
        batch_size=8,
        epochs=1,
        logging=LoggingConfig(progress=False),
        num_workers=0,
    )
    return (
        model,
        data,
        ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config, **kwargs),
    )


def test_the_default_loss_refuses_a_regression_model(tmp_path):
    model, data, trainer = _regression_trainer(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"shape \(8, 1\).*loss_fn=torch.nn.functional.mse_loss and "
        r"metric_fn=ddpkit.regression_metrics",
    ):
        trainer.fit()
    with pytest.raises(
        ConfigError, match=r"classification_metrics .*pass metric_fn=ddpkit.regression_metrics"
    ):
        ddpkit.evaluate(model, data)
    assert set(ddpkit.evaluate(model, data, ddpkit.regression_metrics)) == {"loss"}
    # Control: plain cross-entropy takes it without a word, and trains nothing (loss 0, weights
    # unchanged).
    model, _, trainer = _regression_trainer(
        tmp_path / "control",
        loss_fn=torch.nn.functional.cross_entropy,
        metric_fn=ddpkit.regression_metrics,
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_default_loss_refuses_float_targets_and_a_dict_output(tmp_path):
    from ddpkit.training._evaluation import cross_entropy

    scores = torch.randn(4, 3)
    with pytest.raises(ConfigError, match="targets are float32 of shape \\(4,\\)"):
        cross_entropy(scores, torch.randn(4))
    with pytest.raises(ConfigError, match="returned a dict \\(logits\\): pass batch_loss_fn"):
        cross_entropy({"logits": scores}, torch.zeros(4, dtype=torch.long))

    # The same through the Trainer: a model whose forward returns a dict is pointed to
    # batch_loss_fn.
    class DictNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            return {"logits": self.linear(x)}

    model = DictNet()
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    config = TrainerConfig(
        run_dir=str(tmp_path / "dict"),
        batch_size=8,
        logging=LoggingConfig(progress=False),
        num_workers=0,
    )
    trainer = ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config)
    with pytest.raises(ConfigError, match="returned a dict \\(logits\\): pass batch_loss_fn"):
        trainer.fit()
    # Controls: class indices, and class probabilities shaped like the scores, are what
    # cross-entropy takes.
    assert cross_entropy(scores, torch.tensor([0, 2, 1, 0])).item() > 0
    assert cross_entropy(scores, torch.softmax(torch.randn(4, 3), 1)).item() > 0


def test_an_iterable_dataset_is_refused_saying_what_is_supported(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(3), 0)] * 8)

    config = TrainerConfig(
        run_dir=str(tmp_path / "run"),
        batch_size=4,
        logging=LoggingConfig(progress=False),
        num_workers=0,
    )
    model = torch.nn.Linear(3, 2)
    with pytest.raises(
        ConfigError, match="Stream is not a map-style dataset .* Wrap it in a stream"
    ):
        ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), Stream(), config)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"global_batch_size": 0}, "global_batch_size=0"),
        (
            {"global_batch_size": 10, "grad_accum_steps": 3},
            "does not divide into grad_accum_steps=3",
        ),
        ({"batch_size": 4, "logging": None}, "logging"),
        ({"batch_size": 4, "num_workers": -1}, "num_workers"),
    ],
)
def test_batch_sizes_that_cannot_work_are_refused_by_the_config(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainerConfig(**kwargs)


@pytest.mark.parametrize(
    "build, flag",
    [
        (lambda: LoggingConfig(every_steps=0), "every_steps"),
        (lambda: LoggingConfig(trackers=("neptune",)), "trackers"),
        (lambda: SnapshotConfig(keep=0), "keep"),
        (lambda: SnapshotConfig(every_steps=0), "every_steps"),
        (lambda: EarlyStoppingConfig(mode="lowest"), "mode"),
        (lambda: EarlyStoppingConfig(patience=0), "patience"),
    ],
)
def test_the_nested_configs_refuse_bad_values_naming_them(build, flag):
    # a value of the right type out of range: see the field; of another kind: what it takes
    with pytest.raises(ConfigError, match=f"{flag}=.*( see .*Config.{flag}|: {flag} takes )"):
        build()


def test_a_fresh_run_replaces_a_stale_best_and_a_resumed_one_keeps_it(tmp_path):
    from ddpkit.training._validation import BestWeights

    path = tmp_path / "best.pt"
    model = torch.nn.Linear(2, 2)
    BestWeights(path, "val/loss", "min", enabled=True).update(
        {"val/loss": 0.1}, model.state_dict, 3, 30
    )
    fresh = BestWeights(path, "val/loss", "min", enabled=True)  # a new run, no snapshot to resume
    assert fresh.update({"val/loss": 0.5}, model.state_dict, 1, 10)
    assert torch.load(path, weights_only=True)["value"] == 0.5
    resumed = BestWeights(path, "val/loss", "min", enabled=True)
    # resumed: 0.5 is the best so far; 0.5 again (an epoch redone after a crash) is not better
    resumed.load()
    assert not resumed.update({"val/loss": 0.5}, model.state_dict, 1, 10)
    assert resumed.update({"val/loss": 0.4}, model.state_dict, 2, 20)


class _DictBatches(torch.utils.data.Dataset):
    """Samples as dicts, as a tokenizer or a dict-returning dataset gives them."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        return {
            k: torch.full((3,), float(i)) if k != "labels" else torch.tensor(i % 2)
            for k in self.keys
        }


@pytest.mark.parametrize("keys", [("inputs", "labels"), ("input_ids", "attention_mask", "labels")])
def test_a_dict_batch_with_the_default_loss_asks_for_batch_loss_fn_at_the_first_batch(
    tmp_path, keys
):
    model = torch.nn.Linear(3, 2)
    # No loader workers: pytest keeps the error's traceback, and with it a loader whose workers (a
    # process each) would be shut down whenever a garbage collection finds them, in a later test, in
    # whatever thread runs it.
    config = TrainerConfig(
        run_dir=str(tmp_path / "run"),
        batch_size=4,
        num_workers=0,
        logging=LoggingConfig(progress=False),
    )
    trainer = ddpkit.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _DictBatches(keys), config
    )
    seen = []
    trainer.model.register_forward_pre_hook(lambda *_: seen.append(1))
    # Before: with 2 keys the keys themselves were unpacked and failed inside linear(); with 3, "too
    # many values".
    with pytest.raises(
        ConfigError, match=re.escape(f"a dict with keys {list(keys)}") + ".*pass batch_loss_fn="
    ) as err:
        trainer.fit()
    # at once: no forward ran
    assert "\n" not in str(err.value) and seen == [] and trainer.step == 0
    # Control: the same batches with a batch_loss_fn train.
    model = torch.nn.Linear(3, 2)
    config = TrainerConfig(
        run_dir=str(tmp_path / "ok"),
        batch_size=4,
        num_workers=0,
        logging=LoggingConfig(progress=False),
    )

    def batch_loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[keys[0]]), batch["labels"])

    trainer = ddpkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _DictBatches(keys),
        config,
        batch_loss_fn=batch_loss_fn,
    )
    trainer.fit()
    assert trainer.step == 4


def test_pairs_of_tensors_or_sequences_are_the_default_losss_batches():
    from ddpkit.training._evaluation import inputs_and_targets

    x, y = torch.zeros(2, 3), torch.zeros(2)
    assert inputs_and_targets((x, y), "") == (x, y) and inputs_and_targets([[x, x], y], "")[0] == [
        x,
        x,
    ]
    # inputs for a model that takes a dict
    assert inputs_and_targets(({"a": x}, y), "")[0] == {"a": x}
    for batch, what in [
        ((x, y, y), r"a tuple of 3 \(Tensor, Tensor, Tensor\)"),
        (x, "a Tensor"),
        (("ab", y), r"a tuple of 2 \(str, Tensor\)"),
        ((x, {"y": y}), r"a tuple of 2 \(Tensor, dict\)"),
    ]:
        with pytest.raises(ConfigError, match=f"the batch is {what}, not an"):
            inputs_and_targets(batch, "")


def test_seed_samples_false_gives_the_trainer_a_plain_loader(tmp_path):
    from ddpkit.data import SeededSamples

    class Plain(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int):
            return torch.zeros(3), 0

    def trainer(**kwargs):
        model = torch.nn.Linear(3, 2)
        config = TrainerConfig(run_dir=str(tmp_path), batch_size=4, num_workers=0, **kwargs)
        return ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), Plain(), config)

    data = Plain()
    assert not isinstance(trainer(seed_samples=False).loader.dataset, SeededSamples)
    assert isinstance(trainer().loader.dataset, SeededSamples)  # the default keeps the guarantee
    assert len(data) == 16


def test_a_run_stopped_by_max_steps_inside_an_epoch_validates_where_it_stops(tmp_path):
    import json

    torch.manual_seed(0)
    x = torch.randn(64, 3)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
    val = torch.utils.data.TensorDataset(x[:20], (x[:20].sum(1) > 0).long())

    def run(name: str, val_data):
        model = torch.nn.Linear(3, 2)
        config = TrainerConfig(
            run_dir=str(tmp_path / name),
            batch_size=4,
            epochs=3,
            max_steps=5,  # epoch 0 has 16 steps: the run stops inside it
            num_workers=0,
            early_stopping=EarlyStoppingConfig(metric="val/loss", patience=2),
            logging=LoggingConfig(progress=False),
        )
        trainer = ddpkit.Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, config, val_data=val_data
        )
        return trainer, trainer.fit(), model

    trainer, last, model = run("run", val)
    assert (trainer.epoch, trainer.step, str(trainer.stopped_by)) == (0, 5, "max_steps")
    # Before: no val metrics, no best.pt, no early-stopping count, although val_data was given.
    assert last["val/loss"] == pytest.approx(
        ddpkit.evaluate(model, val)["loss"]
    )  # the weights it stopped with
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    assert (best["value"], best["step"]) == (pytest.approx(last["val/loss"]), 5)
    assert trainer.early_stopping.best == pytest.approx(last["val/loss"])
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["val/loss"] for r in records if r["kind"] == "val"] == [
        pytest.approx(last["val/loss"])
    ]
    # Control: without val_data there is nothing to validate, and no best.pt.
    _, last, _ = run("control", None)
    assert "val/loss" not in last and not (tmp_path / "control" / "best.pt").exists()


def test_a_trainer_is_freed_when_its_last_reference_goes_without_a_garbage_collection(tmp_path):
    # A Trainer in a reference cycle lives on until a collection, with its loader's worker
    # processes, which that collection then shuts down in whatever thread it runs (a snapshot
    # writer's, stalling it for seconds).
    import gc
    import weakref

    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
    model = torch.nn.Linear(4, 2)
    config = TrainerConfig(
        run_dir=str(tmp_path),
        batch_size=8,
        epochs=1,
        val_every_steps=4,
        logging=LoggingConfig(progress=False),
    )
    trainer = ddpkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        config,
        val_data=data,
        callbacks=[ddpkit.Callback()],
    )
    # validation and callbacks used, loader workers started (one per rank on this machine)
    trainer.fit()
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None
    finally:
        gc.enable()


def _stopped_inside_an_epoch(tmp_path, val_data) -> dict:
    from ddpkit.training._trainer import Trainer, TrainerConfig

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    model = torch.nn.Linear(4, 2)
    config = TrainerConfig(
        run_dir=str(tmp_path),
        epochs=3,
        max_steps=12,
        batch_size=4,
        num_workers=0,
        logging=LoggingConfig(progress=False),
    )
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, config, val_data=val_data
    ).fit()


def test_max_steps_inside_an_epoch_returns_the_last_epochs_metrics_without_validation_data(
    tmp_path,
):
    # 8 steps an epoch: step 12 is inside the second epoch, which never ends.
    last = _stopped_inside_an_epoch(tmp_path / "a", None)
    assert last["epoch"] == 1 and last["step"] == 8 and "train/epoch_loss" in last
    # Control: with validation data the run validates where it stopped, and returns that.
    val = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    last = _stopped_inside_an_epoch(tmp_path / "b", val)
    assert last["step"] == 12 and "val/loss" in last
