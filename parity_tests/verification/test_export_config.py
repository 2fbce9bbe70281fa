"""The HF export's config: a BERT classifier's options and label names round-trip.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import dataclasses

from flax_transformer.verification import export


def test_exported_bert_classifier_config_round_trips(tmp_path):
    """hf.save_pretrained writes the model's own options and the label names in order."""
    import json

    import torch_reference.encoder as te
    from flax_transformer.models.configs import EncoderConfig

    config = dataclasses.replace(EncoderConfig.bert(dict(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=12, layer_norm_eps=1e-7, hidden_act="relu", type_vocab_size=3,
        hidden_dropout_prob=0.05, attention_probs_dropout_prob=0.02)), num_labels=3)
    export.save_pretrained(te.TransformerForSequenceClassification(config), tmp_path / "out",
                       labels=["neg", "mixed", "pos"])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["id2label"] == {"0": "neg", "1": "mixed", "2": "pos"}
    assert written["label2id"] == {"neg": 0, "mixed": 1, "pos": 2}
    assert dataclasses.replace(EncoderConfig.bert(written), num_labels=3) == config
