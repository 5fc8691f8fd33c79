"""``Posterior``: the one result type of every fit (SVI, MCMC, MAP, MC dropout, ensembles)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroModule

from probtransformer.data import SequenceData
from probtransformer.inference._pyro_compat import site_is_subsample
from probtransformer.inference._runtime import seeded
from probtransformer.inference.diagnostics.heads import head_importance, prune_heads
from probtransformer.inference.diagnostics.inference_data import to_inference_data
from probtransformer.inference.diagnostics.summary import diagnose
from probtransformer.inference.distributed import (
    check_same,
    data_parallel,
    gather_rows,
    joined,
    together,
)
from probtransformer.inference.inputs import as_inputs, check_data, rows_digest
from probtransformer.inference.model_checks import latent_sites
from probtransformer.inference.posterior.decoding import NextTokenDecoder
from probtransformer.inference.posterior.draws import (
    DEFAULT_NUM_SAMPLES,
    Draws,
    DrawSource,
    GuideDraws,
    check_num_samples,
    draw_source,
    latents_of,
    thin,
)
from probtransformer.inference.posterior.prediction import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MEMORY_BUDGET,
    PredictionEngine,
    attention_reader,
    dropout_modules,
    model_device,
    pointwise_reader,
    predictive_reader,
)
from probtransformer.inference.posterior.results import (
    PosteriorAttention,
    Prediction,
    RegressionPrediction,
)
from probtransformer.inference.posterior.saving import save_posterior
from probtransformer.inference.vi.guides import AmortizedGuide


class Posterior:
    """A fitted model with its posterior: predictions, attention, ArviZ export, diagnostics.

    Build one with ``fit_svi`` (or the other ``fit_*``) rather than directly. A posterior is
    the model plus one draw source (``inference.posterior.draws``): SVI keeps the guide and draws
    fresh
    samples from it for each call (reproducible through ``seed``); sample-based posteriors keep
    their draws with ``(chain, draw)`` dims and thin them evenly to ``num_samples``; MC dropout
    (Gal & Ghahramani 2016) and ensembles (Lakshminarayanan et al. 2017) run one forward pass
    per draw, with fresh dropout masks or that member's parameters.

    Every prediction method takes ``draws=`` (a ``Draws`` from ``draw``) to evaluate an explicit
    set of draws, as Pyro's ``Predictive(posterior_samples=...)`` does: ``to_inference_data``
    draws once and gives the same draws to every group.

    Local latents (sampled inside ``pyro.plate("data")``, one value per training row, e.g. the
    school effects of eight schools) may be kept in ``samples`` as ``(chain, draw, N, *per_row)``
    (``fit_mcmc`` keeps them). They belong to the training rows: a pass over exactly the training
    data (``record["training_data_sha256"]``, see ``inputs.rows_digest``) is conditioned on
    them; any other input draws them from the model given each draw of the global latents.

    Args:
        model: the fitted model.
        record: what the fit did (method, settings, seconds, ``elbo`` trace ...).
        example: a few training rows (``inputs.example_of``): enough to trace model and guide.
        guide, samples, members, mc_dropout, modes: what the fit kept, turned into a draw
            source by ``draws.draw_source`` (or pass ``source`` itself); ``modes`` (Laplace):
            each draw's linearization point, ``{site: (chain, draw, *shape)}``.

    Attributes:
        model: the fitted model (on the fit's device, in eval mode for prediction; for an
            ensemble it holds the first member's parameters between calls).
        source: the ``DrawSource``; ``guide``, ``samples``, ``members`` and ``mc_dropout`` read
            what it holds (None / False where it holds no such thing).
        latent_shapes: ``{site: shape}`` of the global latent sites.
        local_shapes: ``{site: per_row_shape}`` of the local latent sites (not those of
            stochastic attention, which are re-drawn for any input).
        record: what the fit did.

    Raises:
        ValueError: neither or both of ``guide`` and ``samples``; ``members`` without
            ``samples``; ``mc_dropout`` without dropout in the model; stored draws or members
            that do not fit the model's sites and parameters.
    """

    def __init__(
        self,
        model: PyroModule,
        *,
        record: dict,
        example: SequenceData,
        guide: AutoGuide | None = None,
        samples: dict[str, torch.Tensor] | None = None,
        members: dict[str, torch.Tensor] | None = None,
        mc_dropout: bool = False,
        modes: dict[str, torch.Tensor] | None = None,
        source: DrawSource | None = None,
    ) -> None:
        if source is None:
            source = draw_source(
                example=example, guide=guide, samples=samples, members=members,
                mc_dropout=mc_dropout, modes=modes,
            )  # fmt: skip
        if source.mc_dropout and not dropout_modules(model):
            raise ValueError(
                f"mc_dropout=True needs dropout: {type(model).__name__} has no torch.nn.Dropout "
                "module with p > 0"
            )
        self.model = model.eval()  # prediction mode: dropout off (on per pass for MC dropout)
        self.source = source
        self.record = record
        self.example = example
        self._device = model_device(model)
        self.latent_shapes, self.local_shapes = latent_sites(model, example.to(self.device))
        source.check(model, self.latent_shapes, self.local_shapes)

    # -- draws ------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the model lives (inputs are moved there; results come back on CPU)."""
        return self._device

    @property
    def guide(self) -> AutoGuide | None:
        """The fitted autoguide (SVI, MAP, MC dropout), else None."""
        return self.source.guide

    @property
    def samples(self) -> dict[str, torch.Tensor] | None:
        """``{site: (chain, draw, *shape)}`` kept draws (sample-based, ensembles), else None."""
        return self.source.samples

    @property
    def members(self) -> dict[str, torch.Tensor] | None:
        """``{name: (chain, draw, *shape)}`` each ensemble member's model parameters, else None.
        Buffers (prior constants, head masks) are the model's, shared by all members."""
        return self.source.members

    @property
    def mc_dropout(self) -> bool:
        """True when dropout stays on at prediction (MC dropout)."""
        return self.source.mc_dropout

    @property
    def is_point_estimate(self) -> bool:
        """True when every draw is the same (MAP): predictions use one draw. False for MC
        dropout and ensembles, whose draws differ through dropout masks or member parameters."""
        return self.source.is_point_estimate(self.latent_shapes)

    def draw(self, num_samples: int | None = None, *, seed: int = 0) -> Draws:
        """One explicit set of posterior draws, for ``draws=`` of the prediction methods.

        SVI: one chain of ``num_samples`` fresh guide draws (None: ``DEFAULT_NUM_SAMPLES``).
        Sample-based: each chain thinned evenly to ``ceil(num_samples / num_chains)`` draws
        (None: every draw). Point estimates: one draw.

        Raises:
            ValueError: ``num_samples < 1``.
        """
        return self.source.draw(
            num_samples, seed, latent_shapes=self.latent_shapes, device=self.device
        )

    def draws(self, num_samples: int | None = None, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """Posterior draws of every latent site: ``{site: (chain, draw, *shape)}`` on the
        model's device (local latents kept by a sampler: ``(chain, draw, N, *per_row)``); as
        ``draw(num_samples, seed=seed).latents``.

        Raises:
            ValueError: ``num_samples < 1``.
        """
        return self.draw(num_samples, seed=seed).latents

    def decoder(
        self, num_samples: int | None = 100, *, seed: int = 0, cache: bool | None = None
    ) -> NextTokenDecoder:
        """A step-by-step decoder of a causal model over ``draw(num_samples, seed=seed)``
        (kept local latents left out: they belong to the training rows); see
        ``inference.posterior.decoding.NextTokenDecoder`` and ``models.generate``.

        Raises:
            TypeError: the model has no ``logits`` method (it is not a token model).
            ValueError: ``num_samples < 1``; ``cache=True`` with stochastic attention.
        """
        if not callable(getattr(self.model, "logits", None)):
            raise TypeError(
                f"decoding needs a token model with a logits method (CausalLM), got "
                f"{type(self.model).__name__}"
            )
        draws = self.draw(num_samples, seed=seed).without(set(self.local_shapes))
        return NextTokenDecoder(self.model, draws, device=self.device, seed=seed, cache=cache)

    def sample_stats(self, num_samples: int | None = None) -> dict[str, torch.Tensor]:
        """Per-draw sampler statistics ``{name: (chain, draw)}`` of an MCMC posterior, thinned
        like ``draws(num_samples)`` (ArviZ names: ``diverging``, ``acceptance_rate``,
        ``step_size``, ``tree_depth``, ``n_steps``, ``energy``, ``lp``); ``{}`` for others."""
        stats = self.record.get("sample_stats") or {}
        out = {name: torch.from_numpy(np.asarray(value)) for name, value in stats.items()}
        if num_samples is None or not out:
            return out
        check_num_samples(num_samples)
        return {name: thin(value, num_samples) for name, value in out.items()}

    def log_importance_weights(
        self,
        data: SequenceData,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> torch.Tensor:
        """``log p(data, θ_s) − log q(θ_s)`` for ``S`` draws ``θ_s`` of the SVI guide ``q``.

        The weights of the guide as an importance proposal for the posterior; the Pareto k̂ of
        their tail says whether the guide is close enough to trust (Yao, Vehtari, Simpson &
        Gelman 2018, "Yes, but did it work?"). Both densities are in the constrained space.

        Args:
            data: the training data (full, not a mini-batch), with targets.
            num_samples: guide draws ``S`` (None: ``DEFAULT_NUM_SAMPLES``).

        Returns:
            ``(S,)`` log weights in nats (CPU, float64).

        Raises:
            ValueError: a sample-based, point-estimate or MC-dropout posterior, an amortized
                guide (local latents), or ``data`` without targets.
        """
        source = self.source
        if type(source) is not GuideDraws or self.is_point_estimate:
            raise ValueError("importance weights need a non-degenerate SVI guide")
        if isinstance(self.guide, AmortizedGuide):
            raise ValueError(
                "importance weights of a guide with local latents (stochastic attention) are not "
                "available: they would need every training sequence's local latents"
            )
        x, mask, y = self._training_inputs(data, "the importance weights")
        num = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples
        check_num_samples(num)
        with seeded(seed, self.device):
            trace = source.trace(num, self.device)
        log_q = _sum_log_prob(s for s in trace.nodes.values() if s["type"] == "sample")
        latents = latents_of(trace, num, self.latent_shapes)
        draws = Draws({k: v[None] for k, v in latents.items()}, 1, num)

        def read(model_trace):
            site = model_trace.nodes[self.model.likelihood_site]
            latent = (model_trace.nodes[name] for name in self.latent_shapes)
            return {
                "log_lik": site["fn"].log_prob(site["value"]).reshape(num, -1),
                "log_prior": _sum_log_prob(latent).reshape(num, -1).sum(-1, keepdim=True),
            }

        engine = PredictionEngine(self.model)
        out = engine.run(
            draws, x, y, mask, read, seed=seed, batch_size=batch_size, memory_budget=None
        )
        log_joint = out["log_lik"][0].double().sum(-1) + out["log_prior"][0, :, 0].double()
        return log_joint - log_q.reshape(num, -1).sum(-1).double().cpu()

    # -- predictions over explicit draws -------------------------------------------------------

    def _inputs(self, x, mask, y=None):
        return as_inputs(
            self.model, x, mask, y, x_range=self.record.get("x_range"), device=self.device
        )

    def _training_inputs(self, data: SequenceData, what: str):
        check_data(data)
        if data.y is None:
            raise ValueError(f"data.y is None: {what} needs observed targets")
        return self._inputs(data.x, data.mask, data.y)

    def _run(
        self, read, x, y, mask, draws, num_samples, seed, batch_size, memory_budget, distributed
    ):
        """``read`` outputs ``(chain, draw, n, ...)`` over ``draws`` (None: fresh draws); with
        ``distributed``, this rank's contiguous share of the rows, all-gathered in row order."""
        if not isinstance(distributed, bool):
            raise TypeError(f"distributed must be True or False, got {distributed!r}")
        parallel = data_parallel(self.device) if distributed else None
        if draws is None:
            draws = self.draw(num_samples, seed=seed)
        elif not isinstance(draws, Draws):
            raise TypeError(f"draws must come from Posterior.draw, got {type(draws).__name__}")
        local = set(draws.latents) & set(self.local_shapes)
        if local and self.record.get("training_data_sha256") != rows_digest(x, y, mask):
            draws = draws.without(local)  # kept local latents belong to the training rows
        n = x.shape[0]
        if parallel is not None:
            check_same(
                parallel,
                "every rank must call predict with the same arguments and posterior",
                **{
                    "number of rows": n,
                    "inputs": rows_digest(x, y, mask),
                    "seed": seed,
                    "set of posterior draws": rows_digest(
                        *draws.latents.values(), *(draws.states or {}).values()
                    ),
                },
            )
        if parallel is not None and n < parallel.world_size:
            parallel = None  # fewer rows than ranks: each rank runs them all
        if parallel is not None:
            rows = parallel.share(n)
            x, y, mask = (None if t is None else t[rows] for t in (x, y, mask))
            kept = {k: v[:, :, rows] if k in local else v for k, v in draws.latents.items()}
            draws = dataclasses.replace(draws, latents=kept)
        engine = PredictionEngine(self.model, guide=self.guide, local_sites=self.local_shapes)
        out = engine.run(
            draws, x, y, mask, read, seed=seed, batch_size=batch_size, memory_budget=memory_budget
        )
        return out if parallel is None else gather_rows(parallel, out, n)

    def predict(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        num_samples: int | None = 100,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        draws: Draws | None = None,
        distributed: bool = False,
    ) -> Prediction | RegressionPrediction:
        """Posterior predictive for new inputs, from ``num_samples`` draws in one batched pass.

        Args:
            x: ``(N, T, F)`` features (``(N, P)`` for non-sequence models), torch or numpy.
            mask: ``(N, T)`` bool, True = real step, or None.
            num_samples: posterior draws ``S`` (1 for point estimates; None: every draw of a
                sampled posterior). A sampled posterior keeps its (chain, draw) grid: each of
                its K chains gives ``ceil(num_samples / K)`` draws, at most those it kept, so
                ``S`` may round up to a multiple of K or stop at every kept draw (``draw``).
            seed: seeds the draws and the pass; same seed, same numbers.
            batch_size: at most this many rows per forward pass.
            memory_budget: bytes the intermediates of one forward pass may take (default 256 MiB;
                None: no limit); rows and, if need be, draws are split into passes to fit.
            draws: explicit draws (``draw``) instead of ``num_samples`` fresh ones (which is
                then not read).
            distributed: split the rows over the ranks of the initialised ``torch.distributed``
                process group (``torchrun``): every rank calls ``predict`` with the same
                arguments, runs a contiguous share of the rows with the same draws, and receives
                the whole result, all-gathered in row order (ranks whose inputs, draws or seed
                differ are refused first). Probabilities, locations and variances equal one
                process's; random draws per row (regression ``samples``, MC-dropout masks)
                start each rank's share from ``seed``, so they differ.

        Returns:
            Classification (categorical likelihood): ``Prediction`` with ``probs (S, N, C)``.
            Otherwise ``RegressionPrediction`` with ``samples``, ``loc`` and ``variance``
            ``(S, N, ...)`` (CPU tensors) and the likelihood's ``df`` (``inf`` for a Normal,
            None for a family other than Normal and Student-t).

        Raises:
            TypeError/ValueError: malformed inputs (see the model's ``validate``);
                ``distributed=True`` without a process group.
            distributed.RankLostError: a peer rank died or did not answer in time.
        """
        with together(joined(distributed), "predict's argument checks"):
            x, mask, _ = self._inputs(x, mask)
        read = predictive_reader(self.model.likelihood_site)
        out = self._run(
            read, x, None, mask, draws, num_samples, seed, batch_size, memory_budget, distributed
        )
        out = {k: v.flatten(0, 1) for k, v in out.items()}
        if "probs" in out:
            return Prediction(**out)
        df = _one_df(out.pop("df", None))
        return RegressionPrediction(**out, df=df)

    def attention(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        module: str | None = None,
        num_samples: int | None = 100,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        draws: Draws | None = None,
    ) -> PosteriorAttention:
        """Posterior distribution of the attention weights of ``module`` for inputs ``x``.

        Args:
            x, mask: as for ``predict`` (``n`` sequences).
            module: kind of attention (default: the model's first, ``"encoder.self"``).
            num_samples, seed, batch_size, memory_budget, draws: as for ``predict``.

        Returns:
            ``PosteriorAttention`` with samples ``(chain, draw, n, layer, head, query, key)``.

        Raises:
            TypeError: the model declares no ``attention_modules``.
            ValueError: unknown ``module``, or malformed inputs.
        """
        kinds = getattr(self.model, "attention_modules", None)
        if not kinds:
            raise TypeError(f"{type(self.model).__name__} declares no attention_modules")
        module = module or next(iter(kinds))
        if module not in kinds:
            raise ValueError(f"module must be one of {sorted(kinds)}, got {module!r}")
        x, mask, _ = self._inputs(x, mask)
        read = attention_reader(kinds[module])
        out = self._run(
            read, x, None, mask, draws, num_samples, seed, batch_size, memory_budget, False
        )
        return PosteriorAttention(samples=out["attention"], module=module)

    def log_likelihood(self, data: SequenceData, **options) -> torch.Tensor:
        """Pointwise log-likelihood ``log p(y_i | x_i, theta_s)`` in nats, ``(chain, draw, N)``:
        the first output of ``pointwise(data, **options)`` (``num_samples``, ``seed``,
        ``batch_size``, ``draws``).

        Raises:
            ValueError: ``data.y`` is None, or malformed data.
        """
        self._training_inputs(data, "the log-likelihood")
        return self.pointwise(data, **options)[0]

    def pointwise(
        self,
        data: SequenceData,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        draws: Draws | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Pointwise log-likelihood and posterior-predictive replicates of ``data``'s targets.

        Returns:
            ``(log_lik, replicated)``: ``(chain, draw, N)`` log-likelihood in nats (None when
            ``data.y`` is None) and ``(chain, draw, N, ...)`` draws of ``y`` from the predictive.

        Raises:
            TypeError/ValueError: ``data`` not a ``SequenceData``, or malformed for the model.
        """
        check_data(data)
        x, mask, y = self._inputs(data.x, data.mask, data.y)
        read = pointwise_reader(self.model.likelihood_site, log_lik=y is not None)
        budget = DEFAULT_MEMORY_BUDGET
        out = self._run(read, x, y, mask, draws, num_samples, seed, batch_size, budget, False)
        return out.get("log_lik"), out["replicated"]

    # -- export, diagnostics, persistence: the functions of their modules, as methods ----------

    to_inference_data = to_inference_data
    diagnose = diagnose
    head_importance = head_importance
    prune_heads = prune_heads
    save = save_posterior

    def effective_num_heads(self, *, num_samples: int | None = None, seed: int = 0) -> float:
        """Sum over layers and heads of the posterior mean gate: the number of heads in use."""
        table = self.head_importance(num_samples=num_samples, seed=seed)
        return float(table.loc[table["active"], "mean"].sum())

    def __repr__(self) -> str:
        return (
            f"Posterior(model={type(self.model).__name__}, method={self.record.get('method')!r}, "
            f"{self.source.describe()}, latent_sites={len(self.latent_shapes)})"
        )


def _sum_log_prob(sites) -> torch.Tensor:
    """Sum of ``log_prob`` over non-plate sample sites, keeping the draws' batch dims."""
    total = torch.zeros(())
    for site in sites:
        if not site_is_subsample(site):
            total = total + site["fn"].log_prob(site["value"]).detach().cpu()
    return total


def _one_df(df: torch.Tensor | None) -> float | None:
    """The one degrees of freedom of every entry's Normal (``inf``) or Student-t likelihood, or
    None (another family, or degrees of freedom that differ between entries)."""
    if df is None or df.numel() == 0 or not bool((df == df.flatten()[0]).all()):
        return None
    return float(df.flatten()[0])
