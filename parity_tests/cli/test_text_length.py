"""A ``--text`` is read whole or refused, never cut at the tokenizer.json's own length (issue 22 item 7):
MiniLM's tokenizer.json truncates at 128 tokens although the model reads 512."""

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from flax_transformer.cli import bisect_cli, inspection
from flax_transformer.models.former import CTransformer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A word-level tokenizer.json that truncates at 8 tokens, as MiniLM's does at 128."""
    folder = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(40)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_truncation(8)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _words(n):
    return " ".join(f"w{i % 40}" for i in range(n))


def test_a_text_longer_than_the_tokenizers_cut_is_read_whole(folder):
    model = CTransformer(emb=8, heads=2, depth=1, seq_length=16, num_tokens=64, num_classes=2, rngs=nnx.Rngs(0))
    ids, mask = bisect_cli.text_inputs(folder, model, [_words(12), _words(3)])
    assert ids.shape == (2, 12) and mask.sum(axis=1).tolist() == [12, 3]  # not 8: the tokenizer's cut is off
    np.testing.assert_array_equal(ids[0], [i % 40 + 1 for i in range(12)])
    with pytest.raises(ValueError, match="--text is 17 tokens; the model reads at most 16"):
        bisect_cli.text_inputs(folder, model, [_words(17)])


def test_attention_map_reads_a_long_text_whole_and_refuses_one_beyond_the_model(folder):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=48, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=16)
    BertModel(config).save_pretrained(folder)  # beside the tokenizer.json that cuts at 8
    tokens, weights, _ = inspection.bert_attentions(folder, _words(12))
    assert len(tokens) == 12 and weights.shape[-2:] == (12, 12)
    with pytest.raises(ValueError, match=r"the text is 17 tokens \(special tokens included\); the model reads at most 16"):
        inspection.bert_attentions(folder, _words(17))
