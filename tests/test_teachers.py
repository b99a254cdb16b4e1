"""Teachers: driver-side checks name the field; prepared inputs have one shape; embeddings do not
depend on padding; teachers pickle without their weights."""

import json
import pickle

import pytest
import torch

from pairsim import build
from pairsim.teachers import encoders, store
from pairsim.train import driver
from pairsim.config import ConfigError, load_config


def cusa_config(dataset, **cusa):
    cusa.setdefault("image_teacher", {"kind": "initial_student"})
    return load_config(None, [f"data.path={dataset}", f"loss.cusa={json.dumps(cusa)}"])


def test_missing_teacher_files_are_named_before_the_cluster_starts(tiny_dataset, tmp_path):
    cfg = cusa_config(tiny_dataset, image_teacher={"kind": "open_clip", "arch": "pairsim-tiny",
                                                   "path": str(tmp_path / "nope.pt")})
    with pytest.raises(ConfigError) as exc:
        driver.plan_run(cfg)
    assert exc.value.keys == ("loss.cusa.image_teacher.path",) and str(tmp_path / "nope.pt") in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        cusa_config(tiny_dataset, image_teacher={"kind": "sentence_transformers"})
    assert exc.value.keys == ("loss.cusa.image_teacher",) and "sentence_transformers" in str(exc.value)
    cfg = cusa_config(tiny_dataset, teacher_features=str(tmp_path))
    with pytest.raises(ConfigError) as exc:
        driver.plan_run(cfg)
    assert exc.value.keys == ("loss.cusa.teacher_features",) and store.STORE_MANIFEST in str(exc.value)


def test_features_of_other_data_or_teachers_are_refused(tiny_dataset, tmp_path):
    cfg = cusa_config(tiny_dataset, teacher_features=str(tmp_path))
    manifest = {"data_content_hash": "0" * 64, "splits": ["train"],
                "teachers": {m: t.identity() for m, t in build.build_teachers(cusa_config(tiny_dataset)).items()}}
    (tmp_path / store.STORE_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as exc:
        driver.plan_run(cfg)
    assert exc.value.keys == ("loss.cusa.teacher_features",) and "content hash 000000000000" in str(exc.value)
    from pairsim.data import shards

    manifest["data_content_hash"] = shards.read_manifest(tiny_dataset).content_hash
    manifest["teachers"]["text"]["max_length"] = 99
    (tmp_path / store.STORE_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as exc:
        driver.plan_run(cusa_config(tiny_dataset, teacher_features=str(tmp_path),
                                       text_teacher={"kind": "sentence_transformers"}))
    assert exc.value.keys == ("loss.cusa.text_teacher",) and "'max_length': 99" in str(exc.value)  # the features' teacher


def test_minilm_teacher_embeddings_ignore_padding_and_pickle_light():
    captions = ["a small red circle", "a large blue square to the left of a green triangle"]
    short, long = encoders.SentenceTransformerTeacher(max_length=24), encoders.SentenceTransformerTeacher(max_length=64)
    prepared = short.prepare(captions)
    assert {v.shape for v in prepared.values()} == {(2, 24)}
    a, b = short.embed(prepared), long.embed(long.prepare(captions))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.norm(dim=-1), torch.ones(2))
    assert float(a[0] @ a[1]) < 0.99  # different sentences, different embeddings
    assert len(pickle.dumps(short)) < 10_000  # the weights stay behind


def test_initial_student_teacher_is_the_students_initialisation(tiny_dataset):
    from pairsim.models import retrieval

    cfg = cusa_config(tiny_dataset)
    teacher = build.build_teachers(cfg)["image"]
    torch.manual_seed(cfg.train.seed)
    student = retrieval.create_retrieval_model(cfg.model, unimodal_heads=True)
    for (name, got), want in zip(teacher.model.state_dict().items(), student.clip.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)


def test_open_clip_teacher_from_a_local_file_embeds_as_open_clip_does(tiny_dataset, tmp_path):
    import open_clip
    from PIL import Image

    from pairsim.models import clip

    torch.manual_seed(1)
    path = clip.save_open_clip_weights(clip.create_model(load_config().model).state_dict(), tmp_path / "t.pt")
    cfg = cusa_config(tiny_dataset, image_teacher={"kind": "open_clip", "arch": "pairsim-tiny", "path": str(path)})
    build.check_teachers(cfg)
    teacher = build.build_teachers(cfg)["image"]
    images = [Image.new("RGB", (80, 60), c) for c in ((200, 30, 30), (20, 200, 90))]
    reference, _, preprocess = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=str(path))
    with torch.no_grad():
        expected = reference.eval().encode_image(torch.stack([preprocess(i) for i in images]), normalize=True)
    torch.testing.assert_close(teacher.embed(teacher.prepare(images)), expected)


def test_extraction_skips_unreadable_images_and_says_why(tiny_dataset):
    import numpy as np
    import pyarrow.parquet as pq

    from pairsim.data import shards

    rows = pq.read_table(shards.split_files(tiny_dataset, "train")[0]).slice(0, 3).to_pydict()
    batch = {k: np.asarray(v, dtype=object) for k, v in rows.items()}
    batch["image"][1] = b"not an image"
    batch["path"] = np.asarray(["train/part-00000.parquet"] * 3, dtype=object)
    out = store._EmbedShardRows(build.build_teachers(cusa_config(tiny_dataset)))(batch)
    assert [bool(e) for e in out["error"]] == [False, True, False] and "UnidentifiedImageError" in out["error"][1]
    assert out["image"][0].shape == (128,) and out["image"][1].size == 0
    assert out["captions"][2].shape == (len(rows["captions"][2]), 384)
