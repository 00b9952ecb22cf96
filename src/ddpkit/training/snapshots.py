"""The Trainer's snapshots: what a snapshot holds, how a run resumes from one, and the run's config record.

A snapshot is ``run_dir/snapshots/step-N/`` (:mod:`ddpkit.snapshot.manager`): each rank's part of the model and
optimizer through :mod:`torch.distributed.checkpoint` (shards under zero and fsdp, so it reshards on load; each
rank's own buffers under its own name), and from rank 0 the rest: scheduler, scaler, counters, every rank's RNG
states, the config. A resume is refused, naming each difference, before any tensor is read when the config,
the optimizer's hyper-parameters, the model's shapes or the classes of its modules differ from the snapshot's.
At the same world size every rank gets its own buffers and RNG states back and the run continues bit for bit;
at another, every rank takes rank 0's buffers and the random streams are reseeded from (seed, step, rank).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ddpkit.distributed.collectives import gather_object
from ddpkit.distributed.seeding import rng_state, set_rng_state, stream_seed
from ddpkit.errors import ConfigError
from ddpkit.nn.prepare import unwrap
from ddpkit.snapshot import files as run_files
from ddpkit.snapshot import run_dir as run_dir_lib
from ddpkit.snapshot.manager import SnapshotManager, folder_name


class TrainerSnapshots:
    """The snapshot half of :class:`~ddpkit.Trainer`, kept in its own module; it reads the Trainer's state
    (``strategy``, ``scheduler``, ``scaler``, ``sampler``, the counters) and writes through ``_snapshots``."""

    _snapshots: SnapshotManager
    _saved_at: tuple[int, int, int] | None
    run_dir: Path

    def _write_config(self) -> None:
        if not self.runtime.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resolved = asdict(self.config) | {
            "world_size": self.runtime.world_size,
            "per_rank_batch": self.sampler.batch_size,
            "backend": self.runtime.backend,
            "device": str(self.runtime.device),
            "torch": torch.__version__,
        }
        text = json.dumps(resolved, indent=2, default=str) + "\n"
        run_files.write_atomic(self.run_dir / "config.json", text.encode())

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step needs. ``strategy``: model and optimizer, each rank's own part (shards under
        zero and fsdp), for :mod:`torch.distributed.checkpoint`; the rest is the same on every rank, or gathered.
        Collective: every rank calls it (RNG states are gathered)."""
        per_rank = {"rng": rng_state(), "loader_generator": self.generator.get_state()}
        return {
            "strategy": self.strategy.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "trainer": {
                "epoch": self.epoch,
                "step": self.step,
                "cursor": self.cursor,
                "best": self.best,
                "bad_epochs": self.bad_epochs,
                "skipped_steps": self.skipped_steps,
            },
            "ranks": gather_object(per_rank, group=self.group),
            "world_size": self.runtime.world_size,
            "global_micro_batch": self.sampler.global_batch_size,
            "config": json.loads(json.dumps(asdict(self.config), default=str)),
            "optimizer_hparams": self._hparams,
            "model_shapes": run_dir_lib.tensor_shapes(unwrap(self.model).state_dict()),
            "module_types": run_dir_lib.module_types(unwrap(self.model)),
        }

    def _check_resumable(self, saved: dict[str, Any], source: str) -> None:
        config = json.loads(json.dumps(asdict(self.config), default=str))
        shapes = run_dir_lib.tensor_shapes(unwrap(self.model).state_dict())
        run_dir_lib.check_resumable(saved, config, shapes, self._hparams, source,
                                    modules=run_dir_lib.module_types(unwrap(self.model)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; its ``strategy`` part already loaded (by DCP) for this world
        size."""
        rt = self.runtime
        if state["global_micro_batch"] != self.sampler.global_batch_size:
            raise ConfigError(
                f"the snapshot was taken with {state['global_micro_batch']} samples per global micro-batch, this "
                f"run has {self.sampler.global_batch_size}: keep global_batch_size (or batch_size x world size) "
                "and grad_accum_steps as they were to resume"
            )
        self.strategy.load_state_dict(state["strategy"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        t = state["trainer"]
        self.epoch, self.step, self.cursor = t["epoch"], t["step"], t["cursor"]
        self.best, self.bad_epochs, self.skipped_steps = t["best"], t["bad_epochs"], t["skipped_steps"]
        if state["world_size"] == rt.world_size:
            mine = state["ranks"][rt.rank]
            set_rng_state(mine["rng"])
            self.generator.set_state(mine["loader_generator"])
        else:
            # Another world size: rank r's random stream has no counterpart in the old run. Reseed from
            # (seed, step, rank) so the run stays reproducible; results then match within tolerance, not bitwise.
            seed = stream_seed("reseed", self.config.seed, self.step, rt.rank)
            torch.manual_seed(seed)
            self.generator.manual_seed(seed)
            self._print0(
                f"ddpkit: resuming a {state['world_size']}-rank snapshot on {rt.world_size} ranks: same samples "
                "in the same steps; random streams (dropout, augmentation) are reseeded"
            )

    def save(self) -> None:
        """Snapshot this step into ``run_dir/snapshots/step-N/`` (every rank writes its part; every rank must
        call it). With ``snapshot_async`` it returns once the state is copied to host memory."""
        position = (self.epoch, self.step, self.cursor)
        if position == self._saved_at:
            return
        self._saved_at = position
        t0 = time.perf_counter()
        state = self.state_dict()
        sharded = state.pop("strategy")
        self._snapshots.save(self.step, sharded, state)
        if self.stopped_by is not None:
            # The run stops after this snapshot (max_steps, a signal, early stopping): it must be whole before
            # the process may exit, however fit() ends.
            self._snapshots.wait()
        self.writer.log(
            "event",
            self.step,
            {"event": "snapshot", "file": folder_name(self.step), "seconds": round(time.perf_counter() - t0, 4),
             "async": self.config.snapshot_async},
        )

    def wait_for_snapshot(self) -> None:
        """Block until the snapshot being written in the background (if any) is whole on disk."""
        self._snapshots.wait()

    def resume(self) -> bool:
        """Load the newest whole snapshot of ``run_dir``, if any; True if training resumes from one."""
        rt = self.runtime
        found = self._snapshots.latest(warn=self._print0)
        if found is None:
            return False
        # Refused before any tensor is loaded: a snapshot of another config or model is named, not half-read.
        # trainer.pt onto the CPU, not the rank's device: its RNG states must be CPU tensors to be restored (a
        # torch.Generator refuses a CUDA one), and nothing else in it is a device tensor (DCP fills the model).
        sharded, state = self._snapshots.load(found, self.strategy.state_dict, map_location="cpu",
                                              check=lambda saved: self._check_resumable(saved, str(found.path)))
        state["strategy"] = sharded
        self.load_state_dict(state)
        self.resumed_from = found.step
        self._saved_at = (self.epoch, self.step, self.cursor)  # already on disk
        self._print0(f"ddpkit: resumed from {found.path} (epoch {self.epoch}, step {self.step}, restart {rt.restart_count})")
        self.writer.log(
            "event",
            self.step,
            {"event": "resume", "file": found.path.name, "epoch": self.epoch, "cursor": self.cursor,
             "restart_count": rt.restart_count, "world_size": rt.world_size},
        )
        return True
