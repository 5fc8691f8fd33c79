"""The Laplace verdict lines: the posterior precision's conditioning, the evidence's
convergence, GLM against sampled-network disagreement, and the prior scale per site."""

import copy

import pytest

from probtransformer.inference import fit_laplace
from probtransformer.inference.diagnostics.laplace_checks import (
    CONDITION_NUMBER_MAX,
    DISAGREEMENT_MAX,
    laplace_lines,
)
from probtransformer.inference.diagnostics.summary import _flag
from probtransformer.models import SequenceClassifier

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=16)


def _member(**changes) -> dict:
    """One member's summary as ``fit_laplace`` records it, healthy unless changed."""
    member = dict(
        log_evidence=-254.2,
        prior_precision={"head.weight": 0.25, "head.bias": 4.0},
        prior_scale={"head.weight": 2.0, "head.bias": 0.5},
        evidence_gradient=2e-5,
        evidence_converged=True,
        condition_number=757.0,
        log_likelihood=-225.9,
    )
    member.update(changes)
    return member


def _record(members, **changes) -> dict:
    record = dict(
        method="mola" if len(members) > 1 else "laplace",
        subset=["head.weight", "head.bias"],
        prior_precision="marglik",
        laplace=members,
        glm_nn_disagreement=1e-7,
    )
    record.update(changes)
    return record


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("WARN")]


def test_a_healthy_record_passes_every_check():
    lines = laplace_lines(_record([_member(), _member(condition_number=2e3)]), _flag)
    assert _warnings(lines) == []
    assert lines[0] == (
        "ok    condition number of the posterior precision: max 2e+03 (member 1) "
        "(flag > 1e12 in float64)"
    )
    assert lines[1].startswith("ok    evidence maximization converged for every member")
    assert lines[2].startswith("ok    GLM against sampled-network predictive")


def test_an_ill_conditioned_precision_is_flagged_naming_the_member():
    members = [_member(), _member(condition_number=3e13), _member(condition_number=float("inf"))]
    (line,) = _warnings(laplace_lines(_record(members), _flag))
    assert line.startswith("WARN  condition number of the posterior precision: member 1 3e+13, ")
    assert "member 2 inf" in line and "member 0" not in line
    assert "lose accuracy" in line
    # at the threshold itself the Cholesky is still trusted; one member reads "the posterior"
    at = _record([_member(condition_number=CONDITION_NUMBER_MAX)])
    assert _warnings(laplace_lines(at, _flag)) == []
    (alone,) = _warnings(laplace_lines(_record([_member(condition_number=1e15)]), _flag))
    assert "the posterior 1e+15" in alone


def test_an_unconverged_evidence_maximization_is_flagged_with_its_gradient():
    members = [_member(), _member(evidence_converged=False, evidence_gradient=0.37)]
    (line,) = _warnings(laplace_lines(_record(members), _flag))
    assert line.startswith("WARN  evidence maximization did not converge: member 1 (gradient 0.37)")
    assert "member 0" not in line
    # a record without the flag (a hand-edited one) is not taken as converged
    (missing,) = _warnings(laplace_lines(_record([_member(evidence_converged=None)]), _flag))
    assert "the posterior (gradient 2e-05)" in missing


@pytest.mark.parametrize("setting", [1.0, "prior"])
def test_a_fixed_prior_precision_has_no_maximization_to_fail(setting):
    """``fit_laplace`` records no gradient or convergence for a given prior precision."""
    member = _member(evidence_converged=None, evidence_gradient=None)
    lines = laplace_lines(_record([member], prior_precision=setting), _flag)
    assert _warnings(lines) == []
    (line,) = [line for line in lines if "evidence maximization" in line]
    assert line.startswith("n/a   evidence maximization: the prior precision was given as")
    assert "not a failure" in line
    assert ("'prior'" if setting == "prior" else "the number 1.0") in line
    assert "per site, given" in lines[-1]


