"""``pairsim embed``, ``index`` and ``search`` as a hostile or careless user meets them (issue 78):
an output is the command's only when its card parses as the command's; every number a card or
manifest records is bounded before it sizes a read or a shape; bytes that match their recorded
digest but are no Parquet or faiss file, or a faiss index other than the card says, end in one
line naming the file; a tracking store that is a user's file or database is refused unopened."""

import hashlib
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from pairsim import cli, tracking
from pairsim.serving import embeddings
from pairsim.serving import index as ix
from test_embed import manifest, rows

faiss = pytest.importorskip("faiss")


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def refusal(capsys, status: int) -> str:
    """stderr of a command refused as bad input: exit 2, a ``pairsim:`` line (a typed file's
    field errors listed under it, at most 20), no traceback."""
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("pairsim: ") and err.count("\n") <= 21 and "Traceback" not in err, err
    return err


@pytest.fixture
def embedded(tmp_path) -> Path:
    """A finished embeddings directory of 3 images and 3 captions (dim 4)."""
    rng = np.random.default_rng(0)
    output = embeddings.open_output(embeddings.claim_output(tmp_path / "emb"), manifest())
    for modality in ("image", "text"):
        for shard, ids in (("part-00000.parquet", ["a", "b"]), ("part-00001.parquet", ["c"])):
            vectors = embeddings.normalized(rng.normal(size=(len(ids), 4)).astype(np.float32))
            output.write_shard(modality, shard, rows(modality, vectors, ids))
    output.save(complete=True)
    return tmp_path / "emb"


@pytest.fixture
def indexed(embedded, tmp_path, capsys) -> Path:
    assert cli.main(["index", "--embeddings", str(embedded), "--out", str(tmp_path / "ix"), "--modality", "both"]) == 0
    capsys.readouterr()
    return tmp_path / "ix"


def rewrite(path: Path, change) -> None:
    tree = json.loads(path.read_text())
    change(tree)
    path.write_text(json.dumps(tree))


def set_at(tree, where: tuple, value) -> None:
    """``value`` at the key path ``where`` of a JSON tree."""
    for key in where[:-1]:
        tree = tree[key]
    tree[where[-1]] = value


