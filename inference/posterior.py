"""``Posterior``: the one result type of every fit (SVI, MCMC, MAP, ensembles)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pandas as pd
import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta, AutoGuide
from pyro.nn import PyroModule
from torch import nn

from probtransformer.attention import amortized
from probtransformer.datasets import SequenceData
from probtransformer.inference._pyro_compat import site_is_subsample
from probtransformer.inference._runtime import is_invalid_parameter_error, pyro_scope, seeded
from probtransformer.inference.guides import AmortizedGuide
from probtransformer.inference.model_checks import (
    DRAWS_DIM,
    DRAWS_PLATE,
    check_draw_batch_shape,
    latent_sites,
)
from probtransformer.inference.prediction import (
    PosteriorAttention,
    Prediction,
    RegressionPrediction,
)

#: Rows per vectorized forward pass in ``predict``/``attention``/``log_likelihood``.
DEFAULT_BATCH_SIZE = 256

#: Bytes the intermediate tensors of one forward pass of ``predict``/``attention``/
#: ``pointwise`` may take (256 MiB): rows, and if need be draws, are split into passes to fit.
#: Larger passes are not faster on a CPU: 100 draws of the digits classifier on 450 rows took
#: 4.7 s in passes of up to 1 GiB and 3.4 s of up to 256 MiB or 64 MiB (memory traffic; see
#: ``benchmarks/predictive_cost.py``).
DEFAULT_MEMORY_BUDGET = 2**28

#: Guide draws when an export or diagnostic is not told how many (sample-based: all draws).
DEFAULT_NUM_SAMPLES = 100


def check_model(model: object) -> None:
    """Reject objects that do not follow the model protocol (DESIGN.md).

    Raises:
        TypeError: not a ``PyroModule``, or ``likelihood_site``/``config`` missing or mistyped.
    """
    if not isinstance(model, PyroModule):
        raise TypeError(f"model must be a pyro.nn.PyroModule, got {type(model).__name__}")
    if not isinstance(getattr(model, "likelihood_site", None), str):
        raise TypeError(f"{type(model).__name__} must define likelihood_site: str")
    if not isinstance(getattr(model, "config", None), dict):
        raise TypeError(f"{type(model).__name__} must define config: dict of constructor args")


def example_of(data: SequenceData) -> SequenceData:
    """The first (up to) two rows of ``data`` on CPU: enough to trace the model and guide."""
    return data[: min(2, len(data))].to("cpu")


def rows_digest(x: torch.Tensor, y: torch.Tensor | None, mask: torch.Tensor | None) -> str:
    """SHA-256 of the shapes, dtypes and values of ``(x, y, mask)``: recognises the training data
    whose rows the local latents kept by a sample-based posterior belong to."""
    digest = hashlib.sha256()
    for tensor in (x, y, mask):
        if tensor is None:
            digest.update(b"None")
            continue
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _as_tensor(value: object, name: str) -> torch.Tensor | None:
    if value is None:
        return value
    if isinstance(value, torch.Tensor):
        return check_not_meta(value, name)
    if hasattr(value, "to_numpy"):
        value = value.to_numpy()
    if isinstance(value, np.ndarray):
        # a copy where numpy's memory is read-only (pandas) or strided; float64 -> float32
        array = value.astype(np.float32) if value.dtype == np.float64 else value
        return torch.from_numpy(np.require(array, requirements=["C", "W"]))
    raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")


def check_not_meta(value: torch.Tensor, name: str) -> torch.Tensor:
    """``value``, unless it is on PyTorch's ``meta`` device (shapes without values).

    Raises:
        ValueError: naming ``name``.
    """
    if value.device.type == "meta":
        raise ValueError(
            f"{name} is on the 'meta' device, which holds shapes but no values: create it on "
            "'cpu' or 'cuda'"
        )
    return value


class Posterior:
    """A fitted model with its posterior: predictions, attention, ArviZ export, diagnostics.

    Build one with ``fit_svi`` (or the other ``fit_*``) rather than directly. SVI posteriors keep
    the guide and draw fresh samples from it for each call (reproducible through ``seed``);
    sample-based posteriors keep their draws with ``(chain, draw)`` dims and thin them evenly
    to ``num_samples``.

    Two baselines (``inference.baselines``) run one forward pass per draw instead of one
    vectorized pass for all draws: ``mc_dropout=True`` keeps the model's ``nn.Dropout`` modules
    active at prediction, each draw a pass with fresh dropout masks (Gal & Ghahramani 2016);
    ``members`` holds the model's parameters for each draw (a deep ensemble's members,
    Lakshminarayanan et al. 2017), copied into the model for that draw's pass.

    Local latents (sampled inside ``pyro.plate("data")``, one value per training row, e.g. the
    school effects of eight schools) may be kept in ``samples`` as ``(chain, draw, N, *per_row)``
    (``fit_mcmc`` keeps them). They belong to the training rows: a pass over exactly the training
    data (``record["training_data_sha256"]``, see ``rows_digest``) is conditioned on them;
    any other input draws them from the model given each draw of the global latents.

    Attributes:
        model: the fitted model (on the fit's device, in eval mode for prediction; for an
            ensemble it holds the first member's parameters between calls).
        guide: the fitted autoguide (SVI), else None.
        samples: ``{site: (chain, draw, *shape)}`` draws (sample-based), else None; local
            latents ``(chain, draw, N, *per_row)``.
        latent_shapes: ``{site: shape}`` of the global latent sites.
        local_shapes: ``{site: per_row_shape}`` of the local latent sites (not those of
            stochastic attention, which are re-drawn for any input).
        members: ``{name: (chain, draw, *shape)}``, the model's parameter ``name`` (of
            ``named_parameters``: its point estimates) for each draw of ``samples`` (ensembles),
            else None. Buffers (prior constants, head masks) are the model's, shared by all.
        mc_dropout: dropout stays on at prediction (MC dropout).
        record: what the fit did: method, settings, seconds, ``elbo`` trace (SVI) ...
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
    ) -> None:
        if (guide is None) == (samples is None):
            raise ValueError("a Posterior needs exactly one of guide or samples")
        if members is not None and samples is None:
            raise ValueError("members need samples: one latent draw per member")
        if mc_dropout and not dropout_modules(model):
            raise ValueError(
                f"mc_dropout=True needs dropout: {type(model).__name__} has no torch.nn.Dropout "
                "module with p > 0"
            )
        self.model = model.eval()  # prediction mode: dropout off (on per pass for MC dropout)
        self.guide = guide
        self.samples = samples
        self.members = members
        self.mc_dropout = bool(mc_dropout)
        self.record = record
        self.example = example
        tensors = itertools.chain(model.parameters(), model.buffers())
        self._device = next(tensors, torch.empty(0)).device
        self.latent_shapes, self.local_shapes = latent_sites(model, example.to(self._device))
        if samples is not None:
            _check_samples(samples, self.latent_shapes, self.local_shapes)
        if members is not None:
            _check_members(members, model, samples)

    # -- draws ------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the model lives (inputs are moved there; results come back on CPU)."""
        return self._device

    @property
    def is_point_estimate(self) -> bool:
        """True when every draw is the same (MAP): predictions use one draw. False for MC
        dropout and ensembles, whose draws differ through dropout masks or member parameters."""
        if self.mc_dropout or self.members is not None:
            return False
        return isinstance(self.guide, AutoDelta) or not self.latent_shapes

    def draws(self, num_samples: int | None = None, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """Posterior draws of every latent site with ``(chain, draw)`` leading dims.

        Local latents kept by a sample-based posterior come as ``(chain, draw, N, *per_row)``.
        SVI: one chain of ``num_samples`` fresh guide draws (None: ``DEFAULT_NUM_SAMPLES``).
        Sample-based: each chain thinned evenly to ``ceil(num_samples / num_chains)`` draws
        (None: every draw). Point estimates: one draw.

        Returns:
            ``{site: (chain, draw, *shape)}`` on the model's device.

        Raises:
            ValueError: ``num_samples < 1``.
        """
        if num_samples is None:
            if self.samples is not None:
                return dict(self.samples)
            num_samples = DEFAULT_NUM_SAMPLES
        _check_num_samples(num_samples)
        if self.is_point_estimate:
            num_samples = 1
        if self.samples is not None:
            return {name: _thin(value, num_samples) for name, value in self.samples.items()}
        with seeded(seed, self.device):
            return {name: v[None] for name, v in self._guide_draws(num_samples).items()}

    def sample_stats(self, num_samples: int | None = None) -> dict[str, torch.Tensor]:
        """Per-draw sampler statistics ``{name: (chain, draw)}`` of an MCMC posterior, thinned
        like ``draws(num_samples)`` (ArviZ names: ``diverging``, ``acceptance_rate``,
        ``step_size``, ``tree_depth``, ``n_steps``, ``energy``, ``lp``); ``{}`` for others."""
        stats = self.record.get("sample_stats") or {}
        out = {name: torch.from_numpy(np.asarray(value)) for name, value in stats.items()}
        if num_samples is None or not out:
            return out
        _check_num_samples(num_samples)
        return {name: _thin(value, num_samples) for name, value in out.items()}

    def _guide_trace(self, num_samples: int) -> poutine.Trace:
        ex = self.example.to(self.device)
        with pyro_scope(), torch.no_grad(), pyro.plate("_draws", num_samples, dim=-2):
            return poutine.trace(self.guide).get_trace(ex.x, ex.y, ex.mask)

    def _guide_draws(self, num_samples: int) -> dict[str, torch.Tensor]:
        return self._latents_of(self._guide_trace(num_samples), num_samples)

    def _latents_of(self, trace: poutine.Trace, num_samples: int) -> dict[str, torch.Tensor]:
        """``{site: (num_samples, *shape)}`` values of the latent sites in ``trace``."""
        return {
            name: trace.nodes[name]["value"].detach().reshape(num_samples, *shape)
            for name, shape in self.latent_shapes.items()
        }

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
        if self.guide is None or self.is_point_estimate or self.mc_dropout:
            raise ValueError("importance weights need a non-degenerate SVI guide")
        if isinstance(self.guide, AmortizedGuide):
            raise ValueError(
                "importance weights of a guide with local latents (stochastic attention) are not "
                "available: they would need every training sequence's local latents"
            )
        check_data(data)
        if data.y is None:
            raise ValueError("data.y is None: the importance weights need observed targets")
        num = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples
        _check_num_samples(num)
        x, mask, y = self._inputs(data.x, data.mask, data.y)
        with seeded(seed, self.device):
            trace = self._guide_trace(num)
        log_q = (
            _sum_log_prob(site for site in trace.nodes.values() if site["type"] == "sample")
            .reshape(num, -1)
            .sum(-1)
        )
        draws = self._latents_of(trace, num)

        def read(model_trace):
            site = model_trace.nodes[self.model.likelihood_site]
            latent = (model_trace.nodes[name] for name in self.latent_shapes)
            return {
                "log_lik": site["fn"].log_prob(site["value"]).reshape(num, -1),
                "log_prior": _sum_log_prob(latent).reshape(num, -1).sum(-1, keepdim=True),
            }

        with seeded(seed, self.device):
            out = self._run(draws, x, y, mask, read, batch_size)
        log_joint = out["log_lik"].double().sum(-1) + out["log_prior"][:, 0].double()
        return log_joint - log_q.double().cpu()

    # -- vectorized forward passes ----------------------------------------------------------

    def _run(
        self,
        flat_draws: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor | None,
        mask: torch.Tensor | None,
        read: Callable[[poutine.Trace], dict[str, torch.Tensor]],
        batch_size: int,
        *,
        states: dict[str, torch.Tensor] | None = None,
        count: int | None = None,
        draws_per_pass: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """``_run_vectorized`` over all draws, over ``draws_per_pass`` draws at a time, or for MC
        dropout and ensembles one pass per draw.

        A vectorized pass would reuse one dropout mask for all draws wherever a tensor has no
        draw dim yet, and it cannot give each draw its own parameters: draw ``s`` runs alone,
        with dropout on (MC dropout) and parameters ``{name: states[name][s]}`` (ensembles); the
        model's dropout mode and parameters are restored afterwards, also on errors.

        Args:
            states: ``{name: (S, *shape)}`` model parameters per draw, or None.
            count: number of draws ``S`` when ``flat_draws`` is empty (no latent sites).
            draws_per_pass: draws per vectorized pass (None: all).
        """
        num = next(iter(flat_draws.values())).shape[0] if flat_draws else count or 1
        step = 1 if self.mc_dropout or states is not None else draws_per_pass or num
        if step >= num:
            return self._run_vectorized(flat_draws, x, y, mask, read, batch_size)
        outs = []
        with _dropout_active(self.model, self.mc_dropout), _parameters_kept(self.model, states):
            for s in range(0, num, step):
                if states is not None:
                    _set_parameters(self.model, {k: v[s] for k, v in states.items()})
                draw = {k: v[s : s + step] for k, v in flat_draws.items()}
                outs.append(self._run_vectorized(draw, x, y, mask, read, batch_size))
        return {key: torch.cat([out[key] for out in outs]) for key in outs[0]}

    def _run_vectorized(
        self,
        flat_draws: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor | None,
        mask: torch.Tensor | None,
        read: Callable[[poutine.Trace], dict[str, torch.Tensor]],
        batch_size: int,
    ) -> dict[str, torch.Tensor]:
        """Run the model once per row batch for all draws at once; ``read`` picks the outputs.

        Local latents in ``flat_draws`` (``(S, N, *per_row)``, ``x`` being the training data)
        condition each batch on its rows. Each output of ``read`` has dims ``(S, n, ...)``;
        batches are joined along ``n`` on CPU.

        Raises:
            ValueError: non-finite outputs, or a likelihood whose batch shape is not
                ``(S, n)`` (a latent broadcast against the draw dim; ``check_draw_batch_shape``).
        """
        num = next(iter(flat_draws.values())).shape[0] if flat_draws else 1
        site = self.model.likelihood_site
        local = {k: v for k, v in flat_draws.items() if k in self.local_shapes}
        condition = {
            k: v.reshape(num, 1, *v.shape[1:]) for k, v in flat_draws.items() if k not in local
        }
        pieces: dict[str, list[torch.Tensor]] = {}
        with pyro_scope(), torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                args = (
                    x[rows],
                    None if y is None else y[rows],
                    None if mask is None else mask[rows],
                )
                rows_condition = {**condition, **{k: v[:, rows] for k, v in local.items()}}
                model = _LikelihoodNotSampled(site, self.device)(
                    poutine.condition(self.model, data=rows_condition)
                )
                if isinstance(self.guide, AmortizedGuide):  # local latents from the guide
                    model = amortized(self.guide)(model)
                try:
                    with pyro.plate(DRAWS_PLATE, num, dim=DRAWS_DIM):  # -1: the data plate
                        trace = poutine.trace(model).get_trace(*args)
                except ValueError as e:
                    if not is_invalid_parameter_error(e):
                        raise
                    raise ValueError(
                        f"the model's outputs are not finite for input rows {rows.start} to "
                        f"{min(rows.stop, x.shape[0]) - 1}: are the inputs scaled as in training?"
                    ) from e
                check_draw_batch_shape(site, trace.nodes[site]["fn"], num, args[0].shape[0])
                for key, value in read(trace).items():
                    pieces.setdefault(key, []).append(value.cpu())
        return {
            key: torch.cat([v.expand(num, *v.shape[1:]) for v in values], dim=1)
            for key, values in pieces.items()
        }

    def _inputs(
        self, x, mask, y=None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x, mask, y = _as_tensor(x, "x"), _as_tensor(mask, "mask"), _as_tensor(y, "y")
        if hasattr(self.model, "validate"):
            self.model.validate(x, y, mask)
        if x.is_floating_point() and x.dtype != torch.float32:
            x = x.float()  # float64 (or half) features -> the model's float32
        _warn_out_of_range(x, self.record.get("x_range"))
        device = self.device
        return (
            x.to(device),
            None if mask is None else mask.to(device),
            None if y is None else y.to(device),
        )

    def _likelihood(self, trace: poutine.Trace):
        return trace.nodes[self.model.likelihood_site]["fn"]

    def _evaluate(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        mask: torch.Tensor | None,
        read: Callable[[poutine.Trace], dict[str, torch.Tensor]],
        *,
        num_samples: int | None,
        seed: int,
        batch_size: int,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
    ) -> dict[str, torch.Tensor]:
        """``_run`` over seeded posterior draws; outputs come back as ``(chain, draw, n, ...)``.

        Each forward pass holds at most ``batch_size`` rows, and the rows and draws of a pass are
        chosen so that the estimated intermediates (``activation_bytes``) fit ``memory_budget``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if memory_budget is not None and (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, int)
            or memory_budget < 1
        ):
            raise ValueError(
                f"memory_budget must be a number of bytes >= 1 or None, got {memory_budget!r}"
            )
        draws = self.draws(num_samples, seed=seed)
        if set(draws) & set(self.local_shapes) and (
            self.record.get("training_data_sha256") != rows_digest(x, y, mask)
        ):  # kept local latents belong to the training rows: re-drawn for any other input
            draws = {k: v for k, v in draws.items() if k not in self.local_shapes}
        states = self._member_states(num_samples)
        first = next(iter({**draws, **(states or {})}.values()), None)
        if first is not None:
            chains, per_chain = first.shape[:2]
        else:  # no latent sites: one draw, or num_samples dropout passes
            chains, per_chain = 1, (num_samples or DEFAULT_NUM_SAMPLES) if self.mc_dropout else 1
        flat_states = None if states is None else _flatten_chains(states)
        num, draws_per_pass = chains * per_chain, None
        if memory_budget is not None:
            cost = activation_bytes(self.model, x)  # per draw and row
            draws_per_pass = max(1, min(num, memory_budget // cost))
            batch_size = max(1, min(batch_size, memory_budget // (cost * draws_per_pass)))
        with seeded(seed, self.device):
            out = self._run(
                _flatten_chains(draws),
                x,
                y,
                mask,
                read,
                batch_size,
                states=flat_states,
                count=num,
                draws_per_pass=draws_per_pass,
            )
        return {k: v.reshape(chains, per_chain, *v.shape[1:]) for k, v in out.items()}

    def _member_states(self, num_samples: int | None) -> dict[str, torch.Tensor] | None:
        """``members`` thinned as ``draws(num_samples)`` thins ``samples``; None without."""
        if self.members is None or num_samples is None:
            return self.members
        return {name: _thin(value, num_samples) for name, value in self.members.items()}

    def predict(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        num_samples: int | None = 100,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
    ) -> Prediction:
        """Posterior predictive for new inputs, from ``num_samples`` draws in one batched pass.

        Args:
            x: ``(N, T, F)`` features (``(N, P)`` for non-sequence models), torch or numpy.
            mask: ``(N, T)`` bool, True = real step, or None.
            num_samples: posterior draws ``S`` (1 for point estimates; None: every draw of a
                sampled posterior).
            seed: seeds the draws; same seed, same numbers.
            batch_size: at most this many rows per forward pass.
            memory_budget: bytes the intermediates of one forward pass may take (default 256 MiB;
                None: no limit); rows and, if need be, draws are split into passes to fit.

        Returns:
            Classification (categorical likelihood): ``Prediction`` with ``probs (S, N, C)``.
            Otherwise ``RegressionPrediction`` with ``samples``, ``loc`` and ``variance``
            ``(S, N, ...)``. CPU tensors.

        Raises:
            TypeError/ValueError: malformed inputs (see the model's ``validate``).
        """
        x, mask, _ = self._inputs(x, mask)

        def read(trace):
            fn = self._likelihood(trace)
            categorical = _categorical(fn)
            if categorical is not None:
                return {"probs": categorical.probs}
            return {"samples": fn.sample(), "loc": fn.mean, "variance": fn.variance}

        out = self._evaluate(
            x,
            None,
            mask,
            read,
            num_samples=num_samples,
            seed=seed,
            batch_size=batch_size,
            memory_budget=memory_budget,
        )
        out = {k: v.flatten(0, 1) for k, v in out.items()}
        return Prediction(**out) if "probs" in out else RegressionPrediction(**out)

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
    ) -> PosteriorAttention:
        """Posterior distribution of the attention weights of ``module`` for inputs ``x``.

        Args:
            x, mask: as for ``predict`` (``n`` sequences).
            module: kind of attention (default: the model's first, ``"encoder.self"``).
            num_samples, seed, batch_size, memory_budget: as for ``predict``.

        Returns:
            ``PosteriorAttention`` with samples ``(chain, draw, n, layer, head, query, key)``.

        Raises:
            ValueError: unknown ``module``, or malformed inputs.
        """
        kinds = getattr(self.model, "attention_modules", None)
        if not kinds:
            raise TypeError(f"{type(self.model).__name__} declares no attention_modules")
        module = module or next(iter(kinds))
        if module not in kinds:
            raise ValueError(f"module must be one of {sorted(kinds)}, got {module!r}")
        x, mask, _ = self._inputs(x, mask)

        def read(trace):
            weights = [m.attention_weights for m in kinds[module]]  # each (s, n, H, Tq, Tk)
            size = max(w.shape[0] for w in weights)
            return {"attention": torch.stack([w.expand(size, *w.shape[1:]) for w in weights], 2)}

        out = self._evaluate(
            x,
            None,
            mask,
            read,
            num_samples=num_samples,
            seed=seed,
            batch_size=batch_size,
            memory_budget=memory_budget,
        )
        return PosteriorAttention(samples=out["attention"], module=module)

    def log_likelihood(
        self,
        data: SequenceData,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> torch.Tensor:
        """Pointwise log-likelihood ``log p(y_i | x_i, theta_s)`` in nats, ``(chain, draw, N)``.

        Raises:
            ValueError: ``data.y`` is None, or malformed data.
        """
        check_data(data)
        if data.y is None:
            raise ValueError("data.y is None: the log-likelihood needs observed targets")
        return self.pointwise(data, num_samples=num_samples, seed=seed, batch_size=batch_size)[0]

    def pointwise(
        self,
        data: SequenceData,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Pointwise log-likelihood and posterior-predictive replicates of ``data``'s targets.

        Returns:
            ``(log_lik, replicated)``: ``(chain, draw, N)`` log-likelihood in nats (None when
            ``data.y`` is None) and ``(chain, draw, N, ...)`` draws of ``y`` from the predictive.
        """
        check_data(data)
        x, mask, y = self._inputs(data.x, data.mask, data.y)

        def read(trace):
            fn = self._likelihood(trace)
            out = {"replicated": fn.sample()}
            if y is not None:
                out["log_lik"] = fn.log_prob(trace.nodes[self.model.likelihood_site]["value"])
            return out

        out = self._evaluate(
            x, y, mask, read, num_samples=num_samples, seed=seed, batch_size=batch_size
        )
        return out.get("log_lik"), out["replicated"]

    # -- export, diagnostics, persistence -----------------------------------------------------

    def to_inference_data(
        self,
        data: SequenceData,
        *,
        test: SequenceData | None = None,
        attention_obs: int = 4,
        num_samples: int | None = None,
        seed: int = 0,
    ):
        """ArviZ ``InferenceData`` of this posterior (see ``probtransformer.inference.arviz``)."""
        from probtransformer.inference.arviz import to_inference_data

        return to_inference_data(
            self, data, test=test, attention_obs=attention_obs, num_samples=num_samples, seed=seed
        )

    def diagnose(
        self,
        data: SequenceData | None = None,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        verbose: bool = True,
    ) -> pd.DataFrame:
        """Aggregated convergence diagnostics and a printed verdict (see ``diagnostics``)."""
        from probtransformer.inference.diagnostics import diagnose

        return diagnose(self, data, num_samples=num_samples, seed=seed, verbose=verbose)

    def head_importance(
        self, *, num_samples: int | None = None, prob: float = 0.9, seed: int = 0
    ) -> pd.DataFrame:
        """Posterior mean and credible interval of each head's gate in [0, 1] (see
        ``inference.heads.head_importance``); needs a model built with ``head_prior``."""
        from probtransformer.inference.heads import head_importance

        return head_importance(self, num_samples=num_samples, prob=prob, seed=seed)

    def effective_num_heads(self, *, num_samples: int | None = None, seed: int = 0) -> float:
        """Sum over layers and heads of the posterior mean gate: the number of heads in use."""
        table = self.head_importance(num_samples=num_samples, seed=seed)
        return float(table.loc[table["active"], "mean"].sum())

    def prune_heads(
        self, threshold: float, *, num_samples: int | None = None, seed: int = 0
    ) -> Posterior:
        """A copy whose model skips heads with mean gate < ``threshold`` (in [0, 1]; see
        ``inference.heads.prune_heads``)."""
        from probtransformer.inference.heads import prune_heads

        return prune_heads(self, threshold, num_samples=num_samples, seed=seed)

    def save(self, path) -> None:
        """Write this posterior to directory ``path`` (see ``serialization.save_posterior``)."""
        from probtransformer.inference.serialization import save_posterior

        save_posterior(self, path)

    def __repr__(self) -> str:
        kind = type(self.guide).__name__ if self.guide is not None else "samples"
        if self.mc_dropout:
            kind += " + MC dropout"
        if self.members is not None:
            kind += f", members={math.prod(next(iter(self.members.values())).shape[:2])}"
        return (
            f"Posterior(model={type(self.model).__name__}, method={self.record.get('method')!r}, "
            f"{kind}, latent_sites={len(self.latent_shapes)})"
        )


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Estimated bytes of the intermediate tensors of one forward pass, per draw and input row.

    Attention dominates: each module keeps about 4 float32 ``(H, T, T)`` tensors (logits,
    masked logits, weights, recorded weights) and about 12 ``(T, d)`` activations, with ``T``
    the input length plus one (a CLS token). Models without ``attention_modules`` count 16
    copies of an input row.
    """
    steps = (x.shape[1] if x.dim() > 1 else 1) + 1
    elements = 0
    for modules in getattr(model, "attention_modules", {}).values():
        for m in modules:
            elements += 4 * m.num_heads * steps * steps + 12 * steps * m.d_model
    return 4 * max(elements, 16 * x[0].numel(), 1)


def check_data(data: object, name: str = "data") -> None:
    """Raise ``TypeError`` unless ``data`` is a ``SequenceData``."""
    if not isinstance(data, SequenceData):
        raise TypeError(
            f"{name} must be a probtransformer.datasets.SequenceData (e.g. splits.train), "
            f"got {type(data).__name__}"
        )


def _warn_out_of_range(x: torch.Tensor, x_range: list[float] | None) -> None:
    """Warn when features lie far outside the training range (a preprocessing mismatch)."""
    if not x_range or not x.is_floating_point():
        return
    low, high = x_range
    span = max(high - low, 1e-12)
    got_low, got_high = float(x.min()), float(x.max())
    if got_low < low - span or got_high > high + span:
        warnings.warn(
            f"x spans [{got_low:.4g}, {got_high:.4g}] but the training features spanned "
            f"[{low:.4g}, {high:.4g}]: check that the inputs are preprocessed as in training",
            UserWarning,
            stacklevel=4,
        )


def _check_num_samples(num_samples: object) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")


def dropout_modules(model: nn.Module) -> list[nn.Dropout]:
    """The model's ``torch.nn.Dropout`` modules with ``p > 0`` (what MC dropout keeps on)."""
    return [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]


@contextlib.contextmanager
def _dropout_active(model: nn.Module, active: bool) -> Iterator[None]:
    """Put only the model's ``nn.Dropout`` modules in train mode (when ``active``); restore
    each module's mode afterwards, also on errors."""
    modules = [m for m in model.modules() if isinstance(m, nn.Dropout)] if active else []
    modes = [m.training for m in modules]
    try:
        for module in modules:
            module.train()
        yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            module.train(mode)


def _set_parameters(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into the model's parameters of those names, in place."""
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            parameters[name].copy_(value)


@contextlib.contextmanager
def _parameters_kept(model: nn.Module, states: dict | None) -> Iterator[None]:
    """Restore the model's parameters after the block when ``states`` will overwrite them."""
    kept = None
    if states is not None:
        kept = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        yield
    finally:
        if kept is not None:
            _set_parameters(model, kept)


def _check_members(
    members: dict[str, torch.Tensor], model: nn.Module, samples: dict[str, torch.Tensor]
) -> None:
    """Members must hold every parameter of the model with ``(chain, draw, *shape)``,
    ``(chain, draw)`` shared with each other and with ``samples``."""
    state = dict(model.named_parameters())
    if set(members) != set(state):
        raise ValueError(
            f"members must hold every parameter of the model ({len(state)} in named_parameters)"
            f", got {len(members)} of which {len(set(members) - set(state))} are not the model's"
        )
    leading = {tuple(v.shape[:2]) for v in (*members.values(), *samples.values())}
    for name, value in members.items():
        if value.dim() < 2 or value.shape[2:] != state[name].shape or len(leading) > 1:
            raise ValueError(
                f"members[{name!r}] must have shape (chain, draw, *{tuple(state[name].shape)}) "
                f"with the (chain, draw) of samples, got {tuple(value.shape)}"
            )


def _check_samples(
    samples: dict[str, torch.Tensor],
    shapes: dict[str, torch.Size],
    local_shapes: dict[str, torch.Size],
) -> None:
    """Draws must cover every global latent site with ``(chain, draw, *site shape)`` and may
    hold local ones with ``(chain, draw, N, *per_row shape)``; ``(chain, draw)`` and ``N``
    shared."""
    if not set(shapes) <= set(samples) <= set(shapes) | set(local_shapes):
        may = f" (and may hold its local latents {sorted(local_shapes)})" if local_shapes else ""
        raise ValueError(
            f"samples must hold the model's latent sites {sorted(shapes)}{may}, got "
            f"{sorted(samples)}"
        )
    leading = {tuple(value.shape[:2]) for value in samples.values()}
    rows = {value.shape[2] for name, value in samples.items() if name in local_shapes}
    for name, value in samples.items():
        if name in local_shapes:
            shape = local_shapes[name]
            wanted = f"(chain, draw, N, *{tuple(shape)}) with the N of the other local latents and"
            ok = value.dim() >= 3 and value.shape[3:] == shape and len(rows) == 1
        else:
            wanted = f"(chain, draw, *{tuple(shapes[name])}) with"
            ok = value.dim() >= 2 and value.shape[2:] == shapes[name]
        if not ok or len(leading) > 1:
            raise ValueError(
                f"samples[{name!r}] must have shape {wanted} the same (chain, draw) as the "
                f"other sites, got {tuple(value.shape)}"
            )


class _LikelihoodNotSampled(poutine.messenger.Messenger):
    """Skip drawing the unobserved likelihood site: every reader uses its ``fn`` (probs, loc,
    or its own ``fn.sample()``), and a categorical draw over (S, N, T, V) costs as much as a
    third of a token model's forward pass. The site's value is a placeholder of zeros."""

    def __init__(self, site: str, device: torch.device) -> None:
        super().__init__()
        self.site = site
        self.device = device

    def _pyro_sample(self, msg) -> None:
        if msg["name"] == self.site and msg["value"] is None and not msg["is_observed"]:
            fn = msg["fn"]
            dtype = torch.long if fn.support.is_discrete else torch.get_default_dtype()
            msg["value"] = torch.zeros(fn.shape(), dtype=dtype, device=self.device)


def _categorical(fn) -> torch.distributions.Categorical | None:
    """The ``Categorical`` inside ``fn`` (through ``.to_event``/``.mask`` wrappers), or None."""
    while not isinstance(fn, torch.distributions.Categorical):
        fn = getattr(fn, "base_dist", None)
        if fn is None:
            return None
    return fn


def _sum_log_prob(sites) -> torch.Tensor:
    """Sum of ``log_prob`` over non-plate sample sites, keeping the draws' batch dims."""
    total = torch.zeros(())
    for site in sites:
        if not site_is_subsample(site):
            total = total + site["fn"].log_prob(site["value"]).detach().cpu()
    return total


def _thin(value: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Evenly thin ``(chain, draw, ...)`` to ``ceil(num_samples / chain)`` draws per chain."""
    chains, draws = value.shape[:2]
    keep = min(draws, math.ceil(num_samples / chains))
    index = torch.linspace(0, draws - 1, keep).round().long().to(value.device)
    return value.index_select(1, index)


def _flatten_chains(draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.flatten(0, 1) for name, value in draws.items()}