def test_glm_against_network_disagreement_is_flagged_above_the_threshold():
    flagged = laplace_lines(_record([_member()], glm_nn_disagreement=0.12, subset=["a.w"]), _flag)
    (line,) = _warnings(flagged)
    assert "mean total variation distance" in line and "0.12" in line
    assert "the linearization is poor for the subset [a.w]" in line
    at = laplace_lines(_record([_member()], glm_nn_disagreement=DISAGREEMENT_MAX), _flag)
    assert _warnings(at) == []
    (na,) = [
        line
        for line in laplace_lines(_record([_member()], glm_nn_disagreement=None), _flag)
        if "GLM" in line
    ]
    assert na.startswith("n/a") and "categorical likelihoods only" in na
    (nan,) = _warnings(laplace_lines(_record([_member()], glm_nn_disagreement=float("nan")), _flag))
    assert "not a finite number" in nan


def test_the_prior_scale_is_printed_per_site():
    one = laplace_lines(_record([_member()]), _flag)[-1]
    assert one == (
        "info  prior scale 1/sqrt(precision) per site, chosen by the evidence: "
        "head.weight 2; head.bias 0.5"
    )
    scales = [{"head.weight": w, "head.bias": 0.5} for w in (1.0, 3.0, 2.0)]
    members = [_member(prior_scale=s) for s in scales]
    several = laplace_lines(_record(members), _flag, {"head.weight": 0.75})[-1]
    assert several.endswith(
        "median (min-max) over 3 members: head.weight 2 (1-3; model's prior 0.75); "
        "head.bias 0.5 (0.5-0.5)"
    )


@pytest.mark.parametrize("laplace", [None, [], ["not a dict"], {"log_evidence": 1.0}])
def test_a_record_without_member_summaries_is_flagged(laplace):
    (line,) = laplace_lines(_record([_member()], laplace=laplace), _flag)
    assert line.startswith("WARN  record['laplace'] is not a list of one summary per member")


@pytest.fixture(scope="module")
def laplace_posterior(digits):
    model = SequenceClassifier(8, 10, 8, **TINY)
    return fit_laplace(model, digits.train[:48], num_steps=5, num_samples=8, progress=False)


def test_diagnose_gives_a_fitted_laplace_posterior_its_verdict(laplace_posterior):
    table = laplace_posterior.diagnose(verbose=False)
    verdict = table.attrs["verdict"]
    assert verdict[0].startswith("verdict (laplace, 1 chain(s) x 8 draws)")
    assert verdict[1].startswith("n/a   R-hat and ESS do not apply: Laplace draws")
    assert _warnings(verdict) == []
    assert any(line.startswith("ok    condition number") for line in verdict)
    assert any(line.startswith("ok    evidence maximization converged") for line in verdict)
    (scales,) = [line for line in verdict if line.startswith("info  prior scale")]
    assert "head.weight" in scales and "model's prior" in scales
    assert table["r_hat_max"].isna().all()


def test_diagnose_flags_a_damaged_laplace_record(laplace_posterior, monkeypatch):
    record = copy.deepcopy(laplace_posterior.record)
    record["laplace"][0].update(condition_number=1e14, evidence_converged=False)
    record["glm_nn_disagreement"] = 0.3
    monkeypatch.setattr(laplace_posterior, "record", record)
    warned = _warnings(laplace_posterior.diagnose(verbose=False).attrs["verdict"])
    assert [line.split(":")[0] for line in warned] == [
        "WARN  condition number of the posterior precision",
        "WARN  evidence maximization did not converge",
        "WARN  GLM against sampled-network predictive",
    ]


def test_the_model_prior_scale_is_what_prior_precision_prior_records(digits):
    """``prior_precision="prior"`` uses the model's own prior: the scales it records are the
    ``model_prior_scale`` beside which the verdict prints the evidence's."""
    model = SequenceClassifier(8, 10, 8, **TINY)
    posterior = fit_laplace(
        model, digits.train[:32], prior_precision="prior", num_steps=2, num_samples=4,
        progress=False,
    )  # fmt: skip
    recorded = posterior.record["laplace"][0]["prior_scale"]
    assert posterior.record["model_prior_scale"] == pytest.approx(recorded, rel=1e-6)
    assert posterior.record["model_prior_scale"]["head.weight"] == pytest.approx(3 / 8**0.5)
