"""The property tests' settings: one owner for how many examples a run draws.

The default run draws a fixed set (derandomized: a failure comes back the same each time);
``DDPKIT_FUZZ_EXAMPLES=2000`` draws that many fresh random examples, for a deeper run."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

DEEP = int(os.environ.get("DDPKIT_FUZZ_EXAMPLES", "0"))


def examples(default: int, *, shrink: bool = True) -> settings:
    """``default`` examples (``DDPKIT_FUZZ_EXAMPLES`` of them in a deep run), no deadline.
    ``shrink=False``: the default run skips shrinking; a deep run shrinks."""
    phases = list(Phase) if shrink or DEEP else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(
        max_examples=DEEP or default,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=not DEEP,
        phases=phases,
    )
