"""Every field of every typed config refuses a value of another type in words: the config, the
field, the value and what it takes (``None`` where it means off), never a bare ``TypeError`` from
inside ddpkit (argparse's strings, ``None`` for "off" where a number is needed)."""

from __future__ import annotations

import dataclasses
import inspect

import ddpkit._errors as errors
from ddpkit import (
    DDPConfig,
    EarlyStoppingConfig,
    FSDPConfig,
    LoggingConfig,
    SnapshotConfig,
    TrainerConfig,
    ZeroConfig,
)
from ddpkit._errors import ConfigError, _hints, _matches
from ddpkit.search import SearchConfig
from ddpkit.tools._bench import BenchConfig
from ddpkit.tools._check import CheckConfig

CONFIGS = [
    TrainerConfig, SnapshotConfig, EarlyStoppingConfig, LoggingConfig, DDPConfig, ZeroConfig,
    FSDPConfig, SearchConfig, BenchConfig, CheckConfig,
]  # fmt: skip
REQUIRED = {
    TrainerConfig: {"batch_size": 8},
    SearchConfig: {"n_trials": 2},
    BenchConfig: {},
    CheckConfig: {},
}
WRONG = ["3", None, True, 2.5, {"a": 1}, object()]


def _cases() -> list[tuple[type, str, object]]:
    found = []
    for cls in CONFIGS:
        for name, hint in _hints(cls).items():
            for value in WRONG:
                if not _matches(value, hint):
                    found.append((cls, name, value))
    return found


CASES = _cases()


def _build(cls: type, **kwargs: object) -> object:
    base = dict(REQUIRED.get(cls, {}))
    return cls(**(base | kwargs))


def test_the_cases_cover_every_field_of_every_config():
    fields = {(c, f.name) for c in CONFIGS for f in dataclasses.fields(c) if f.init}
    covered = {(cls, name) for cls, name, _ in CASES}
    assert fields - covered == set(), sorted((c.__name__, n) for c, n in fields - covered)


def test_a_value_of_another_type_is_refused_naming_the_field_and_what_it_takes():
    wrong = []
    for cls, name, value in CASES:
        try:
            _build(cls, **{name: value})
            wrong.append(f"{cls.__name__}({name}={value!r}): accepted")
        except ConfigError as refused:
            if not str(refused).startswith(f"{cls.__name__}({name}=") or " takes " not in str(
                refused
            ):
                wrong.append(f"{cls.__name__}({name}={value!r}): {refused}")
        except Exception as err:  # noqa: BLE001  (anything else is the defect)
            wrong.append(f"{cls.__name__}({name}={value!r}): {type(err).__name__}: {err}")
    assert not wrong, "\n".join(wrong)
    assert len(CASES) > 400


def test_control_without_the_type_check_some_values_end_in_a_bare_type_error(monkeypatch):
    monkeypatch.setattr(errors, "check_types", lambda config: None)
    for module in ("ddpkit.training._config", "ddpkit.snapshot._state"):
        monkeypatch.setattr(f"{module}.check_types", lambda config: None)
    bare = []
    for make in (
        lambda: SnapshotConfig(every_epochs=None),
        lambda: SnapshotConfig(every_steps="5"),
        lambda: TrainerConfig(batch_size=8, epochs="3"),
    ):
        try:
            make()
        except TypeError:
            bare.append(make)
    assert len(bare) == 3  # what the users met


def test_the_front_doors_refuse_numbers_flags_and_names_of_another_type_in_words(tmp_path):
    import torch

    from ddpkit import Snapshots, build_loader

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    doors = {
        "Snapshots": (
            Snapshots.__init__,
            lambda **kw: Snapshots(tmp_path / "run", model=model, optimizer=optimizer, **kw),
        ),
        "build_loader": (build_loader, lambda **kw: build_loader(data, **({"batch_size": 2} | kw))),
    }
    wrong, tried = [], 0
    for door, (fn, call) in doors.items():
        for name, hint in errors._argument_hints(inspect.unwrap(fn)).items():
            for value in WRONG:
                if _matches(value, hint):
                    continue
                tried += 1
                try:
                    call(**{name: value})
                    wrong.append(f"{door}({name}={value!r}): accepted")
                except ConfigError as refused:
                    if not str(refused).startswith(f"{door}({name}="):
                        wrong.append(f"{door}({name}={value!r}): {refused}")
                except Exception as err:  # noqa: BLE001  (anything else is the defect)
                    wrong.append(f"{door}({name}={value!r}): {type(err).__name__}: {err}")
    assert not wrong, "\n".join(wrong)
    assert tried > 60
    # control: unchecked, a string batch size ends in a bare TypeError inside ddpkit
    from ddpkit.data import ShardedBatchSampler

    try:
        inspect.unwrap(ShardedBatchSampler.__init__)(object.__new__(ShardedBatchSampler), 8, "2")
    except TypeError as bare:
        assert "not supported between" in str(bare)
    else:
        raise AssertionError("an unchecked sampler took batch_size='2'")


# called every step or batch: a check of their arguments would cost each one
HOT = {"all_reduce", "broadcast_object", "to_device", "get_runtime", "EpochIndices", "shard_bounds"}
# its own check names torch's argument order (mp.spawn takes args second); made by ddpkit, not users
OWN_CHECK = {"spawn", "Preempted", "Candidate"}


def test_every_public_callable_with_number_flag_or_name_arguments_checks_them():
    import ddpkit
    import ddpkit.data
    import ddpkit.nn
    import ddpkit.search
    import ddpkit.snapshot
    import ddpkit.strategies
    import ddpkit.tracking

    unchecked = []
    for module in (ddpkit, ddpkit.data, ddpkit.nn, ddpkit.search, ddpkit.snapshot,
                   ddpkit.strategies, ddpkit.tracking):  # fmt: skip
        for name in module.__all__:
            obj = getattr(module, name)
            if dataclasses.is_dataclass(obj) or name in HOT | OWN_CHECK:
                continue  # a config: check_types
            fn = obj.__init__ if inspect.isclass(obj) else obj
            if not callable(fn) or not errors._argument_hints(inspect.unwrap(fn)):
                continue
            if not any(
                getattr(f, "__code__", None) is errors.checked_arguments(len).__code__
                for f in (fn, getattr(fn, "__wrapped__", None))
            ):
                unchecked.append(f"{module.__name__}.{name}")
    assert not unchecked, ", ".join(unchecked)
