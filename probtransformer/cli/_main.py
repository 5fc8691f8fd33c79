"""The entry point of ``probtransformer``: parse, run the command, map errors to exit codes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence

from probtransformer.cli._common import PROG, CLIError
from probtransformer.cli.parser import build_parser
from probtransformer.rundir import RunWriteError

#: Appended to an out-of-memory error: what the user can change.
OOM_HINT = " (lower --num-samples or the model's sizes)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        Exit status: 0 on success, 2 on bad arguments or files, or sizes that do not fit in
        memory (one line on stderr), 1 when the fit diverges or, under ``torchrun``, a peer
        rank is lost, 130 when interrupted (Ctrl-C): with nothing written, or after writing a
        run of the draws MCMC had kept (``partial``); 143 after SIGTERM (what batch schedulers
        send), which stops a command as Ctrl-C does and keeps the same work.
        Under ``torchrun`` the line names the rank that prints it.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or an argument error already reported on one line
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # while the parser imports the libraries its defaults come from
        return _fail(KeyboardInterrupt("nothing was written"), 130, "stopped")
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _warning_line  # the library's warnings, as one line each
    terminated = threading.Event()
    try:
        with _sigterm_as_ctrl_c(terminated):
            status = args.handler(args)
    except BrokenPipeError:  # stdout's reader left (`| head`): no error, nothing more to say
        with contextlib.suppress(OSError, ValueError):  # Python's advice: no flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except RunWriteError as e:  # the run directory is fit's --out
        return _fail(CLIError(f"cannot write --out {e.path}: {e.reason}"), 2)
    except (CLIError, ValueError, TypeError, OSError) as e:
        return _fail(e, 2)
    except FloatingPointError as e:  # NonFiniteELBOError: the fit diverged
        from probtransformer.inference.vi.elbo import NON_FINITE_ADVICE

        # the library's advice names fit_svi's parameters; the CLI has only --lr of them
        return _fail(FloatingPointError(str(e).replace(NON_FINITE_ADVICE, "try a lower --lr")), 1)
    except MemoryError as e:
        return _fail(MemoryError(f"out of memory: {e}{OOM_HINT}"), 2)
    except RuntimeError as e:  # torch's allocation failures; under torchrun: a rank was lost
        from probtransformer.inference._runtime import is_out_of_memory
        from probtransformer.inference.distributed import RankLostError

        if is_out_of_memory(e):  # sizes too large for this machine: --d-model, --num-samples
            # torch's first line; Pyro appends a trace-shape table of every site (95 kB at
            # 1,024 layers)
            return _fail(RuntimeError(f"out of memory: {str(e).splitlines()[0]}{OOM_HINT}"), 2)
        if not isinstance(e, RankLostError):
            raise
        return _fail(e, 1)
    except KeyboardInterrupt as e:
        message = str(e).replace("(resume_from=...)", "(continue with --resume-from it)")
        message = message.replace("checkpoint_every=N", "--checkpoint-every N")
        message = message or "nothing was written"
        if terminated.is_set():
            return _fail(KeyboardInterrupt(f"by SIGTERM; {message}"), 143, "stopped")
        return _fail(KeyboardInterrupt(message), 130, "stopped")
    finally:
        warnings.formatwarning = formatwarning
    if terminated.is_set() and status == 130:  # a command that kept its work and said so
        return 143
    return status or 0


@contextlib.contextmanager
def _sigterm_as_ctrl_c(terminated: threading.Event):
    """SIGTERM raises KeyboardInterrupt (setting ``terminated``), so the work Ctrl-C keeps
    (MCMC's draws, a checkpoint, decoded tokens) is kept; the previous handler comes back after.
    Only the main thread can set handlers; ``serve``'s uvicorn sets its own while it runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        terminated.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """``PROG: warning: message`` rather than the source file and line of the library."""
    return f"{PROG}: warning: {' '.join(str(message).split())}\n"


def _fail(error: Exception, status: int, label: str = "error") -> int:
    """Print ``PROG: label: message`` (``stopped`` for a Ctrl-C, which is no error) and return
    ``status``."""
    message = " ".join(str(error).split()) or type(error).__name__
    if os.environ.get("WORLD_SIZE", "1") != "1":  # under torchrun: every rank may say it
        message = f"[rank {os.environ.get('RANK', '?')}] {message}"
    print(f"{PROG}: {label}: {message}", file=sys.stderr)
    return status
