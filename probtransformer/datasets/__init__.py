"""Datasets as CPU torch tensors: one `SequenceData` per split, `load` and `available`.

A dataset is registered once (name -> loader + one-line description, `_registry.register`),
so `load(name)` and `available()` pick it up. Every loader returns `DatasetSplits` with a fixed
test split and a validation part carved deterministically from the training part
(`_splits`). Nothing is downloaded: the data ship with scikit-learn (`digits`), CPython
(`pydoc_data`, `text`), or, for the optional `datasets` extra
(`pip install 'probtransformer[datasets]'`), sktime (`ucr`) and statsmodels (`forecasting`),
which are imported only when one of their datasets is loaded. `encode_text` / `decode_text`
map text to and from the character ids of the text datasets. Your own tables (a DataFrame,
CSV or Parquet file) are not registered: `SequenceData.from_pandas` / `from_csv` /
`from_parquet` read one split, `from_table` carves train/val/test (`tables`). `SequenceData` and
`DatasetSplits` live in `probtransformer.data` (re-exported here), which loads no dataset.
"""

# the loader modules register their datasets on import, in the order `available()` lists them
from probtransformer.datasets import digits, text, ucr, forecasting  # noqa: F401, I001
from probtransformer.data import DatasetSplits, SequenceData
from probtransformer.datasets._registry import available, load
from probtransformer.datasets.tables import TableSchema, from_table
from probtransformer.datasets.text import decode_text, encode_text

__all__ = [
    "DatasetSplits",
    "SequenceData",
    "TableSchema",
    "available",
    "decode_text",
    "encode_text",
    "from_table",
    "load",
]
