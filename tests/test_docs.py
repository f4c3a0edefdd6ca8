"""The README stays a page for users and every link in it and in the docs site leads somewhere.

`mkdocs build --strict` (in the README's test command) checks the site's own links and anchors;
these checks also cover the README, which MkDocs does not build, and run without MkDocs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# [text](target) and ![alt](target), the target up to a space or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _figure_dirs() -> dict[str, str]:
    """The site folders the MkDocs hook serves from elsewhere in the repository."""
    spec = importlib.util.spec_from_file_location("figures_hook", ROOT / "docs_hooks/figures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.FIGURE_DIRS)


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page (code blocks and code spans left out)."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def resolve(page: Path, target: str) -> Path:
    """Where a relative link from `page` leads on disk (figures: where the hook takes them)."""
    path = (page.parent / target.split("#", 1)[0]).resolve()
    if path.is_relative_to(DOCS):
        inside = path.relative_to(DOCS).as_posix()
        for site_dir, source_dir in _figure_dirs().items():
            if inside.startswith(site_dir + "/"):
                return ROOT / source_dir / inside.removeprefix(site_dir + "/")
    return path


PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted(DOCS.rglob("*.md"))]


def test_the_readme_is_a_page_for_users() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    # .ci/run reads the test command after its marker; the docs build strictly in it
    command = readme.split("<!-- test-command -->\n```\n", 1)[1].split("\n```", 1)[0]
    assert "mkdocs build --strict" in command
    assert "<!-- report:readme-speed -->" in readme and "<!-- /report:readme-speed -->" in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file(page: Path) -> None:
    missing = [t for t in relative_links(page) if not resolve(page, t).is_file()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_every_included_table_exists() -> None:
    included = {
        m.group(1)
        for page in DOCS.rglob("*.md")
        for m in SNIPPET.finditer(page.read_text(encoding="utf-8"))
    }
    assert included, "no page includes a generated table"
    assert not [name for name in included if not (DOCS / name).is_file()]


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md), [gone](nowhere.md#x), [web](https://x.org), `[c](no.md)`\n")
    assert relative_links(page) == ["page.md", "nowhere.md#x"]
    assert not resolve(page, "nowhere.md#x").is_file()


CODE_REFERENCE = re.compile(r"(?<![\w/])docs/([\w/-]+\.md)(?:#([\w-]+))?")


def anchors(page: Path) -> set[str]:
    """The ids a page's headings get: explicit `{#id}` attributes and MkDocs' own slugs."""
    ids = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if not line.startswith("#"):
            continue
        if explicit := re.search(r"\{#([\w-]+)\}", line):
            ids.add(explicit.group(1))
        title = re.sub(r"\{.*?\}", "", line.lstrip("#")).strip().lower()
        ids.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title)))
    return ids


def test_the_code_cites_docs_that_exist() -> None:
    """The code explains itself by pointing into the docs (`docs/math.md#dragon`): each page and
    anchor it names exists, so no reference points outside the repository or at nothing."""
    sources = [f for f in ROOT.rglob("*.py") if not {".venv", ".venv-vllm", "site"} & set(f.parts)]
    cited = {
        (m.group(1), m.group(2)) for f in sources for m in CODE_REFERENCE.finditer(f.read_text())
    }
    assert len(cited) > 10
    missing = [
        f"docs/{page}#{anchor or ''}"
        for page, anchor in sorted(cited, key=str)
        if not (DOCS / page).is_file() or (anchor and anchor not in anchors(DOCS / page))
    ]
    assert not missing, f"the code cites docs that do not exist: {missing}"
    assert "no-such-anchor" not in anchors(DOCS / "math.md") and "dragon" in anchors(
        DOCS / "math.md"
    )


def test_the_license_the_readme_names_is_in_the_tree() -> None:
    """The README and pyproject say Apache-2.0: the tree carries that license's text."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0" and "Licensed Apache-2.0." in (ROOT / "README.md").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
