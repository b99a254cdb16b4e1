"""The documentation site builds with no warning (``mkdocs build --strict``: every link and
anchor resolves), its generated references hold what the code defines, and the README stays a
front page."""

import subprocess
import sys
from pathlib import Path

import pytest

from pairsim.cli import build_parser
from pairsim.config import RunConfig

REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={"NO_MKDOCS_2_WARNING": "1",
                                                                             "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-5000:]
    return out


def dotted_keys(model, prefix=""):
    for name, field in model.model_fields.items():
        if name.endswith("_params") or name == "params":
            continue
        section = next((k for k in (field.annotation, *getattr(field.annotation, "__args__", ()))
                        if isinstance(k, type) and hasattr(k, "model_fields") and k.model_fields), None)
        yield f"{prefix}{name}"
        if section is not None:
            yield from dotted_keys(section, f"{prefix}{name}.")


def test_the_config_reference_lists_every_key_of_a_run_config(site):
    page = (site / "configuration" / "index.html").read_text()
    keys = list(dotted_keys(RunConfig))
    assert len(keys) > 90
    assert [key for key in keys if f"<code>{key}</code>" not in page] == []
    assert "≥ 1" in page and "Ray Train run name, held while the run lives" in page  # bounds and descriptions


def test_the_cli_reference_lists_every_command_and_flag(site):
    page = (site / "cli" / "index.html").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name, command in commands.items():
        assert f"pairsim {name}" in page
        for action in command._actions:
            assert all(flag in page for flag in action.option_strings), (name, action.option_strings)


def test_the_front_page_is_the_readme_with_its_links_into_the_site(site):
    page = (site / "index.html").read_text()
    assert 'href="objectives/"' in page and "docs/objectives.md" not in page
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
