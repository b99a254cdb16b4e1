"""Config and sweep files, and source records, as a careless user or an attacker writes them
(issue 31, items 2 and 3): each refused (or, for a record, counted as a reject) in well under a
second, before Ray, with one message naming the file and what is wrong — no expansion, no
traceback, no file content echoed beyond a short excerpt."""

import time

import pytest

from pairsim import cli
from pairsim.config import ConfigError, load_config
from pairsim.config.loading import MAX_CONFIG_BYTES, MAX_DEPTH
from pairsim.tune.space import load_sweep

ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))


def refused(path, match, *, sweep=False):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=match) as caught:
        load_sweep(path) if sweep else load_config(path)
    assert time.monotonic() - started < 5
    return str(caught.value)


def test_duplicate_keys_are_refused_naming_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 5\nloss:\n  margin: 0.2\ntrain:\n  micro_batch_size: 8\n")
    refused(path, rf"{path}: not valid YAML: .*the key 'train' appears twice \(lines 1 and 5\): the second would "
                  "replace the first")
    path.write_text("loss:\n  margin: 0.2\n  gamma: 30\n  margin: 0.3\n")
    refused(path, r"the key 'margin' appears twice \(lines 2 and 4\)")


def test_aliases_are_refused_before_anything_expands(tmp_path):
    for body in (f"train:\n  deepspeed:\n    bomb:\n{''.join('      ' + line + chr(10) for line in ALIAS_BOMB.splitlines())}",
                 "x: &big [1, 2]\nmodel:\n  arch: *big\n"):
        path = tmp_path / "run.yaml"
        path.write_text(body)
        refused(path, r"not valid YAML: .*an alias \(\*a?\w+\) is not accepted in a config: write the value out")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("base:\n  bomb:\n" + "".join("    " + line + "\n" for line in ALIAS_BOMB.splitlines())
                     + "space: {loss.base.margin: {uniform: [0.1, 0.2]}}\n")
    refused(sweep, r"an alias \(\*a0\) is not accepted", sweep=True)


