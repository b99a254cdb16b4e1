"""The papers' effects, in small: each objective fine-tunes a pretrained CLIP, several seeds, next
to what its paper claims.

    python benchmarks/reproduce.py                     # every stage; what is cached is reused
    python benchmarks/reproduce.py --stage pretrain    # only the base CLIP (or --stage teacher)
    python benchmarks/reproduce.py --stage report      # the table from the runs saved so far, training nothing
    python benchmarks/reproduce.py --setting scratch   # the from-scratch table instead
    python benchmarks/reproduce.py --objectives infonce unified --seeds 0 --out bench_out/reproduce

Setting ``pretrained`` (the default) follows the papers' protocol:

1. **pretrain** — a base pairsim-tiny CLIP trained with InfoNCE on a larger generated corpus
   (``configs/reproduce/pretrain.yaml``), its own MLflow run; its best checkpoint is exported
   (model.pt + model card) into ``OUT/pretrain-<digest>/``, where a second run finds it.
2. **teacher** — CUSA's image teacher: an image encoder learned on its own corpus and labels
   (``configs/reproduce/image_teacher.yaml``), cached the same way; ``--image-teacher
   initial_student`` uses the student's own starting tower instead. The text teacher is MiniLM.
3. **table** — every objective preset fine-tunes from the base (``model.init_from``) with one
   fine-tuning optimizer (``configs/reproduce/finetune.yaml``) on the fine-tuning corpus, for
   each seed (``train.seed`` and ``data.seed``); val is plain, and the best checkpoint is tested
   on a hard-negative split (scenes in families that differ in one attribute).

Setting ``scratch`` is the earlier table: the presets on a randomly initialised model with the
demo's optimizer for all alike, 3 epochs of 1,500 scenes, no hard split.

The table: mean ± std over seeds of the last epoch's val i2t/t2i R@1, RSUM, i2i/t2t R@1 and the
mean R@1 of the five modality-grid cells with a fused side, and the hard split's RSUM (best
checkpoint); then each paper's claim and whether it holds: "holds" when the mean difference
exceeds twice its standard error, "same sign, within noise" when it is positive but smaller,
else "does not hold"; with one seed on a side it is not judged. Both are printed and written
into ``--results`` (``reproduce.json`` and ``.md``, ``reproduce_<setting>`` for a setting other
than ``pretrained``; see ``results.py``). Each run's row, seconds,
MLflow run and commit go to ``OUT/<setting>/results.json`` as it ends; a re-run skips the runs
recorded there with the same protocol digest, so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from pairsim import cluster, log
from pairsim.cli import DEMO_CONFIG, objective_config
from pairsim.config import ConfigError, RunConfig, load_config
from pairsim.data import synth
from pairsim.eval import inference, suite
from pairsim.eval.suite import MODALITIES, grid_metric_name
from pairsim.models import retrieval
from pairsim.models.saved import read_card
from pairsim.train import checkpoints, driver
from pairsim.tune.space import load_sweep
from pairsim.tune.sweep import run_sweep

PROTOCOL = DEMO_CONFIG.parent / "reproduce"
OBJECTIVES = {"base": "base (as is)", "infonce": "InfoNCE", "triplet_hn": "Triplet-HN", "unified": "Unified",
              "sigmoid": "Sigmoid (SigLIP)", "gcl_infonce": "GCL-InfoNCE", "gcl_unified": "GCL-Unified",
              "cusa_paper": "CUSA", "cusa_unified": "CUSA-Unified"}
FUSED_CELLS = [grid_metric_name(q, k, 1) for q in MODALITIES for k in MODALITIES if "fused" in (q, k)]
COLUMNS = {"i2t R@1": "i2t_R@1", "t2i R@1": "t2i_R@1", "RSUM": "rsum", "i2i R@1": "i2i_R@1", "t2t R@1": "t2t_R@1",
           "fused R@1": "fused", "hard RSUM": "hard"}


@dataclass
class Claim:
    """``better`` beats ``worse`` on ``columns``: the paper's words."""

    paper: str
    words: str
    better: str
    worse: str
    columns: tuple[str, ...]


