"""The step-time estimate the scheduler sizes prompt chunks with
(sfnode/engines/scheduling/pace.py), alone: no model, no clock; steps are made up with known
rates."""

from __future__ import annotations

import random

from twisted.trial import unittest

from sfnode.engines.scheduling.pace import PRIOR, RateEstimator, StepCost, StepRates, prompt_keys
from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepPlan
from sfnode.linkf.wire import GenParams

TRUE = StepRates(step_s=0.04, decode_row_s=0.003, prompt_row_s=0.0015, keys_s=0.0008)


def steps(rng: random.Random, n: int) -> list[StepCost]:
    """A serving mix: decode-only steps of 1 to 8 lanes, and steps with prompt chunks."""
    found = []
    for _ in range(n):
        decode = rng.randrange(0, 9)
        rows = rng.choice((0, 0, 16, 64, 100, 256))
        start = rng.randrange(0, 1200)
        keys = prompt_keys(start, start + rows) / 1024
        found.append(StepCost(decode, rows, keys) if decode or rows else StepCost(1, 0, 0.5))
    return found


class CostTests(unittest.SynchronousTestCase):
    def test_the_cost_of_a_plan(self) -> None:
        """A plan's cost counts its decode rows, its prompt rows, and the keys its prompt rows
        attend to (a row at position p reads p + 1), in units of 1024."""
        params = GenParams()
        plan = StepPlan(
            decode=(DecodeRow(0, 5, 99, params, 0), DecodeRow(1, 5, 9, params, 0)),
            chunks=(ChunkRow(2, 10, (5,) * 6, False, params, 0),),
        )
        self.assertEqual(StepCost.of(plan), StepCost(2, 6, sum(range(11, 17)) / 1024))
        self.assertEqual(prompt_keys(10, 16), sum(range(11, 17)))

    def test_predicted_seconds(self) -> None:
        """A prediction is the fixed part plus each figure times its rate."""
        cost = StepCost(2, 100, 3.0)
        self.assertAlmostEqual(TRUE.seconds(cost), 0.04 + 0.006 + 0.15 + 0.0024)
        self.assertAlmostEqual(
            TRUE.prompt_seconds(0, 100), 0.15 + 0.0008 * prompt_keys(0, 100) / 1024
        )


class EstimatorTests(unittest.SynchronousTestCase):
    def test_the_prior_until_a_step_is_measured(self) -> None:
        """Before any step the estimate is the prior, a slow CPU's figures."""
        self.assertEqual(RateEstimator().rates, PRIOR)
        self.assertEqual(RateEstimator().observe(StepCost(), 1.0), PRIOR)

    def test_it_finds_the_rates_of_a_machine(self) -> None:
        """Fed steps timed at known rates (with 5% noise), the predictions come within 5% of
        the true times of a decode step of 8 lanes and of a 256-token chunk."""
        rng = random.Random(3)
        estimator = RateEstimator()
        for cost in steps(rng, 60):
            estimator.observe(cost, TRUE.seconds(cost) * rng.uniform(0.95, 1.05))
        for cost in (StepCost(8, 0, 0.0), StepCost(7, 256, 320.0)):
            ratio = estimator.rates.seconds(cost) / TRUE.seconds(cost)
            self.assertLess(abs(ratio - 1.0), 0.05, cost)

    def test_it_follows_a_machine_that_gets_slower(self) -> None:
        """After the machine gets twice as slow, forty steps bring the prediction of a
        256-token chunk within 10% of the new time."""
        rng = random.Random(4)
        estimator = RateEstimator()
        for cost in steps(rng, 40):
            estimator.observe(cost, TRUE.seconds(cost))
        for cost in steps(rng, 40):
            estimator.observe(cost, 2 * TRUE.seconds(cost))
        chunk = StepCost(4, 256, 200.0)
        self.assertLess(abs(estimator.rates.seconds(chunk) / TRUE.seconds(chunk) - 2.0), 0.2)

    def test_an_odd_step_cannot_swing_the_rates_and_fades(self) -> None:
        """One 256-token step ten times too slow (the machine busy with something else) moves
        the prediction of such a step at most twofold, and forty ordinary steps bring it back
        within 10%."""
        rng = random.Random(5)
        estimator = RateEstimator()
        history = steps(rng, 80)
        for cost in history[:40]:
            estimator.observe(cost, TRUE.seconds(cost))
        chunk = StepCost(4, 256, 200.0)
        estimator.observe(chunk, 10 * TRUE.seconds(chunk))
        self.assertLessEqual(estimator.rates.seconds(chunk) / TRUE.seconds(chunk), 2.0)
        for cost in history[40:]:
            estimator.observe(cost, TRUE.seconds(cost))
        self.assertLess(abs(estimator.rates.seconds(chunk) / TRUE.seconds(chunk) - 1.0), 0.1)

    def test_rates_are_never_negative(self) -> None:
        """Steps whose times fall as rows grow (noise) never give a negative rate."""
        estimator = RateEstimator()
        for rows in range(1, 30):
            rates = estimator.observe(StepCost(1, rows * 16, 0.0), 0.2 - rows * 0.005)
        figures = (rates.step_s, rates.decode_row_s, rates.prompt_row_s, rates.keys_s)
        self.assertGreaterEqual(min(figures), 0.0)

    def test_forget_must_be_a_fraction(self) -> None:
        """A forgetting factor outside (0, 1] is refused."""
        self.assertRaises(ValueError, RateEstimator, forget=0.0)
        self.assertRaises(ValueError, RateEstimator, forget=1.5)
