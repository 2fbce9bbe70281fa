"""The documentation site's own code: the API pages follow the packages, and its link and
docstring rewrites do what mkdocs.yml relies on (the build itself runs in .ci/run, strict)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


api_pages = _load("api_pages")


def test_every_public_module_has_an_api_page_and_a_docstring():
    """The API section lists every public module of both packages, and each module says what it
    is (an empty docstring gives an empty page)."""
    modules = api_pages.public_modules()
    on_disk = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for package in ("flax_transformer", "torch_reference") for p in (ROOT / package).rglob("*.py")
               if not any(part.startswith("_") for part in p.relative_to(ROOT).with_suffix("").parts[:-1])
               and (not p.stem.startswith("_") or p.stem == "__init__")}
    assert set(modules) == on_disk
    assert {"flax_transformer.models.llama", "torch_reference.llama", "flax_transformer.interop"} <= set(modules)
    nav = "".join(api_pages.nav_lines(modules))
    packages = api_pages.packages_of(modules)
    for module in modules:
        assert f"({api_pages.page_path(module, packages)[4:]})" in nav, module
        path = ROOT / (module.replace(".", "/") + ("/__init__.py" if module in packages else ".py"))
        assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), f"{path} has no docstring"


def test_nav_nests_modules_under_their_package():
    lines = api_pages.nav_lines(["a", "a.b", "a.b.c", "a.d"])
    assert lines == ["* [a](a/index.md)\n", "    * [b](a/b/index.md)\n", "        * [c](a/b/c.md)\n",
                     "    * [d](a/d.md)\n"]


def test_site_links():
    """The README becomes the home page; links out of docs/ become their text on the site."""
    text = "[README](../README.md) · [x](../README.md#port-a-checkpoint) · [v](verification.md#bf16-budgets) " \
           "· [script](../bench/speed_isolated.py) · [web](https://example.org/a.md)"
    assert api_pages.site_links(text, "docs/porting.md") == (
        "[README](index.md) · [x](index.md#port-a-checkpoint) · [v](verification.md#bf16-budgets) "
        "· script · [web](https://example.org/a.md)")
    assert api_pages.site_links("[p](docs/porting.md#x)", "README.md") == "[p](porting.md#x)"
    assert api_pages.site_links("[c](CHANGELOG.md) [r](#two-commands)", "README.md") == "[c](changelog.md) [r](#two-commands)"
    assert api_pages.site_links("[c](../CHANGELOG.md#issue-25)", "docs/benchmarks.md") == "[c](changelog.md#issue-25)"


def test_grouped_argument_names_are_split_and_nothing_else():
    """``a, b: what`` in an Args section becomes one entry per name; other sections are left alone,
    so a name that the signature lacks still makes griffe warn."""
    pytest.importorskip("griffe", reason="the docs extra is not installed (pip install -e '.[docs]'; CI installs it)")
    split_groups = _load("griffe_names").split_groups
    doc = ("Do it.\n\nArgs:\n    x: one.\n    a, b: two\n        lines.\n    rng / seed: three.\n\n"
           "Returns:\n    a, b: the pair.\n")
    assert split_groups(doc) == ("Do it.\n\nArgs:\n    x: one.\n    a: two\n        lines.\n    b: two\n        lines.\n"
                                 "    rng: three.\n    seed: three.\n\nReturns:\n    a, b: the pair.")
    assert not re.search(r"^\s+\w+, \w+:", split_groups(doc).split("Returns:")[0], flags=re.M)


EXCERPT = re.compile(r"^an excerpt of (\S+)$")


def _normalised(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def excerpts(path: Path) -> list[tuple[int, str, str]]:
    """(line, source file, code) of each block marked ``<!-- docs-test: skip (an excerpt of FILE) -->``."""
    lines, found = path.read_text(encoding="utf-8").splitlines(), []
    for number, line in enumerate(lines):
        match = re.match(r"^<!-- docs-test: skip \((.*)\) -->$", line)
        if match and EXCERPT.match(match[1]) and lines[number + 1].startswith("```"):
            end = next(j for j in range(number + 2, len(lines)) if lines[j].strip() == "```")
            found.append((number + 3, EXCERPT.match(match[1])[1], "\n".join(lines[number + 2:end])))
    return found


def test_the_add_a_family_excerpts_are_the_code():
    """Each excerpt of docs/add-a-family.md is, line for line (indentation aside), in the file it
    names: a renamed class, a changed table or a moved file fails here until the page follows."""
    found = excerpts(ROOT / "docs" / "add-a-family.md")
    assert len(found) >= 5
    for line, source, code in found:
        assert (ROOT / source).is_file(), f"add-a-family.md:{line}: {source} does not exist"
        assert _normalised(code) in _normalised((ROOT / source).read_text(encoding="utf-8")), \
            f"add-a-family.md:{line}: the excerpt is no longer in {source}"


def test_an_edited_excerpt_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip (an excerpt of torch_reference/llama.py) -->\n```python\n"
                    "class LlamaMLP(Module):\n    pass\n```\n")
    ((line, source, code),) = excerpts(page)
    assert source == "torch_reference/llama.py" and _normalised(code) not in _normalised((ROOT / source).read_text())


def test_verification_guide_stays_a_guide():
    """docs/verification.md stays under 25 KiB: rationale goes to verification-design.md and
    figures to benchmarks.md, so that the guide stays readable."""
    assert len((ROOT / "docs" / "verification.md").read_bytes()) <= 25 * 1024
