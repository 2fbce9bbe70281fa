"""The API reference's pages, one per public module, made at build time by mkdocs-gen-files.

`mkdocs.yml` runs this file. It walks `flax_transformer` and `torch_reference` on disk, so a module
that is added, renamed or removed needs no edit here or in `mkdocs.yml`: its page and its line in
the API section of the navigation follow the files. A module is public when no part of its dotted
name starts with an underscore (`__init__.py` stands for its package).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flax_transformer", "torch_reference")


def public_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The dotted names of the packages' public modules, packages first within each folder."""
    names = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(part.startswith("_") for part in parts):
                continue
            names.append(".".join(parts))
    return sorted(names, key=lambda name: name.split("."))


def page_path(module: str, packages: frozenset[str] = frozenset()) -> str:
    """Where a module's page goes in the site: ``api/flax_transformer/models/llama.md``, and a
    package's (one of ``packages``) ``api/flax_transformer/models/index.md``."""
    return "api/" + module.replace(".", "/") + ("/index.md" if module in packages else ".md")


def packages_of(modules: list[str]) -> frozenset[str]:
    """The modules that are packages: those that other modules sit in."""
    return frozenset(module.rpartition(".")[0] for module in modules if "." in module)


def nav_lines(modules: list[str]) -> list[str]:
    """The API section as a literate-nav list: one line per module, nested by package."""
    packages = packages_of(modules)
    return [f"{'    ' * module.count('.')}* [{module.rpartition('.')[2]}]({page_path(module, packages)[4:]})\n"
            for module in modules]


def main() -> None:
    import mkdocs_gen_files

    modules = public_modules()
    packages = packages_of(modules)
    for module in modules:
        with mkdocs_gen_files.open(page_path(module, packages), "w") as page:
            page.write(f"# `{module}`\n\n::: {module}\n")
    with mkdocs_gen_files.open("api/SUMMARY.md", "w") as summary:
        summary.writelines(nav_lines(modules))
    for source, name in ROOT_PAGES.items():  # the README and the changelog, their links made the site's
        with mkdocs_gen_files.open(name, "w") as page:
            page.write(site_links((ROOT / source).read_text(encoding="utf-8"), source))
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        if site_links(text, f"docs/{page.name}") != text:
            with mkdocs_gen_files.open(page.name, "w") as copy:
                copy.write(site_links(text, f"docs/{page.name}"))


LINK = re.compile(r"\[([^\]]*)\]\(([^)\s:#]*)(#[^)\s]*)?\)")


ROOT_PAGES = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}  # files at the root -> site pages


def site_links(markdown: str, where: str) -> str:
    """``markdown`` (the file at ``where``, relative to the repository) with its links made the
    site's: the README is the home page, ``index.md``, the changelog ``changelog.md``; a link to
    another file of the repository outside ``docs/`` (a script, say) becomes its text, since the
    site holds only ``docs/`` and those two."""
    def link(match: re.Match) -> str:
        text, target, anchor = match[1], match[2], match[3] or ""
        if not target:  # an anchor on the same page
            return match[0]
        path = (ROOT / where).parent.joinpath(target).resolve()
        if path.parent == ROOT and path.name in ROOT_PAGES:
            return f"[{text}]({ROOT_PAGES[path.name]}{anchor})"
        if path.is_relative_to(ROOT / "docs"):
            return f"[{text}]({path.relative_to(ROOT / 'docs').as_posix()}{anchor})"
        return text
    return LINK.sub(link, markdown)


if __name__ in ("__main__", "<run_path>"):
    main()
