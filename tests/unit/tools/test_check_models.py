"""``ddpkit check``'s comparison of models by name (a step_fn Trainer's): each model's weights
compared on their own, the worst named, no gradient column."""

import torch

from ddpkit.tools._check import (
    CheckConfig,
    Tolerance,
    Verdict,
    _describe_mismatch,
    _Judged,
    _table,
    compare,
)


def _records(g, d, loss=1.0):
    models = {"g": torch.tensor(g, dtype=torch.float64), "d": torch.tensor(d, dtype=torch.float64)}
    return {
        "loss": [loss],
        "grad": [],
        "weights": [torch.cat(list(models.values()))],
        "models": [models],
        "error": None,
    }


def test_each_model_is_compared_on_its_own_and_the_worst_is_named():
    # d is small next to g: in one flat vector its difference would be lost (1e-4 of the whole)
    ref = _records([100.0, 100.0], [0.01, 0.01])
    other = _records([100.0, 100.0], [0.01, 0.02])
    c = compare(other, ref)
    assert c.model == ["d"] and c.diffs[0]["weights"] > 0.5 and "grad" not in c.diffs[0]
    cfg = CheckConfig()
    verdict = Verdict(c, compare(ref, ref))
    judged = _Judged(exact=False, tol=Tolerance(cfg.rtol), notes=[])
    assert "(most in model 'd')" in _describe_mismatch(verdict, cfg, judged)
    assert _table(ref, other, verdict, None, cfg).splitlines()[1].split()[4] == "-"
    # Control: the same weights as one flat vector, with no models by name, hide it.
    flat = {k: v for k, v in other.items() if k != "models"}
    c = compare(flat, {k: v for k, v in ref.items() if k != "models"})
    assert c.model == [] and c.diffs[0]["weights"] < 1e-4
