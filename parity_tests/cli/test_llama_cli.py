"""The command line for the llama family (issue 24 item 7): ``summary`` of the real shapes and of an HF
folder, ``attention-map`` of a decoder (causal maps, one per query head under grouped-query
attention, equal to transformers' ``output_attentions``), and ``verify``'s llama rows and flags.

The HF folder is a tiny random transformers ``LlamaForCausalLM`` (no download) with a word-level
``tokenizer.json`` that adds a BOS token. Tolerance: 1e-5 in fp32 (TOL).
"""

import numpy as np
import pytest
import torch

from flax_transformer.cli import inspection, verify_flags
from flax_transformer.cli.commands import main
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import verify
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "slept"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An HF llama folder: 2 layers, 4 query heads sharing 2 key/value heads, a tokenizer.json with a BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=12,
                                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # distinct, peaked attention: a head in the wrong place would show
            p.add_(0.5 * torch.randn(p.shape))
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _transformers_attentions(folder, ids) -> np.ndarray:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return np.stack([a[0].numpy() for a in out.attentions])  # (layers, heads, t, t)


def test_attention_maps_of_a_decoder_are_transformers_own_per_query_head(folder):
    tokens, weights, b_start, groups = inspection.attentions(folder, "the cat sat on a mat")
    assert tokens == ["<s>", "the", "cat", "sat", "on", "a", "mat"] and b_start == len(tokens) and groups == 2
    assert weights.shape == (2, 4, 7, 7)  # layers, query heads, queries, keys
    want = _transformers_attentions(folder, [1, 3, 4, 5, 6, 7, 8])
    np.testing.assert_allclose(weights, want, atol=TOL, rtol=0)
    assert np.all(np.triu(weights, 1) == 0)  # causal: no query sees a later key
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    # the check can fail: heads of different key/value heads differ (a tiled, not repeated, GQA would swap them)
    assert np.abs(want[:, [1, 2]] - want[:, [2, 1]]).max() > 0.05


def test_attention_map_command_on_a_decoder(folder, tmp_path, capsys):
    args = ["attention-map", "--checkpoint", str(folder), "--text", "the cat sat", "--layer", "1"]
    assert main([*args, "--out", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out
    assert main([*args, "--head", "3", "--out", str(tmp_path / "a.html")]) == 0
    page = (tmp_path / "a.html").read_text()
    assert '"<s>"' in page and "groups = 2" in page and "<svg" in page
    for bad, says in ((["--text-b", "a mat"], "--text-b is for a BERT"),
                      (["--text", " ".join(["the"] * 12)], "the text is 13 tokens")):
        assert main([*args, *bad, "--out", str(tmp_path / "b.png")]) == 2
        assert says in capsys.readouterr().err
        assert not (tmp_path / "b.png").exists()


def test_summary_of_real_shapes_and_of_an_hf_folder(folder, capsys):
    # Llama 3.2 1B's published count, its tied head counted once (the other presets: the same code)
    assert main(["summary", "llama-3.2-1b", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "total: 1,235,814,400 parameters" in out and "tied: lm_head.weight is model.embed_tokens.weight" in out
    assert main(["summary", str(folder)]) == 0  # untied
    out = capsys.readouterr().out
    count = transformers.LlamaForCausalLM.from_pretrained(folder).num_parameters()
    assert f"total: {count:,} parameters" in out and "model.layers.1.self_attn.k_proj" in out and "tied" not in out


def test_verify_covers_every_llama_switch_at_long_positions():
    """The llama rows of ``verify`` (``--family llama``), by what their models hold: every switch."""
    specs = [s for s in verify.specs() if s.family == "llama"]
    configs = [LlamaConfig.from_any(spec.build(True).init_kwargs()["config"]) for spec in specs]
    seen = {
        "GQA": any(1 < c.num_key_value_heads < c.num_attention_heads for c in configs),
        "MQA": any(c.num_key_value_heads == 1 for c in configs),
        "q/k norm": any(c.qk_norm for c in configs), "biases": any(c.attention_bias for c in configs),
        "MLP biases": any(c.mlp_bias for c in configs), "window": any(c.sliding_window for c in configs),
        "1 + w": any(c.norm_plus_one for c in configs), "tanh GELU": any(c.hidden_act == "gelu_pytorch_tanh" for c in configs),
        "tied": any(c.tie_word_embeddings for c in configs),
        **{rope: any(c.rope_scaling and c.rope_scaling.rope_type == rope for c in configs)
           for rope in ("llama3", "linear", "dynamic")},
    }
    assert all(seen.values()), seen
    assert {s.name.split("(")[0] for s in specs} == {"LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM"}
    assert all(s.cases == ("causal", "causal+padding", "fully-masked-row") for s in specs)
    _, args, _ = verify.case_inputs(specs[0], "causal", 0)
    assert args[2].max() >= 16_000  # position ids: RoPE scaling is exact at position 0
    models = [s.name for s in specs if s.name in verify.MODELS]
    assert len(models) == 2 and {c.tie_word_embeddings for c in configs[-2:]} == {True, False}


def test_verify_flags_say_which_check_runs():
    import argparse

    parser = argparse.ArgumentParser()
    verify_flags.add_parser(parser.add_subparsers(), func=None)
    mode = lambda *flags: verify_flags.mode(parser.parse_args(["verify", *flags]))  # noqa: E731
    assert mode("--family", "llama") == verify_flags.TABLE
    assert mode("--family", "llama", "--grads") == verify_flags.TABLE
    assert mode("--train-steps", "2", "--family", "llama") == verify_flags.TRAIN_STEPS
    assert mode("--checkpoint", "x") == verify_flags.CHECKPOINT
    assert mode("--pair", "m:f") == verify_flags.PAIR
    assert mode("--checkpoint", "x", "--pair", "m:f") == verify_flags.CERTIFIED_PAIR
    for flags, says in ((("--pair", "m:f", "--family", "llama"), "take no --train-steps or --family"),
                        (("--text", "hi"), "go with --bisect or --pair"),
                        (("--through-torch-state",), "goes with --train-steps")):
        with pytest.raises(ValueError, match=says):
            mode(*flags)
