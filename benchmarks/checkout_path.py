"""Imported first by the benchmarks and the reproduction: this checkout's pairsim first on the
path, as for the job entry points (``pipelines/checkout_path.py``, run from here)."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "pipelines" / "checkout_path.py"))
