"""The quality benchmark's ChEES sizing (``benchmarks.quality_fits``) and its reading against
the ensemble (no fits run)."""

import pytest

from benchmarks import quality, quality_fits, quality_laplace, quality_report
from benchmarks._suite import Context
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


def test_the_laplace_rows_run_after_the_fits_they_reuse():
    order = quality.RUN_ORDER
    for method in quality_laplace.LAPLACE_METHODS:
        assert method in quality.BAYESIAN
        assert order.index(method) > order.index(quality_laplace.mode_method(method))
    assert quality_laplace.mode_method("mola") == "ensemble-batched"
    assert quality_laplace.mode_method("laplace-attention") == "map"
    with pytest.raises(ValueError, match="method must be one of"):
        quality_laplace.mode_method("map")


def test_laplace_rows_reuse_the_map_and_the_batched_ensemble_of_the_process(monkeypatch):
    """At quick sizes: ``laplace`` fits the MAP that ``laplace-attention`` then reuses; ``mola``
    sits around the ``ensemble-batched`` row's members, its cost counted on top of theirs."""
    monkeypatch.setattr(quality, "_MODES", {})
    monkeypatch.setattr(quality, "_BATCHED_ENSEMBLES", {})
    ctx = Context(quick=True)
    ensemble = quality.run_row("digits/ensemble-batched/0", ctx)
    head = quality.run_row("digits/laplace/0", ctx)
    attention = quality.run_row("digits/laplace-attention/0", ctx)
    mola = quality.run_row("digits/mola/0", ctx)
    assert head["mode_basis"] == "fitted by the laplace row, this process"
    assert attention["mode_basis"] == head["mode_basis"]
    assert attention["mode_seconds"] == head["mode_seconds"]
    assert mola["mode_basis"] == "the ensemble-batched row's, this process"
    assert mola["mode_seconds"] == ensemble["fit_seconds"] == mola["ensemble_seconds"]
    assert mola["fit_seconds"] == pytest.approx(mola["mode_seconds"] + mola["laplace_seconds"])
    assert mola["ensemble_ratio"] == pytest.approx(mola["fit_seconds"] / ensemble["fit_seconds"])
    assert head["ensemble_ratio"] == pytest.approx(head["fit_seconds"] / ensemble["fit_seconds"])
    assert (head["num_members"], mola["num_members"]) == (1, quality_fits.ENSEMBLE_MEMBERS)
    assert (
        set(head["default_prior_scale"])
        == {"head.weight", "head.bias"}
        == set(mola["prior_scale"][0])
    )
    fan_in = quality.MODEL["d_model"]
    assert head["default_prior_scale"]["head.weight"] == pytest.approx(3 / fan_in**0.5)
    assert attention["hessian"] == "diag"
    assert all(s.endswith("attention.projection") for s in attention["prior_scale"][0])
    assert len(mola["log_evidence"]) == quality_fits.ENSEMBLE_MEMBERS
    assert head["glm_nn_disagreement"] < 1e-4  # the network is linear in its last layer
    assert head["predictive_draws"] == quality_fits.QUICK.draws


def laplace_row(method: str, seed: int, nll: float, auroc: float, **extra) -> dict:
    base = {"dataset": "digits", "method": method, "seed": seed, "nll": nll, "ece": 0.02}
    laplace = {
        "ensemble_ratio": 1.5,
        "evidence_converged": [True, False],
        "glm_nn_disagreement": 1e-7,
        "default_prior_scale": {"head.weight": 0.5},
        "prior_scale": [{"head.weight": 1.0 + seed}, {"head.weight": 2.0 + seed}],
    }
    return {**base, "auroc_entropy": auroc, **(laplace if method != "ensemble-batched" else {}),
            **extra}  # fmt: skip


def test_the_mola_reading_applies_the_issues_goal_against_the_batched_ensemble():
    ensemble = [laplace_row("ensemble-batched", s, 0.100, 0.90 + 0.01 * (s - 1)) for s in range(3)]
    better = [laplace_row("mola", s, 0.095, 0.895) for s in range(3)]  # AUROC within the sd
    slow = [laplace_row("mola", s, 0.090, 0.95, ensemble_ratio=2.5) for s in range(3)]
    loose = [laplace_row("mola", s, 0.090, 0.95, ece=0.03) for s in range(3)]
    groups = {
        "digits": {"ensemble-batched": ensemble, "mola": better},
        "ArrowHead": {"ensemble-batched": ensemble, "mola": slow},
        "JapaneseVowels": {"ensemble-batched": ensemble, "mola": loose},
    }
    goal, summary = quality_laplace.laplace_reading(groups)
    assert "NLL met on 3 of 3" in goal
    assert "digits: met (fit 1.50x" in goal
    assert "ArrowHead: missed: fit up to 2.50x the batched ensemble's seconds" in goal
    assert "JapaneseVowels: met" in goal  # ECE counts on digits only
    groups["digits"]["mola"] = loose
    assert "digits: missed: ECE 0.030 vs 0.020" in quality_laplace.laplace_reading(groups)[0]
    assert "converged in 9 of 18 fits" in summary and "1.50-2.50x" in summary


def test_the_prior_scale_table_averages_over_seeds_and_members():
    rows = [laplace_row("laplace", s, 0.1, 0.9) for s in range(2)]  # scales 1, 2, 2, 3
    table = quality_laplace.prior_scale_table({"digits": {"laplace": rows}})
    assert "| digits | laplace | `head.weight` | 0.500 | 2 (1-3) | 4 | 4 |" in table
    assert quality_laplace.prior_scale_table({"digits": {"map": rows}}) == []
