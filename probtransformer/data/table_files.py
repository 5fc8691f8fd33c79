"""Reading a table file (``.csv``, ``.csv.gz``, ``.parquet``) into a DataFrame without
executing anything, refused above a size limit, and the SHA-256 a run records of it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd

#: Files larger than this are refused before they are read (``max_bytes`` overrides it): a
#: table is read whole into memory, and its tensors take a few times its size again.
MAX_TABLE_BYTES = 1 << 30

SUFFIXES = {".csv": "csv", ".csv.gz": "csv", ".parquet": "parquet", ".pq": "parquet"}


def read_table(
    path: str | Path, *, max_bytes: int = MAX_TABLE_BYTES, text_columns: tuple[str, ...] = ()
) -> pd.DataFrame:
    """The DataFrame of a ``.csv`` (or ``.csv.gz``) or ``.parquet`` file, read without
    executing anything; a CSV's ``text_columns`` are read as text (an id "0042" stays
    "0042").

    Raises:
        ValueError: the file does not exist, has another suffix, is empty, is larger than
            ``max_bytes`` (refused unread: the limit is named), is not UTF-8, or cannot be
            parsed.
        ImportError: a Parquet file without ``pyarrow`` installed.
    """
    path = Path(path)
    suffix = "".join(path.suffixes[-2:]).lower() if path.suffix.lower() == ".gz" else path.suffix
    kind = SUFFIXES.get(suffix.lower())
    if kind is None:
        raise ValueError(
            f"{path}: expected a .csv, .csv.gz or .parquet file, got suffix {suffix!r}"
        )
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(
            f"{path} holds {size / 2**20:,.0f} MiB, more than the {max_bytes / 2**20:,.0f} MiB "
            "a table may hold (max_bytes): it is read whole into memory; split it by sequence "
            "id, or sample it"
        )
    if size == 0:
        raise ValueError(f"{path} is empty: expected a header row and one row per step")
    try:
        if kind == "csv":
            frame = pd.read_csv(path, low_memory=False, dtype=dict.fromkeys(text_columns, str))
        else:
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise ImportError(
                    f"reading {path} needs pyarrow: pip install 'probtransformer[parquet]'"
                ) from None
            frame = pd.read_parquet(path)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} cannot be read as {kind}: it is not UTF-8 text ({e.reason} at byte "
            f"{e.start}); save it as UTF-8"
        ) from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, OSError) as e:
        raise ValueError(f"{path} cannot be read as {kind}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # pyarrow's own errors (ArrowInvalid ...): a file, not a bug
        if type(e).__module__.startswith("pyarrow"):
            raise ValueError(f"{path} cannot be read as parquet: {e}") from None
        raise
    if frame.empty:
        raise ValueError(f"{path} has a header but no rows")
    return frame


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks (a run records its data file's)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
