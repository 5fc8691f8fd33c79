"""SVI step overhead: one ``fit_svi`` step against a plain training step of the same network.

The contenders train on mini-batches of the same size, in one process:

- ``svi``: one ``svi_step`` of an ``svi_init(guide="normal")`` state, the very step that
  ``fit_svi`` loops over: the next mini-batch of the training set, the mean-field ELBO
  (``inference.vi.elbo.MeanFieldELBO``) of the model and an ``AutoNormal`` guide
  (``init_to_sample``, ``init_scale=1e-3``) in the fit's own param-store and RNG state, Pyro's
  validation on for the first evaluation only, the NaN guard, Adam and the learning-rate decay.
- ``svi-pyro``: the same step with Pyro's own ``TraceMeanField_ELBO`` and validation on every
  step: what ``fit_svi`` did before ``MeanFieldELBO``, kept to show what that change saves.

The other two run ``fit_svi``'s step machinery by hand on one fixed mini-batch (zero grad,
loss, backward, ``clip_grad_norm_(params, inf)`` and ``loss.item()`` as the finiteness check,
Adam and exponential learning-rate decay):

- ``deterministic``: the same ``SequenceClassifier`` built with ``bayesian=()`` (every weight a
  point estimate, hence no logit scale either), dropout matched; cross-entropy of the logits of
  its network parts (embedding -> encoder -> mean pooling -> head), no Pyro sample sites.
- ``torch``: ``torch.nn.TransformerEncoder`` of the same size (pre-norm, GELU, final LayerNorm)
  between an input projection plus the same sinusoidal positions and mean pooling plus a linear
  head. In training mode PyTorch takes its regular path: the fused "fast path" of
  ``TransformerEncoderLayer`` serves inference (eval mode, no grad) only.

Contenders alternate within each round (the order rotates from round to round) so drift in the
machine's load reaches all of them; each round times ``--steps`` steps and a contender's figure is
the median over rounds of ms/step (wall clock; the CPU time of the process is shown next to it).
``--profile`` adds a breakdown of an SVI step by phase and by where its forward time goes (inside
tensor operations vs outside them: Pyro's bookkeeping and other Python).

Threads default to 1 (``--threads``): the steps are made of hundreds of small operations, and on
a 2-core machine that other processes share, two intra-op threads wait on each other at every
operation whenever one of them loses its core (steps measured 10-20x slower, spread 2x), so the
figure would measure the neighbours rather than the code.

Usage::

    python -m benchmarks.studies.svi_overhead                          # digits size (DESIGN.md)
    python -m benchmarks.studies.svi_overhead --d-model 64 --seq-len 32
    python -m benchmarks.studies.svi_overhead --profile

The last line printed is ``ratio <svi ms/step / deterministic ms/step>``; figures and findings
are kept in ``benchmarks/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO
from torch import nn

from probtransformer.datasets import SequenceData, load
from probtransformer.inference import SVIState, svi_init, svi_step
from probtransformer.inference._runtime import pyro_scope, reinitialised_copy, resolve_device
from probtransformer.models import SequenceClassifier
from probtransformer.positional import SinusoidalPositionalEncoding

DIGITS_LEN = 8  # digits rows are sequences of T=8 steps with F=8 features
IN_FEATURES = 8
NUM_CLASSES = 10
NUM_HEADS = 4
NUM_LAYERS = 2
DROPOUT = 0.1
SYNTHETIC_NUM_DATA = 1024  # training-set size N used for the likelihood scale with --seq-len != 8
# fit_svi defaults, so the learning-rate schedule does the same work per step
LR = 3e-3
LR_DECAY = 0.1
NUM_STEPS = 3000
INIT_SCALE = 1e-3
SEED = 0

StepFn = Callable[[], float]


@dataclass(frozen=True)
class Batch:
    """One mini-batch and the training set it is drawn from.

    Attributes:
        x: ``(B, T, F)`` float32 features.
        y: ``(B,)`` int64 labels.
        num_data: training-set size ``N`` (likelihood scale ``N / B``).
        source: where the data came from, for the header.
        train: the whole training set, ``(N, T, F)`` and ``(N,)``: the SVI contenders walk
            through it in mini-batches of ``B``, as ``fit_svi`` does.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_data: int
    source: str
    train: SequenceData


