"""The notebooks' tokenizers, built on HuggingFace ``tokenizers`` (Rust) instead of Python loops.

* ``notebook_000(texts)``: torchtext's ``Field(lower=True)``: lower-case, split on
  whitespace, a vocabulary of the 50k most frequent words with ``<unk>`` = 0 and
  ``<pad>`` = 1 first (torchtext's order).
* ``notebook_002(texts)``: the GPT notebook's ``preprocess_text`` (lower-case, ASCII,
  no ``<br />``, punctuation split off, other symbols dropped, numbers as ``<NUM>``) and
  its ``WhiteSpaceTokenizer``: the 10k most frequent words, then ``<UNK>``, ``<BOS>``,
  ``<EOS>``, ``<PAD>``; ``encode`` wraps a text in ``<BOS>`` ... ``<EOS>``.
* ``characters(text)``: one id per character (Tiny Shakespeare).
* ``wordpiece(folder)``: BERT's WordPiece from a checkpoint's ``tokenizer.json`` or ``vocab.txt``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers


def notebook_000(texts, vocab_size: int = 50_000) -> Tokenizer:
    """Lower-cased whitespace words; ``<unk>`` = 0, ``<pad>`` = 1, then by frequency (vocab_size in all)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=vocab_size,
                                                                   special_tokens=["<unk>", "<pad>"]))
    return tokenizer


# notebook 002's preprocess_text, step by step, as tokenizers normalisers
_NOTEBOOK_002 = normalizers.Sequence([
    normalizers.Lowercase(),
    normalizers.NFD(),
    normalizers.Replace(Regex(r"[^\x00-\x7f]"), ""),  # .encode("ascii", "ignore")
    normalizers.Replace("<br />", ""),
    *[normalizers.Replace(mark, f" {mark} ") for mark in ".!,?"],
    normalizers.Replace(Regex(r"[^a-zA-Z0-9\s.!,]"), " "),  # "?" goes here too, as in the notebook
    normalizers.Replace(Regex(r"\d+"), "<NUM>"),
])


def notebook_002(texts, max_voc: int = 10_000, max_length: int = 128) -> Tokenizer:
    """The GPT notebook's preprocessing and whitespace vocabulary, ``<BOS>`` text ``<EOS>``, truncated to
    ``max_length`` ids in all (the notebook's ``max_length - 2`` words plus the two markers)."""
    # Count with the notebook's tie-break (most frequent first, ties in order of first
    # appearance: Python's stable sort), words first (ids 0..), special tokens after them.
    split = pre_tokenizers.WhitespaceSplit()
    counts = Counter()
    for text in texts:
        counts.update(word for word, _ in split.pre_tokenize_str(_NOTEBOOK_002.normalize_str(text)))
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:max_voc]
    vocab = {word: i for i, (word, _) in enumerate(ranked)}
    for special in ("<UNK>", "<BOS>", "<EOS>", "<PAD>"):
        vocab.setdefault(special, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<UNK>"))
    tokenizer.normalizer = _NOTEBOOK_002
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<BOS> $A <EOS>", special_tokens=[("<BOS>", vocab["<BOS>"]), ("<EOS>", vocab["<EOS>"])])
    tokenizer.enable_truncation(max_length)
    return tokenizer


def characters(text: str) -> Tokenizer:
    """One id per distinct character of ``text`` (sorted), for character-level language models."""
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # [\s\S], not ".": "." skips newlines, and a run of them would become one unknown piece
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # decode back to the exact text, not space-separated
    return tokenizer


def wordpiece(folder) -> Tokenizer:
    """BERT's tokenizer from a checkpoint folder: its ``tokenizer.json``, else built from ``vocab.txt``."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.no_padding()  # padding is the batcher's job
        return tokenizer
    if not (folder / "vocab.txt").is_file():
        raise FileNotFoundError(f"{folder} has neither tokenizer.json nor vocab.txt")
    from tokenizers import BertWordPieceTokenizer

    return BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=True)._tokenizer
