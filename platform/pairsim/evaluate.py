"""Former home of the evaluation; the retrieval metrics stay importable from here.

The evaluation lives in :mod:`pairsim.eval` now (metrics, suite, inference, report)."""

from pairsim.eval.metrics import blocked_retrieval_metrics, retrieval_metrics

__all__ = ["blocked_retrieval_metrics", "retrieval_metrics"]
