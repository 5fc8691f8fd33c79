"""``probtransformer generate``: continue a prompt with a language-model run, with each generated
token's entropy split into aleatoric and epistemic parts."""

from __future__ import annotations

import argparse
import sys
import warnings

from probtransformer.cli._common import PROG, CLIError, check_output, given, warn, write_csv
from probtransformer.rundir import read_run


def run(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation, then the per-token table (or write it as CSV).

    Returns:
        0, or 130 when Ctrl-C stopped the decoding: the tokens generated so far are printed
        and written, and a line on stderr says so.

    Raises:
        CLIError: the run is not a language model's, or ``--output`` cannot be written.
        ValueError: not a run directory, or options ``generate`` refuses.
    """
    check_output(args.output)
    fitted = read_run(args.run_dir)
    from probtransformer.models import CausalLM
    from probtransformer.models.generate import generate_stream, generation_from_steps
    from probtransformer.tasks import task_of

    post = fitted.posterior
    if not isinstance(post.model, CausalLM):
        raise CLIError(
            f"{args.run_dir} is a {task_of(post.model).name} run ({type(post.model).__name__}); "
            "generate needs a language-model run (fit --dataset pydoc-text)"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = generate_stream(
            post,
            args.prompt,
            bayes_average=not args.thompson,
            **given(
                max_new_tokens=args.max_new_tokens,
                strategy=args.strategy,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                num_samples=args.num_samples,
                seed=args.seed,
            ),
        )
        steps, interrupted = [], False
        try:
            steps.extend(stream)
        except KeyboardInterrupt:  # Ctrl-C: what was generated is printed and written
            interrupted = True
    for message in dict.fromkeys(str(w.message) for w in caught if w.category is UserWarning):
        warn(message)
    generation = generation_from_steps(post.model, args.prompt, steps)
    print(args.prompt + (generation.text or ""))
    print()
    frame = generation.to_dataframe()
    if args.output is not None:
        write_csv(frame, args.output)
        print(f"wrote {args.output}")
    else:
        print(f"{'step':>4}  {'token':<8}{'entropy':>9}{'aleatoric':>11}{'epistemic':>11}")
        for step, row in enumerate(frame.itertuples(index=False), start=1):
            print(
                f"{step:>4}  {row.token!r:<8}{row.entropy:>9.4f}{row.aleatoric:>11.4f}"
                f"{row.epistemic:>11.4f}"
            )
    if len(generation):
        print(
            f"mean over {len(generation)} tokens: entropy {float(generation.entropy.mean()):.4f}, "
            f"aleatoric {float(generation.aleatoric.mean()):.4f}, "
            f"epistemic {float(generation.epistemic.mean()):.4f} nats"
        )
    if interrupted:
        print(
            f"{PROG}: stopped: interrupted after {len(generation)} generated token(s); the output "
            "above holds them",
            file=sys.stderr,
        )
        return 130
    return 0
