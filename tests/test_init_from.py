"""``model.init_from``: a run starts from a pairsim export or checkpoint; what cannot be one is
refused on the driver, naming the key, before Ray starts and without running anything in it."""

import hashlib
import json
import pickle

import pytest
import torch

from pairsim.cli import DEMO_CONFIG, main
from pairsim.config import ConfigError, ModelConfig, load_config
from pairsim.models import clip, retrieval
from pairsim import cluster
from pairsim.train import checkpoints


def export(path, seed, heads=True, unimodal=False, arch="pairsim-tiny"):
    """A pairsim export of a seeded model (cross-modal heads, and uni-modal ones if asked)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch=arch, crossmodal_heads=heads)
    model = retrieval.create_retrieval_model(cfg, unimodal_heads=unimodal)
    retrieval.write_exported(retrieval.model_card(cfg, model, zero_stage=0, epoch=3, step=30, val={}),
                             model.state_dict(), path)
    return model


def test_an_export_loads_its_open_clip_weights_and_the_heads_both_have(tmp_path):
    source = export(tmp_path / "model.pt", seed=0, heads=True, unimodal=True)
    torch.manual_seed(1)
    # this model has cross-modal heads (loaded), no uni-modal heads (left out of the source)
    target = retrieval.create_retrieval_model(ModelConfig(crossmodal_heads=True))
    fresh_heads = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("cross_heads")}
    checkpoints.load_initial_weights(target, tmp_path / "model.pt")
    expected = source.state_dict()
    for key, value in target.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(fresh_heads[k], expected[k]) for k in fresh_heads)  # the heads did change

    torch.manual_seed(2)  # a model with uni-modal heads the source lacks: those keep their own init
    cfg = ModelConfig(crossmodal_heads=False)
    plain_source = export(tmp_path / "plain" / "model.pt", seed=3, heads=False)
    target = retrieval.create_retrieval_model(cfg, unimodal_heads=True)
    own = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("unimodal_heads")}
    checkpoints.load_initial_weights(target, tmp_path / "plain" / "model.pt")
    state = target.state_dict()
    assert all(torch.equal(state[k], v) for k, v in own.items())
    assert all(torch.equal(state[k], v) for k, v in plain_source.state_dict().items())


def test_initial_weights_make_the_same_embeddings_as_the_source(tmp_path):
    source = export(tmp_path / "model.pt", seed=0).eval()
    target = retrieval.create_retrieval_model(ModelConfig(crossmodal_heads=True))
    checkpoints.load_initial_weights(target, tmp_path / "model.pt")
    pixels, tokens = torch.randn(2, 3, 64, 64), clip.tokenizer("pairsim-tiny")(["a red circle", "two blue squares"])
    with torch.no_grad():
        want, got = source(pixels, tokens), target.eval()(pixels, tokens)
    for key in ("image", "text"):
        torch.testing.assert_close(got[key], want[key])


def test_missing_and_plain_files_are_named(tmp_path):
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "nowhere.pt"))
    assert str(exc.value).startswith("model.init_from:") and f"{tmp_path / 'nowhere.pt'}: no such file" in str(exc.value)
    model = retrieval.create_retrieval_model(ModelConfig())
    torch.save(retrieval.open_clip_state(model.state_dict()), tmp_path / "plain.pt")
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "plain.pt"))
    assert str(tmp_path / "plain.pt") in str(exc.value) and "model.pretrained" in str(exc.value)  # where it goes
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "empty"))
    assert str(exc.value).startswith("model.init_from:") and str(tmp_path / "empty") in str(exc.value)
    assert checkpoints.NOT_A_CHECKPOINT in str(exc.value)
    (tmp_path / "empty" / "deepspeed").mkdir()
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "empty"))
    assert str(exc.value).startswith("model.init_from:") and str(tmp_path / "empty") in str(exc.value)
    assert checkpoints.NOT_A_CHECKPOINT not in str(exc.value) and checkpoints.CARD_FILE in str(exc.value)  # what it lacks


def test_another_architecture_is_refused_by_its_card_and_by_its_weights(tmp_path):
    export(tmp_path / "model.pt", seed=0)
    checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "model.pt"))  # the right one passes
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(arch="ViT-B-32", init_from=tmp_path / "model.pt"))
    assert str(exc.value).startswith("model.init_from:")
    assert "pairsim-tiny" in str(exc.value) and "model.arch 'ViT-B-32'" in str(exc.value)  # the card's, the config's
    card = json.loads((tmp_path / "model.json").read_text())
    card["model"]["arch"] = "ViT-B-32"  # a card edited to claim what the weights are not
    (tmp_path / "model.json").write_text(json.dumps(card))
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(arch="ViT-B-32", init_from=tmp_path / "model.pt"))
    assert str(exc.value).startswith("model.init_from:") and "ViT-B-32" in str(exc.value)
    assert "pairsim-tiny" not in str(exc.value) and "tensors missing" in str(exc.value)  # the weights, not the card


class RunsCode:
    def __reduce__(self):
        import os

        return os.system, (f"touch {MARKER}",)


MARKER = "/tmp/pairsim-init-from-was-run"


def test_a_crafted_pickle_is_refused_and_nothing_in_it_runs(tmp_path):
    import os

    if os.path.exists(MARKER):
        os.remove(MARKER)
    export(tmp_path / "model.pt", seed=0)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    torch.save(state | {"payload": RunsCode()}, tmp_path / "model.pt")
    card = json.loads((tmp_path / "model.json").read_text())
    card["sha256"]["weights"] = hashlib.sha256((tmp_path / "model.pt").read_bytes()).hexdigest()  # and its checksum
    (tmp_path / "model.json").write_text(json.dumps(card))
    with pytest.raises(ConfigError) as exc:
        checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "model.pt"))
    assert str(exc.value).startswith("model.init_from:") and f"{tmp_path / 'model.pt'}: refused" in str(exc.value)
    assert not os.path.exists(MARKER)
    with pytest.raises(pickle.UnpicklingError):  # the file does carry code: the refusal is what stops it
        torch.load(tmp_path / "model.pt", weights_only=True)


def test_init_from_and_pretrained_are_one_or_the_other(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"model.init_from={tmp_path}/model.pt", "model.pretrained=openai"])
    assert exc.value.keys == ("model.init_from", "model.pretrained")


def test_a_bad_init_from_stops_a_run_before_ray_starts(tmp_path, tiny_dataset, capsys, monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("init_ray was reached: the init_from error came after Ray started")

    monkeypatch.setattr(cluster, "init_ray", reached)
    export(tmp_path / "model.pt", seed=0)
    args = ["train", "--config", str(DEMO_CONFIG), "--set", f"data.path={tiny_dataset}", "--set", f"ray.storage_path={tmp_path}/ray",
            "--set", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    assert main([*args, "--set", "model.arch=ViT-B-32", "--set", f"model.init_from={tmp_path}/model.pt"]) == 2
    assert "model.init_from" in capsys.readouterr().err
    # a relative path is resolved against the working directory, as every local path is
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--set", "model.init_from=missing/model.pt"]) == 2
    assert f"{tmp_path}/missing/model.pt" in capsys.readouterr().err  # resolved against the working directory


def test_init_from_through_a_link_names_the_link_and_where_it_leads(tmp_path):
    """``model.init_from`` a link to an export (``latest.pt`` → ``runs/a/model.pt``): it loads
    the export beside its target (card and heads there), and a refusal names the path the config
    gives and where it leads, as a run checks it (its paths made absolute first)."""
    export(tmp_path / "runs" / "a" / "model.pt", seed=0)
    (tmp_path / "latest.pt").symlink_to(tmp_path / "runs" / "a" / "model.pt")
    cfg = load_config(None, [f"model.init_from={tmp_path}/latest.pt"]).with_absolute_paths()
    assert cfg.model.init_from == tmp_path / "latest.pt"
    checkpoints.check_init_from(cfg.model)
    target = retrieval.create_retrieval_model(ModelConfig(crossmodal_heads=True))
    checkpoints.load_initial_weights(target, cfg.model.init_from)
    with pytest.raises(ConfigError) as refused:
        checkpoints.check_init_from(cfg.model.model_copy(update={"arch": "ViT-B-32"}))
    assert str(refused.value).startswith(f"model.init_from: {tmp_path / 'latest.pt'} leads to "
                                         f"{tmp_path / 'runs' / 'a' / 'model.pt'}: ")
    assert "model.arch 'ViT-B-32'" in str(refused.value)
    (tmp_path / "loop.pt").symlink_to(tmp_path / "loop.pt")
    with pytest.raises(ConfigError, match=f"model.init_from: {tmp_path / 'loop.pt'}: a loop of links"):
        checkpoints.check_init_from(ModelConfig(init_from=tmp_path / "loop.pt"))


def test_initial_student_teacher_starts_from_init_from(tmp_path):
    from pairsim.build import build_teachers

    source = export(tmp_path / "model.pt", seed=0).eval()
    cfg = load_config(None, [f"model.init_from={tmp_path}/model.pt",
                             "loss.cusa={image_teacher: {kind: initial_student}}"])
    teacher = build_teachers(cfg)["image"]
    pixels = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        want = torch.nn.functional.normalize(source.clip.encode_image(teacher.normalize(pixels)), dim=-1)
    torch.testing.assert_close(teacher.embed({"pixels": pixels}), want)
    (tmp_path / "ckpt").mkdir()
    dir_cfg = load_config(None, [f"model.init_from={tmp_path}/ckpt", "loss.cusa={image_teacher: {kind: initial_student}}"])
    with pytest.raises(ConfigError, match="export it"):
        build_teachers(dir_cfg)
