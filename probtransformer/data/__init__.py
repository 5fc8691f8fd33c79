"""Data as CPU tensors, apart from any dataset: ``SequenceData`` (one split) and
``DatasetSplits`` (all splits of one dataset), and how a table becomes ``SequenceData``
(``table_files``: reading a file; ``table_schema``: ``TableSchema``; ``table_columns``: the
checks of one column).

Nothing here loads a dataset or its loader, so ``probtransformer.inference``, the tasks and the
scikit-learn wrappers import it freely; the dataset registry (``probtransformer.datasets``)
re-exports these names.
"""

from probtransformer.data.sequence import DatasetSplits, SequenceData

__all__ = ["DatasetSplits", "SequenceData"]
