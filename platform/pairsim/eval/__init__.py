"""Evaluation: retrieval metrics (:mod:`.metrics`), the suite a run reports (:mod:`.suite`),
embedding a split (:mod:`.inference`) and the report's tables and pictures (:mod:`.report`)."""
