"""A griffe extension for the API reference: ``a, b: what they are`` in an ``Args:`` section.

The docstrings often describe parameters that go together on one line (``dtype, param_dtype:
compute and storage types``). Google style has one name per entry, so griffe would warn that the
parameter ``dtype, param_dtype`` is not in the signature. This extension gives each name of such a
line its own entry with the line's description before griffe parses the docstring. A name that
is not in the signature, alone or in a group, still warns.
"""

from __future__ import annotations

import re

import griffe

SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args|Other Parameters):\s*$")
GROUP = re.compile(r"^(\s*)(\*{0,2}\w+(?:\s*(?:,|/)\s*\*{0,2}\w+)+)(\s*(?:\([^)]*\))?:(?:\s.*)?)$")


def _continues(lines: list[str], j: int, indent: int) -> bool:
    """Whether line ``j`` continues an entry indented by ``indent`` (a blank line: if the next does)."""
    while j < len(lines) and not lines[j].strip():
        j += 1
    return j < len(lines) and len(lines[j]) - len(lines[j].lstrip()) > indent


def split_groups(text: str) -> str:
    """``text`` with each grouped entry of its argument sections written once per name."""
    lines, out, i = text.splitlines(), [], 0
    section_indent = None
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if line.strip() and section_indent is not None and indent <= section_indent:
            section_indent = None
        start = SECTION.match(line)
        if start:
            section_indent = len(start[1])
            out.append(line)
            i += 1
            continue
        group = GROUP.match(line) if section_indent is not None else None
        if group:
            body = [line]
            while _continues(lines, i + 1, indent):
                i += 1
                body.append(lines[i])
            for name in re.split(r"\s*[,/]\s*", group[2]):
                out.append(group[1] + name + group[3])
                out.extend(body[1:])
        else:
            out.append(line)
        i += 1
    return "\n".join(out)


class GroupedNames(griffe.Extension):
    """Splits ``a, b:`` argument entries of every docstring (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_groups(obj.docstring.value)
