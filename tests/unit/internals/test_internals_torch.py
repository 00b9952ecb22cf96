"""torch's internals behind ddpkit's seam: distributed checkpoint's storage, the scheduler's marks,
the fused inf/NaN check, and the compiler probe. Each check holds on this torch, and names what
differs when the shape it relies on changes (controls: the shape changed by hand)."""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import pytest
import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit._internals import compiler, dcp, optim
from ddpkit._internals.contract import problem


def _named(module: types.ModuleType, start: str) -> str | None:
    (internal,) = [i for i in module.INTERNALS if i.name.startswith(start)]
    return problem(internal)


@pytest.mark.parametrize("module", [dcp, optim, compiler])
def test_every_check_holds_on_this_torch(module):
    assert [problem(i) for i in module.INTERNALS] == [None] * len(module.INTERNALS)


def test_a_storage_info_with_other_fields_is_named(monkeypatch):
    from torch.distributed.checkpoint import filesystem

    @dataclasses.dataclass
    class Moved:
        path: str
        offset: int
        length: int

    monkeypatch.setattr(filesystem, "_StorageInfo", Moved)
    found = _named(dcp, "torch.distributed.checkpoint.filesystem._StorageInfo")
    assert found is not None and "_StorageInfo" in found and "['path', 'offset', 'length']" in found
    assert f"torch {torch.__version__}" in found


def test_a_writer_without_its_file_system_attribute_is_named(monkeypatch):
    import torch.distributed.checkpoint as dcp_api

    class Renamed(dcp_api.FileSystemWriter):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self._fs = self.__dict__.pop("fs")

    monkeypatch.setattr(dcp_api, "FileSystemWriter", Renamed)
    found = _named(dcp, "torch.distributed.checkpoint.FileSystemWriter.fs")
    assert found is not None and "FileSystemWriter's .fs is NoneType" in found


def test_an_overridden_method_with_other_arguments_is_named(monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    monkeypatch.setattr(FileSystem, "rename", lambda self, src, dst: None)
    found = _named(dcp, "torch.distributed.checkpoint.filesystem.FileSystem")
    assert found is not None and "FileSystem.rename takes (src, dst), not (path, new_path)" in found


def test_a_renamed_scheduler_mark_is_named(monkeypatch):
    monkeypatch.setattr(optim, "_MARK", "_marked_by_scheduler")
    found = _named(optim, "torch.optim.lr_scheduler")
    assert (
        found is not None
        and "no longer marks its optimizer's step with _marked_by_scheduler" in found
    )


def _scheduler_warnings(rebind: bool) -> list[str]:
    old = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(old, step_size=1)
    new = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler.optimizer = new
    if rebind:
        optim.mark_stepped_like(old, new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new.step()
        scheduler.step()
    return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_a_scheduler_moved_to_another_optimizer_does_not_warn_that_it_stepped_first():
    assert _scheduler_warnings(rebind=True) == []
    assert _scheduler_warnings(rebind=False)  # control: without the marks, torch warns


@pytest.mark.parametrize(
    ("values", "finite"),
    [([1.0, 2.0], True), ([1.0, float("inf")], False), ([float("nan")], False)],
)
def test_the_fused_check_flags_inf_and_nan(values, finite):
    flag, one = torch.zeros(1), torch.ones(1)
    assert optim.any_non_finite([torch.tensor(values), torch.ones(3)], flag, one) is not finite


@pytest.fixture
def probe_gone(monkeypatch):
    """torch's compiler probe removed, as a release that moves it would."""
    monkeypatch.setitem(
        sys.modules, "torch._inductor.cpp_builder", types.ModuleType("torch._inductor.cpp_builder")
    )


def test_a_missing_compiler_probe_is_named_with_torchs_version_not_taken_for_no_compiler(
    probe_gone,
):
    from ddpkit.training._step import compile_for_training

    with pytest.raises(ConfigError) as caught:
        compile_for_training(nn.Linear(2, 2), torch.device("cpu"))
    message = str(caught.value)
    assert (
        "torch._inductor.cpp_builder.get_cpp_compiler" in message
        and f"torch {torch.__version__}" in message
    )
    assert "none was found" not in message
    found = _named(compiler, "torch._inductor.cpp_builder.get_cpp_compiler")
    assert found is not None and "cannot import it" in found


def test_no_compiler_found_is_still_said_as_such(monkeypatch):
    """Control: where the probe is there and finds no compiler, the message is the one naming
    g++."""
    from ddpkit.training._step import compile_for_training

    def none_found() -> str:
        raise RuntimeError("no C++ compiler")

    module = types.ModuleType("torch._inductor.cpp_builder")
    module.get_cpp_compiler = none_found  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._inductor.cpp_builder", module)
    assert compiler.cpp_compiler() is None
    with pytest.raises(ConfigError, match="needs a C.. compiler .* none was found: install g"):
        compile_for_training(nn.Linear(2, 2), torch.device("cpu"))
