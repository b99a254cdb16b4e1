"""Evaluation: retrieval metrics (:mod:`.metrics`), the suite a run reports (:mod:`.suite`),
embedding a split (:mod:`.inference`), the report's tables and pictures (:mod:`.report`) and
positive vs hardest-negative similarities (:mod:`.similarity`)."""
