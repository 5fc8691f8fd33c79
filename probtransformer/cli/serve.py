"""``probtransformer serve``: a run's uncertainty-aware predictions over HTTP
(``probtransformer.serving``), with FastAPI and uvicorn from the ``serve`` extra."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from probtransformer.cli._common import PROG, CLIError, warn
from probtransformer.cli.rundir import read_run

#: Seconds a stopping server (SIGTERM, Ctrl-C) gives the requests in flight.
DRAIN_SECONDS = 30


def run(args: argparse.Namespace) -> None:
    """Read the run (nothing it names is executed), then serve it until SIGTERM or Ctrl-C,
    which stop taking connections and answer the requests in flight first.

    Raises:
        CLIError: the serve extra is missing, or ``--api-key-env`` names an unset variable.
        ValueError: not a run directory, or a run the server cannot serve.
        KeyboardInterrupt: after Ctrl-C, once the requests in flight are answered.
    """
    try:
        import uvicorn

        from probtransformer.serving import Limits, Service, create_app
    except ImportError as e:
        raise CLIError(
            f"serve needs FastAPI and uvicorn ({e.name} is missing): "
            "pip install 'probtransformer[serve]'"
        ) from None
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
    elif not _loopback(args.host):
        warn(f"serving on {args.host} without --api-key-env: anyone who reaches it may use it")
    service = Service(read_run(args.run_dir, device=args.device), num_samples=args.num_samples)
    if service.diagnostics is not None and service.diagnostics["ok"] is None:
        warn(service.diagnostics["warnings"][0])
    limits = Limits(
        num_samples=args.num_samples,
        max_batch_rows=args.max_batch_rows,
        max_wait_ms=args.max_wait_ms,
        max_request_rows=args.max_request_rows,
        max_body_bytes=args.max_body_bytes,
        max_response_bytes=args.max_response_bytes,
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
    try:
        server.run()
    except KeyboardInterrupt:
        if server.force_exit:  # a second Ctrl-C
            raise KeyboardInterrupt("stopped at once; requests in flight were dropped") from None
        raise KeyboardInterrupt("stopped; the requests in flight were answered") from None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
