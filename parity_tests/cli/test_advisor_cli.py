"""``verify --advise-precision``: the report printed (exit 0 when the advised set meets the target), its
JSON, and every bad command line refused in one line (exit 2) before any model loads. The pair is
``test_advisor``'s toy (norm, sharp attention, projection, head), advised eagerly in a few seconds.
"""

import json

import pytest

from flax_transformer.cli.commands import main

TOY = "parity_tests.verification.test_advisor:toy_pair"


def _one_line(capsys, code, *expected):
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err, (code, out, err)
    assert all(text in err for text in expected), err


@pytest.mark.slow(reason="test_the_search_on_a_toy_pair_finds_a_smallest_set (the same search; here through the CLI)")
def test_advise_precision_prints_the_report_and_writes_its_json(capsys, tmp_path):
    out = tmp_path / "advice.json"
    code = main(["verify", "--pair", TOY, "--advise-precision", "--target", "budget", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "met with" in text and "advised set: attn" in text and "every norm and attention in float32 (2)" in text
    assert "sets tried (budget metric; every one measured)" in text
    data = json.loads(out.read_text())
    assert data["passed"] and "attn" in data["modules"] and data["target"] == {"kind": "budget", "value": 1.0}
    # a target beyond reach: every candidate in float32 still misses it -> exit 1, said so
    assert main(["verify", "--pair", TOY, "--advise-precision", "--target", "budget=1e-9"]) == 1
    assert "NOT met even with every candidate in float32" in capsys.readouterr().out


def test_bad_command_lines_are_one_line(capsys, tmp_path):
    _one_line(capsys, main(["verify", "--pair", TOY, "--advise-precision", "--target", "kl=abc"]), "not a number")
    _one_line(capsys, main(["verify", "--pair", TOY, "--advise-precision", "--target", "loss=1"]), "give 'budget'")
    _one_line(capsys, main(["verify", "--advise-precision"]), "needs one of --checkpoint PATH and --pair")
    _one_line(capsys, main(["verify", "--pair", TOY, "--checkpoint", str(tmp_path), "--advise-precision"]),
              "needs one of")
    _one_line(capsys, main(["verify", "--pair", TOY, "--advise-precision", "--bisect", "--grads"]),
              "--advise-precision takes no --bisect, --grads")
    _one_line(capsys, main(["verify", "--pair", TOY, "--target", "kl=1e-3"]), "--target goes with --advise-precision")
    _one_line(capsys, main(["verify", "--pair", TOY, "--advise-precision", "--text", "hi"]),
              "--text goes with --checkpoint")
    (tmp_path / "taken.json").write_text("{}")
    _one_line(capsys, main(["verify", "--pair", TOY, "--advise-precision", "--json", str(tmp_path / "taken.json")]),
              "--overwrite replaces it")
