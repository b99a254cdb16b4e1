"""``pairsim`` command line: ``demo``, ``train``, ``extract-teacher``, ``data synth``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pairsim.config import ConfigError, RunConfig, load_config

DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"
OBJECTIVES = Path(__file__).parent / "configs" / "objectives"


def objective_config(name: str) -> Path:
    """A shipped objective preset (``configs/objectives/<name>.yaml``) to layer on a run config."""
    path = OBJECTIVES / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in OBJECTIVES.glob("*.yaml"))
        raise ConfigError(f"--objective: unknown objective {name!r} (shipped: {', '.join(known)})")
    return path


def results_table(metrics: dict[str, float], prefix: str = "val/") -> str:
    """Image→text and text→image R@K as rows, then RSUM."""
    ks = sorted({int(k.rsplit("@", 1)[1]) for k in metrics if k.startswith(prefix + "i2t_R@")})
    lines = ["direction     " + "".join(f"{f'R@{k}':>8}" for k in ks)]
    for direction, label in (("i2t", "image→text"), ("t2i", "text→image")):
        lines.append(f"{label:<14}" + "".join(f"{metrics[f'{prefix}{direction}_R@{k}']:8.2f}" for k in ks))
    lines.append(f"{'RSUM':<14}{metrics[prefix + 'rsum']:8.2f}")
    return "\n".join(lines)


def _train(cfg: RunConfig) -> None:
    from pairsim import train  # heavy imports only once the config is known to be good

    result = train.fit(cfg)
    print(f"\nval retrieval after {result.metrics.get('epoch')} epochs (run {result.run_name}):")
    print(results_table(result.metrics))
    print(f"\nMLflow run {result.mlflow_run_id} in {result.tracking_uri}")
    if result.tracking_uri.startswith("sqlite:///"):
        print(f"look at it with:  mlflow ui --backend-store-uri {result.tracking_uri}")
    print(f"checkpoint: {result.checkpoint_path}")


def _demo(objective: str | None, overrides: list[str]) -> None:
    cfg = load_config([DEMO_CONFIG] + ([objective_config(objective)] if objective else []), overrides)
    from pairsim import shards, synth

    try:
        shards.read_manifest(cfg.data.path)
    except FileNotFoundError:
        print(f"[pairsim] generating the shapes dataset in {cfg.data.path}")
        synth.generate(cfg.data.path)
    _train(cfg)


def _extract_teacher(cfg: RunConfig, args: argparse.Namespace) -> None:
    from pairsim import teachers, train

    teachers.check_teachers(cfg.model_copy(update={"loss": cfg.loss.model_copy(update={
        "cusa": cfg.loss.cusa and cfg.loss.cusa.model_copy(update={"teacher_features": None})})}))
    train.init_ray(cfg)
    out = teachers.extract(cfg, args.out, args.splits or [cfg.data.train_split], args.batch_size, args.concurrency)
    print(f"teacher features in {out}; train from them with --set loss.cusa.teacher_features={out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pairsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    set_help = "dotted override, e.g. --set loss.margin=0.3 (repeatable)"

    demo = sub.add_parser("demo", help="generate the shapes data if absent and train a tiny CLIP on it")
    demo.add_argument("--objective", help="layer a shipped objective preset: unified, gcl_infonce, gcl_unified, "
                                           "cusa_unified")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)

    train = sub.add_parser("train", help="train from a YAML run config")
    train.add_argument("--config", type=Path, action="append", required=True,
                       help="YAML run config; repeat to layer files left to right")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)

    extract = sub.add_parser("extract-teacher", help="embed a dataset with the run's CUSA teachers, to train from disk")
    extract.add_argument("--config", type=Path, action="append", required=True,
                         help="YAML run config with loss.cusa teachers; repeat to layer files")
    extract.add_argument("--out", type=Path, required=True, help="directory for the teacher features")
    extract.add_argument("--splits", nargs="+", default=None, help="splits to embed (default: data.train_split)")
    extract.add_argument("--batch-size", type=int, default=64)
    extract.add_argument("--concurrency", type=int, default=1, help="Ray Data actors running the teachers")
    extract.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="generate the compositional shapes dataset")
    synth.add_argument("--out", type=Path, required=True)
    synth.add_argument("--num-train", type=int, default=10_000)
    synth.add_argument("--num-val", type=int, default=500)
    synth.add_argument("--num-test", type=int, default=500)
    synth.add_argument("--image-size", type=int, default=64)
    synth.add_argument("--rows-per-shard", type=int, default=2_000)
    synth.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            _demo(args.objective, args.overrides)
        elif args.command == "train":
            _train(load_config(args.config, args.overrides))
        elif args.command == "extract-teacher":
            _extract_teacher(load_config(args.config, args.overrides), args)
        elif args.command == "data":
            from pairsim import synth

            manifest = synth.generate(args.out, num_train=args.num_train, num_val=args.num_val,
                                      num_test=args.num_test, image_size=args.image_size, seed=args.seed,
                                      rows_per_shard=args.rows_per_shard)
            print(f"wrote {args.out}: " + ", ".join(f"{s} {c['images']} images" for s, c in manifest["splits"].items()))
    except ConfigError as exc:
        print(f"pairsim: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