CLAIMS = [
    Claim("Unified loss (Li et al.)", "Unified ≥ InfoNCE", "unified", "infonce", ("RSUM", "hard RSUM")),
    Claim("Unified loss (Li et al.)", "Unified > Triplet-HN (m = 0.2, γ = 50)", "unified", "triplet_hn",
          ("RSUM", "hard RSUM")),
    Claim("SigLIP (Zhai et al.)", "Sigmoid > InfoNCE (softmax) at small batch sizes", "sigmoid", "infonce",
          ("RSUM", "hard RSUM")),
    Claim("CUSA (Huang et al.)", "CUSA ≫ its InfoNCE base on uni-modal retrieval", "cusa_paper", "infonce",
          ("i2i R@1", "t2t R@1")),
    Claim("CUSA (Huang et al.)", "CUSA ≥ its InfoNCE base on cross-modal RSUM", "cusa_paper", "infonce", ("RSUM",)),
    Claim("CUSA (Huang et al.)", "CUSA's soft labels on Unified ≫ Unified on uni-modal retrieval", "cusa_unified",
          "unified", ("i2i R@1", "t2t R@1")),
    Claim("GCL (Lee et al.)", "GCL-InfoNCE ≫ InfoNCE on the fused cells", "gcl_infonce", "infonce", ("fused R@1",)),
    Claim("GCL (Lee et al.)", "GCL-Unified ≫ Unified on the fused cells", "gcl_unified", "unified", ("fused R@1",)),
]


@dataclass(frozen=True)
class Corpus:
    """A generated shapes dataset: its sizes, its data seed and which splits are hard-negative families."""

    name: str
    num_train: int
    num_val: int
    num_test: int = 0
    seed: int = 0
    hard_negatives: tuple[str, ...] = ()
    captions: str = "scene"

    def ensure(self, out: Path) -> Path:
        return synth.ensure(out / "data" / f"{self.name}-{self.digest()}", num_train=self.num_train,
                            num_val=self.num_val, num_test=self.num_test, seed=self.seed,
                            hard_negatives=self.hard_negatives, captions=self.captions)

    def digest(self) -> str:
        """Names the data's directory: its arguments, and for hard splits the families' version (a
        split the generator now draws differently is made anew, not reused)."""
        families = f"/families-v{synth.FAMILIES_VERSION}" if self.hard_negatives else ""
        return hashlib.sha256((repr(self) + families).encode()).hexdigest()[:10]


@dataclass
class Setting:
    """One way of running the table: its corpus, its config layers and overrides, and what it
    starts from (a pretraining stage, or nothing)."""

    name: str
    corpus: Corpus
    layers: list[Path]
    overrides: list[str]
    pretrained: bool
    notes: list[str] = field(default_factory=list)


SETTINGS = {
    "pretrained": Setting("pretrained", Corpus("finetune", 2_000, 300, 300, seed=0, hard_negatives=("test",)),
                          [PROTOCOL / "finetune.yaml"], [], pretrained=True),
    "scratch": Setting("scratch", Corpus("shapes", 1_500, 300), [], [
        "data.test_split=null", "train.epochs=3", "optim.lr=1.0e-3", "optim.weight_decay=0.1",
        "optim.warmup_steps=10", "optim.min_lr_ratio=0.0"], pretrained=False),
}
PRETRAIN_CORPUS = Corpus("pretrain", 10_000, 500, seed=1)
TEACHER_CORPUS = Corpus("image-teacher", 5_000, 300, seed=2, captions="object_labels")


def common(out: Path, run_name: str) -> list[str]:
    """Where every run of the reproduction keeps its checkpoints and MLflow runs."""
    return [f"ray.storage_path={out / 'ray'}", f"ray.run_name={run_name}", "train.log_every_n_steps=10",
            f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", "tracking.experiment=reproduce"]


def digest(*parts: object) -> str:
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:10]


