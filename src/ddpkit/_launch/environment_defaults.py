"""``ddpkit run``'s options from what a platform set in the environment (each platform's
``launch_defaults``, :func:`ddpkit.platforms.launch_defaults`: today a Kubernetes operator's
``PET_*``, torchrun's names, and JobSet's ``JOB_COMPLETION_INDEX``, read by
:mod:`ddpkit.platforms._kubernetes`), added to the command line where the user typed none, and said
once at launch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ddpkit import platforms
from ddpkit._launch import options
from ddpkit.platforms import _kubernetes as kubernetes


def typed_options(ours: Sequence[str], value_options: set[str] | None = None) -> dict[str, str]:
    """The value options typed in ``ours`` (``--opt value`` or ``--opt=value``), option -> value as
    typed."""
    value_options = options.value_options() if value_options is None else value_options
    typed, i = {}, 0
    while i < len(ours) - 1:  # the last token is the script
        name, eq, value = ours[i].partition("=")
        if name in value_options:
            typed[name] = value if eq else ours[i + 1]
            i += 0 if eq else 1
        i += 1
    return typed


def with_environment_defaults(
    ours: list[str], env: Mapping[str, str]
) -> tuple[list[str], str | None]:
    """``ours`` with the options a Kubernetes operator set for torchrun (``PET_*``; JobSet's
    ``JOB_COMPLETION_INDEX``) added where the user gave none, and the line that says so (None if
    none). A value the user typed that disagrees with the operator's is refused, naming both
    (:func:`ddpkit.platforms._kubernetes.resolve_options`)."""
    defaults = platforms.launch_defaults(env)
    if not defaults:
        return ours, None
    added, taken = kubernetes.resolve_options(typed_options(ours), defaults)
    extra = [token for option, value in added.items() for token in (option, value)]
    return ours[:-1] + extra + ours[-1:], kubernetes.summary(taken, env) if taken else None
