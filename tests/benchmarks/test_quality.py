"""The quality benchmark's ChEES sizing (``benchmarks.quality_fits``) and its reading against
the ensemble (no fits run)."""

import pytest

from benchmarks import quality, quality_fits, quality_report
from benchmarks.quality_fits import FULL, QUICK, Sizes, plan_chees
from probtransformer.block import BAYESIAN_PARTS


def test_nuts_model_is_pinned_to_the_small_fully_bayesian_classifier():
    assert quality.NUTS_MODEL == dict(
        d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=0.0, bayesian=BAYESIAN_PARTS
    )
    assert (FULL.nuts_train, FULL.max_tree_depth) == (200, 6)


def test_chees_fits_the_ensembles_classifier_fully_bayesian_and_runs_after_it():
    assert quality.CHEES_MODEL == {**quality.MODEL, "dropout": 0.0, "bayesian": BAYESIAN_PARTS}
    order = quality.RUN_ORDER
    assert sorted(order) == sorted(quality.METHODS)
    assert order.index("chees") > order.index("ensemble")
    for method in quality.MILE_METHODS:  # MILE starts from the batched ensemble's members
        assert order.index(method) > order.index("ensemble-batched")
    assert FULL.chees_chains % FULL.chees_starts == 0
    assert FULL.chees_chains // FULL.chees_starts >= 2  # superchains of 2+ chains: nested R-hat


def planned_seconds(plan: dict, gradient_s: float, map_step_s: float) -> float:
    transitions = plan["num_warmup"] + plan["num_samples"]
    steps = quality_fits.CHEES_STEPS_PER_TRANSITION
    return plan["map_steps"] * map_step_s + transitions * steps * gradient_s


@pytest.mark.parametrize("times_the_fewest", [1.01, 1.5, 3.0, 10.0])
def test_plan_chees_keeps_to_the_budget_at_the_assumed_trajectory(times_the_fewest):
    fewest = quality_fits.MIN_CHEES_WARMUP + quality_fits.MIN_CHEES_DRAWS
    budget_s = times_the_fewest * fewest * quality_fits.CHEES_STEPS_PER_TRANSITION * 0.4
    plan = plan_chees(budget_s, gradient_seconds=0.4, map_step_seconds=0.05, sizes=FULL)
    assert planned_seconds(plan, 0.4, 0.05) <= budget_s
    assert 1 <= plan["map_steps"]
    assert plan["map_steps"] * 0.05 <= quality_fits.CHEES_MAP_SHARE * budget_s
    assert plan["num_warmup"] >= quality_fits.MIN_CHEES_WARMUP
    assert plan["num_samples"] >= quality_fits.MIN_CHEES_DRAWS


def test_plan_chees_takes_the_planned_sizes_when_they_fit_and_the_minimums_when_nothing_does():
    roomy = plan_chees(1e6, gradient_seconds=0.01, map_step_seconds=0.01, sizes=FULL)
    assert roomy == {
        "map_steps": FULL.chees_map_steps,
        "num_warmup": FULL.chees_warmup,
        "num_samples": FULL.chees_draws,
    }
    tight = plan_chees(1.0, gradient_seconds=10.0, map_step_seconds=10.0, sizes=FULL)
    assert tight == {
        "map_steps": 1,
        "num_warmup": quality_fits.MIN_CHEES_WARMUP,
        "num_samples": quality_fits.MIN_CHEES_DRAWS,
    }
    quick = plan_chees(1.0, gradient_seconds=10.0, map_step_seconds=10.0, sizes=QUICK)
    assert (quick["num_warmup"], quick["num_samples"]) == (QUICK.chees_warmup, QUICK.chees_draws)


def test_plan_chees_splits_a_cut_in_proportion_to_the_planned_warmup_and_draws():
    sizes = Sizes(chees_warmup=60, chees_draws=20)
    gradient_s, map_step_s = 2**-3, 2**-10  # exact in binary: 40 transitions exactly fit
    budget_s = 40 * quality_fits.CHEES_STEPS_PER_TRANSITION * gradient_s + map_step_s * 1000
    plan = plan_chees(budget_s, gradient_s, map_step_seconds=map_step_s, sizes=sizes)
    assert plan["map_steps"] == 1000
    assert (plan["num_warmup"], plan["num_samples"]) == (30, 10)