def make_batch(seq_len: int, batch_size: int, device: torch.device) -> Batch:
    """The digits training split at ``seq_len == 8``, random sequences of ``seq_len`` otherwise.

    The batch is a seeded random subset of ``batch_size`` rows (capped at ``N``, as in fit_svi).
    """
    generator = torch.Generator().manual_seed(SEED)
    if seq_len == DIGITS_LEN:
        train = load("digits", seed=SEED).train
        x, y, source = train.x, train.y, f"digits train split (N={len(train)})"
    else:
        x = torch.randn(SYNTHETIC_NUM_DATA, seq_len, IN_FEATURES, generator=generator)
        y = torch.randint(0, NUM_CLASSES, (SYNTHETIC_NUM_DATA,), generator=generator)
        source = f"synthetic N(0, 1) sequences (N={SYNTHETIC_NUM_DATA})"
    n = len(x)
    idx = torch.randperm(n, generator=generator)[: min(batch_size, n)]
    return Batch(x[idx].to(device), y[idx].to(device), n, source, SequenceData(x, y).to(device))


def make_classifier(
    d_model: int, seq_len: int, *, bayesian: Sequence[str], device: torch.device
) -> SequenceClassifier:
    """``SequenceClassifier(8, 10, seq_len)`` of width ``d_model`` (``d_ff = 2 d_model``),
    re-initialised and moved as ``fit_svi`` does, in training mode."""
    model = reinitialised_copy(_classifier(d_model, seq_len, bayesian), SEED, device)
    return model.train()


def _classifier(d_model: int, seq_len: int, bayesian: Sequence[str]) -> SequenceClassifier:
    return SequenceClassifier(
        IN_FEATURES,
        NUM_CLASSES,
        seq_len,
        d_model=d_model,
        num_heads=NUM_HEADS,
        num_layers=NUM_LAYERS,
        d_ff=2 * d_model,
        dropout=DROPOUT,
        bayesian=tuple(bayesian),
    )


class TorchTransformer(nn.Module):
    """Reference network from ``torch.nn`` with the classifier's architecture.

    Shapes:
        ``forward(x)``: ``(N, T, F)`` -> logits ``(N, C)``.
    """

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, d_model)
        self.positional = SinusoidalPositionalEncoding(d_model, max_len)
        layer = nn.TransformerEncoderLayer(
            d_model,
            NUM_HEADS,
            dim_feedforward=2 * d_model,
            dropout=DROPOUT,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, NUM_LAYERS, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.positional(self.embed(x)))  # (N, T, d)
        return self.head(h.mean(dim=1))  # (N, C)


def _train_step(loss_of: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> StepFn:
    """One optimisation step as in ``fit_svi``: the shared machinery of every contender."""
    optimizer = torch.optim.Adam(params, lr=LR)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=LR_DECAY ** (1 / NUM_STEPS))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
        value = loss.item()
        if not (math.isfinite(value) and torch.isfinite(grad_norm)):
            raise FloatingPointError(f"non-finite loss {value} or gradient norm {grad_norm}")
        optimizer.step()
        scheduler.step()
        return value

    return step


def svi_state(
    d_model: int, seq_len: int, batch: Batch, device: torch.device, *, pyro_elbo: bool = False
) -> SVIState:
    """``svi_init``'s state of the latent-attention classifier on ``batch.train``, with
    ``fit_svi``'s defaults and mini-batches of ``len(batch.x)``.

    ``pyro_elbo``: the state's loss becomes Pyro's ``TraceMeanField_ELBO`` of the same model
    and guide with validation on every step (``fit_svi`` before ``MeanFieldELBO``); the
    parameters, optimizer and mini-batches stay the state's.
    """
    state = svi_init(
        _classifier(d_model, seq_len, ("attention", "head")),
        batch.train,
        guide="normal",
        num_steps=NUM_STEPS,
        batch_size=len(batch.x),
        lr=LR,
        lr_decay=LR_DECAY,
        init_scale=INIT_SCALE,
        device=device,
        seed=SEED,
    )
    if not pyro_elbo:
        return state
    loss_fn = TraceMeanField_ELBO(num_particles=1)(state.model, state.guide)

    def validated(*args, **kwargs) -> torch.Tensor:
        with pyro.validation_enabled(True):
            return loss_fn(*args, **kwargs)

    return dataclasses.replace(state, loss_fn=validated)


def state_loss(state: SVIState, batch: Batch) -> Callable[[], torch.Tensor]:
    """The negative ELBO of ``state`` on the fixed ``batch``, evaluated in the state's own param
    store (validation off, as in ``svi_step``): for the phase breakdown of ``profile_step``."""

    def loss() -> torch.Tensor:
        with pyro.get_param_store().scope(state.param_store), pyro.validation_enabled(False):
            return state.loss_fn(batch.x, batch.y, None, num_data=batch.num_data)

    return loss


