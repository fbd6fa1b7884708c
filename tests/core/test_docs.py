"""docs/configuration.md must list every setting with its description; the README gets a new user from
the quick start to a working shell and to the other pages; the docs cite commands and features, not
the project's internal issue numbers or one machine's paths."""

import re
from pathlib import Path

import pytest

from pypto_serving.config import SERVER_ONLY, ServingSettings, read_config_file

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def test_every_setting_is_documented() -> None:
    text = DOC.read_text()
    for name, field in ServingSettings.model_fields.items():
        assert f"| `{name}` |" in text, f"docs/configuration.md lacks {name}"
        assert field.description and field.description in text, f"docs/configuration.md: stale description of {name}"


def test_the_server_only_list_is_complete() -> None:
    """The sentence that tells which settings `generate` leaves out names each of them (or its
    `prefix_*` family)."""
    text = DOC.read_text()
    sentence = text[text.index("`generate` leaves out") :].split(").", 1)[0]
    named = set(re.findall(r"`(\w+)`", sentence))
    families = [n[:-1] for n in re.findall(r"`(\w+_)\*`", sentence)]
    missing = [n for n in SERVER_ONLY if n not in named and not any(n.startswith(f) for f in families)]
    assert not missing, f"docs/configuration.md's server-only list lacks {sorted(missing)}"


def test_the_readme_says_how_to_reach_the_installed_command() -> None:
    """quickstart.sh installs into .venv without activating it for the user's next shell."""
    readme = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in readme
    assert ".venv/bin/pypto-serving" in readme


def test_the_readme_links_every_doc_page() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


# An internal issue reference ("issue 25", "Issue-12", "#12", "item 9") or a path of one machine.
INTERNAL = re.compile(r"\b[Ii]ssues?[- ]#?\d+|(?<![\w&/])#\d+\b|\bitems? \d+|/work/|/tmp/")


@pytest.mark.parametrize("doc", ["benchmarks.md", "scale-out.md"])
def test_docs_cite_no_internal_issues_or_machine_paths(doc: str) -> None:
    lines = (ROOT / "docs" / doc).read_text().splitlines()
    found = [f"{doc}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if INTERNAL.search(line)]
    assert not found, "\n".join(found)


def test_the_example_config_loads_and_calls_model_optional() -> None:
    path = ROOT / "examples" / "serve.toml"
    assert set(read_config_file(path)) <= set(ServingSettings.model_fields)
    model_lines = [line for line in path.read_text().splitlines() if re.match(r"#? ?model ", line)]
    assert model_lines and not any("required" in line for line in model_lines)
    assert ServingSettings.load(path).model is not None
