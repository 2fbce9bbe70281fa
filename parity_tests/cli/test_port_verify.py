"""``port SRC DST --verify`` (``cli.port_verify``) on the user's path, in-process: an export in bf16 is
checked by bf16's tolerance alone (no float64 budget holds rounded weights), and a ``--no-certify``
export written over a certified one takes the old certificate away with the old weights. SRC: an HF
folder of a tiny llama (1 layer, width 32), so each check is also one against transformers."""

import pytest

from flax_transformer.cli import main
from flax_transformer.interop.safetensors_io import open_weights
from flax_transformer.verification import certificate


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """An HF folder of a tiny llama written by transformers (torch's initialisation: no JAX op to compile)."""
    torch = pytest.importorskip("torch", reason="port --verify compares with SRC's torch model")
    transformers = pytest.importorskip("transformers", reason="transformers writes SRC")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("src") / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)).save_pretrained(folder)
    return folder


def test_a_bf16_export_passes_by_bf16s_tolerance(src, tmp_path, capsys):
    dst = tmp_path / "hf"
    assert main(["port", str(src), str(dst), "--dtype", "bf16", "--verify", "--no-certify"]) == 0
    out = capsys.readouterr().out
    assert f"between {src} (torch) and {dst} (bf16 weights) (reloaded) -> pass (tolerance " in out, out
    assert f"between {src} (transformers) and {dst} (bf16 weights) (reloaded) -> pass" in out
    assert f"wrote {dst} (hf) without a certificate (--no-certify)\n" in out
    assert {str(v.dtype) for v in open_weights(dst).values()} == {"bfloat16"}


def test_an_uncertified_export_over_a_certified_one_leaves_no_certificate(src, tmp_path, capsys):
    dst = tmp_path / "m.safetensors"
    certificate.path_for(dst).write_text("{}")  # an earlier export's certificate (its contents are not read)
    dst.write_bytes(b"an earlier export")
    assert main(["port", str(src), str(dst), "--verify", "--overwrite", "--no-certify"]) == 0
    assert "-> pass" in capsys.readouterr().out
    assert open_weights(dst) and not certificate.path_for(dst).exists()


def test_a_failing_reload_check_fails_though_transformers_agrees(src, tmp_path, capsys, monkeypatch):
    """The reload's compare held to a tolerance of 0 (so it fails) while transformers' check passes: exit 1."""
    from flax_transformer.verification import compare

    real = compare.compare
    monkeypatch.setattr(compare, "compare", lambda *args, **kwargs: real(*args, **{**kwargs, "tol": 0.0}))
    dst = tmp_path / "hf"
    assert main(["port", str(src), str(dst), "--verify", "--no-certify"]) == 1
    out = capsys.readouterr().out
    assert f"between {src} (torch) and {dst} (reloaded) -> FAIL" in out, out
    assert f"between {src} (transformers) and {dst} (reloaded) -> pass" in out, out
