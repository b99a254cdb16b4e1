"""``pairsim index`` (a faiss index of ``pairsim embed``'s embeddings) and ``pairsim search``
(captions or images against it, by the model that made the embeddings)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pairsim.commands.arguments import int_at_least, location_arg, name_arg, path_arg, tracking_uri_arg
from pairsim.config import ConfigError, apply_overrides
from pairsim.errors import shown


def add_search_parsers(sub) -> None:
    """The ``index`` and ``search`` commands in the ``pairsim`` subcommands ``sub``."""
    index = sub.add_parser("index", help="a faiss index (exact by default; HNSW or IVF-PQ for large corpora) of "
                                         "`pairsim embed`'s embeddings, saved with their ids and the model's digest")
    index.add_argument("--embeddings", type=location_arg, required=True, help="a `pairsim embed` output directory")
    index.add_argument("--out", type=location_arg, required=True,
                       help="index directory: new, empty, or an index pairsim wrote (replaced)")
    index.add_argument("--modality", choices=["image", "text", "both"], default="image",
                       help="which embeddings to index (default image: captions search images)")
    index.add_argument("--kind", choices=["flat", "hnsw", "ivfpq"], default="flat",
                       help="flat: exact inner product (IndexFlatIP); hnsw: a graph; ivfpq: compressed codes")
    index.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                       help="an index parameter, e.g. --param m=16 --param ef_search=128 (hnsw), "
                            "--param nlist=4096 --param nprobe=32 (ivfpq); repeatable")
    index.add_argument("--run-id", type=name_arg, help="also log the index under this MLflow run's artifacts (index/)")
    index.add_argument("--tracking-uri", type=tracking_uri_arg,
                       help="MLflow store of --run-id (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    index.set_defaults(func=build)

    search = sub.add_parser("search", help="the top k of an index for captions or images")
    search.add_argument("--index", type=location_arg, required=True, help="a `pairsim index` directory")
    queries = search.add_argument_group("queries (at least one; each repeatable)")
    queries.add_argument("--text", action="append", default=[], help="a caption to search with")
    queries.add_argument("--image", type=path_arg, action="append", default=[], help="an image file to search with")
    search.add_argument("-k", type=int_at_least(1, 10_000), default=10, help="results a query (default 10)")
    search.add_argument("--model", type=path_arg,
                        help="the export that made the embeddings (default: the one the index names, if it is there)")
    search.add_argument("--run-id", type=name_arg, help="instead of --model: an MLflow training run's exported model")
    search.add_argument("--tracking-uri", type=tracking_uri_arg,
                        help="MLflow store of --run-id (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    search.add_argument("--grid", type=path_arg,
                        help="also write a PNG of each query's top k images (the first query's at this path, the "
                             "next ones numbered -2, -3 …)")
    search.set_defaults(func=search_command)


def build(args: argparse.Namespace) -> None:
    from pairsim.serving import embeddings, index

    spec = index.parse_spec({**apply_overrides({}, args.param, flag="--param"), "kind": args.kind}, "--param")
    manifest, rows = embeddings.read_embeddings(args.embeddings, None if args.modality == "both" else args.modality)
    if not rows.num_rows:
        raise ConfigError(f"--embeddings: {args.embeddings} holds no {args.modality} embeddings", keys=["--embeddings"])
    built = index.build_index(embeddings.vectors(rows), rows.select(list(index.ROW_COLUMNS)), spec,
                              manifest.model_digest, manifest.model_source, str(args.embeddings))
    out = built.save(args.out)
    print(f"{spec.kind} index of {', '.join(f'{n:,} {m}' for m, n in built.card.modalities.items())} embeddings "
          f"(dim {built.card.dim}, model {manifest.model_digest[:12]}) in {out}")
    if args.run_id:
        from pairsim import tracking

        tracking_uri = tracking.resolve_tracking_uri(args.tracking_uri)
        tracking.check_reachable(tracking_uri)
        with tracking.RunLogger(tracking_uri, args.run_id) as run:
            for name in [index.CARD_FILE, *built.card.file_names()]:
                with (out / name).local_copy() as local:
                    run.log_artifact(local, "index")
        print(f"logged to run {args.run_id}'s artifacts under index/")


def query_encoder(args: argparse.Namespace, card, tmp: Path):
    """The :class:`~pairsim.serving.encoder.Encoder` of ``--model`` / ``--run-id``, else of the
    export the index's card names; refused unless its digest is the one the index was built with."""
    from pairsim.serving.encoder import Encoder

    if args.run_id:
        from pairsim import tracking

        tracking_uri = tracking.resolve_tracking_uri(args.tracking_uri)
        tracking.check_reachable(tracking_uri)
        weights = tracking.download_run_model(args.run_id, tracking_uri, tmp / "model.pt")[0]
    elif args.model:
        weights = args.model
    elif Path(card.model_source).is_file():
        weights = Path(card.model_source)
    else:
        raise ConfigError(f"--model: the index was built with the model {card.model_source!r}, which is not a file "
                          "here; give its export with --model or its run with --run-id", keys=["--model"])
    encoder = Encoder.load(weights)
    if encoder.digest != card.model_digest:
        raise ConfigError(f"--model: {weights} is not the model the index was built with (digest "
                          f"{encoder.digest[:12]}, the index's {card.model_digest[:12]}: {card.model_source})",
                          keys=["--model"])
    return encoder


