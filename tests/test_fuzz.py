"""Property-based fuzzing of everything pairsim reads from a user or reads back from disk (issues
51 and 78): hostile configs, ``--set`` values, sweep files, manifests, model cards, lock files,
source lists, embeddings manifests, index cards and command lines (``embed``, ``index`` and
``search`` among them, beside a user's files, a FIFO and a link). The invariants, for every input
hypothesis generates:

- a reader returns its typed result or raises its :class:`~pairsim.errors.InputError` — no
  other exception, in bounded time (hypothesis's deadline);
- a command exits 0, 1 or 2 with one ``pairsim:`` line and no traceback;
- nothing is written outside the command's output, and no file that was there is changed.

The default budget (:data:`EXAMPLES` a property, a minute or two in all) runs in the test
command; ``benchmarks/bench_fuzz.py`` runs the same properties with a long budget and records what it
found. ``PAIRSIM_FUZZ_EXAMPLES`` sets the budget."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pairsim import cli, locks
from pairsim.config import ConfigError, load_config
from pairsim.data import shards, sources, synth
from pairsim.errors import InputError
from pairsim.models import retrieval, saved  # noqa: F401 (export's heavy imports, loaded before the deadlines count)
from pairsim.train import checkpoints  # noqa: F401
from pairsim.tune.space import load_sweep

EXAMPLES = int(os.environ.get("PAIRSIM_FUZZ_EXAMPLES", "40"))
fuzz = settings(max_examples=EXAMPLES, deadline=10_000, derandomize="PAIRSIM_FUZZ_SEED" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---------------------------------------------------------------- what a careless or hostile user writes

NASTY = ["", ".", "..", "../..", "../../other/train", "/", "/etc/passwd", "/dev/null", "~", "-", "--help", "\x00",
         "a\x00b", "\x1b[2J", "s3://", "s3://user:secret@bucket/key", "file:///etc", "%s%n", "ü" * 300, "x" * 5000,
         "*alias", "&anchor", "!!python/object/apply:os.system ['touch PWNED']", "{a: 1, a: 2}", "[" * 100,
         ".nan", "-.inf", "1e999", "NaN", "true", "null", "0x10", "-1", "99999999999999999999"]
nasty_text = st.one_of(st.sampled_from(NASTY), st.text(max_size=60))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), nasty_text)
json_trees = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(nasty_text, kids, max_size=4)), max_leaves=20)
CONFIG_KEYS = ["train.epochs", "train.micro_batch_size", "train.num_workers", "train.deepspeed", "loss.base",
               "loss.base.margin", "loss.structure", "loss.cusa", "data.path", "data.val_path", "model.arch",
               "optim.lr", "optim.betas", "ray.run_name", "ray.storage_path", "eval.ks", "eval.select_metric",
               "tracking.tracking_uri", "temperature.init", "x", "train", "loss"]


def nested(key: str, value):
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


config_trees = st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), json_trees), max_size=5).map(
    lambda items: {k: v for key, value in items for k, v in nested(key, value).items()})


def dump(tree) -> str:
    try:
        return yaml.safe_dump(tree, allow_unicode=True)
    except yaml.YAMLError:
        return json.dumps(tree)


# ---------------------------------------------------------------- the invariants

def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def run_cli(argv: list[str], sandbox: Path, output: Path | None = None) -> tuple[int, str]:
    """``pairsim argv`` in ``sandbox``: its status and stderr, after checking the invariants —
    0, 1 or 2 and one ``pairsim:`` line on failure, no traceback, nothing changed in the
    sandbox outside ``output``."""
    before = digests(sandbox)
    err = io.StringIO()
    with contextlib.chdir(sandbox), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:  # argparse: a bad flag (2) or --help (0)
            status = exit_.code
    text = err.getvalue()
    assert status in (0, 1, 2), (argv, status, text)
    assert "Traceback" not in text, (argv, text)
    if status and "usage:" not in text:
        assert text.startswith("pairsim: "), (argv, text)
    after = digests(sandbox)
    inside = (lambda name: output is not None and (sandbox / name).is_relative_to(output))
    assert {k: v for k, v in after.items() if not inside(k)} == {k: v for k, v in before.items() if not inside(k)}, argv
    assert not (sandbox / "PWNED").exists()
    return status, text


def sandbox_with_victims() -> tempfile.TemporaryDirectory:
    """A scratch directory holding files a command must never change: a user's notes and table."""
    tmp = tempfile.TemporaryDirectory(prefix="pairsim-fuzz-")
    root = Path(tmp.name)
    (root / "victim").mkdir()
    (root / "victim" / "notes.txt").write_text("the user's own file")
    (root / "victim" / "settings.json").write_text('{"mine": true}')
    return tmp


# ---------------------------------------------------------------- readers