def cached_stage(out: Path, stage: str, corpus: Corpus, layers: list[Path], extra: list[str],
                 train: bool = True) -> Path:
    """The export (``model.pt`` with its card) of a pretraining-like stage: trained once, with its
    own MLflow run, its best checkpoint exported into ``OUT/<stage>-<digest>/``; found there by
    every later call with the same config and corpus. An interrupted stage resumes (same run name).
    ``train=False``: not trained when missing (SystemExit)."""
    data = corpus.ensure(out)
    layers = [DEMO_CONFIG, objective_config("infonce"), *layers]
    key = digest(*(path.read_text() for path in layers), extra, corpus)  # what was asked, not how code reads it
    model = out / f"{stage}-{key}" / "model.pt"
    if retrieval.exported_files(model)[2].is_file():
        print(f"{stage}: cached at {model} (val RSUM {read_card(model.with_suffix('.json')).val['val/rsum']:.2f})")
        return model
    if not train:
        raise SystemExit(f"{stage}: not made yet (no {model}); run without --stage report first")
    started = time.perf_counter()
    cfg = load_config(layers, [f"data.path={data}", "data.test_split=null", *extra, *common(out, f"{stage}-{key}")])
    result = driver.fit(cfg)
    checkpoints.export_checkpoint(result.best_checkpoint_path, model)
    card = read_card(model.with_suffix(".json"))
    print(f"{stage}: {time.perf_counter() - started:.0f} s, best epoch {card.epoch}, val RSUM "
          f"{card.val['val/rsum']:.2f}; exported to {model} (MLflow run {result.mlflow_run_id})")
    return model


def row(metrics: dict[str, float], hard: dict[str, float]) -> dict[str, float]:
    """The table's columns from a run's last val report (``val/...`` keys) and the hard split's report."""
    val = {k.removeprefix("val/"): v for k, v in metrics.items()}
    out = {name: val.get(key, math.nan) for name, key in COLUMNS.items() if key not in ("fused", "hard")}
    out["fused R@1"] = statistics.fmean(val[c] for c in FUSED_CELLS) if all(c in val for c in FUSED_CELLS) else math.nan
    out["hard RSUM"] = hard.get("rsum", math.nan)
    return out


def evaluate_export(model_file: Path, cfg: RunConfig, splits: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """An exported model evaluated, as it is, on ``cfg``'s data: each split's metrics (no prefix)."""
    model, _ = retrieval.load_exported(model_file)
    return {split: suite.evaluate_split(inference.embed_with_ray_data(model, cfg, split, progress=False),
                                        retrieval.fusion_module(model, cfg.model), cfg.eval.ks).metrics
            for split in splits}


def evaluate_base(base: Path, cfg: RunConfig) -> dict[str, float]:
    """The base model's row: the export evaluated, as it is, on the val and hard splits."""
    reports = evaluate_export(base, cfg, ("val", "test"))
    return row({f"val/{k}": v for k, v in reports["val"].items()}, reports["test"])


def sweep_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a research sweep from the table's base (``unified_figure5.py``,
    ``cusa_tradeoff.py``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-from", metavar="MODEL", help="the pretrained model every trial starts from")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a key of the sweep file or its base config, as for pairsim tune")
    parser.add_argument("--name", help="sweep name (default sweep-<date>-<time>); an existing one is resumed")
    parser.add_argument("--out", type=Path, default=Path("bench_out/reproduce"),
                        help="benchmarks/reproduce.py's folder: its cached base, corpus, MLflow store and runs")
    results.add_results_argument(parser)
    return parser


