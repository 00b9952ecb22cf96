"""Hyper-parameter search whose candidates each train with DDP on their own group of ranks.

::

    def objective(candidate):  # runs on every rank of one group
        model = Net(candidate.params["channels"])
        config = TrainerConfig(run_dir=str(candidate.run_dir), epochs=5, batch_size=64)
        optimizer = SGD(model.parameters(), lr=candidate.params["lr"])
        trainer = Trainer(model, optimizer, train, config, val_data=val,
                          group=candidate.group, callbacks=[candidate])
        return trainer.fit()  # the metrics; config.metric is the result

    space = {"lr": uniform(1e-3, 1e-1, log=True), "channels": choice([8, 16, 32])}
    search(objective, space, SearchConfig(n_trials=20, group_size=2, metric="val/loss"))

Launched like any ddpkit job; every group of ``group_size`` ranks trains one candidate at a time.
Needs ``pip install 'ddpkit[search]'`` (Optuna).
"""

try:
    import optuna  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the optional extra
    raise ImportError("ddpkit.search needs Optuna: pip install 'ddpkit[search]'") from err

from ddpkit.search._config import SearchConfig, choice, integer, uniform
from ddpkit.search._engine import Candidate, search

__all__ = ["Candidate", "SearchConfig", "choice", "integer", "search", "uniform"]
