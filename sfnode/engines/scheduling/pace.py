"""How long a step takes on this machine: the rates the scheduler sizes prompt chunks with.

A step's time is modelled as a line in four figures of its plan (:class:`StepCost`): a fixed
part (reading every weight once, whatever the row count), a part per decode row, a part per
prompt row, and a part per key a prompt row attends to (a prompt's attention grows with its
context; a decode row's is small beside its share of the products and is left in its rate).  The
engine times every step on its worker thread and hands each duration, with the step's cost, to
a :class:`RateEstimator`; the scheduler reads the current :class:`StepRates` as a value and
plans prompt chunks that fit a budget in milliseconds (docs/engine.md section 3).  On a slow
CPU the chunks get shorter, on a fast one longer, with the same budget.

The estimate is a least-squares fit that forgets old steps (each step weighs ``forget`` times
the one after it), pulled slightly towards a prior so that it is defined from the first step
on; once it has seen a few steps, a step's time counts at most :data:`OUTLIER_FACTOR` times
the prediction either way, so an odd step (the machine busy with something else) cannot swing
it, while a machine that really got slower is followed within a few dozen steps.

This module must never import torch, read a clock or touch a runner: it is arithmetic on
figures the engine gives it, tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sfnode.engines.scheduling.plan import StepPlan

KEYS_UNIT = 1024
"""Attended keys are counted in units of this many (keeps the figures of one size)."""


@dataclass(frozen=True)
class StepCost:
    """The figures of a step that its time depends on."""

    decode_rows: int = 0
    prompt_rows: int = 0
    keys: float = 0.0
    """Keys attended by the prompt rows, in units of :data:`KEYS_UNIT` (a row at position ``p``
    attends to ``p + 1`` keys)."""

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.decode_rows), float(self.prompt_rows), self.keys)

    @classmethod
    def of(cls, plan: StepPlan) -> StepCost:
        """The cost figures of ``plan``."""
        keys = 0
        rows = 0
        for chunk in plan.chunks:
            rows += len(chunk.tokens)
            keys += prompt_keys(chunk.start, chunk.start + len(chunk.tokens))
        return cls(len(plan.decode), rows, keys / KEYS_UNIT)


def prompt_keys(start: int, end: int) -> int:
    """Keys attended by prompt rows at positions ``start .. end - 1`` (row ``p`` reads
    ``p + 1``)."""
    return (end * (end + 1) - start * (start + 1)) // 2


@dataclass(frozen=True)
class StepRates:
    """Seconds per step, per decode row, per prompt row and per :data:`KEYS_UNIT` keys."""

    step_s: float
    decode_row_s: float
    prompt_row_s: float
    keys_s: float

    def seconds(self, cost: StepCost) -> float:
        """The predicted duration of a step of ``cost``."""
        return (
            self.step_s
            + self.decode_row_s * cost.decode_rows
            + self.prompt_row_s * cost.prompt_rows
            + self.keys_s * cost.keys
        )

    def prompt_seconds(self, start: int, end: int) -> float:
        """The predicted time of prompt rows ``start .. end - 1`` of one lane (no fixed part)."""
        return self.prompt_row_s * (end - start) + self.keys_s * prompt_keys(start, end) / KEYS_UNIT


PRIOR = StepRates(step_s=0.05, decode_row_s=0.004, prompt_row_s=0.003, keys_s=0.002)
"""Before any step is measured: a slow CPU's figures (about those of a 135M-parameter model on
two AVX2 cores), so that the first steps err on the short side."""

SETTLED_STEPS = 8
"""Steps after which the fit is the machine's own rather than the prior's."""

OUTLIER_FACTOR = 2.0
"""Once settled, a step's time counts at most this many times the prediction (or this many
times less): a step slowed by something else cannot swing the rates."""

_SCALES = (1.0, 8.0, 256.0, 256.0 * 512 / KEYS_UNIT)
"""Typical size of each figure in a step, to weigh the prior evenly across them."""


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """``matrix @ x = vector`` by Gaussian elimination with partial pivoting; None if singular."""
    n = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(n)]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(rows[r][column]))
        if abs(rows[pivot][column]) < 1e-300:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(n):
            if r != column:
                factor = rows[r][column] / rows[column][column]
                for c in range(column, n + 1):
                    rows[r][c] -= factor * rows[column][c]
    return [rows[i][n] / rows[i][i] for i in range(n)]


class RateEstimator:
    """Fits :class:`StepRates` to measured steps (see the module docstring)."""

    def __init__(
        self, prior: StepRates = PRIOR, *, forget: float = 0.95, prior_weight: float = 0.05
    ) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError("forget must be in (0, 1]")
        self._prior = prior
        self._forget = forget
        self._prior_weight = prior_weight
        self._gram = [[0.0] * 4 for _ in range(4)]
        self._moment = [0.0] * 4
        self.steps = 0
        self._rates = prior

    @property
    def rates(self) -> StepRates:
        """The current estimate (the prior until a step was observed)."""
        return self._rates

    def observe(self, cost: StepCost, seconds: float) -> StepRates:
        """Take one measured step; answers the new estimate."""
        if seconds < 0 or cost == StepCost():
            return self._rates
        if self.steps >= SETTLED_STEPS:
            # One odd step (the machine busy with something else) moves the fit at most as
            # much as a step this many times off would.
            predicted = self._rates.seconds(cost)
            seconds = min(max(seconds, predicted / OUTLIER_FACTOR), predicted * OUTLIER_FACTOR)
        x = cost.features()
        for i in range(4):
            self._moment[i] = self._forget * self._moment[i] + x[i] * seconds
            for j in range(4):
                self._gram[i][j] = self._forget * self._gram[i][j] + x[i] * x[j]
        self.steps += 1
        prior = (
            self._prior.step_s,
            self._prior.decode_row_s,
            self._prior.prompt_row_s,
            self._prior.keys_s,
        )
        matrix = [row[:] for row in self._gram]
        vector = self._moment[:]
        for i, scale in enumerate(_SCALES):
            weight = self._prior_weight * scale * scale
            matrix[i][i] += weight
            vector[i] += weight * prior[i]
        solved = _solve(matrix, vector)
        if solved is not None:
            step_s, decode_row_s, prompt_row_s, keys_s = (max(0.0, v) for v in solved)
            self._rates = StepRates(step_s, decode_row_s, prompt_row_s, keys_s)
        return self._rates
