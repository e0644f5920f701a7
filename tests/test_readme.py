"""The README stays in step with the code it documents."""
from __future__ import annotations

import re

from harness.store.schema import COLUMNS
from tests.conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def test_every_parquet_column_is_documented_with_its_unit():
    documented = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", README, flags=re.MULTILINE))
    for name, _type, unit, _meaning in COLUMNS:
        assert name in documented, f"README lacks column {name}"
        assert documented[name].strip() == unit, f"README unit of {name} differs from harness/schema.py"


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.DOTALL)
    assert "python -m harness.run +sweep=batch_ctx" in blocks[0]
    assert "python -m pytest" in blocks[1]
