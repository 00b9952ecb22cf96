"""examples/gan.py as the kill test runs it: ``python gan_job.py OUT KILL_RANK
KILL_STEP FORGET -- <its args>``.

The example runs unchanged; its Trainer gets one more callback, which SIGKILLs this process after
step ``KILL_STEP`` on rank ``KILL_RANK`` on the first attempt (a negative step: never), and each
rank ``r`` writes both models' and both optimizers' final state, the step and the attempt to
``OUT.rank<r>``. ``FORGET`` 1: the control, a resume that restores everything but the
discriminator's optimizer state.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import torch

import ddpkit

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gan.py"
out, kill_rank, kill_step, forget = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4] == "1",
)


class Kill:
    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        rt = trainer.runtime
        if rt.restart_count == 0 and rt.rank == kill_rank and trainer.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


class Recorded(ddpkit.Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs, callbacks=[Kill()])
        if forget:
            load = self.strategy.load_state_dict

            def load_without_d(state: dict[str, Any]) -> None:
                load(state)
                self.strategy.optimizers["d"].state.clear()  # type: ignore[attr-defined]

            self.strategy.load_state_dict = load_without_d  # type: ignore[method-assign]

    def fit(self) -> dict[str, float]:
        last = super().fit()
        state = {
            "strategy": self.strategy.full_state_dict(),
            "step": self.step,
            "attempt": self.runtime.restart_count,
            "resumed_from": self.resumed_from,
        }
        torch.save(state, f"{out}.rank{self.runtime.rank}")
        return last


ddpkit.Trainer = Recorded  # type: ignore[misc]
sys.argv = [str(EXAMPLE), *sys.argv[sys.argv.index("--") + 1 :]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
