"""What a newcomer meets first on the command line: ``--version``, help texts that name what the
commands do, one form for every command's user error, a line per family while ``verify`` runs with
its stderr in a file, and a passed count at the end of ``verify --train-steps``.

Nothing heavy runs: the errors are found before any model is built, and ``verify``'s rows and
training runs are stand-ins (the real ones are the parity tests').
"""

from __future__ import annotations

import io
import types
from importlib import metadata

import pytest

from flax_transformer.cli import progress
from flax_transformer.cli.commands import main
from flax_transformer.verification.reports import Row


def test_version_is_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"flax-transformer {metadata.version('flax-transformer')}\n"


def test_port_help_names_every_family_it_writes(capsys):
    with pytest.raises(SystemExit):
        main(["port", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "former, encoder, gpt, classic or llama" in text
    assert "every llama-family model" in text  # an HF folder for them too, not only BERT ... GPT-2
    assert '\'{"config": {"vocab_size"' in text  # a bare Llama state_dict's --config, shown


@pytest.mark.parametrize("argv", [
    ["verify", "--text", "x"],  # a flag that goes with another
    ["port", "{tmp}/nosuch.pt", "{tmp}/out.safetensors"],
    ["summary", "{tmp}/nosuch"],
    ["attention-map", "--text", "hi", "--layer", "0", "--out", "{tmp}/a.png", "--checkpoint", "{tmp}/nosuch"],
    ["generate", "--checkpoint", "{tmp}/nosuch", "--prompt", "hi"],
    ["port", "{tmp}/only-src"],  # argparse's own error
], ids=lambda argv: " ".join(argv[:2]))
def test_every_command_says_a_user_error_in_one_form(argv, tmp_path, capsys):
    """``flax-transformer COMMAND: error: ...`` as the last (for ours, the only) line, exit 2."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's errors exit
        code = stop.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in out + err and lines, (code, out, err)
    assert lines[-1].startswith(f"flax-transformer {argv[0]}: error: "), err
    if argv[-1] != f"{tmp_path}/only-src":
        assert len(lines) == 1, err


def test_attention_map_says_a_missing_checkpoint_does_not_exist(tmp_path, capsys):
    assert main(["attention-map", "--text", "hi", "--layer", "0", "--out", str(tmp_path / "a.png"),
                 "--checkpoint", str(tmp_path / "nosuch")]) == 2
    assert capsys.readouterr().err == f"flax-transformer attention-map: error: no such checkpoint: {tmp_path}/nosuch\n"


def _row(family, passed=True):
    return Row(family, "M", "none", "torch->flax", 0.0 if passed else 1.0, True)


def test_verify_logs_a_line_per_family_when_stderr_is_a_file():
    log = io.StringIO()  # not a terminal: lines, no bar
    family_progress = progress.FamilyProgress(log)
    for row in (_row("former"), _row("former", passed=False), _row("gpt")):
        family_progress.row(row)
    assert log.getvalue().splitlines()[0].startswith("verify: former: 2 rows, 1 passed (")  # when gpt's began
    family_progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("verify: gpt: 1 rows, 1 passed ("), lines


def test_the_verify_command_logs_its_families(monkeypatch, capsys):
    from flax_transformer.verification import verify

    monkeypatch.setattr(verify, "run", lambda **kw: iter([_row("former"), _row("gpt")]))
    assert main(["verify"]) == 0
    out, err = capsys.readouterr()  # capsys's stderr is no terminal
    assert [line.split(" (")[0] for line in err.splitlines()] == ["verify: former: 1 rows, 1 passed",
                                                                  "verify: gpt: 1 rows, 1 passed"]
    assert "\n2 passed, 0 failed" in out


@pytest.mark.parametrize("passes, last", [((True, True), "2 passed, 0 failed"), ((True, False), "1 passed, 1 failed")])
def test_train_steps_ends_with_a_passed_count(passes, last, monkeypatch, capsys):
    from flax_transformer.training import parity

    results = iter(types.SimpleNamespace(passed=p, loss_err=0.0) for p in passes)
    monkeypatch.setattr(parity, "trajectory", lambda *a, **kw: next(results))
    monkeypatch.setattr(parity, "format_trajectory", lambda result: "(curves)")
    code = main(["verify", "--train-steps", "1", "--family", "former"])  # adam and adamw: two runs
    assert code == (0 if all(passes) else 1)
    assert capsys.readouterr().out.splitlines()[-1].startswith(last + " (")
