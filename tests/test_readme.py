"""The docs stay in step with the code they document, and stand alone."""
from __future__ import annotations

import re

from harness.store.columns import columns_markdown
from tests.conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
DOCS = sorted((REPO_ROOT / "docs").rglob("*.md"))


def test_columns_md_is_generated_from_the_schema():
    assert (REPO_ROOT / "docs" / "columns.md").read_text() == columns_markdown(), \
        "docs/columns.md is stale: python -m harness.store.columns > docs/columns.md"


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.DOTALL)
    assert "python -m harness.run +sweep=batch_ctx" in blocks[0]
    assert "python -m pytest" in blocks[1]


def test_readme_is_a_front_page():
    assert len(README.splitlines()) <= 170


def test_every_link_between_the_docs_resolves():
    for page in [REPO_ROOT / "README.md", *DOCS]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_nothing_refers_outside_the_repository():
    """The project's text stands alone: nothing names a guide, a tracker entry or a folder of the team that wrote it."""
    # Spelled in pieces, so that this file holds none of them and is checked like every other.
    shared = "sha" + "red/"
    needles = ("GUI" + "DE", shared, "../" + shared, "iss" + "ue ")
    texts = [REPO_ROOT / "README.md", *DOCS, *(REPO_ROOT / "harness").rglob("*.py"),
             *(REPO_ROOT / "strategies").rglob("*.py"), *(REPO_ROOT / "harness" / "kernels" / "csrc").glob("*.[ch]"),
             *(REPO_ROOT / "harness" / "kernels" / "csrc").glob("*.cpp"),
             *(REPO_ROOT / "conf").rglob("*.yaml"), *(REPO_ROOT / "tests").rglob("*.py")]
    found = [f"{path.relative_to(REPO_ROOT)}: {needle}" for path in texts for needle in needles
             if needle in path.read_text()]
    assert not found, "\n".join(found)


def test_the_docs_tell_no_history_of_their_writing():
    """Docs state what is, not who measured what when: no sessions of the writing, no scratch probes."""
    needles = ("later " + "session", "last " + "session", "sessions " + "so far", "/tmp" + " probe", "(`/tmp`" + " a/b")
    found = [f"{page.relative_to(REPO_ROOT)}: {needle}" for page in [REPO_ROOT / "README.md", *DOCS]
             for needle in needles if needle in page.read_text().lower()]
    assert not found, "\n".join(found)
