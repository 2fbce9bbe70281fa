"""HF masked-LM folders (BERT, DistilBERT, RoBERTa heads) load, from random tiny configs.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import numpy as np
import pytest
import torch


def _masked_lm_config(kind):
    import transformers

    common = dict(vocab_size=53, max_position_embeddings=20)
    if kind == "distilbert":
        return transformers.DistilBertConfig(dim=12, n_layers=1, n_heads=2, hidden_dim=20, **common)
    if kind == "roberta":
        return transformers.RobertaConfig(hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=20, type_vocab_size=1, pad_token_id=1, **common)
    return transformers.BertConfig(hidden_size=12, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
                                   **common)


@pytest.mark.parametrize("kind,cls", [
    ("bert", "BertForPreTraining"),  # bert-base-uncased on the hub: cls.predictions and cls.seq_relationship
    ("bert", "BertForMaskedLM"),  # saved without a pooler: the encoder is built without one (hf.read_folder)
    ("distilbert", "DistilBertForMaskedLM"),  # distilbert-base-uncased on the hub
    ("roberta", "RobertaForMaskedLM"),  # roberta-base on the hub
])
@pytest.mark.slow_cases({
    "bert-BertForPreTraining": "test_masked_lm_folders_load: the other masked-LM folders",
})
def test_masked_lm_folders_load(tmp_path, kind, cls):
    """Guards the masked-LM heads each encoder's table sets aside (DistilBERT's ``vocab_transform``,
    ``vocab_layer_norm``, ``vocab_projector``; BERT's ``cls.``; RoBERTa's ``lm_head.``): a folder of
    the class the hub's checkpoints are loads as the base model, whose hidden states are transformers'
    own."""
    transformers = pytest.importorskip("transformers")
    from flax_transformer.interop import hf

    torch.manual_seed(0)
    reference = getattr(transformers, cls)(_masked_lm_config(kind)).eval()
    reference.save_pretrained(tmp_path / kind)
    ids = np.random.default_rng(0).integers(3, 53, (2, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    ids[mask == 0] = 1 if kind == "roberta" else 0
    with pytest.warns(UserWarning, match="task-head tensors"):
        model = hf.from_pretrained(tmp_path / kind)
    with torch.no_grad():
        want = reference.base_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    got = np.asarray(model(ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want.last_hidden_state.numpy()[real], atol=1e-5, rtol=0)
