"""Propulate's asynchronous evolution against Optuna's NSGA-II (and TPE, random) with asynchronous
workers.

Seed 003's search breeds each new candidate from every candidate finished so far, the moment a
worker is free. Optuna's NSGA-II is a genetic algorithm too; this run shows how it behaves in the
same setting. The workers are simulated in one process (no training): ``--workers`` candidates are
in flight at once, each takes a random time, and whenever one finishes its result is told and the
freed worker asks for the next. The objective is the 6-dimensional Rastrigin function on log-scaled
and linear parameters (minimum 0).

Reported for each sampler, over ``--seeds`` runs: the best value after ``--trials`` candidates
(median and quartiles), and how many finished candidates a new candidate's parents could be chosen
from, on average ("pool"): all finished ones for the steady-state evolution, the last complete
generation for NSGA-II.

    python bench/search_evolution.py                       # 8 workers, 200 candidates, 5 seeds
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics

import optuna
from optuna.trial import TrialState

from ddpkit.search._config import uniform
from ddpkit.search._study import EvolutionSampler

SPACE = {f"x{i}": uniform(-5.12, 5.12) for i in range(6)}


def rastrigin(params: dict[str, float]) -> float:
    xs = list(params.values())
    return 10 * len(xs) + sum(x * x - 10 * math.cos(2 * math.pi * x) for x in xs)


def run(
    sampler: optuna.samplers.BaseSampler, trials: int, workers: int, seed: int
) -> tuple[float, float]:
    study = optuna.create_study(sampler=sampler)
    rng = random.Random(seed)
    clock, flying, pools = 0.0, [], []
    for _ in range(min(workers, trials)):
        t = study.ask(SPACE)
        heapq.heappush(flying, (clock + rng.expovariate(1.0), t.number, t))
    asked = len(flying)
    while flying:
        clock, _, t = heapq.heappop(flying)
        study.tell(t, rastrigin(t.params))
        if asked < trials:
            new = study.ask(SPACE)
            pools.append(_pool(sampler, study, new))
            heapq.heappush(flying, (clock + rng.expovariate(1.0), new.number, new))
            asked += 1
    return study.best_value, statistics.mean(pools) if pools else 0.0


def _pool(sampler, study: optuna.Study, trial: optuna.Trial) -> float:
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if isinstance(sampler, optuna.samplers.NSGAIISampler):
        key = next(
            (
                k
                for k in study.get_trials(deepcopy=False)[trial.number].system_attrs
                if "generation" in k
            ),
            None,
        )
        if key is None:
            return 0.0
        gen = study.get_trials(deepcopy=False)[trial.number].system_attrs[key]
        return float(sum(t.system_attrs.get(key) == gen - 1 for t in complete))
    return float(len(complete))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seeds", type=int, default=5)
    a = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    samplers = {
        "evolution (ddpkit)": lambda s: EvolutionSampler(seed=s),
        "nsga2 (optuna)": lambda s: optuna.samplers.NSGAIISampler(seed=s, population_size=16),
        "tpe (optuna)": lambda s: optuna.samplers.TPESampler(seed=s),
        "random": lambda s: optuna.samplers.RandomSampler(seed=s),
    }
    print(
        f"# {a.workers} asynchronous workers, {a.trials} candidates, 6-D Rastrigin (min 0), "
        f"{a.seeds} seeds"
    )
    print(f"{'sampler':>20} {'best: median':>13} {'q1':>7} {'q3':>7} {'parent pool':>12}")
    for name, make in samplers.items():
        results = [run(make(seed), a.trials, a.workers, seed) for seed in range(a.seeds)]
        best = sorted(r[0] for r in results)
        q = statistics.quantiles(best, n=4) if len(best) > 1 else [best[0]] * 3
        pool = (
            f"{statistics.mean(r[1] for r in results):.1f}"
            if "evolution" in name or "nsga2" in name
            else "-"
        )
        print(f"{name:>20} {statistics.median(best):>13.2f} {q[0]:>7.2f} {q[2]:>7.2f} {pool:>12}")


if __name__ == "__main__":
    main()
