"""``pairsim embed`` → ``pairsim index`` → ``pairsim search`` on the demo config's trained model,
against what ``pairsim evaluate`` computes for the same model and split; and the search command's
refusals."""

import re

import numpy as np
import pyarrow as pa
import pytest

from pairsim.cli import main
from pairsim.config import ConfigError, load_config
from pairsim.data import shards
from pairsim.models import retrieval
from pairsim.serving import index


def random_export(path, seed: int):
    """A randomly initialised pairsim-tiny export at ``path`` (model.pt and its card)."""
    import torch

    cfg = load_config(None).model
    torch.manual_seed(seed)
    model = retrieval.create_retrieval_model(cfg)
    retrieval.write_exported(retrieval.model_card(cfg, model, 0, 1, 0, {}), model.state_dict(), path)
    return path


def printed_hits(out: str) -> list[list[str]]:
    """The ids ``pairsim search`` printed, a list per query in order."""
    blocks: list[list[str]] = []
    for line in out.splitlines():
        if re.match(r"^(text|image) .*: top \d+ of", line):
            blocks.append([])
        elif blocks and (hit := re.match(r"^\s*\d+\s+-?[\d.]+\s+(\S+)", line)):
            blocks[-1].append(hit[1])
    return blocks


@pytest.mark.slow
def test_embed_index_search_finds_each_captions_image_as_often_as_evaluate_says(ray_instance, trained_export,
                                                                                tiny_dataset, tmp_path, capsys):
    """Every val caption searched against the exact index of the val images: the share whose own
    image is in the top 5 is evaluate's t2i R@5 (± 5 points, the issue's bound; a near tie may
    fall either way between Ray Data's embeddings and the search's own)."""
    from pairsim.eval import inference, suite

    emb, idx = tmp_path / "emb", tmp_path / "idx"
    assert main(["embed", "--model", str(trained_export), "--data", str(tiny_dataset), "--split", "val",
                 "--out", str(emb)]) == 0
    assert main(["index", "--embeddings", str(emb), "--out", str(idx)]) == 0
    model, card = retrieval.load_exported(trained_export)
    cfg = load_config(None, [f"data.path={tiny_dataset}"]).model_copy(update={"model": card.model})
    evaluated = suite.evaluate_split(inference.embed_with_ray_data(model, cfg, "val", progress=False),
                                     retrieval.fusion_module(model, cfg.model), cfg.eval.ks).metrics

    table = shards.read_table(shards.split_shards(tiny_dataset, "val"), columns=["image_id", "captions"]).to_pylist()
    queries = [(row["image_id"], caption) for row in table for caption in row["captions"]]
    capsys.readouterr()
    assert main(["search", "--index", str(idx), "-k", "5", *(a for _, c in queries for a in ("--text", c))]) == 0
    hits = printed_hits(capsys.readouterr().out)
    assert len(hits) == len(queries) and all(len(found) == 5 for found in hits)
    found_own = 100 * np.mean([f"image/{image_id}" in found for (image_id, _), found in zip(queries, hits)])
    assert found_own == pytest.approx(evaluated["t2i_R@5"], abs=5)
    assert evaluated["t2i_R@5"] > 100 * 5 / len(table)  # the trained model does better than chance


def test_search_refuses_a_model_other_than_the_indexes_and_a_query_less_call(tmp_path):
    """The index records the digest of the model that made its embeddings: another export (or the
    same architecture with other weights) would embed queries in another space."""
    built_with = random_export(tmp_path / "a" / "model.pt", seed=0)
    other = random_export(tmp_path / "b" / "model.pt", seed=1)
    vectors = np.eye(4, 128, dtype=np.float32)  # pairsim-tiny embeds in 128 dimensions
    rows = pa.table({"id": [f"image/{i}" for i in range(4)], "modality": ["image"] * 4,
                     "image_id": [str(i) for i in range(4)], "caption": pa.nulls(4, pa.string()),
                     "source": pa.nulls(4, pa.string())})
    index.build_index(vectors, rows, index.parse_spec({}), retrieval.model_digest(built_with), str(built_with),
                      str(tmp_path / "gone")).save(tmp_path / "idx")
    with pytest.raises(ConfigError) as refused:
        main(["--debug", "search", "--index", str(tmp_path / "idx"), "--model", str(other), "--text", "a red circle"])
    assert refused.value.keys == ("--model",) and retrieval.model_digest(other)[:12] in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        main(["--debug", "search", "--index", str(tmp_path / "idx")])
    assert set(refused.value.keys) == {"--text", "--image"}
