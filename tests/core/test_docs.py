"""docs/configuration.md must list every setting with its description."""

from pathlib import Path

from pypto_serving.config import ServingSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_setting_is_documented() -> None:
    text = DOC.read_text()
    for name, field in ServingSettings.model_fields.items():
        assert f"| `{name}` |" in text, f"docs/configuration.md lacks {name}"
        assert field.description and field.description in text, f"docs/configuration.md: stale description of {name}"
