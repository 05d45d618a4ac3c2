"""The clock's calibration fit recovers known costs and never goes negative."""

import random

from benchmarks.calibration_fit import fit


def test_fit_recovers_the_seconds_per_unit_that_made_the_samples():
    rng = random.Random(0)
    true = {"a": 2e-3, "b": 5e-6, "c": 0.7}
    samples = []
    for _ in range(30):
        units = {"a": rng.uniform(0, 1000), "b": rng.uniform(0, 1e6), "c": rng.uniform(0, 10)}
        wall = sum(true[k] * v for k, v in units.items()) * rng.uniform(0.98, 1.02)
        samples.append((units, wall))
    f = fit(samples)
    for k, v in true.items():
        assert abs(f.seconds[k] / v - 1) < 0.05, (k, f.seconds[k], v)
    assert f.worst() < 0.05


def test_a_unit_that_would_fit_negative_is_dropped_and_others_refitted():
    # "b" only ever appears with wall time explained by "a": a free fit would make it negative
    samples = [({"a": n, "b": 10 * n * (i % 2)}, 1e-3 * n * (0.9 if i % 2 else 1.0)) for i, n in enumerate(range(1, 20))]
    f = fit(samples, keep={"z": 1.0})
    assert f.seconds["b"] == 0.0 and f.seconds["a"] > 0
    assert f.seconds["z"] == 1.0  # a unit no sample counted keeps its value


def test_a_prior_weight_keeps_a_unit_no_sample_can_tell_apart_near_its_prior():
    # "a" and "b" are counted alike in every sample: plain least squares may split their cost anyhow
    samples = [({"a": n, "b": n}, 3e-3 * n) for n in range(1, 20)]
    f = fit(samples, keep={"a": 1e-3, "b": 2e-3}, prior_weight=0.1)
    assert abs(f.seconds["a"] / 1e-3 - 1) < 0.05 and abs(f.seconds["b"] / 2e-3 - 1) < 0.05
    assert f.worst() < 0.05


def test_with_priors_a_unit_priced_at_zero_stays_zero():
    # "z" is counted with "a" in every sample; the table prices it at 0 (its cost is in "a"): the pulled fit keeps it so
    samples = [({"a": n, "z": 3 * n}, 2e-3 * n) for n in range(1, 20)]
    f = fit(samples, keep={"a": 1e-3, "z": 0.0}, prior_weight=0.05)
    assert f.seconds["z"] == 0.0 and abs(f.seconds["a"] / 2e-3 - 1) < 0.05


def test_the_peak_bound_charges_its_max_flow_work():
    """The bound's min cuts cost in proportion to the max flows' edge steps, not to the edges built (a 365-op GPT:
    200k edges built, 2.5M steps, 0.4 s): the clock counts both, and the steps are what is priced."""
    from optsched.solvers.model import calibration, clock
    from optsched.solvers.search.heuristics import lower_bound_peak
    from optsched.solvers.synthetic import chain_training_problem

    problem = chain_training_problem(12)
    with clock.deterministic(True):
        t0 = clock.now()
        lower_bound_peak(problem)
        units, spent = clock.units_counted(), clock.now() - t0
    assert units["bound_flow"] >= units["bound_edge"] > 0
    assert calibration.UNITS["bound_flow"].seconds > 0 and spent >= calibration.seconds("bound_flow", units["bound_flow"])
