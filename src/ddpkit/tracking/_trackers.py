"""MLflow and Weights & Biases: the records the CSV and TensorBoard get, sent to an experiment
tracker too, from the main rank (``LoggingConfig(trackers=("mlflow", "wandb"))``, each an optional
extra). Without a server or an account: MLflow logs to ``$MLFLOW_TRACKING_URI``, else to
``run_dir/mlflow.db`` (SQLite); W&B logs online with an API key, else offline to ``run_dir/wandb``.
A resumed run continues the same tracker run, its id kept in ``run_dir/loggers.json``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs


def _ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / "loggers.json"
    return json.loads(fs.read_bytes(path)) if os.path.lexists(path) else {}


def _remember(run_dir: Path, name: str, run_id: str) -> None:
    ids = _ids(run_dir) | {name: run_id}
    fs.write_atomic(run_dir / "loggers.json", (json.dumps(ids) + "\n").encode())


def need(name: str) -> Any:
    """The tracker's package (of the extra of its name), imported; a missing one is named."""
    try:
        return __import__(name)
    except ImportError as err:
        raise ImportError(
            f"LoggingConfig(trackers=[{name!r}]) needs `pip install 'ddpkit[{name}]'`"
        ) from err


class MLflowLogger:
    def __init__(self, run_dir: Path, params: dict[str, Any]) -> None:
        mlflow = need("mlflow")
        from mlflow.entities import Metric, Param

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
            fs.unshare(run_dir / "mlflow.db")  # SQLite writes in place: a copied run's is its own
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self.run_id = _ids(run_dir).get("mlflow")
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ddpkit")
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
            from ddpkit.snapshot._run_dir import flat_config

            # MLflow's params are flat: a nested config's fields as `logging.every_steps`
            flat = [Param(k, str(v)[:500]) for k, v in flat_config(params).items()]
            self.client.log_batch(self.run_id, params=flat)
            _remember(run_dir, "mlflow", self.run_id)
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[self._metric(k, v, now, step) for k, v in values.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbLogger:
    def __init__(self, run_dir: Path, params: dict[str, Any]) -> None:
        wandb = need("wandb")
        offline = not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"))
        run_id = _ids(run_dir).get("wandb") or uuid.uuid4().hex[:8]
        # without a key wandb.init would ask for one on the terminal
        self.run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "ddpkit"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            config=params,
            mode="offline" if offline else None,
        )
        _remember(run_dir, "wandb", run_id)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def build(names: tuple[str, ...] | list[str], run_dir: Path, params: dict[str, Any]) -> list[Any]:
    """The loggers named (``"mlflow"``, ``"wandb"``), for the main rank."""
    classes = {"mlflow": MLflowLogger, "wandb": WandbLogger}
    return [classes[name](run_dir, params) for name in names]
