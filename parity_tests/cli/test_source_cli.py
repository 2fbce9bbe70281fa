"""``flax-transformer verify --checkpoint CONVERTED --source ORIGINAL`` (issue 36 item 2): is this conversion right?

One tiny random Llama (transformers' ``LlamaForCausalLM``: hidden 32, 2 layers, 4 query heads and 2
key/value heads of width 8), written as a Meta folder by ``test_meta_llama``'s own writer (each head's
q/k rows moved to Meta's interleaved RoPE order; checked there against Meta's forward pass), and as
HF folders: the right conversion (transformers' ``save_pretrained`` of the model itself), and two
wrong ones a converting script makes: q/k copied from Meta's files without the RoPE permutation, and
one layer's ``o_proj`` transposed (square, so it loads). ``--source`` must pass the right one (exit
0) and fail each wrong one (exit 1) naming exactly the tensors that differ; a training checkpoint
dict of a ``torch.compile``'d model is read as a source; ``verify --checkpoint`` alone says in one
line that it does not check the conversion.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from flax_transformer.cli import source_cli
from flax_transformer.cli.commands import main
from parity_tests.interop.test_meta_llama import meta_files, meta_state, to_interleaved

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

# Meta's MLP width from dim 32, multiple_of 32: 32 * ceil(int(2 * 128 / 3) / 32) = 96
PARAMS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, norm_eps=1e-5,
              rope_theta=10000.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"meta", "right", "no_permutation", "transposed"}: the Meta folder and three HF conversions of it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))  # no norm all ones, no two tensors alike
    root = tmp_path_factory.mktemp("source")
    out = {"meta": meta_files(root / "meta", meta_state(model), params=PARAMS), "right": root / "right"}
    model.save_pretrained(out["right"])
    wrong = {"no_permutation": {}, "transposed": {}}
    for i in range(2):  # q/k as Meta's files hold them: the converter forgot RoPE's permutation
        for name, heads in (("q", 4), ("k", 2)):
            key = f"model.layers.{i}.self_attn.{name}_proj.weight"
            wrong["no_permutation"][key] = to_interleaved(model.state_dict()[key], heads)
    key = "model.layers.1.self_attn.o_proj.weight"
    wrong["transposed"][key] = model.state_dict()[key].T.contiguous()
    for name, changed in wrong.items():  # the right folder's files, with the changed tensors
        out[name] = root / name
        out[name].mkdir()
        shutil.copy(out["right"] / "config.json", out[name])
        save_file({k: v.contiguous() for k, v in {**model.state_dict(), **changed}.items()},
                  out[name] / "model.safetensors", metadata={"format": "pt"})
    out["model"] = model
    return out


def _verify(capsys, *argv) -> tuple[int, str]:
    code = main(["verify", *map(str, argv)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    print(captured.out)  # shown again by `pytest -rP`: docs/verification.md's figures
    return code, captured.out + captured.err


def test_right_conversion_of_a_meta_folder_passes(folders, capsys):
    code, out = _verify(capsys, "--checkpoint", folders["right"], "--source", folders["meta"])
    assert code == 0, out
    assert "read by flax_transformer's Meta reader" in out and "every one equal: pass" in out
    assert out.rstrip().splitlines()[-2].startswith("pass: ")


def test_forgotten_rope_permutation_fails_naming_q_and_k(folders, capsys, tmp_path):
    """The wrong conversion fails on its logits and names q_proj and k_proj of both layers, nothing else;
    ``--json`` holds the same."""
    code, out = _verify(capsys, "--checkpoint", folders["no_permutation"], "--source", folders["meta"],
                        "--json", tmp_path / "report.json")
    assert code == 1, out
    verdict = next(line for line in out.splitlines() if line.startswith("FAIL: "))
    assert "the logits differ" in verdict and "LM top-1 agreement" in out
    assert ("tensors that differ: model.layers.*.self_attn.q_proj.weight (layers 0, 1); "
            "model.layers.*.self_attn.k_proj.weight (layers 0, 1)") in verdict
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is False and report["logits"]["passed"] is False
    assert sorted(d["name"] for d in report["tensors"]["differ"]) == sorted(
        f"model.layers.{i}.self_attn.{n}_proj.weight" for i in range(2) for n in "qk")


@pytest.mark.slow(reason="test_forgotten_rope_permutation_fails_naming_q_and_k (the same folders, no --bisect)")
def test_bisect_names_q_proj_against_the_source(folders, capsys):
    code, out = _verify(capsys, "--checkpoint", folders["no_permutation"], "--source", folders["meta"], "--bisect")
    assert code == 1, out
    assert "forward: error introduced in model.layers.0.self_attn.q_proj (Linear)" in out
    assert out.rstrip().splitlines()[-2].endswith("bisect: first divergent module model.layers.0.self_attn.q_proj")


def test_hf_to_hf_transposed_tensor_fails_naming_it(folders, capsys):
    """An HF source read by transformers itself; the one transposed tensor is named, alone."""
    code, out = _verify(capsys, "--checkpoint", folders["transposed"], "--source", folders["right"])
    assert code == 1, out
    assert "read by transformers (LlamaForCausalLM)" in out
    verdict = next(line for line in out.splitlines() if line.startswith("FAIL: "))
    assert verdict.endswith("tensors that differ: model.layers.*.self_attn.o_proj.weight (layers 1)"), verdict


def test_training_checkpoint_of_a_compiled_model_as_source(folders, capsys, tmp_path):
    """``{"model": state_dict, "optimizer": ..., "step": ...}`` of a ``torch.compile``'d model: read from its
    ``model`` entry and without ``_orig_mod.``, each said on a line; the architecture from CONVERTED."""
    state = {f"_orig_mod.{k}": v for k, v in folders["model"].state_dict().items()}
    torch.save({"model": state, "optimizer": {"state": {}}, "step": 3}, tmp_path / "train.pt")
    code, out = _verify(capsys, "--checkpoint", folders["right"], "--source", tmp_path / "train.pt")
    assert code == 0, out
    assert "its weights read from its 'model' entry (left out: optimizer, step)" in out
    assert "keys start with `_orig_mod.`" in out and "the prefix stripped" in out
    code, out = _verify(capsys, "--checkpoint", folders["no_permutation"], "--source", tmp_path / "train.pt")
    assert code == 1 and "q_proj.weight (layers 0, 1)" in out, out


def test_a_bin_state_dict_is_a_source(folders, capsys, tmp_path):
    """transformers' older ``pytorch_model.bin``: a ``torch.save``'d state_dict, read with ``weights_only``."""
    torch.save(folders["model"].state_dict(), tmp_path / "pytorch_model.bin")
    code, out = _verify(capsys, "--checkpoint", folders["right"], "--source", tmp_path / "pytorch_model.bin")
    assert code == 0 and "a state_dict file, read by strict load_state_dict into LlamaForCausalLM" in out, out


def test_a_conversion_stored_in_bf16_passes_saying_so(folders, capsys, tmp_path):
    """CONVERTED holds the fp32 source's tensors rounded to bf16: said on the tensors' line, and its logits
    are compared with the source's model rounded alike (against the unrounded source they differ)."""
    folder = tmp_path / "bf16"
    folder.mkdir()
    shutil.copy(folders["right"] / "config.json", folder)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in folders["model"].state_dict().items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    code, out = _verify(capsys, "--checkpoint", folder, "--source", folders["right"])
    assert code == 0, out
    assert "the converted ones equal to the source's rounded to bfloat16, every one equal: pass" in out


