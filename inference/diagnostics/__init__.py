"""Diagnostics: the summary and verdict, per-mode checks, InferenceData, heads."""
