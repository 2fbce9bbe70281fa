"""The language model inside a multimodal Gemma 3 folder (model_type "gemma3", issue 34 item 2).

A random tiny ``Gemma3ForConditionalGeneration`` (a 2-layer ``gemma3_text`` language model, a 1-layer
SigLIP vision tower) saved by transformers 5, which writes the older layout back
(``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``), and the same tensors
under the names transformers 4.52-5 hold them in a loaded model (``model.language_model.*``,
``model.vision_tower.*``). ``hf.from_pretrained`` reads the language model, leaves out the vision
tower and projector in one warning, and gives transformers' logits on text-only input at 1e-5 (TOL).
"""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from flax_transformer.interop import hf
from flax_transformer.interop.safetensors_io import open_weights
from parity_tests.conftest import TOL
from parity_tests.interop.test_llama_hf import logits

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=3, query_pre_attn_scalar=12, max_position_embeddings=4,
            layer_types=["sliding_attention", "full_attention"])
VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """(transformers' model, its folder, the same tensors under transformers 5's loaded names, text-only ids)."""
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                       image_token_index=5, boi_token_index=6, eoi_token_index=7)
    reference = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # fresh norms are zeros in 1 + w: a wrong convention would hide
        for p in reference.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    folder = tmp_path_factory.mktemp("gemma3") / "saved"
    reference.save_pretrained(folder)
    newer = folder.parent / "newer"
    newer.mkdir()
    (newer / "config.json").write_text((folder / "config.json").read_text())
    save_file({k: v.detach().numpy() for k, v in reference.state_dict().items() if k != "lm_head.weight"},
              str(newer / "model.safetensors"))
    ids = np.random.default_rng(0).integers(8, TEXT["vocab_size"], size=(2, 7))  # no image tokens
    mask = np.ones((2, 7), np.int64)
    mask[1, 5:] = 0
    return reference, folder, newer, (ids, mask)


def test_saved_folder_layout(multimodal):
    """What transformers 5's save_pretrained writes: a "gemma3" folder (not gemma3_text) with the language model
    under language_model.model.*, the tied head left out, and the vision tower beside it."""
    reference, folder, newer, _ = multimodal
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["text_config"]["model_type"] == "gemma3_text"
    names = set(open_weights(folder))
    assert "language_model.model.embed_tokens.weight" in names and not any("lm_head" in k for k in names)
    assert {k.split(".")[0] for k in names} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert {k.split(".")[1] for k in open_weights(newer)} == {"language_model", "vision_tower", "multi_modal_projector"}


@pytest.mark.parametrize("layout", ["saved", "newer"])
def test_language_model_read_vision_left_out(multimodal, layout):
    """Either layout: the language model as a gemma3_text LlamaForCausalLM, transformers' logits at 1e-5 on
    text-only input, and one warning that counts the vision tower and projector tensors left out."""
    reference, folder, newer, (ids, mask) = multimodal
    path = folder if layout == "saved" else newer
    vision = [k for k in open_weights(path) if "vision_tower" in k or "multi_modal_projector" in k]
    with pytest.warns(UserWarning) as caught:
        model = hf.from_pretrained(path)
    messages = [str(w.message) for w in caught if "multimodal" in str(w.message)]
    assert len(messages) == 1 and f"left out its {len(vision)} vision tower and projector tensors" in messages[0]
    assert model.config.model_type == "gemma3_text" and model.config.layer_types == tuple(TEXT["layer_types"])
    want = logits(reference, ids, mask)
    assert np.max(np.abs(logits(model, ids, mask) - want)) <= TOL * max(1.0, float(np.abs(want).max()))


def test_export_is_a_gemma3_text_folder(multimodal, tmp_path):
    """Written back, the language model is a gemma3_text folder that transformers loads as Gemma3ForCausalLM with
    nothing missing or unexpected, computing the multimodal model's text-only logits."""
    reference, folder, _, (ids, mask) = multimodal
    with pytest.warns(UserWarning, match="multimodal"):
        model = hf.torch_from_pretrained(folder)
    hf.save_pretrained(model, tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "gemma3_text"
    again, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(again).__name__ == "Gemma3ForCausalLM" and not any(info.values())
    assert np.max(np.abs(logits(again.eval(), ids, mask) - logits(reference, ids, mask))) <= TOL