def test_equal_tensors_under_another_config_fail_on_the_logits(folders, capsys, tmp_path):
    """Every tensor copied right but another rope_theta written: the tensors pass, the logits differ: exit 1."""
    folder = tmp_path / "theta"
    shutil.copytree(folders["right"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    (folder / "config.json").write_text(json.dumps(config))
    code, out = _verify(capsys, "--checkpoint", folder, "--source", folders["right"])
    assert code == 1 and "every one equal: pass" in out, out
    verdict = next(line for line in out.splitlines() if line.startswith("FAIL: "))
    assert "the logits differ" in verdict and "tensors that differ" not in verdict, verdict

def test_no_certificate_says_what_is_not_checked(folders, capsys):
    """``verify --checkpoint`` on the wrong conversion alone passes its table (the twin, the Flax model and
    transformers read the same wrong weights) and says, in its last line, that the conversion was not checked."""
    assert main(["verify", "--checkpoint", str(folders["no_permutation"])]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-2].startswith("8 passed, 0 failed") and out[-1] == source_cli.NO_CERTIFICATE


@pytest.mark.parametrize("argv, message", [
    (["--source", "x"], "--source ORIGINAL goes with --checkpoint CONVERTED"),
    (["--checkpoint", "y", "--source", "x", "--family", "llama"], "takes no --family"),
    (["--checkpoint", "y", "--source", "x", "--grads", "--dtype", "bf16"], "takes no --grads, --dtype"),
    (["--checkpoint", "y", "--source", "x", "--bisect-generate", "--prompt", "a"], "takes no --source"),
])
def test_flags_of_other_checks_are_refused(capsys, argv, message):
    code, out = _verify(capsys, *argv)
    assert code == 2 and message in out and out.count("\n") == 1, out


@pytest.mark.slow(reason="test_training_checkpoint_of_a_compiled_model_as_source (a state_dict source, the "
                         "architecture from CONVERTED instead of a pair)")
def test_a_pair_builds_both_sides(capsys, tmp_path):
    """``--pair MODULE:FACTORY``: the source state_dict (a ``{"model": ...}`` dict) loads into the pair's torch
    model, CONVERTED's tensors (torch names, no description) into its Flax model; one transposed tensor is named."""
    import numpy as np
    from safetensors.numpy import save_file

    from flax_transformer.interop import porting
    from parity_tests import user_models_tied

    torch_model, flax_model, _ = user_models_tied.make_pair()
    torch.save({"model": torch_model.state_dict(), "step": 1}, tmp_path / "source.pt")
    state = porting.state_dict(flax_model)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, tmp_path / "right.safetensors")
    wrong = dict(state, **{"blocks.0.c_proj.weight": np.ascontiguousarray(state["blocks.0.c_proj.weight"].T)})
    save_file(wrong, tmp_path / "wrong.safetensors")
    pair = f"{user_models_tied.__file__}:make_pair"
    code, out = _verify(capsys, "--checkpoint", tmp_path / "right.safetensors", "--source", tmp_path / "source.pt",
                        "--pair", pair)
    assert code == 0 and "into the pair's torch model" in out and "17 compared, every one equal" in out, out
    code, out = _verify(capsys, "--checkpoint", tmp_path / "wrong.safetensors", "--source", tmp_path / "source.pt",
                        "--pair", pair)
    assert code == 1 and out.rstrip().splitlines()[-2].endswith("tensors that differ: blocks.*.c_proj.weight (layers 0)")


def test_an_existing_json_target_is_refused_before_any_computation(capsys, tmp_path, monkeypatch):
    from flax_transformer.verification import source_check

    def computed(*args, **kwargs):
        raise AssertionError("the check ran before the --json target was refused")

    monkeypatch.setattr(source_check, "check", computed)
    (tmp_path / "report.json").write_text("{}")
    code, out = _verify(capsys, "--checkpoint", tmp_path / "c", "--source", tmp_path / "s",
                        "--json", tmp_path / "report.json")
    assert code == 2 and "report.json" in out and out.count("\n") == 1, out
    assert (tmp_path / "report.json").read_text() == "{}"
