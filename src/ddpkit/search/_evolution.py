"""The asynchronous evolution of Propulate (seed 003) as an Optuna sampler.

Each new candidate is bred from the candidates finished so far, whenever a worker asks: no
generations, so no worker waits for the slowest candidate of a generation. With probability
``random_share`` a candidate is drawn at random (exploration); otherwise two parents are chosen by
tournaments among the ``top`` best finished candidates, each parameter is taken from either parent
(uniform crossover), and each is mutated with probability ``mutation_prob``: floats and integers by
a Gaussian step of ``mutation_scale`` of their range (in log space for log distributions), choices
by a new draw.

Optuna's NSGA-II (``sampler="nsga2"``) is a genetic algorithm too, but generational: parents come
from the population of the last complete generation, which changes only once ``population_size``
candidates of the current one have finished (see bench/search_evolution.py for the two side by
side).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import IntersectionSearchSpace
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState


class EvolutionSampler(BaseSampler):
    """Steady-state evolution: select, cross over and mutate the best finished candidates, or draw
    at random."""

    def __init__(
        self,
        *,
        top: int = 8,
        random_share: float = 0.2,
        mutation_prob: float = 0.3,
        mutation_scale: float = 0.1,
        min_finished: int = 4,
        seed: int | None = None,
    ) -> None:
        self.top, self.random_share, self.min_finished = top, random_share, min_finished
        self.mutation_prob, self.mutation_scale = mutation_prob, mutation_scale
        self._rng = np.random.default_rng(seed)
        self._random = RandomSampler(seed=seed)
        self._space = IntersectionSearchSpace()

    def reseed_rng(self) -> None:
        self._rng = np.random.default_rng()
        self._random.reseed_rng()

    def infer_relative_search_space(
        self, study: Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self._space.calculate(study)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        finished = [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None
        ]
        if (
            not search_space
            or len(finished) < self.min_finished
            or self._rng.random() < self.random_share
        ):
            return {}  # drawn at random by sample_independent
        reverse = study.direction == StudyDirection.MAXIMIZE
        best = sorted(finished, key=lambda t: cast(float, t.value), reverse=reverse)[: self.top]
        mother, father = self._tournament(best), self._tournament(best)
        child = {}
        for name, dist in search_space.items():
            parent = mother if self._rng.random() < 0.5 else father
            value = parent.params.get(name)
            if value is None:
                continue
            child[name] = (
                self._mutate(value, dist) if self._rng.random() < self.mutation_prob else value
            )
        return child

    def _tournament(self, ranked: Sequence[FrozenTrial], size: int = 2) -> FrozenTrial:
        # ranked is best first: the lowest index among `size` draws wins.
        return ranked[int(min(self._rng.integers(len(ranked), size=size)))]

    def _mutate(self, value: Any, dist: BaseDistribution) -> Any:
        if isinstance(dist, CategoricalDistribution):
            return dist.choices[int(self._rng.integers(len(dist.choices)))]
        assert isinstance(dist, (FloatDistribution, IntDistribution))
        to, back = (math.log, math.exp) if dist.log else (float, float)
        lo, hi = to(dist.low), to(dist.high)
        x = min(max(to(value) + self._rng.normal(0.0, self.mutation_scale * (hi - lo)), lo), hi)
        x = back(x)
        if dist.step is not None:
            x = dist.low + round((x - dist.low) / dist.step) * dist.step
        x = min(max(x, dist.low), dist.high)
        return int(round(x)) if isinstance(dist, IntDistribution) else x

    def sample_independent(
        self,
        study: Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)
