"""Standalone studies: one-off measurements run as ``python -m benchmarks.studies.<name>``.

The sections of ``python -m benchmarks.run`` reuse some of their functions (``nuts`` calls
``nuts_vs_numpyro``, ``claims`` calls ``task_families``, ``speed`` calls ``svi_overhead``).
"""
