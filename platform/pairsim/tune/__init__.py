"""Ray Tune sweeps: search spaces (:mod:`.space`), the sweep driver and its trials
(:mod:`.sweep`), and what a person reads of a sweep: table, ``best.yaml``, plots (:mod:`.results`)."""