def replace_recorded(directory: Path, name: str, data: bytes) -> None:
    """``name`` in an index directory replaced by ``data``, its card's size and SHA-256 updated to
    match (whoever can write the directory can do both)."""
    (directory / name).write_bytes(data)
    rewrite(directory / ix.CARD_FILE, lambda card: card["files"].__setitem__(
        name, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.mark.parametrize("users_card", ['{"my": "notes"}', '{"format_version": 1}', "[1, 2]", "not json"])
def test_index_out_over_a_users_index_json_and_rows_is_refused_and_both_are_kept(embedded, tmp_path, capsys,
                                                                                users_card):
    out = tmp_path / "mine"
    out.mkdir()
    (out / ix.CARD_FILE).write_text(users_card)  # a user's files that happen to carry pairsim's names
    (out / ix.ROWS_FILE).write_bytes(b"PAR1 the user's own table PAR1")
    before = tree_digest(out)
    err = refusal(capsys, cli.main(["index", "--embeddings", str(embedded), "--out", str(out)]))
    assert ix.CARD_FILE in err and "not one pairsim wrote" in err and err.count("\n") == 1
    assert tree_digest(out) == before


def test_an_index_directory_pairsim_wrote_is_replaced(embedded, indexed, capsys):
    assert cli.main(["index", "--embeddings", str(embedded), "--out", str(indexed), "--modality", "text"]) == 0
    assert ix.load_index(indexed).card.modalities == {"text": 3}


@pytest.mark.parametrize("where, value", [
    (("files", "rows.parquet", "bytes"), 10**15), (("files", "rows.parquet", "bytes"), 2**63 - 1),
    (("dim",), 2**63 - 1), (("modalities", "image"), 10**15), (("model_source",), "x" * 10_000)])
def test_an_index_card_recording_numbers_beyond_their_bounds_is_refused_naming_the_field(indexed, tmp_path, capsys,
                                                                                         where, value):
    rewrite(indexed / ix.CARD_FILE, lambda tree: set_at(tree, where, value))
    err = refusal(capsys, cli.main(["search", "--index", str(indexed), "--text", "a cat",
                                             "--model", str(tmp_path / "none.pt")]))
    assert ".".join(where) in err or where[-1] in err


def test_a_card_counting_more_rows_than_its_file_holds_is_refused_before_anything_is_sized_by_it(indexed):
    """Found by bench_fuzz.py: 2^31 image rows (within the bound) made a 40 GiB array of the
    card's modality per row before the rows file was compared."""
    rewrite(indexed / ix.CARD_FILE, lambda tree: set_at(tree, ("modalities", "image"), 2**31))
    with pytest.raises(ix.IndexFileError, match=f"{ix.ROWS_FILE}: not the {2**31 + 3} rows"):
        ix.load_index(indexed)


@pytest.mark.parametrize("where, value", [(("dim",), 10**15), (("shards", 0, "bytes"), 2**63 - 1),
                                          (("shards", 0, "rows"), 10**15), (("split",), "../../other")])
def test_an_embeddings_manifest_recording_numbers_beyond_their_bounds_is_refused(embedded, tmp_path, capsys,
                                                                                where, value):
    rewrite(embedded / embeddings.MANIFEST, lambda tree: set_at(tree, where, value))
    err = refusal(capsys, cli.main(["index", "--embeddings", str(embedded), "--out", str(tmp_path / "ix")]))
    assert str(where[-1]) in err
    assert not (tmp_path / "ix").exists()


@pytest.mark.parametrize("name, data", [(ix.ROWS_FILE, b"PAR1" + bytes(range(256)) * 4 + b"PAR1"),
                                        ("index.image.faiss", b"IxFI" + bytes(range(256)) * 4),
                                        ("index.text.faiss", b"")])
def test_garbage_with_its_digest_updated_ends_in_one_line_naming_the_file(indexed, capsys, name, data):
    replace_recorded(indexed, name, data)
    with pytest.raises(ix.IndexFileError, match=name):
        ix.load_index(indexed)
    err = refusal(capsys, cli.main(["search", "--index", str(indexed), "--text", "a cat"]))
    assert name in err


@pytest.mark.parametrize("make, what", [(lambda: faiss.IndexFlatL2(4), "IndexFlatL2"),
                                        (lambda: faiss.IndexHNSWFlat(4, 8, faiss.METRIC_INNER_PRODUCT),
                                         "IndexHNSWFlat")])
def test_a_faiss_index_other_than_the_card_describes_is_refused(indexed, make, what):
    part = make()
    part.add(embeddings.normalized(np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)))
    replace_recorded(indexed, "index.image.faiss", faiss.serialize_index(part).tobytes())
    with pytest.raises(ix.IndexFileError, match=what):
        ix.load_index(indexed)


def test_rows_of_another_schema_with_their_digest_updated_are_refused(indexed):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = ix.load_index(indexed).rows
    sink = pa.BufferOutputStream()
    pq.write_table(table.set_column(4, "source", pa.array([1] * table.num_rows)), sink)  # ints where strings go
    replace_recorded(indexed, ix.ROWS_FILE, sink.getvalue().to_pybytes())
    with pytest.raises(ix.IndexFileError, match=ix.ROWS_FILE):
        ix.load_index(indexed)


def test_an_embeddings_shard_of_garbage_with_its_digest_updated_is_one_error(embedded):
    data = b"PAR1" + bytes(range(256)) * 8 + b"PAR1"
    (embedded / "image-part-00000.parquet").write_bytes(data)

    def change(tree):
        shard = next(s for s in tree["shards"] if s["file"] == "image-part-00000.parquet")
        shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

    rewrite(embedded / embeddings.MANIFEST, change)
    with pytest.raises(embeddings.EmbeddingsError, match="image-part-00000.parquet"):
        embeddings.read_embeddings(embedded)


def test_a_tracking_store_that_is_a_users_file_or_database_is_refused_and_left_as_it_was(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes")
    app = tmp_path / "app.db"
    with sqlite3.connect(app) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    store = tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{store}").search_experiments()  # an MLflow store: MLflow made its tables
    capsys.readouterr()
    before = tree_digest(tmp_path)
    for path, problem in ((notes, "not an SQLite database"), (app, "users")):
        err = refusal(capsys, cli.main(["export", "--run-id", "abc", "--tracking-uri", f"sqlite:///{path}",
                                                 "--out", str(tmp_path / "model.pt")]))
        assert problem in err and "tracking_uri" in err
    assert tree_digest(tmp_path) == before
    tracking.check_reachable(f"sqlite:///{store}")
    (tmp_path / "empty.db").touch()
    tracking.check_reachable(f"sqlite:///{tmp_path / 'empty.db'}")


@pytest.mark.parametrize("param", ["nlist=!!python/object/apply:os.system ['touch PWNED']", "m=[&a 8, *a]", "m=[",
                                   "m=\x1b[2J", "nothing"])
def test_an_index_param_goes_through_the_set_parser_and_is_refused_in_one_line(embedded, tmp_path, capsys, param,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = refusal(capsys, cli.main(["index", "--embeddings", str(embedded), "--out", str(tmp_path / "ix"),
                                    "--kind", "hnsw", "--param", param]))
    assert "--param" in err and "\x1b" not in err
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "ix").exists()