def network_logits(model: SequenceClassifier, x: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, C)`` of a classifier without latents, from its network parts (no Pyro sites).

    Mirrors ``SequenceClassifier.forward`` for mean pooling and no padding.
    """
    h, _ = model.embedding(x)  # (1, N, T, d)
    h = model.encoder(h)  # (1, N, T, d)
    return model.head(h.mean(dim=2))[0]  # (N, C)


def build_contenders(d_model: int, seq_len: int, batch: Batch, device: torch.device) -> dict:
    """The four step functions, keyed by contender name. Call inside ``pyro_scope()``."""
    torch.manual_seed(SEED)
    state = svi_state(d_model, seq_len, batch, device)
    before = svi_state(d_model, seq_len, batch, device, pyro_elbo=True)

    plain = make_classifier(d_model, seq_len, bayesian=(), device=device)
    deterministic = _train_step(
        lambda: F.cross_entropy(network_logits(plain, batch.x), batch.y),
        list(plain.parameters()),
    )

    reference = TorchTransformer(d_model, seq_len).to(device).train()
    torch_step = _train_step(
        lambda: F.cross_entropy(reference(batch.x), batch.y), list(reference.parameters())
    )
    return {
        "svi": lambda: svi_step(state),
        "svi-pyro": lambda: svi_step(before),
        "deterministic": deterministic,
        "torch": torch_step,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Per-round ms/step of one contender: wall clock and CPU time of this process.

    The CPU time (``time.process_time``, all threads) leaves out the time the process waits for
    a core, so on a shared machine it is the steadier cross-check of the wall-clock figure.
    """

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def warmup_steps(steps_per_round: int) -> int:
    """Untimed steps each contender runs in ``time_contenders`` before the first round."""
    return max(5, steps_per_round // 3)


def time_contenders(
    steps: dict[str, StepFn],
    *,
    rounds: int,
    steps_per_round: int,
    device: torch.device,
    warmup: int | None = None,
) -> dict[str, Timing]:
    """ms/step of each contender in each round, after a warm-up of every contender.

    Each round runs every contender for ``steps_per_round`` steps; the order rotates by one
    contender per round. ``warmup``: untimed steps per contender first (None:
    ``warmup_steps(steps_per_round)``).
    """
    if warmup is None:
        warmup = warmup_steps(steps_per_round)
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    times = {name: Timing() for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            _sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps_per_round):
                steps[name]()
            _sync(device)
            times[name].wall.append((time.perf_counter() - wall) * 1e3 / steps_per_round)
            times[name].cpu.append((time.process_time() - cpu) * 1e3 / steps_per_round)
    return times


LABELS = {
    "svi": "SVI (AutoNormal, MeanFieldELBO)",
    "svi-pyro": "SVI, Pyro TraceMeanField_ELBO",
    "deterministic": "ours, deterministic (bayesian=())",
    "torch": "torch.nn.TransformerEncoder",
}


def format_table(times: dict[str, Timing]) -> str:
    """Rows: contender, median wall ms/step, ratio to the deterministic step, its min-max over
    rounds, then the same median and ratio in CPU time."""
    base = statistics.median(times["deterministic"].wall)
    base_cpu = statistics.median(times["deterministic"].cpu)
    lines = [
        f"{'contender':<40}{'ms/step':>9}{'ratio':>7}{'rounds min-max':>17}"
        f"{'cpu ms/step':>13}{'cpu ratio':>11}"
    ]
    for name, timing in times.items():
        wall, cpu = statistics.median(timing.wall), statistics.median(timing.cpu)
        spread = f"{min(timing.wall):.1f}-{max(timing.wall):.1f}"
        lines.append(
            f"{LABELS[name]:<40}{wall:>9.2f}{wall / base:>7.2f}{spread:>17}"
            f"{cpu:>13.2f}{cpu / base_cpu:>11.2f}"
        )
    return "\n".join(lines)


def _phase_times(
    loss_of: Callable[[], torch.Tensor], params: list, device: torch.device, num_steps: int
) -> dict[str, float]:
    """Mean ms per step spent in each phase of a training step (no instrumentation)."""
    optimizer = torch.optim.Adam(params, lr=LR)
    totals = dict.fromkeys(("forward", "backward", "clip + Adam"), 0.0)
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        loss = loss_of()
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, math.inf)
        optimizer.step()
        _sync(device)
        t3 = time.perf_counter()
        for key, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            totals[key] += dt * 1e3 / num_steps
    return totals


