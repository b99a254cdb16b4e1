"""pairsim.serving.index: exact search against a numpy brute force, the approximate kinds' recall
against exact search, the saved directory read back only once its files match their digests,
and the refusals (foreign output, too few training vectors, bad vectors, rows or queries)."""

import io
import json
import sys

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pairsim.config import ConfigError
from pairsim.errors import InputError
from pairsim.outputs import OutputRefused
from pairsim.serving import index as ix

faiss = pytest.importorskip("faiss")
DIGEST = "ab" * 32


@pytest.fixture(autouse=True, scope="module")
def one_faiss_thread():
    """One OpenMP thread: on a shared 2-core machine faiss's spinning threads cost ~10× the time."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


def normalised(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def clustered(n: int, d: int, seed: int, clusters: int = 50, latent: int = 16) -> np.ndarray:
    """Unit vectors near a ``latent``-dimensional subspace, in ``clusters`` Gaussian clusters (as
    embeddings are: a low intrinsic dimension, topics)."""
    rng, latent = np.random.default_rng(seed), min(latent, d)
    basis = np.linalg.qr(rng.standard_normal((d, latent)))[0].T
    z = rng.standard_normal((clusters, latent))[rng.integers(0, clusters, n)] + 0.3 * rng.standard_normal((n, latent))
    return normalised(z @ basis + 0.02 * rng.standard_normal((n, d)))


def rows_for(n: int, images_every: int = 3) -> pa.Table:
    """Metadata rows ``r0``…: every ``images_every``-th an image, the others its captions."""
    image = [i % images_every == 0 for i in range(n)]
    return pa.table({"id": [f"r{i}" for i in range(n)],
                     "modality": ["image" if m else "text" for m in image],
                     "image_id": [f"img{i // images_every}" for i in range(n)],
                     "caption": [None if m else f"caption {i}" for i, m in enumerate(image)],
                     "source": ["val"] * n},
                    schema=pa.schema([(name, pa.string()) for name in ix.ROW_COLUMNS]))


def build(vectors: np.ndarray, spec: dict, rows: pa.Table | None = None) -> ix.Index:
    return ix.build_index(vectors, rows if rows is not None else rows_for(len(vectors)), ix.parse_spec(spec), DIGEST,
                          "runs:/abc/model", "/data/embeddings")


SMALL_SPECS = [{}, {"kind": "hnsw", "m": 8}, {"kind": "ivfpq", "nlist": 4, "m": 4, "nbits": 3, "refine": 2}]


def test_exact_search_is_the_brute_force_top_k_in_float64():
    vectors = normalised(np.random.default_rng(0).standard_normal((600, 48)))
    queries = normalised(np.random.default_rng(1).standard_normal((25, 48)))
    index = build(vectors, {})
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    rows = rows_for(600).to_pylist()
    for q, line in enumerate(index.search(queries, 10)):
        assert [hit.id for hit in line] == [f"r{j}" for j in expected[q]]
        np.testing.assert_allclose([hit.score for hit in line], scores[q, expected[q]], atol=1e-5)
        assert [hit.row for hit in line] == [rows[j] for j in expected[q]]
    images = index.search(queries, 10, modality="image")
    image_rows = np.arange(0, 600, 3)
    top_images = image_rows[np.argsort(-scores[:, image_rows], axis=1, kind="stable")[:, :10]]
    assert [[hit.id for hit in line] for line in images] == [[f"r{j}" for j in line] for line in top_images]
    assert [len(line) for line in index.search(queries[:2], 10_000)] == [600, 600]  # k clipped to the count
    assert len(index.search(queries[:1], 10_000, modality="image")[0]) == 200


@pytest.mark.parametrize("spec", [{"kind": "hnsw"},
                                  {"kind": "ivfpq", "nlist": 32, "m": 16, "nbits": 6, "nprobe": 8, "refine": 8}],
                         ids=["hnsw", "ivfpq"])
def test_approximate_indexes_find_nine_in_ten_of_the_exact_top_10(spec):
    data = clustered(4200, 64, seed=0)
    vectors, queries = data[:4000], data[4000:]
    exact = np.argsort(-(queries.astype(np.float64) @ vectors.astype(np.float64).T), axis=1)[:, :10]
    hits = build(vectors, spec, rows_for(4000, images_every=1)).search(queries, 10)
    recall = np.mean([len({f"r{j}" for j in want} & {hit.id for hit in got}) / 10 for want, got in zip(exact, hits)])
    assert recall >= 0.9, recall


def test_captions_find_images_across_the_modality_gap():
    """Image and caption embeddings lie apart, each modality offset along its own direction (the
    modality gap): a search kept to the images from a caption still finds the exact top 10,
    each modality its own index."""
    shared = clustered(4000, 64, seed=9)
    offsets = np.eye(64, dtype=np.float32)[[0, 1]]
    images, texts = normalised(shared[:2000] + offsets[0]), normalised(shared[2000:] + offsets[1])
    vectors = np.concatenate([images, texts])
    rows = rows_for(4000).set_column(1, "modality", pa.array(["image"] * 2000 + ["text"] * 2000))
    exact = np.argsort(-(texts[:100].astype(np.float64) @ images.astype(np.float64).T), axis=1)[:, :10]
    hits = build(vectors, {"kind": "hnsw"}, rows).search(texts[:100], 10, modality="image")
    assert all(len(line) == 10 and {hit.row["modality"] for hit in line} == {"image"} for line in hits)
    recall = np.mean([len({f"r{j}" for j in want} & {hit.id for hit in got}) / 10 for want, got in zip(exact, hits)])
    assert recall >= 0.9, recall


@pytest.mark.parametrize("spec", SMALL_SPECS, ids=["flat", "hnsw", "ivfpq"])
def test_a_saved_index_loads_back_with_its_card_and_the_same_answers(spec, tmp_path):
    vectors = clustered(1000, 32, seed=2)
    built = build(vectors, spec)
    built.save(tmp_path / "index")
    loaded = ix.load_index(tmp_path / "index")
    card = json.loads((tmp_path / "index" / ix.CARD_FILE).read_text())
    assert card["spec"]["kind"] == spec.get("kind", "flat") and card["dim"] == 32
    assert card["modalities"] == {"image": 334, "text": 666}
    assert (card["model_digest"], card["model_source"], card["embeddings_source"]) == \
        (DIGEST, "runs:/abc/model", "/data/embeddings")
    assert set(card["files"]) == {"index.image.faiss", "index.text.faiss", "rows.parquet"}
    assert loaded.card == built.card and loaded.modalities == built.modalities == {"image": range(0, 334),
                                                                                    "text": range(334, 1000)}
    for modality in (None, "text"):
        before, after = built.search(vectors[:5], 7, modality), loaded.search(vectors[:5], 7, modality)
        assert [[(h.id, h.score, h.row) for h in line] for line in before] == \
            [[(h.id, h.score, h.row) for h in line] for line in after]
    built.save(tmp_path / "index")  # its own directory: written again


@pytest.mark.parametrize("name", ["index.text.faiss", ix.ROWS_FILE])
def test_a_tampered_file_is_refused_before_faiss_or_parquet_reads_it(name, tmp_path, monkeypatch):
    build(clustered(300, 16, seed=3), {}).save(tmp_path)
    target = tmp_path / name
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))

    def never(*args):
        raise AssertionError("parsed before its digest was checked")

    monkeypatch.setattr(faiss, "deserialize_index", never)
    monkeypatch.setattr(ix.pq, "read_table", never)
    with pytest.raises(ix.IndexFileError, match=name):
        ix.load_index(tmp_path)
    target.write_bytes(bytes(data) + b"more")  # longer than recorded: not read past the recorded size
    with pytest.raises(ix.IndexFileError, match=name):
        ix.load_index(tmp_path)


def test_a_card_that_disagrees_with_its_files_is_refused(tmp_path):
    build(clustered(300, 16, seed=3), {}).save(tmp_path)
    card = json.loads((tmp_path / ix.CARD_FILE).read_text())
    (tmp_path / ix.CARD_FILE).write_text(json.dumps(card | {"dim": 32}))
    with pytest.raises(ix.IndexFileError, match="dim"):
        ix.load_index(tmp_path)
    (tmp_path / ix.CARD_FILE).write_text(json.dumps(card | {"model_digest": "not hex"}))
    with pytest.raises(ix.IndexFileError, match="model_digest"):
        ix.load_index(tmp_path)


def test_a_foreign_directory_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match="not empty"):
        build(clustered(100, 16, seed=4), {}).save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_ivfpq_with_too_few_training_vectors_is_refused_naming_the_field():
    vectors = clustered(1000, 32, seed=5)
    with pytest.raises(ConfigError) as refused:
        build(vectors, {"kind": "ivfpq", "nlist": 64, "m": 4, "nbits": 4})
    assert refused.value.keys == ("nlist",) and "2,496" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        build(vectors, {"kind": "ivfpq", "nlist": 4, "m": 4, "nbits": 8})
    assert refused.value.keys == ("nbits",)
    with pytest.raises(ConfigError) as refused:
        build(vectors, {"kind": "ivfpq", "nlist": 4, "m": 5, "nbits": 4})
    assert refused.value.keys == ("m",)


def test_bad_specs_vectors_rows_and_queries_are_refused_naming_them():
    with pytest.raises(ConfigError) as refused:
        ix.parse_spec({"kind": "hnsw", "m": "32", "ef_serch": 10})
    assert set(refused.value.keys) == {"hnsw.m", "hnsw.ef_serch"}
    with pytest.raises(ConfigError):
        ix.parse_spec({"kind": "lsh"})
    vectors = clustered(30, 8, seed=6)
    for bad_vectors, field in ((vectors * 2, "normalised"), (vectors[:, :, None], "shape"),
                               (np.full((30, 8), np.nan, np.float32), "NaN")):
        with pytest.raises(InputError, match=field):
            build(bad_vectors, {})
    duplicated = rows_for(30).set_column(0, "id", pa.array(["same"] * 30))
    for rows, problem in ((rows_for(29), "29 rows"), (rows_for(30).drop_columns(["caption"]), "caption"),
                          (duplicated, "repeat")):
        with pytest.raises(InputError, match=problem):
            build(vectors, {}, rows)
    with pytest.raises(InputError, match="model_digest"):
        ix.build_index(vectors, rows_for(30), ix.FlatSpec(), "not a digest", "m", "e")
    index = build(vectors, {})
    with pytest.raises(InputError, match="queries: dim 16"):
        index.search(clustered(2, 16, seed=7), 3)
    with pytest.raises(InputError, match="modality"):
        index.search(vectors[:1], 3, modality="audio")
    with pytest.raises(InputError, match="k"):
        index.search(vectors[:1], 0)


def test_without_faiss_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss raises ImportError
    with pytest.raises(InputError, match=r'pip install "pairsim\[search\]"'):
        ix.load_index("/nonexistent")


def test_the_picture_grid_shows_the_image_hits_asking_only_for_their_images(tmp_path):
    vectors = clustered(90, 16, seed=8)
    hits = build(vectors, {}).search(vectors[:1], 4, modality="image")[0]
    asked = []

    def images(ids):
        asked.append(ids)
        return {i: Image.new("RGB", (32, 32), (int(i[3:]) * 8 % 256, 0, 0)) for i in ids}

    grid = ix.picture_grid(hits, images, tmp_path / "grid.png", title="a red circle")
    assert asked == [sorted({hit.row["image_id"] for hit in hits})]
    with Image.open(io.BytesIO((tmp_path / "grid.png").read_bytes())) as png:
        assert png.format == "PNG" and png.width > png.height  # one line of 4
    assert grid == tmp_path / "grid.png"
    with pytest.raises(OutputRefused):
        ix.picture_grid(hits, images, tmp_path / "grid.png")  # not replaced


def test_the_picture_grid_shows_at_most_its_limit_and_draws_titles_as_text(tmp_path):
    vectors = clustered(300, 16, seed=9)
    hits = build(vectors, {}).search(vectors[:1], 100, modality="image")[0]
    asked = []

    def images(ids):
        asked.extend(ids)
        return {i: Image.new("RGB", (8, 8)) for i in ids}

    ix.picture_grid(hits, images, tmp_path / "grid.png", title="text '$\\frac{$' \x1b[2J")  # TeX, an escape: as text
    assert len(hits) == 100 and len(asked) == ix.MAX_GRID_PICTURES