@fuzz
@given(text=st.one_of(config_trees.map(dump), st.text(max_size=400)))
@example(text="data:\n  path: s3://\n")  # found by bench_fuzz.py: an AttributeError in storage.check_uri
def test_any_config_file_is_a_config_or_one_config_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(text)
        try:
            load_config(path)
        except ConfigError:
            pass


@fuzz
@given(overrides=st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(CONFIG_KEYS), nasty_text),
                                    nasty_text), max_size=4))
def test_any_set_value_is_a_config_or_one_config_error(overrides):
    try:
        load_config(None, overrides)
    except ConfigError:
        pass


distribution = st.one_of(
    st.dictionaries(st.sampled_from(["uniform", "loguniform", "quniform", "randint", "choice", "grid", "normal"]),
                    st.lists(st.one_of(st.integers(-5, 100), st.floats(-1, 100), nasty_text), max_size=40),
                    min_size=1, max_size=2),
    json_trees)
spaces = st.dictionaries(st.sampled_from(["loss.base.margin", "loss.base.gamma", "optim.lr", "temperature.init", "train.epochs",
                                          "loss.base", "x.y", "../z"]), distribution, max_size=4)
sweep_trees = st.fixed_dictionaries(
    {"base": config_trees, "space": st.one_of(spaces, st.lists(spaces, max_size=30), json_trees)},
    optional={"sweep": st.dictionaries(st.sampled_from(["search", "num_samples", "metric", "mode", "scheduler",
                                                        "max_trials", "max_concurrent_trials"]),
                                       st.one_of(scalars, st.sampled_from(["grid", "optuna", "random", "asha"])),
                                       max_size=4)})


@fuzz
@given(tree=sweep_trees)
def test_any_sweep_file_is_a_sweep_or_one_input_error(tree):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sweep.yaml"
        path.write_text(dump(tree))
        try:
            load_sweep(path)
        except InputError:
            pass


def manifest_tree(splits):
    return {"schema_version": shards.SCHEMA_VERSION, "source": "fuzz", "rejected": 0,
            "splits": {name: {"images": 1, "captions": 1, "shards": 1, "content_hash": "0" * 64} | extra
                       for name, extra in splits.items()}}


manifests = st.one_of(
    st.dictionaries(nasty_text, st.dictionaries(st.sampled_from(["images", "shards", "sha256", "digests"]), json_trees,
                                                max_size=2), max_size=3).map(manifest_tree),
    json_trees)


@fuzz
@given(tree=manifests)
def test_any_manifest_is_read_with_its_splits_inside_the_dataset_or_refused(tree):
    with sandbox_with_victims() as tmp:
        sandbox = Path(tmp)
        data = sandbox / "data"
        data.mkdir()
        (data / shards.MANIFEST).write_text(json.dumps(tree))
        try:
            manifest = shards.read_manifest(data)
        except InputError:
            manifest = None
        if manifest is not None:
            for split in manifest.splits:
                assert (data / split).resolve().parent == data.resolve(), split
        for command in (["shards", "inspect", str(data)], ["shards", "verify", str(data)]):
            run_cli(command, sandbox)


@fuzz
@given(tree=st.one_of(json_trees, st.fixed_dictionaries({"model": json_trees, "epoch": scalars, "step": scalars,
                                                         "val": json_trees, "fused": scalars})))
def test_any_model_card_is_a_card_or_one_metadata_error(tree):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.json"
        path.write_text(json.dumps(tree))
        try:
            saved.read_card(path)
        except saved.MetadataError:
            pass


lock_files = st.one_of(
    st.fixed_dictionaries({k: st.one_of(scalars, json_trees) for k in ("user", "host", "pid", "started", "command", "token", "heartbeat")}),
    json_trees.map(json.dumps), st.binary(max_size=200))


