"""The docs site's pages say what the code is: the REST reference is the API's own document, the layout page
names every module where it lives, and the README stays a short front door into them.

CI builds the site itself with ``mkdocs build --strict`` (``.ci/run``), which fails on a dead link or anchor and,
through ``docs/gen_rest.py``'s hook, on a stale reference; these tests hold the same without mkdocs.
"""

from __future__ import annotations

import importlib.util
import re

from tests.procs import ROOT

DOCS = ROOT / "docs"
PARTS = ("gpumgr", "manager", "agent", "wire", "plugin")


def _gen_rest():
    spec = importlib.util.spec_from_file_location("gen_rest", DOCS / "gen_rest.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rest_reference_is_the_apis_own_document():
    """The committed page is what the generator writes from openapi.document() now: no call or field is missing."""
    from gpumgr.manager.api import openapi

    gen = _gen_rest()
    page = (DOCS / "api" / "reference.md").read_text()
    assert page == gen.render(), "docs/api/reference.md is stale: run python docs/gen_rest.py"
    doc = openapi.document()
    for path, item in doc["paths"].items():
        for method in item:
            if method in gen.METHODS:
                assert f"### `{method.upper()} {path}`" in page
    for name, schema in doc["components"]["schemas"].items():
        assert f"### {name}\n" in page
        for field in schema.get("properties", {}):
            assert f"| `{field}` |" in page, (name, field)


def test_a_stale_reference_is_noticed(tmp_path, monkeypatch):
    """The check itself: a page that differs from the document is reported stale, and the build hook refuses it."""
    import pytest
    from mkdocs.exceptions import PluginError

    gen = _gen_rest()
    stale = tmp_path / "reference.md"
    stale.write_text(gen.render().replace("### `POST /v1/containers`", "### `POST /v1/boxes`"))
    monkeypatch.setattr(gen, "PAGE", stale)
    assert gen.stale() and gen.main(["--check"]) == 1
    with pytest.raises(PluginError, match="out of date"):
        gen.on_pre_build({})
    assert gen.main([]) == 0 and not gen.stale() and gen.main(["--check"]) == 0


def _rows(page: str) -> dict[str, str]:
    """The layout table's rows by their first cell (a folder such as ``manager/model/``)."""
    rows = {}
    for line in page.splitlines():
        if found := re.match(r"^\| `([a-z_/]+/)` \|", line):
            rows[found[1]] = line
    return rows


def test_the_layout_page_names_every_module_in_its_folder():
    """Every module of the package is named in its folder's row of docs/concepts/layout.md, and no folder is
    listed that the tree lacks: moving a module means moving its line."""
    rows = _rows((DOCS / "concepts" / "layout.md").read_text())
    folders = {}
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            folders.setdefault(folder, [])
            if path.name != "__init__.py":
                folders[folder].append(path.name)
    assert set(rows) == set(folders), (set(rows) ^ set(folders))
    missing = [f"{folder}{name}" for folder, names in folders.items() for name in names
               if f"`{name}`" not in rows[folder]]
    assert not missing, f"not in their folder's row of docs/concepts/layout.md: {missing}"


def test_the_layout_check_sees_a_module_out_of_place():
    """The check itself: a row without one of its folder's modules, or a folder not in the tree, is seen."""
    rows = _rows("| `manager/model/` | x | `cluster.py` |\n| `nowhere/` | y | z |\n")
    assert set(rows) == {"manager/model/", "nowhere/"} and "`ledger.py`" not in rows["manager/model/"]


def test_the_readme_is_a_front_door():
    """At most 300 lines, and every page of the site is linked from it or from the docs' home page."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    home = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(docs/([^)#]+)", readme)) | set(re.findall(r"\]\(([^)#:]+\.md)", home))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - {"index.md"}
    top = {p for p in pages if p.count("/") == 0 or p.endswith("index.md") or p.startswith("concepts/")
           or p.startswith("api/")}
    assert top <= linked, top - linked
    for target in linked:
        assert (DOCS / target).is_file(), target
