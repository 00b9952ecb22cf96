"""``PET_*`` values, parsed one way (:func:`ddpkit.platforms._kubernetes.pet_value`) by
``ddpkit run`` and by ``ddpkit.init()``: a bad one is a one-line ConfigError naming the variable and
its value, never a ValueError traceback, and a digit of another script is not read as a number."""

from __future__ import annotations

import os

import pytest

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit._launch.cli.options import with_environment_defaults
from ddpkit.distributed import _runtime as runtime
from ddpkit.distributed._environment import read_launch_env
from ddpkit.platforms import _kubernetes as k8s

# the operators' pods
from tests.unit.platforms.pods import PYTORCHJOB_WORKER, TRAINJOB_NODE

# "\u0663" is ARABIC-INDIC DIGIT THREE (int() reads it as 3), "\u00b2" SUPERSCRIPT TWO (isdigit()
# says yes, int() raises), "\uff11" FULLWIDTH DIGIT ONE.
BAD = ["\u0663", "\u00b2", "\uff11", "+2", "-1", "", " ", "1 2", "0x2", "2\n3"]
NAMES = ["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MAX_RESTARTS", "PET_MASTER_PORT"]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", NAMES)
def test_a_bad_value_is_one_line_naming_the_variable_and_its_value(name, value):
    with pytest.raises(ConfigError) as info:
        k8s.pet_value({name: value}, name)
    message = str(info.value)
    assert message.startswith(f"{name}={value!a}, set in this pod's environment: use ")
    assert "\n" not in message


@pytest.mark.parametrize("value", BAD)
def test_ddpkit_run_and_init_refuse_it_the_same_way(value, monkeypatch):
    match = "PET_NPROC_PER_NODE=.*, set in this pod's environment"
    with pytest.raises(ConfigError, match=match):  # ddpkit run
        with_environment_defaults(["train.py"], TRAINJOB_NODE | {"PET_NPROC_PER_NODE": value})
    # ddpkit.init() in a PyTorchJob pod, without torchrun
    with pytest.raises(ConfigError, match=match):
        read_launch_env(PYTORCHJOB_WORKER | {"PET_NPROC_PER_NODE": value})
    monkeypatch.setattr(
        os, "environ", TRAINJOB_NODE | {"PET_NNODES": "1", "PET_NPROC_PER_NODE": value}
    )
    try:  # ddpkit.init() alone in a TrainJob's pod
        with pytest.raises(ConfigError, match=match):
            ddpkit.init()
    finally:
        runtime.forget()
    with pytest.raises(ConfigError, match="PET_NNODES=.*, set in this pod's environment"):
        with_environment_defaults(["train.py"], TRAINJOB_NODE | {"PET_NNODES": f"1:{value}"})


def test_the_forms_torchrun_takes_are_taken():
    # Control for the refusals: ASCII numbers (spaces around them, leading zeros), words, MIN:MAX.
    assert k8s.pet_value({"PET_NPROC_PER_NODE": " 02 "}, "PET_NPROC_PER_NODE") == "02"
    assert k8s.pet_value({"PET_NPROC_PER_NODE": "auto"}, "PET_NPROC_PER_NODE") == "auto"
    assert k8s.pet_value({"PET_NNODES": "1:3"}, "PET_NNODES") == "1:3"
    assert k8s.pet_value({}, "PET_NNODES") is None
    info = read_launch_env(PYTORCHJOB_WORKER | {"PET_NPROC_PER_NODE": "1"})
    assert (info.rank, info.world_size, info.launcher) == (2, 3, "pytorchjob")
    ours, _ = with_environment_defaults(
        ["train.py"], TRAINJOB_NODE | {"PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "29500"}
    )
    assert "m:29500" in ours


def _mains_one_process(nproc: str) -> bool:
    """How main read PET_NPROC_PER_NODE in a PyTorchJob pod (kubernetes._one_process before
    pet_value)."""
    return not nproc.strip().isdigit() or int(nproc) == 1


def test_control_mains_parse_raises_a_bare_valueerror_or_takes_a_digit_of_another_script():
    # a traceback out of ddpkit.init()
    with pytest.raises(ValueError, match="invalid literal for int"):
        _mains_one_process("\u00b2")
    assert _mains_one_process("\uff11")  # fullwidth one: taken as 1, the pod runs
    assert not _mains_one_process("\u0663")  # Arabic-Indic three: taken as 3