def research_sweep(space: Path, doc: str, argv: list[str] | None):
    """A research sweep's command line parsed (:func:`sweep_parser`) and its sweep run from the
    table's base: (arguments, sweep, outcome); a config error is printed and exits with status 2."""
    args = sweep_parser(doc).parse_args(argv)
    log.setup()
    try:
        sweep = load_sweep(space, finetune_start(args.out.resolve(), args.init_from) + args.overrides)
        return args, sweep, run_sweep(sweep, args.name)
    except ConfigError as exc:
        print(f"pairsim: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def finetune_start(out: Path, init_from: str | None) -> list[str]:
    """The overrides that make a research sweep (Figure 5, CUSA's trade-off) fine-tune as the
    table does: from ``init_from``, else from the table's pretrained base (trained here if not
    cached under ``out``) on its fine-tuning corpus, into its stores."""
    if init_from:
        return [f"model.init_from={init_from}"]
    base = cached_stage(out, "pretrain", PRETRAIN_CORPUS, [PROTOCOL / "pretrain.yaml"], [])
    return [f"model.init_from={base}", f"data.path={SETTINGS['pretrained'].corpus.ensure(out)}",
            f"ray.storage_path={out / 'ray'}", f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            "tracking.experiment=reproduce"]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std; NaN for both when a value is NaN (a column not measured: the scratch
    setting has no hard split), which ``statistics.stdev`` would raise on."""
    if any(math.isnan(v) for v in values):
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def verdict(claim: Claim, rows: dict[str, list[dict[str, float]]]) -> str:
    parts = []
    for column in claim.columns:
        better = [r[column] for r in rows[claim.better]]
        worse = [r[column] for r in rows[claim.worse]]
        if any(math.isnan(v) for v in better + worse):
            continue
        (mb, sb), (mw, sw) = mean_std(better), mean_std(worse)
        diff, stderr = mb - mw, math.sqrt(sb**2 / len(better) + sw**2 / len(worse))
        if min(len(better), len(worse)) < 2:  # no spread to measure the noise by
            parts.append(f"{column} {diff:+.2f}: not judged (one seed)")
            continue
        word = ("holds" if diff > 2 * stderr and diff > 0 else "same sign, within noise" if diff > 0
                else "does not hold")
        parts.append(f"{column} {diff:+.2f} ± {stderr:.2f}: {word}")
    return "; ".join(parts)


def grouped(saved: dict[str, dict], keys: list[str]) -> dict[str, list[dict[str, float]]]:
    """The rows of the saved runs named by ``keys`` (``<objective>/seed<n>``, ``base/<export>``), by
    objective, in the table's order."""
    rows: dict[str, list[dict[str, float]]] = {}
    for key in sorted(keys, key=lambda k: list(OBJECTIVES).index(k.split("/")[0])):
        rows.setdefault(key.split("/")[0], []).append(saved[key]["row"])
    return rows


def tables(rows: dict[str, list[dict[str, float]]], title: str) -> list[results.Table]:
    """Mean and std over seeds of each objective's runs (– where a column was not measured), then
    each paper's claim with its verdict."""
    table = results.Table(title, ["objective", "n", *(h for column in COLUMNS for h in (column, "±"))],
                          ["", "d", *[".2f"] * (2 * len(COLUMNS))])
    for name, runs in rows.items():
        cells = [mean_std([r[c] for r in runs]) for c in COLUMNS]
        table.add(OBJECTIVES.get(name, name), len(runs),
                  *(None if math.isnan(m) else v for m, s in cells for v in (m, s)))
    claims = results.Table("Each paper's claim: the mean difference ± its standard error; \"holds\" beyond twice "
                           "that, \"same sign, within noise\" when positive but smaller", ["paper", "claim", "verdict"],
                           ["", "", ""])
    for claim in CLAIMS:
        if claim.better in rows and claim.worse in rows:
            claims.add(claim.paper, claim.words, verdict(claim, rows))
    return [table, claims] if claims.rows else [table]  # claims: both sides in the table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=list(SETTINGS), default="pretrained")
    parser.add_argument("--stage", choices=["pretrain", "teacher", "table", "report"], default="table",
                        help="run up to this stage (the earlier ones are cached); report: print the table from "
                             "the runs saved so far, training nothing")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    presets = [name for name in OBJECTIVES if name != "base"]
    parser.add_argument("--objectives", nargs="+", default=presets, choices=presets)
    parser.add_argument("--image-teacher", choices=["pretrained", "initial_student"], default="pretrained",
                        help="CUSA's image teacher: the teacher stage's encoder, or the student's starting tower")
    parser.add_argument("--out", type=Path, default=Path("bench_out/reproduce"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    log.setup()  # pairsim's progress lines (PAIRSIM_LOG_LEVEL, else INFO)
    out = args.out.resolve()
    setting = SETTINGS[args.setting]
    started = time.perf_counter()
    extra: list[str] = list(setting.overrides)
    base = teacher = None
    if setting.pretrained:
        train = args.stage != "report"
        base = cached_stage(out, "pretrain", PRETRAIN_CORPUS, [PROTOCOL / "pretrain.yaml"], [], train)
        extra.append(f"model.init_from={base}")
        if args.stage == "pretrain":
            return
        wants_teacher = args.stage == "teacher" or any(name.startswith("cusa") for name in args.objectives)
        teacher = (cached_stage(out, "image-teacher", TEACHER_CORPUS, [PROTOCOL / "image_teacher.yaml"], [], train)
                   if args.image_teacher == "pretrained" and wants_teacher else None)
        if args.stage == "teacher":
            return
    data = setting.corpus.ensure(out)
    folder = out / (setting.name if args.image_teacher == "pretrained" else f"{setting.name}-initial-student-teacher")
    folder.mkdir(parents=True, exist_ok=True)
    results_file = folder / "results.json"
    saved = json.loads(results_file.read_text()) if results_file.is_file() else {}

    keys: list[str] = []
    if base is not None:  # the pretrained model before any fine-tuning, on the same splits
        base_key = f"base/{base.parent.name}"
        if base_key not in saved and args.stage != "report":
            base_cfg = load_config([DEMO_CONFIG], [f"data.path={data}"])
            cluster.init_ray(base_cfg)
            saved[base_key] = {"row": evaluate_base(base, base_cfg), "seconds": 0.0, "commit": results.commit()}
        keys += [base_key] if base_key in saved else []
    # seed by seed, every objective at each: a table cut short compares like with like
    for seed, name in ((seed, name) for seed in args.seeds for name in args.objectives):
        overrides = [f"data.path={data}", f"data.seed={seed}", f"train.seed={seed}", *extra]
        if name.startswith("cusa") and teacher is not None:
            overrides.append(f"loss.cusa.image_teacher={{kind: open_clip, arch: pairsim-tiny, path: {teacher}}}")
        cfg = load_config([DEMO_CONFIG, objective_config(name), *setting.layers], overrides)
        key = f"{name}/seed{seed}"
        protocol = digest(cfg.to_yaml(), setting.corpus)
        if saved.get(key, {}).get("protocol") != protocol:
            if args.stage == "report":
                continue
            run_started = time.perf_counter()
            run_cfg = load_config([DEMO_CONFIG, objective_config(name), *setting.layers],
                                  overrides + common(out, f"{setting.name}-{name}-seed{seed}-{protocol}"))
            result = driver.fit(run_cfg)
            saved[key] = {"protocol": protocol, "row": row(result.metrics, result.test_metrics),
                          "seconds": time.perf_counter() - run_started, "mlflow_run_id": result.mlflow_run_id,
                          "commit": results.commit()}
            results_file.write_text(json.dumps(saved, indent=1))
        keys.append(key)
    results_file.write_text(json.dumps(saved, indent=1))
    made = sorted({saved[k].get("commit", "not recorded") for k in keys})
    report = tables(grouped(saved, keys), (
        f"Setting {setting.name}: {setting.corpus.num_train:,} train scenes, val {setting.corpus.num_val} images, seeds "
        f"{', '.join(map(str, args.seeds))}; last-epoch val and the hard split's RSUM (best checkpoint), mean ± std "
        f"over the seeds, in percent"))
    checkout = Path(__file__).resolve().parents[1]
    shown = results_file.relative_to(checkout) if results_file.is_relative_to(checkout) else results_file
    report[0].notes.append(f"Runs: {len(keys)}, from {shown} (made at {', '.join(made)}), "
                           f"{sum(saved[k]['seconds'] for k in keys) / 60:.0f} min of them in all.")
    results.publish("reproduce", report, args.results, time.perf_counter() - started,
                    variant=None if setting.name == "pretrained" else setting.name)


if __name__ == "__main__":
    main()