@fuzz
@given(content=lock_files)
def test_any_lock_file_is_taken_over_or_refused_in_one_line(content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.lock"
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        try:
            locks.acquire(path, "fuzz").release()
        except locks.NameInUse:
            pass


csv_cells = st.one_of(st.sampled_from(["a.png", "missing.jpg", "../outside.png", "/etc/passwd", "a\x00b.png", "",
                                       "dir/", '"', "a,b", "\n"]), nasty_text)


@fuzz
@given(rows=st.lists(st.tuples(csv_cells, csv_cells), max_size=8), header=st.booleans())
def test_any_csv_source_lists_records_and_counted_rejects(rows, header):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        text = ("filepath,title\n" if header else "") + "".join(f"{a},{b}\n" for a, b in rows)
        (root / "pairs.csv").write_text(text)
        try:
            listing = sources.list_source("csv", root / "pairs.csv", root, "train")
        except InputError:
            return
        for record in listing.records:
            assert Path(record.image.path).resolve().is_relative_to(root.resolve()), record


# ---------------------------------------------------------------- command lines

paths = st.one_of(st.sampled_from(["out", "victim", "victim/notes.txt", "victim/settings.pt", "/dev/null", "data",
                                   "data/train", "new/deeper/out", ".", "out.pt"]), nasty_text)
counts = st.one_of(st.integers(-3, 30).map(str), nasty_text)
command_lines = st.one_of(
    st.tuples(st.just(["data", "synth", "--out"]), paths, st.just("--num-train"), counts, st.just("--num-val"), counts,
              st.just("--num-test"), st.just("0"), st.just("--rows-per-shard"), counts),
    st.tuples(st.sampled_from([["shards", "inspect"], ["shards", "verify"], ["checkpoints", "list"],
                               ["checkpoints", "verify"]]), paths),
    st.tuples(st.just(["export", "--checkpoint"]), paths, st.just("--out"), paths),
    st.lists(nasty_text, max_size=4).map(tuple),
).map(lambda parts: [part for piece in parts for part in (piece if isinstance(piece, list) else [piece])])


@settings(parent=fuzz, max_examples=max(EXAMPLES // 2, 10))
@given(argv=command_lines)
@example(argv=["shards", "inspect", "s3://"])  # found by bench_fuzz.py: an AttributeError in storage.check_uri
@example(argv=["export", "--checkpoint", "out", "--out", "."])  # found by this test: a ValueError (an empty name)
@example(argv=["export", "--checkpoint", "out", "--out", ""])
@example(argv=["data", "synth", "--out", "a\x00b"])
@example(argv=["checkpoints", "list", "\x00"])  # found by bench_fuzz.py: a ValueError (embedded null byte)
@example(argv=["data", "synth", "--out", "out", "--num-train", "99999999999999999999"])  # found by bench_fuzz.py: endless
def test_any_command_line_ends_in_one_line_and_changes_nothing_it_does_not_own(argv):
    with sandbox_with_victims() as tmp:
        sandbox = Path(tmp)
        synth.generate(sandbox / "data", num_train=4, num_val=0, num_test=0, rows_per_shard=2, progress=False)
        out = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--out"), "\x00")
        output = None if "\x00" in out else sandbox / out
        output = output if output is not None and output.resolve().is_relative_to(sandbox.resolve()) else None
        status, _ = run_cli(argv, sandbox, output)
        if output is None or status != 0:
            return
        assert not output.resolve().is_relative_to((sandbox / "victim").resolve()), argv


# ---------------------------------------------------------------- embed, index, search (issue 78)

HUGE = st.sampled_from([-1, 0, 2**31, 10**15, 2**63 - 1, 2**64, 10**400 // 10**300, 1.5, 1e300, float("nan")])
card_values = st.one_of(HUGE, json_trees, st.sampled_from(["../../x", "/etc/passwd", "x" * 5000, "\x1b[2J", "a\nb"]))


def leaf_paths(tree, prefix=()) -> list[tuple]:
    """Every key path of a JSON tree, inner ones included."""
    children = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    return [prefix] * bool(prefix) + [path for key, value in children for path in leaf_paths(value, prefix + (key,))]


def mutated(data, tree):
    """``tree`` with up to 3 of its values (or whole sections) replaced by hostile ones, drawn from ``data``."""
    tree = json.loads(json.dumps(tree))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(leaf_paths(tree)))
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(card_values)
    return tree


@functools.cache
def served_template() -> Path:
    """A scratch template, made once: a random export (``model/model.pt``), a finished embeddings
    directory of its dim (``emb``: 3 images, 3 captions) and a flat index of both (``ix``)."""
    import numpy as np

    from pairsim.config import ModelConfig
    from pairsim.serving import embeddings
    from pairsim.serving import index as ix
    from pairsim.serving.encoder import Encoder
    from test_embed import manifest, rows

    root = Path(tempfile.mkdtemp(prefix="pairsim-fuzz-served-"))
    atexit.register(shutil.rmtree, root, True)
    cfg = ModelConfig()
    model = retrieval.create_retrieval_model(cfg)
    retrieval.write_exported(retrieval.model_card(cfg, model, 0, 1, 1, {}), model.state_dict(), root / "model" / "model.pt")
    encoder = Encoder.load(root / "model" / "model.pt")
    vectors = {"text": encoder.embed_texts(["a red square", "a blue circle", "two green stars"]),
               "image": embeddings.normalized(np.random.default_rng(0).normal(size=(3, encoder.dim)).astype(np.float32))}
    output = embeddings.open_output(embeddings.claim_output(root / "emb"), manifest(
        model_digest=encoder.digest, model_source=str(root / "model" / "model.pt"), dim=encoder.dim,
        input_shards=["part-00000.parquet"]))
    for modality, v in vectors.items():
        output.write_shard(modality, "part-00000.parquet", rows(modality, v, ["a", "b", "c"]))
    output.save(complete=True)
    table = embeddings.read_embeddings(root / "emb")[1]
    ix.build_index(embeddings.vectors(table), table.select(list(ix.ROW_COLUMNS)), ix.parse_spec({}), encoder.digest,
                   str(root / "model" / "model.pt"), str(root / "emb")).save(root / "ix")
    return root


def served_sandbox() -> tempfile.TemporaryDirectory:
    """:func:`sandbox_with_victims` holding a copy of :func:`served_template` (``model``, ``emb``, ``ix``)."""
    tmp = sandbox_with_victims()
    for name in ("model", "emb", "ix"):
        shutil.copytree(served_template() / name, Path(tmp.name) / name)
    return tmp


@fuzz
@given(data=st.data(), duplicate=st.booleans())
def test_any_embeddings_manifest_is_read_within_its_bounds_or_refused(data, duplicate):
    from pairsim.serving import embeddings

    with served_sandbox() as tmp:
        root = Path(tmp) / "emb"
        tree = mutated(data, json.loads((root / embeddings.MANIFEST).read_text()))
        text = json.dumps(tree)
        (root / embeddings.MANIFEST).write_text(text[:-1] + ', "dim": 4}' if duplicate else text)
        try:
            found, table = embeddings.read_embeddings(root)
        except InputError:
            return
        assert table.num_rows == sum(s.rows for s in found.shards) and found.dim <= embeddings.MAX_DIM


@fuzz
@given(data=st.data())
def test_any_index_card_is_read_within_its_bounds_or_refused(data):
    from pairsim.serving import index as ix

    with served_sandbox() as tmp:
        root = Path(tmp) / "ix"
        (root / ix.CARD_FILE).write_text(json.dumps(mutated(data, json.loads((root / ix.CARD_FILE).read_text()))))
        try:
            found = ix.load_index(root)
        except InputError:
            return
        assert len(found) == found.rows.num_rows and all(part.d == found.card.dim for part in found.parts.values())


served_paths = st.one_of(st.sampled_from(["emb", "ix", "model/model.pt", "out", "victim", "victim/notes.txt",
                                          "victim/settings.json", "data", "/dev/null", "/dev/zero", "fifo", ".", "link",
                                          "new/deeper/out", "s3://", "hdfs://namenode/x"]), nasty_text)
served_command_lines = st.one_of(
    st.tuples(st.just(["index", "--embeddings"]), served_paths, st.just("--out"), served_paths,
              st.lists(st.sampled_from(["--kind", "hnsw", "ivfpq", "--modality", "both", "--param", "m=4", "m=*a",
                                        "nlist=!!python/object/apply:os.system ['touch PWNED']", "x", "m=[&a 1, *a]"]),
                       max_size=4)),
    st.tuples(st.just(["search", "--index"]), served_paths,
              st.lists(st.one_of(st.sampled_from(["--text", "--image", "--model", "-k", "--grid"]), served_paths,
                                 nasty_text), max_size=6)),
    st.tuples(st.just(["embed", "--data"]), served_paths, st.just("--out"), served_paths,
              st.sampled_from([["--model", "victim/settings.json"], ["--model", "ix/index.json"], ["--model", "fifo"],
                               ["--checkpoint", "victim"], ["--model", "emb/embeddings.json"]]),
              st.lists(st.sampled_from(["--split", "val", "../x", "--modality", "image"]), max_size=3)),
).map(lambda parts: [part for piece in parts for part in (piece if isinstance(piece, list) else [piece])])


@settings(parent=fuzz, max_examples=max(EXAMPLES // 2, 10))
@given(argv=served_command_lines)
@example(argv=["index", "--embeddings", "emb", "--out", "victim"])  # a user's folder: refused, kept
@example(argv=["search", "--index", "ix", "--text", "a red square", "--model", "model/model.pt", "-k", "2"])
@example(argv=["search", "--index", "ix", "--image", "fifo"])  # a FIFO: refused unread
def test_any_embed_index_or_search_command_line_ends_in_one_line_and_changes_nothing_it_does_not_own(argv):
    with served_sandbox() as tmp:
        sandbox = Path(tmp)
        os.mkfifo(sandbox / "fifo")
        (sandbox / "link").symlink_to(sandbox / "victim")
        synth.generate(sandbox / "data", num_train=0, num_val=4, num_test=0, rows_per_shard=2, progress=False)
        outputs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--out", "--grid")]
        output = next((sandbox / out for out in outputs if "\x00" not in out), None)
        output = output if output is not None and output.resolve().is_relative_to(sandbox.resolve()) else None
        status, _ = run_cli(argv, sandbox, output)
        if output is not None and status == 0:
            assert not output.resolve().is_relative_to((sandbox / "victim").resolve()), argv