def test_size_depth_and_encoding_are_bounded(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    refused(big, rf"{big}: larger than {MAX_CONFIG_BYTES:,} bytes, too big for a config file")
    deep = tmp_path / "deep.yaml"
    deep.write_text("".join(" " * i + "a:\n" for i in range(1_000)))
    refused(deep, rf"nested more than {MAX_DEPTH} levels deep")
    flow = tmp_path / "flow.yaml"
    flow.write_text("train: " + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(flow, rf"nested more than {MAX_DEPTH} levels deep")
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff" * 10)
    refused(binary, rf"{binary}: not a UTF-8 text file \(byte 0\)")
    refused(tmp_path, rf"config file not found: {tmp_path}")  # a directory


def test_a_file_that_is_no_config_is_not_echoed(tmp_path):
    secrets = tmp_path / "shadow.yaml"
    secrets.write_text("".join(f"user{i}: $6$salt{i}$hash{i}\n" for i in range(500)))
    message = refused(secrets, r"500 error\(s\) in .*shadow.yaml")
    assert message.count("unknown key") == 20 and "… and 480 more" in message and "user499" not in message
    long = tmp_path / "long.yaml"
    long.write_text(f"ray:\n  run_name: {'x' * 300}\nmodel:\n  arch: {'y' * 5000}\n")
    message = refused(long, r"ray.run_name: String should have at most 200 characters")
    assert len(message) < 1500 and "(5,002 characters)" not in message  # arch is a free name: no bound here
    assert all(len(line) < 400 for line in message.splitlines())


@pytest.mark.parametrize("body, where, problem", [
    ("root:x:0:0:root:/root:/bin/bash\npassword: hunter2 secret: x\n", "line 2, column 9",
     "mapping values are not allowed here"),
    ("a: 1\n\tpassword: hunter2\n", "line 2, column 1", "found character '\\t' that cannot start any token"),
    ("token: !!python/object/apply:os.system [hunter2]\n", "line 1, column 8",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
    ("train: {epochs: 1}\n\"\\e[2Jhunter2\": 1\n\"\\e[2Jhunter2\": 2\n", "line 3, column 1",
     "the key '\\x1b[2Jhunter2' appears twice (lines 2 and 3)"),
    ("key: \x1b[31mhunter2\n", "character 6", "unacceptable character #x001b"),
], ids=["mapping", "tab", "tag", "key-twice-escaped", "control-character"])
def test_a_yaml_error_shows_where_and_what_not_the_files_lines(tmp_path, capsys, body, where, problem):
    """PyYAML's message quotes the line it stopped at (a password file's, say): pairsim's names
    the file, the line and column and the problem, and shows no line of it; what the problem
    quotes of the file is escaped."""
    path = tmp_path / "secrets.yaml"
    path.write_text(body)
    message = refused(path, "not valid YAML")
    assert message.startswith(f"{path}: not valid YAML: {where}: ") and problem in message, message
    assert "\n" not in message and "\x1b" not in message and "password:" not in message
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "password:" not in err and "hunter2\n" not in err


def test_a_key_from_a_config_file_is_shown_escaped(tmp_path):
    """An unknown key is echoed as its file writes it, its escapes escaped: it cannot clear the
    screen or start a line of its own."""
    path = tmp_path / "run.yaml"
    path.write_text('train:\n  "\\e[2J\\npairsim: all good": 1\n')
    message = refused(path, "unknown key")
    assert "train.\\x1b[2J\\npairsim: all good: unknown key" in message and "\x1b" not in message
    assert message.count("\n") == 1


@pytest.mark.parametrize("uri", ["file:///etc", "javascript:alert(1)", "./mlruns", "ftp://host/x"])
def test_a_tracking_uri_mlflow_does_not_serve_is_refused_before_ray(uri, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"tracking.tracking_uri={uri}"])
    assert exc.value.keys == ("tracking.tracking_uri",)
    assert f"{uri}:" in str(exc.value) and "http://, https://, sqlite://" in str(exc.value)  # the URI, the stores offered
    run = tmp_path / "run.yaml"
    run.write_text(f"tracking: {{tracking_uri: '{uri}'}}\n")
    assert cli.main(["train", "--config", str(run)]) == 2
    err = capsys.readouterr().err
    assert "tracking.tracking_uri" in err and f"{uri}:" in err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from pairsim.tracking import resolve_tracking_uri
    with pytest.raises(ConfigError) as exc:
        resolve_tracking_uri(None)
    assert str(exc.value).startswith(f"MLFLOW_TRACKING_URI: {uri}:") and "sqlite://" in str(exc.value)
    assert list(tmp_path.iterdir()) == [run]  # nothing written (no mlartifacts/, no mlruns/)


def test_oversized_and_too_deeply_nested_source_records_are_counted_rejects(tmp_path):
    """A 10 MB caption in a CSV, a JSONL line of 100,000 nested lists: each one counted reject
    naming its line, the rest of the file built; a Karpathy file nested as deep is named, not a
    RecursionError traceback."""
    from PIL import Image

    from pairsim.data import sources

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("filepath\ttitle\na.png\tfine\na.png\t" + "x" * 10_000_000 + "\na.png\talso fine\n")
    listing = sources.list_source("csv", pairs, None, "train")
    assert [r.captions for r in listing.records] == [["fine", "also fine"]]
    assert [(r.source, r.reason) for r in listing.rejects] == [("pairs.csv:3", "malformed line")]
    assert "field larger than field limit" in listing.rejects[0].detail
    lines = tmp_path / "captions.jsonl"
    lines.write_text('{"file": "a.png", "caption": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    listing = sources.list_source("folder", lines, None, "train")
    assert [r.captions for r in listing.records] == [["fine"]]
    assert [(r.source, r.reason) for r in listing.rejects] == [("captions.jsonl:2", "malformed line")]
    assert "nested too deeply" in listing.rejects[0].detail
    karpathy = tmp_path / "dataset_coco.json"
    karpathy.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(sources.SourceError) as exc:
        sources.list_source("karpathy", karpathy, None, "train")
    assert str(karpathy) in str(exc.value) and "nested too deeply" in str(exc.value)


def test_a_build_into_a_folder_that_is_not_a_pairsim_dataset_is_refused_and_leaves_it_alone(tmp_path):
    from PIL import Image

    from pairsim.data import builder
    from pairsim.data.build_config import BuildConfig

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "pairs.csv").write_text("filepath\ttitle\na.png\tone\n")
    out = tmp_path / "mine"
    (out / "train").mkdir(parents=True)
    (out / "train" / "part-00003.parquet").write_bytes(b"my own file")
    (out / "notes.txt").write_text("mine")
    from pairsim.outputs import OutputRefused

    with pytest.raises(OutputRefused, match=r"--out .*mine: not empty.* 2 files"):
        builder.build(BuildConfig(format="csv", input=tmp_path / "pairs.csv", out=out), progress=False)
    assert (out / "train" / "part-00003.parquet").read_bytes() == b"my own file"
    assert sorted(p.name for p in out.rglob("*")) == ["notes.txt", "part-00003.parquet", "train"]


def test_inspect_checks_every_shard_and_writes_nothing_into_the_dataset(tmp_path, capsys):
    from pairsim.data import shards, synth

    data = tmp_path / "data"
    synth.generate(data, num_train=40, num_val=8, num_test=0, rows_per_shard=10, progress=False)
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    report = shards.inspect(data)
    assert "train" in report and "--sheet" in report  # how to draw the contact sheet
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
    assert cli.main(["shards", "inspect", str(data), "--sheet", str(tmp_path / "sheet.png")]) == 0
    assert (tmp_path / "sheet.png").is_file()
    victim = sorted((data / "train").glob("*.parquet"))[1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    capsys.readouterr()
    assert cli.main(["shards", "inspect", str(data)]) == 1
    err = capsys.readouterr().err
    assert f"{victim}:" in err and "Parquet" in err
    victim.unlink()  # deleted
    assert cli.main(["shards", "inspect", str(data)]) == 1
    assert "manifest lists 4 shards, found 3" in capsys.readouterr().err


def test_a_manifest_from_a_newer_format_is_refused_naming_the_field(tmp_path):
    import json

    from pairsim.data import shards, synth

    data = tmp_path / "data"
    synth.generate(data, num_train=8, num_val=4, num_test=0, progress=False)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps(manifest | {"schema_version": 99, "new_field": 1}))
    with pytest.raises(shards.ShardError) as exc:
        shards.read_manifest(data)
    message = str(exc.value)  # the file, the field, its bound
    assert str(data / "manifest.json") in message and "schema_version" in message and "equal to 1" in message


def test_shards_verify_names_a_shard_whose_bytes_or_hash_differ_from_the_manifest(tmp_path, capsys):
    """64 bytes flipped inside a shard's data pages leave its Parquet footer and row count as
    they were (what ``train`` and ``inspect`` check); ``shards verify`` reads every byte and
    names the shard, and a content hash edited in the manifest (zeros) is caught too."""
    import json

    from pairsim.data import shards, synth

    data = tmp_path / "data"
    synth.generate(data, num_train=40, num_val=8, num_test=0, rows_per_shard=10, progress=False)
    assert cli.main(["shards", "verify", str(data)]) == 0
    assert f"{data}: every split verified" in capsys.readouterr().out
    victim = sorted((data / "train").glob("*.parquet"))[2]
    raw = bytearray(victim.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
    victim.write_bytes(bytes(raw))
    shards.verify_split(data, "train", shards.read_manifest(data))  # what a run checks before Ray: footers and rows
    assert cli.main(["shards", "verify", str(data)]) == 1
    out = capsys.readouterr().out
    assert any(line.strip().startswith(f"{victim}:") and "SHA-256" in line for line in out.splitlines()), out
    assert "val: 1 shards, 8 images — verified" in out
    assert "train: 4 shards, 40 images — FAILED" in out and "1 of 2 failed verification" in out

    synth.generate(tmp_path / "fresh", num_train=40, num_val=8, num_test=0, rows_per_shard=10, progress=False)
    manifest = json.loads((tmp_path / "fresh" / "manifest.json").read_text())
    manifest["splits"]["train"]["content_hash"] = "0" * 64
    (tmp_path / "fresh" / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["shards", "verify", str(tmp_path / "fresh")]) == 1
    out = capsys.readouterr().out
    fresh = tmp_path / "fresh"
    assert any(line.strip().startswith(f"{fresh / 'train'}:") and "content hash" in line for line in out.splitlines()), out
    assert any(line.strip().startswith(f"{fresh / 'manifest.json'}:") and "content_hash" in line
               for line in out.splitlines()), out

    for split in manifest["splits"].values():  # a manifest written before per-shard SHA-256s: the split's hash decides
        del split["shard_sha256"]
    manifest["splits"]["train"]["content_hash"] = shards.split_content_hash("train", shards.shard_digests(
        tmp_path / "fresh", "train"))
    (tmp_path / "fresh" / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["shards", "verify", str(tmp_path / "fresh")]) == 0
    capsys.readouterr()
    (tmp_path / "fresh" / "train" / victim.name).write_bytes(bytes(raw))
    assert cli.main(["shards", "verify", str(tmp_path / "fresh")]) == 1
    assert "per-shard SHA-256" in capsys.readouterr().out