def _op_counts(loss_of: Callable[[], torch.Tensor], num_steps: int) -> dict[str, float]:
    """Per step under ``torch.profiler``: forward wall ms, ms inside top-level aten ops, number
    of aten ops, and number of autograd nodes run by the backward pass."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            with torch.profiler.record_function("_forward"):
                loss = loss_of()
            loss.backward()
    events = prof.events()
    regions = {e.id: e for e in events if e.name == "_forward"}
    ops = [e for e in events if e.cpu_parent is not None and e.cpu_parent.id in regions]
    nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    return {
        "forward ms (profiled)": sum(e.cpu_time_total for e in regions.values()) / num_steps / 1e3,
        "  inside aten ops, ms": sum(e.cpu_time_total for e in ops) / num_steps / 1e3,
        "aten ops per forward": len(ops) / num_steps,
        "autograd nodes per backward": len(nodes) / num_steps,
    }


def profile_step(d_model: int, seq_len: int, batch: Batch, device: torch.device) -> str:
    """Where an SVI step's time goes, next to the deterministic step of the same network.

    Phase times are measured without instrumentation; ``torch.profiler`` then splits the forward
    pass into time inside tensor (aten) operations and time outside them (Python: Pyro's
    tracing, guide and ELBO bookkeeping, module calls), and counts the operations launched.
    Call inside ``pyro_scope()``.
    """
    num_steps = 30
    torch.manual_seed(SEED)
    state = svi_state(d_model, seq_len, batch, device)
    plain = make_classifier(d_model, seq_len, bayesian=(), device=device)
    svi = (state_loss(state, batch), state.params)
    deterministic = (
        lambda: F.cross_entropy(network_logits(plain, batch.x), batch.y),
        list(plain.parameters()),
    )
    columns = {}
    for name, (loss_of, params) in (("SVI", svi), ("deterministic", deterministic)):
        for _ in range(5):  # warm-up
            loss_of().backward()
        columns[name] = _phase_times(loss_of, params, device, num_steps)
        columns[name].update(_op_counts(loss_of, num_steps))
    before = svi_state(d_model, seq_len, batch, device, pyro_elbo=True)
    columns["SVI"]["forward, Pyro TraceMeanField_ELBO"] = _phase_times(
        state_loss(before, batch), before.params, device, num_steps
    )["forward"]
    lines = [f"{'per step (mean of ' + str(num_steps) + ' steps)':<34}{'SVI':>10}{'determ.':>10}"]
    for key, value in columns["SVI"].items():
        other = columns["deterministic"].get(key)
        cell = "" if other is None else f"{other:>10.1f}"
        lines.append(f"{key:<34}{value:>10.1f}{cell}")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.svi_overhead",
        description="Time an SVI step against a deterministic step of the same architecture.",
    )
    parser.add_argument("--d-model", type=int, default=64, help="model width (d_ff = 2 d_model)")
    parser.add_argument(
        "--seq-len", type=int, default=DIGITS_LEN, help="T; digits at 8, random data otherwise"
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (see module doc)"
    )
    parser.add_argument("--profile", action="store_true", help="also profile one SVI step")
    args = parser.parse_args(argv)
    for name in ("d_model", "seq_len", "batch_size", "rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % NUM_HEADS:
        parser.error(f"--d-model must be a multiple of {NUM_HEADS} heads, got {args.d_model}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the benchmark and print the header, the table and ``ratio <svi/deterministic>``.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        Median wall-clock ms/step per contender, plus ``ratio`` (svi / deterministic) and
        ``ratio_torch`` (svi / torch).
    """
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    batch = make_batch(args.seq_len, args.batch_size, device)
    print(
        f"SVI overhead | torch {torch.__version__}, pyro {pyro.__version__}, "
        f"python {platform.python_version()} | device {device}, torch threads "
        f"{torch.get_num_threads()} | {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"SequenceClassifier({IN_FEATURES}, {NUM_CLASSES}, {args.seq_len}): "
        f"d_model {args.d_model}, {NUM_HEADS} heads, {NUM_LAYERS} layers, "
        f"d_ff {2 * args.d_model}, dropout {DROPOUT}; SVI latent parts ('attention', 'head')"
    )
    print(
        f"batch {len(batch.x)} x T={args.seq_len} x F={IN_FEATURES} from {batch.source}; "
        f"{args.rounds} rounds x {args.steps} steps after warm-up, median per contender"
    )
    with pyro_scope():
        contenders = build_contenders(args.d_model, args.seq_len, batch, device)
        times = time_contenders(
            contenders, rounds=args.rounds, steps_per_round=args.steps, device=device
        )
        report = profile_step(args.d_model, args.seq_len, batch, device) if args.profile else ""
    print()
    print(format_table(times))
    result = {name: statistics.median(timing.wall) for name, timing in times.items()}
    result["ratio"] = result["svi"] / result["deterministic"]
    result["ratio_torch"] = result["svi"] / result["torch"]
    print(f"SVI / torch.nn.TransformerEncoder: {result['ratio_torch']:.2f}")
    if report:
        print()
        print(report)
    print(f"ratio {result['ratio']:.3f}")
    return result


if __name__ == "__main__":
    main()
