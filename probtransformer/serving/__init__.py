"""``probtransformer serve``: uncertainty-aware predictions of a run over HTTP.

``Service`` computes (one run, read back safely), ``MicroBatcher`` merges concurrent requests
into one vectorized pass on one worker thread, ``create_app`` builds the FastAPI app. They need
the ``serve`` extra (FastAPI, uvicorn) and are imported on first use, so ``Limits`` and the
defaults can be read without it. ``probtransformer.client.Client`` talks to a server.
"""

from probtransformer.serving.limits import Limits

_LAZY = {
    "create_app": "probtransformer.serving.app",
    "MicroBatcher": "probtransformer.serving.batcher",
    "Service": "probtransformer.serving.service",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Limits", "MicroBatcher", "Service", "create_app"]
