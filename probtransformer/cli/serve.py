"""``probtransformer serve``: a run's uncertainty-aware predictions over HTTP
(``probtransformer.serving``), with FastAPI and uvicorn from the ``serve`` extra."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket
import sys

from probtransformer.cli._common import PROG, CLIError, warn
from probtransformer.cli.argtypes import float_in, int_in, positive_int
from probtransformer.rundir import read_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``serve`` (its defaults: ``serving.limits``, which imports no FastAPI)."""
    from probtransformer.serving.limits import (
        DEFAULT_MAX_BATCH_ROWS,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_REQUEST_ROWS,
        DEFAULT_MAX_RESPONSE_BYTES,
        DEFAULT_MAX_WAIT_MS,
        MAX_NUM_SAMPLES,
        MAX_WAIT_MS,
    )

    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="cpu",
        help="where the model runs; auto: CUDA when available (default: %(default)s)",
    )
    parser.add_argument(
        "--port", type=int_in(1, 65535), default=8000, help="port to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--num-samples",
        type=int_in(1, MAX_NUM_SAMPLES),
        default=100,
        metavar="S",
        help="posterior draws of a request that does not say (default: %(default)s)",
    )
    parser.add_argument(
        "--max-batch-rows",
        type=positive_int,
        default=DEFAULT_MAX_BATCH_ROWS,
        metavar="N",
        help="rows of the merged requests of one pass; 1: no batching (default: %(default)s)",
    )
    parser.add_argument(
        "--max-wait-ms",
        type=float_in(0, MAX_WAIT_MS),
        default=DEFAULT_MAX_WAIT_MS,
        metavar="M",
        help="milliseconds a request waits for others to join its pass (a lone request does "
        f"not wait), at most {MAX_WAIT_MS:g} (default: %(default)s)",
    )
    parser.add_argument(
        "--max-request-rows",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_ROWS,
        metavar="N",
        help="rows one request may hold, 413 beyond (default: %(default)s)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="B",
        help="bytes one request body may hold, 413 beyond (default: %(default)s)",
    )
    parser.add_argument(
        "--max-response-bytes",
        type=positive_int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        metavar="B",
        help="bytes of JSON one answer may hold, estimated before computing it; 413 beyond "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="require 'Authorization: Bearer <key>', the key read from this environment "
        "variable (default: no key)",
    )


#: Seconds a stopping server (SIGTERM, Ctrl-C) gives the requests in flight.
DRAIN_SECONDS = 30


def run(args: argparse.Namespace) -> None:
    """Read the run (nothing it names is executed), then serve it until SIGTERM or Ctrl-C,
    which stop taking connections and answer the requests in flight first.

    Raises:
        CLIError: the serve extra is missing, ``--api-key-env`` names an unset variable, or
            the address cannot be bound (the port is in use).
        ValueError: not a run directory, or a run the server cannot serve.
        KeyboardInterrupt: after Ctrl-C, once the requests in flight are answered.
    """
    try:
        import fastapi_offline  # noqa: F401
        import uvicorn  # noqa: F401

        import probtransformer.serving  # noqa: F401
    except ImportError as e:
        raise CLIError(
            f"serve needs FastAPI, fastapi-offline and uvicorn ({e.name} is missing): "
            "pip install 'probtransformer[serve]'"
        ) from None
    if not args.host.strip():
        raise CLIError("--host must name an address, such as 127.0.0.1 (or 0.0.0.0 for all)")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise CLIError(
                f"--api-key-env {args.api_key_env}: that environment variable is unset or empty"
            )
        if api_key != api_key.strip() or not (api_key.isprintable() and api_key.isascii()):
            raise CLIError(
                f"--api-key-env {args.api_key_env}: the key has surrounding whitespace, control "
                "or non-ASCII characters, which HTTP headers do not carry; remove them"
            )
    # bound first: a port in use fails at once, before the run loads
    with _bound_socket(args.host, args.port) as listening:
        if api_key is None and not _loopback(args.host):
            warn(f"serving on {args.host} without --api-key-env: anyone who reaches it may use it")
        _serve(args, listening, api_key)


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to listen on.

    Raises:
        CLIError: the address cannot be bound (in use, not this machine's, no permission).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    listening = socket.socket(family, kind, proto)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        listening.bind(address)
    except OSError as e:
        listening.close()
        raise CLIError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return listening


def _serve(args: argparse.Namespace, listening: socket.socket, api_key: str | None) -> None:
    """``run`` once the options are checked and the socket is bound."""
    import uvicorn

    from probtransformer.serving import Limits, Service, create_app

    service = Service(read_run(args.run_dir, device=args.device), num_samples=args.num_samples)
    if service.diagnostics is not None and service.diagnostics["ok"] is None:
        warn(service.diagnostics["warnings"][0])
    limits = Limits(
        **{field.name: getattr(args, field.name) for field in dataclasses.fields(Limits)}
    )
    app = create_app(service, limits, api_key=api_key)
    host = f"[{args.host}]" if ":" in args.host else args.host  # IPv6 in a URL
    print(
        f"{PROG}: serving {args.run_dir} ({service.task}, {type(service.model).__name__}, on "
        f"{service.post.device}); "
        f"docs at http://{host}:{args.port}/docs",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=DRAIN_SECONDS,
    )
    server = uvicorn.Server(config)
    quiet = _ForcedExitTraceback(server)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    interrupted = False
    try:
        server.run(sockets=[listening])
    except KeyboardInterrupt:
        interrupted = True
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if server.force_exit:  # a second Ctrl-C, after which uvicorn may return instead of raising
        raise KeyboardInterrupt(
            "at once, by a second Ctrl-C; the requests in flight were answered 503 with Retry-After"
        )
    if interrupted:
        raise KeyboardInterrupt(
            f"the requests in flight were answered (any still running after the {DRAIN_SECONDS} "
            "s drain, with 503 and Retry-After)"
        )


class _ForcedExitTraceback(logging.Filter):
    """Drops the traceback uvicorn logs when a forced exit (a second Ctrl-C) cancels the app's
    lifespan task: the ``CancelledError`` is the exit itself, not a fault."""

    def __init__(self, server) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.server.force_exit and "CancelledError" in record.getMessage())


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
