"""Reproduction table: each paper objective, several seeds, on the shapes data, next to what its
paper claims.

    python pipelines/reproduce.py [--num-train 1500] [--num-val 300] [--epochs 3] [--seeds 0 1 2]
                                  [--objectives infonce triplet_hn ...] [--out bench_out/reproduce]

Every objective is its shipped preset (``configs/objectives/<name>.yaml``: the papers' losses and
hyperparameters) layered on the demo's model, optimizer and workers (a 7.6 M-parameter CLIP
trained from scratch, so CUSA's fine-tuning optimizer is replaced by the demo's for every
objective alike), trained with the real pipeline (Ray Train, 2 DeepSpeed workers) for
``--epochs`` on a generated shapes dataset; ``train.seed`` and ``data.seed`` are the seed. Prints
mean ± std over seeds of the last epoch's val i2t/t2i R@1, RSUM, i2i/t2t R@1 and the mean R@1 of
the five modality-grid cells with a fused side, then each paper's claim and whether it holds:
"holds" when the mean difference exceeds twice its standard error, "same sign, within noise"
when it is positive but smaller, else "does not hold".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pairsim.config import load_config
from pairsim.data import synth
from pairsim.eval.suite import MODALITIES, grid_metric_name
from pairsim.train import driver

DEMO = Path(driver.__file__).parents[1] / "configs"
OBJECTIVES = {"infonce": "InfoNCE", "triplet_hn": "Triplet-HN", "unified": "Unified",
              "gcl_infonce": "GCL-InfoNCE", "gcl_unified": "GCL-Unified", "cusa_paper": "CUSA"}
FUSED_CELLS = [grid_metric_name(q, k, 1) for q in MODALITIES for k in MODALITIES if "fused" in (q, k)]
COLUMNS = {"i2t R@1": "i2t_R@1", "t2i R@1": "t2i_R@1", "RSUM": "rsum", "i2i R@1": "i2i_R@1", "t2t R@1": "t2t_R@1",
           "fused R@1": "fused"}


@dataclass
class Claim:
    """``better`` beats ``worse`` on ``column``: the paper's words."""

    paper: str
    words: str
    better: str
    worse: str
    columns: tuple[str, ...]


CLAIMS = [
    Claim("Unified loss (Li et al.)", "Unified ≥ InfoNCE on RSUM", "unified", "infonce", ("RSUM",)),
    Claim("Unified loss (Li et al.)", "Unified > Triplet-HN on RSUM (m = 0.2, γ = 50)", "unified", "triplet_hn",
          ("RSUM",)),
    Claim("CUSA (Huang et al.)", "CUSA ≫ its InfoNCE base on uni-modal retrieval", "cusa_paper", "infonce",
          ("i2i R@1", "t2t R@1")),
    Claim("CUSA (Huang et al.)", "CUSA ≥ its InfoNCE base on cross-modal RSUM", "cusa_paper", "infonce", ("RSUM",)),
    Claim("GCL (Lee et al.)", "GCL-InfoNCE ≫ InfoNCE on the fused cells", "gcl_infonce", "infonce", ("fused R@1",)),
    Claim("GCL (Lee et al.)", "GCL-Unified ≫ Unified on the fused cells", "gcl_unified", "unified", ("fused R@1",)),
]


def row(metrics: dict[str, float]) -> dict[str, float]:
    """The table's columns from a run's last val report (``val/...`` keys)."""
    val = {k.removeprefix("val/"): v for k, v in metrics.items() if k.startswith("val/")}
    out = {name: val.get(key, math.nan) for name, key in COLUMNS.items() if key != "fused"}
    out["fused R@1"] = statistics.fmean(val[c] for c in FUSED_CELLS) if all(c in val for c in FUSED_CELLS) else math.nan
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def verdict(claim: Claim, results: dict[str, list[dict[str, float]]]) -> str:
    parts = []
    for column in claim.columns:
        better = [r[column] for r in results[claim.better]]
        worse = [r[column] for r in results[claim.worse]]
        (mb, sb), (mw, sw) = mean_std(better), mean_std(worse)
        diff, stderr = mb - mw, math.sqrt(sb**2 / len(better) + sw**2 / len(worse))
        word = ("holds" if diff > 2 * stderr and diff > 0 else "same sign, within noise" if diff > 0
                else "does not hold")
        parts.append(f"{column} {diff:+.2f} ± {stderr:.2f}: {word}")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-train", type=int, default=1500)
    parser.add_argument("--num-val", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--out", type=Path, default=Path("bench_out/reproduce"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = synth.ensure(out / f"shapes-{args.num_train}-{args.num_val}", num_train=args.num_train,
                        num_val=args.num_val, num_test=0)

    results: dict[str, list[dict[str, float]]] = {}
    started = time.perf_counter()
    for name in args.objectives:
        for seed in args.seeds:
            cfg = load_config([DEMO / "demo.yaml", DEMO / "objectives" / f"{name}.yaml"], [
                f"data.path={data}", "data.test_split=null", f"data.seed={seed}", f"train.seed={seed}",
                f"train.epochs={args.epochs}", "train.log_every_n_steps=10",
                "optim.lr=1.0e-3", "optim.weight_decay=0.1", "optim.warmup_steps=10", "optim.min_lr_ratio=0.0",
                f"ray.storage_path={out / 'ray'}", f"ray.run_name=reproduce-{name}-seed{seed}-{time.strftime('%H%M%S')}",
                f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", "tracking.experiment=reproduce"])
            result = driver.fit(cfg)
            results.setdefault(name, []).append(row(result.metrics))
            (out / "results.json").write_text(json.dumps(results, indent=1))
    wall = time.perf_counter() - started

    print(f"\nshapes {args.num_train} train / {args.num_val} val, {args.epochs} epochs, seeds {args.seeds}: "
          f"last-epoch val, mean ± std ({wall / 60:.0f} min in all)\n")
    print(f"{'objective':12}" + "".join(f"{c:>16}" for c in COLUMNS))
    for name, rows in results.items():
        cells = [mean_std([r[c] for r in rows]) for c in COLUMNS]
        print(f"{OBJECTIVES[name]:12}" + "".join(f"{m:10.2f} ± {s:4.2f}" for m, s in cells))
    print()
    for claim in CLAIMS:
        if claim.better in results and claim.worse in results:
            print(f"{claim.paper:26} {claim.words:48} {verdict(claim, results)}")


if __name__ == "__main__":
    main()
