"""Module paths that became private keep importing for one release, with a FutureWarning
(ddpkit._moved)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit._moved import private_path


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ddpkit.training.trainer", "ddpkit.training._trainer"),
        ("ddpkit.launch.agent", "ddpkit._launch.agent"),
        ("ddpkit.errors", "ddpkit._errors"),
        ("ddpkit.fs.safe", "ddpkit._fs.safe"),
        ("ddpkit.data.sample_seeding", "ddpkit.data._sample_seeding"),
    ],
)
def test_an_old_path_names_its_private_module(old, new):
    assert private_path(old) == new


@pytest.mark.parametrize(
    "name", ["ddpkit.training.nothing", "ddpkit.data._loader", "numpy.linalg", "ddpkit"]
)
def test_control_no_private_module_no_alias(name):
    assert private_path(name) is None


def test_an_old_import_works_with_a_warning_naming_the_new_place():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from ddpkit.training.trainer import Trainer\n"
        "    import ddpkit.launch.agent as agent\n"
        "import ddpkit, ddpkit._launch.agent\n"
        "assert Trainer is ddpkit.Trainer and agent is ddpkit._launch.agent\n"
        "messages = [str(w.message) for w in caught if w.category is FutureWarning]\n"
        "assert any('ddpkit.training._trainer' in m for m in messages), messages\n"
        "assert any('(ddpkit._launch)' in m for m in messages), messages\n"
        "try:\n"
        "    import ddpkit.training.nothing\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('a path that never existed imported')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
