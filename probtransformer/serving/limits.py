"""Batching and size limits of ``probtransformer serve`` (no FastAPI import: the CLI's help
reads them)."""

from __future__ import annotations

import dataclasses

#: Defaults of ``probtransformer serve`` (measured in benchmarks/BENCHMARKS.md, "Serving").
DEFAULT_MAX_BATCH_ROWS = 64  # a 64-row digits pass at S=100 takes about 0.3 s on 2 cores
DEFAULT_MAX_WAIT_MS = 5.0  # a request close behind another waits at most this long for more
#: The longest batching window: a stopping server answers requests in their window.
MAX_WAIT_MS = 1000.0
DEFAULT_MAX_REQUEST_ROWS = 1024
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
#: An answer may hold about this many bytes of JSON (413 beyond, before computing it): per-draw
#: values and attention of many rows grow fast (50 rows x 1,000 draws with both: 12 MB).
DEFAULT_MAX_RESPONSE_BYTES = 64 * 2**20
MAX_NUM_SAMPLES = 1000
MAX_NEW_TOKENS = 1024
SEED_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server accepts and how it batches.

    Attributes:
        max_batch_rows: rows of the merged requests of one pass (1: no batching).
        max_wait_ms: milliseconds a request waits for others to join its pass (a lone request,
            with no other within this time before it, does not wait).
        max_request_rows: rows one request may hold (413 beyond).
        max_body_bytes: bytes a request body may hold (413 beyond).
        max_response_bytes: bytes of JSON an answer may hold, estimated before computing it
            (413 beyond).
    """

    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
