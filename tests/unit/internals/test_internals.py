"""The seam: each private name ddpkit relies on still has the shape it relies on (a failure names
the internal and the version), and the rest of the package touches no private code."""

from __future__ import annotations

import pytest

from ddpkit._internals import all_internals
from ddpkit._internals.contract import Internal, problem

INTERNALS = all_internals()


@pytest.mark.parametrize("internal", INTERNALS, ids=[i.name for i in INTERNALS])
def test_each_internal_has_the_shape_ddpkit_relies_on(internal: Internal) -> None:
    assert problem(internal) is None, problem(internal)


def test_a_changed_internal_is_reported_with_its_name_and_version() -> None:
    """Control: a check that finds a difference (or raises) is reported, naming the internal and
    torch's version."""
    import torch

    gone = Internal("torch.nowhere._gone", "torch", "nothing", lambda: "no such attribute")
    raising = Internal("torch.nowhere._raises", "torch", "nothing", lambda: 1 / 0)  # type: ignore[func-returns-value]
    for internal in (gone, raising):
        line = problem(internal)
        assert line is not None and internal.name in line and torch.__version__ in line