def row(method: str, seed: int, nll: float, auroc: float, ratio: float = 1.0) -> dict:
    base = {"dataset": "digits", "method": method, "seed": seed, "nll": nll}
    extra = {
        "ensemble_ratio": ratio,
        "divergences": 0,
        "mean_acceptance": 0.7,
        "adapted_step_size": 0.01,
        "mean_leapfrog_steps_sampling": 12.0,
        "nested_rhat_lp": 1.01,
    }
    return {**base, "auroc_entropy": auroc, **(extra if method == "chees" else {})}


def reading(groups: dict, method: str) -> str:
    return quality_report._chees_reading(groups, method)


def test_the_chees_reading_applies_the_goals_tolerances_and_cost_ratio():
    ensemble = [row("ensemble", s, 0.100, 0.90) for s in range(3)]
    within = [row("chees", s, 0.104, 0.896, ratio=4.0) for s in range(3)]  # within 0.005
    text = reading({"digits": {"chees": within, "ensemble": ensemble}}, "chees")
    assert "digits (seeds 0, 1, 2): met" in text
    worse_nll = [row("chees", s, 0.106, 0.90) for s in range(3)]
    text = reading({"digits": {"chees": worse_nll, "ensemble": ensemble}}, "chees")
    assert "missed: NLL 0.106 vs 0.100 (tolerance 0.005)" in text
    spread = [row("chees", s, 0.106 + 0.01 * (s - 1), 0.90) for s in range(3)]  # sd 0.01
    text = reading({"digits": {"chees": spread, "ensemble": ensemble}}, "chees")
    assert ": met" in text
    slow = [row("chees", s, 0.100, 0.90, ratio=5.5) for s in range(3)]
    text = reading({"digits": {"chees": slow, "ensemble": ensemble}}, "chees")
    assert "missed: fit up to 5.5x" in text
    low_auroc = [row("chees", s, 0.100, 0.89) for s in range(3)]
    text = reading({"digits": {"chees": low_auroc, "ensemble": ensemble}}, "chees")
    assert "missed: OOD AUROC 0.890 vs 0.900" in text


def test_the_chees_reading_compares_only_the_seeds_both_methods_have():
    ensemble = [row("ensemble", 0, 0.100, 0.90)] + [row("ensemble", s, 0.050, 0.99) for s in (1, 2)]
    text = reading(
        {"digits": {"chees": [row("chees", 0, 0.102, 0.90)], "ensemble": ensemble}}, "chees"
    )
    assert "digits (seed 0): met" in text


def mile_row(method: str, seed: int, nll: float, auroc: float, ratio: float = 5.0) -> dict:
    return {
        "dataset": "digits", "method": method, "seed": seed, "nll": nll, "auroc_entropy": auroc,
        "ensemble_ratio": ratio, "within_mode_r_hat_lp": 1.004, "within_mode_ess_lp": 450.0,
        "divergences": 0,
    }  # fmt: skip


def test_the_mile_reading_and_the_routes_goal_against_the_batched_ensemble():
    """The issue's goal: NLL at most the batched ensemble's, OOD AUROC at least its minus the
    larger seed sd, at most 10x its seconds, NLL at most MAP's; met on 2 of the 3 data sets."""
    ensemble = [mile_row("ensemble-batched", s, 0.100, 0.90 + 0.01 * (s - 1)) for s in range(3)]
    map_ = [mile_row("map", s, 0.200, 0.85) for s in range(3)]
    better = [mile_row("mile", s, 0.095, 0.895) for s in range(3)]  # AUROC within the sd 0.01
    worse = [mile_row("mile", s, 0.101, 0.90) for s in range(3)]
    slow = [mile_row("mile", s, 0.090, 0.95, ratio=11.0) for s in range(3)]
    groups = {
        "digits": {"mile": better, "ensemble-batched": ensemble, "map": map_},
        "ArrowHead": {"mile": worse, "ensemble-batched": ensemble, "map": map_},
        "JapaneseVowels": {"mile": slow, "ensemble-batched": ensemble, "map": map_},
    }
    text = quality_report._mile_reading(groups, "mile")
    assert "digits: met (fit 5.0x" in text
    assert "ArrowHead: missed: NLL 0.101 vs 0.100" in text
    assert "JapaneseVowels: missed: fit up to 11.0x the batched ensemble's seconds" in text
    assert "within-mode R-hat of lp 1.00-1.00, within-mode bulk ESS of lp 450-450" in text
    goal = quality_report._route_goal(groups)
    assert "met on 1 of 3" in goal and "digits mile: met" in goal
    groups["ArrowHead"]["mile"] = better
    assert "met on 2 of 3" in quality_report._route_goal(groups)
