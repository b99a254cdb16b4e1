"""Imported first by the job entry points: puts this checkout's ``platform/`` first on the path,
so ``python pipelines/train.py`` runs the pairsim beside it with nothing installed — in a ``ray
job submit --working-dir .`` job, the copy Ray unpacked as the job's working directory. The
driver ships that package on to the cluster's workers (:func:`pairsim.cluster.join_cluster`);
``PYTHONPATH`` carries it to the workers of a local instance, which the driver starts."""

import os
import sys
from pathlib import Path

PLATFORM = str(Path(__file__).resolve().parents[1] / "platform")
sys.path.insert(0, PLATFORM)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (PLATFORM, os.environ.get("PYTHONPATH"))))
