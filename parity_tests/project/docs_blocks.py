"""The docs' blocks read and run, as ``test_docs`` describes (its module docstring): each Python block
in a fresh namespace and folder, given the files it names that earlier blocks made; the concrete
``flax-transformer`` commands of bash blocks that read such a file, in process."""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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


def runnable(command: str, made: dict[str, Path]) -> bool:
    """A concrete ``flax-transformer`` command of a bash block that reads a setup's file runs too, when
    every file it reads was made: the first argument under a made name must exist (``runs/minilm-lora`` when
    only ``runs/lm`` was made names a run no block made), and a ``FILE.py:FACTORY`` outside them
    (``tagger.py:pair``, the block above as the reader saved it) was not made: such a command is shown,
    not run."""
    if not (command.startswith("flax-transformer ") and not any(c in command for c in "[]|")
            and " ... " not in command):
        return False
    args = shlex.split(command, comments=True)[1:]  # a comment's words ("# the adapter") name nothing
    if not any(_names(" ".join(args), name) for name in made):
        return False
    first = True  # the first argument under a made name is read; a later one may be written
    for token in args:
        path = token.split(":")[0]  # MODULE.py:FACTORY names the file MODULE.py
        root = path.split("/")[0]
        if root in made:
            if first and not (made[root].parent / path).exists():
                return False
            first = False
        elif path != token and path.endswith(".py"):  # a --pair FILE.py:FACTORY no block made
            return False
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
                if runnable(command, made):
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