def search_command(args: argparse.Namespace) -> None:
    from pairsim import outputs
    from pairsim.data.images import read_image
    from pairsim.serving import index
    from pairsim.storage import Location

    if not args.text and not args.image:
        raise ConfigError("search: give at least one --text or --image", keys=["--text", "--image"])
    count = len(args.text) + len(args.image)
    grids = [args.grid if n == 1 else args.grid.with_name(f"{args.grid.stem}-{n}{args.grid.suffix}")
             for n in range(1, count + 1)] if args.grid else [None] * count
    for grid in filter(None, grids):  # before any work
        outputs.check_file_target(grid, "--grid")
    found = index.load_index(args.index)
    with tempfile.TemporaryDirectory() as tmp:
        encoder = query_encoder(args, found.card, Path(tmp))
    queries = [(f"text '{shown(t, 100)}'", vector) for t, vector in zip(args.text, encoder.embed_texts(args.text))]
    images = [(f"--image {p}", read_image(Location.of(p), "--image")) for p in args.image]
    queries += [(f"image {shown(p, 100)}", vector) for p, vector in zip(args.image, encoder.embed_encoded(images))]
    import numpy as np

    results = found.search(np.stack([vector for _, vector in queries]), args.k)
    data = DatasetRows.of_index(found)
    for (query, _), hits, grid in zip(queries, results, grids):
        print(f"{query}: top {len(hits)} of {len(found):,}")
        captions = data.first_captions([hit.row["image_id"] for hit in hits if hit.row["modality"] == "image"])
        for rank, hit in enumerate(hits, start=1):
            caption = hit.row["caption"] or captions.get(hit.row["image_id"], "")
            print(f"{rank:3d}  {hit.score:.4f}  {shown(hit.id, 80)}  {shown(hit.row['source'] or '-', 80)}  "
                  f"{shown(caption, 120)}")
        if grid:
            index.picture_grid(hits, data.images, grid, title=query)
            print(f"picture grid: {grid}")


class DatasetRows:
    """The rows of the dataset split the index's embeddings came from (read from its shards by
    image id), for the captions and pictures of image results; none when it cannot be read."""

    PICTURE_SIDE = 240  # pixels: a picture grid's tile (index.picture_grid: 2.4 inches at 100 dpi)

    def __init__(self, data_path: str | None, split: str | None):
        self.data_path, self.split = data_path, split

    @classmethod
    def of_index(cls, found) -> DatasetRows:
        from pairsim.serving import embeddings

        try:
            manifest = embeddings.read_manifest(found.card.embeddings_source)
        except (OSError, ValueError):  # moved or deleted since: results print without the dataset's captions
            return cls(None, None)
        return cls(manifest.data_path, manifest.split)

    def _rows(self, image_ids: list[str], columns: tuple[str, ...]) -> dict:
        from pairsim.data import shards

        if self.data_path is None or not image_ids:
            return {}
        return shards.read_rows(self.data_path, self.split, image_ids, columns)

    def first_captions(self, image_ids: list[str]) -> dict[str, str]:
        return {i: (row["captions"] or [""])[0] for i, row in self._rows(image_ids, ("image_id", "captions")).items()}

    def images(self, image_ids: list[str]) -> dict:
        """The pictures of ``image_ids`` (a grid's, and only those), each brought down to about a
        grid tile as it is decoded (:func:`~pairsim.data.images.decode_image` to :attr:`PICTURE_SIDE`)."""
        from pairsim.data.images import decode_image

        rows = self._rows(image_ids, ("image_id", "image"))
        if missing := sorted(set(image_ids) - rows.keys()):
            raise ConfigError(f"--grid: images {', '.join(missing[:5])} are not in the dataset the embeddings name "
                              f"({self.data_path or 'unreadable'}, split {self.split})", keys=["--grid"])
        return {i: decode_image(rows[i]["image"], f"image {i}", self.PICTURE_SIDE) for i in image_ids}
