"""A causal LM's prompt as token ids, and a checkpoint folder's own tokenizer for generation.

``prompt_ids(tokenizer, text, prefix=None)`` is the one rule of every path that turns a prompt into ids
with a ``tokenizers.Tokenizer``: ``generate`` on a ``train.lm --model hf`` run (``lm.prompt_ids``), on an
HF or Meta folder (``cli/folder_generation.py``), and ``verify --bisect-generate``
(``cli/generation_cli.py``). The ids are what the tokenizer's template puts *before* a text (a BOS:
Llama's and Gemma's ``<s>``/``<bos>``; nothing for GPT-2 or Qwen), read from the template itself, so an
empty prompt keeps its BOS, then the text's own ids; never what the template puts after (an EOS would
end the text before its continuation). A prompt that would lose characters is refused in one line
naming them: a piece the tokenizer maps to its unknown token (a BPE without byte fallback) would be
dropped from the echoed text, and the model would not see it. A prompt that gives no id at all
(an empty prompt and no BOS) is refused too.

``folder_tokenizer(folder)`` reads a folder's tokenizer as transformers or Meta's own code reads it:

* ``tokenizer.json`` (the ``tokenizers`` library), with ``tokenizer_config.json``'s ``add_bos_token``
  when the folder sets it (transformers rebuilds the template from it), else the template's own BOS;
* ``tokenizer.model`` in SentencePiece's format (Llama 2), converted by transformers'
  ``SpmConverter.build_tokenizer_from_spm_proto`` (which follows the model's own normaliser: the ids of
  ``SentencePieceProcessor.encode``), BOS added as Meta's ``generate`` adds it;
* ``tokenizer.model`` in tiktoken's format (Llama 3's BPE ranks: a base64 token and its rank a line),
  converted by transformers' ``TikTokenConverter``, with Meta's 256 special tokens after the ranks
  (llama-models' ``llama3/tokenizer.py`` names), ``<|begin_of_text|>`` before a prompt.

The stop ids: ``generation_config.json``'s ``eos_token_id`` (an id or a list), else ``config.json``'s, else
the tokenizer's (SentencePiece's ``eos_id``; Llama 3's ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``).
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flax_transformer.interop import files

# llama-models' llama3/tokenizer.py: the special tokens after the BPE ranks, 256 in all
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>")
LLAMA3_SPECIALS += tuple(f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS)))
LLAMA3_STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
RANK_LINE = re.compile(rb"[A-Za-z0-9+/=]+ \d+")


class PromptError(ValueError):
    """A prompt the tokenizer cannot give the model as written: the characters named, in one line."""


@dataclass(frozen=True)
class FolderTokenizer:
    """A folder's tokenizer (no padding or truncation), the ids put before a prompt, and the stop ids."""

    tokenizer: object
    prefix: tuple[int, ...]
    eos_ids: tuple[int, ...]
    source: str


def template_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer's post-processor puts before a single text (its template up to ``$A``; a
    ``Sequence`` of processors read in order; BERT's and RoBERTa's ``cls``)."""
    if tokenizer.post_processor is None:
        return []
    prefix, stack = [], [json.loads(tokenizer.post_processor.__getstate__())]
    while stack:
        state = stack.pop(0)
        kind = state.get("type")
        if kind == "Sequence":
            stack = list(state["processors"]) + stack
        elif kind == "TemplateProcessing":
            for piece in state["single"]:
                if "Sequence" in piece:
                    break
                prefix += state["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
        elif kind in ("BertProcessing", "RobertaProcessing"):
            prefix.append(state["cls"][1])
    return prefix


def unknown_pieces(tokenizer, text: str, encoding) -> list[str]:
    """The pieces of ``text`` that ``encoding`` holds as the tokenizer's unknown token."""
    state = json.loads(tokenizer.model.__getstate__())
    unk = state.get("unk_token")
    unk_id = tokenizer.token_to_id(unk) if unk is not None else state.get("unk_id")
    if unk_id is None:
        return []
    return [text[start:end] for token, (start, end) in zip(encoding.ids, encoding.offsets) if token == unk_id]


def prompt_ids(tokenizer, text: str, *, prefix=None, flag: str = "--prompt") -> np.ndarray:
    """``text``'s ids after ``prefix`` (default: what the tokenizer's template puts before a text), without
    what it puts after; ``PromptError`` for characters the tokenizer has no id for, or no ids at all."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    unknown = unknown_pieces(tokenizer, text, encoding)
    if unknown:
        shown = ", ".join(repr(piece) for piece in dict.fromkeys(unknown))
        raise PromptError(f"{flag} has characters its tokenizer cannot encode ({shown}): they would become the "
                          "unknown token, which the model would see instead and the echoed text would drop; "
                          "leave them out or write them otherwise")
    ids = (template_prefix(tokenizer) if prefix is None else list(prefix)) + encoding.ids
    if not ids:
        raise PromptError(f"{flag} gives no tokens ({text!r}, and this tokenizer puts no BOS before a text): "
                          "give the model some text to continue")
    return np.asarray(ids, dtype=np.int32)


def _read_json(folder: Path, name: str) -> dict:
    return files.read_json_object(folder, name) if (folder / name).is_file() else {}


def _ids(value) -> tuple[int, ...]:
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)


def _tokenizer_json(folder: Path):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as error:  # the Rust library raises plain Exceptions
        raise ValueError(f"{folder / 'tokenizer.json'} is unreadable: {str(error)[:200]}") from None
    settings = _read_json(folder, "tokenizer_config.json")
    prefix = template_prefix(tokenizer)
    if "add_bos_token" in settings:  # transformers rebuilds the template from it
        bos = settings.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        bos_id = tokenizer.token_to_id(bos) if isinstance(bos, str) else None
        if settings["add_bos_token"] and bos_id is None:
            raise ValueError(f"{folder / 'tokenizer_config.json'} sets add_bos_token but its bos_token {bos!r} is "
                             "not in tokenizer.json")
        prefix = [bos_id] if settings["add_bos_token"] else [i for i in prefix if i != bos_id]
    return tokenizer, tuple(prefix), (), "tokenizer.json"


def _sentencepiece(folder: Path, data: bytes):
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise ValueError(f"{folder / 'tokenizer.model'} is a SentencePiece model: converting it needs transformers' "
                         "SpmConverter.build_tokenizer_from_spm_proto (transformers 5): upgrade transformers, or "
                         "put the folder's tokenizer.json beside it")
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(data)
    pieces = [(piece.piece, piece.score) for piece in proto.pieces]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)} if proto.trainer_spec.model_type == 2 else pieces
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    if tokenizer is None:
        raise ValueError(f"{folder / 'tokenizer.model'}: a SentencePiece model of a kind transformers does not "
                         "convert (neither BPE nor unigram)")
    spec = proto.trainer_spec
    prefix = (spec.bos_id,) if spec.bos_id >= 0 else ()  # Meta's generate: encode(prompt, bos=True)
    return tokenizer, prefix, (spec.eos_id,) if spec.eos_id >= 0 else (), "tokenizer.model (SentencePiece)"


def _tiktoken(folder: Path):
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken caches a file by its path: a changed file would read stale
    try:
        tokenizer = TikTokenConverter(vocab_file=str(folder / "tokenizer.model")).converted()
    except ValueError as error:
        raise ValueError(f"{folder / 'tokenizer.model'}: {error} (its BPE ranks)") from None
    finally:
        if cache is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = cache
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in LLAMA3_SPECIALS])
    ids = {token: tokenizer.token_to_id(token) for token in LLAMA3_SPECIALS}
    return (tokenizer, (ids["<|begin_of_text|>"],), tuple(ids[token] for token in LLAMA3_STOPS),
            "tokenizer.model (tiktoken BPE ranks, Llama 3's special tokens)")


def folder_tokenizer(folder) -> FolderTokenizer:
    """``folder``'s own tokenizer: ``tokenizer.json``, else ``tokenizer.model`` (SentencePiece or tiktoken)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        tokenizer, prefix, eos, source = _tokenizer_json(folder)
    elif (folder / "tokenizer.model").is_file():
        data = (folder / "tokenizer.model").read_bytes()
        first = data.split(b"\n", 1)[0]
        if RANK_LINE.fullmatch(first) and _is_base64(first.split()[0]):
            tokenizer, prefix, eos, source = _tiktoken(folder)
        else:
            tokenizer, prefix, eos, source = _sentencepiece(folder, data)
    else:
        raise ValueError(f"{folder} has no tokenizer.json or tokenizer.model: generate reads the folder's own "
                         "tokenizer (Meta's Llama 2 download keeps tokenizer.model beside the model folders: copy "
                         "it in)")
    tokenizer.no_padding()
    tokenizer.no_truncation()  # a prompt too long for the model is refused by name, not cut
    generation = _read_json(folder, "generation_config.json")
    config = _read_json(folder, "config.json")
    stops = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id")) or eos
    return FolderTokenizer(tokenizer, tuple(int(i) for i in prefix), tuple(int(i) for i in stops), source)


def _is_base64(token: bytes) -> bool:
    try:
        base64.b64decode(token, validate=True)
    except ValueError:
        return False
    return True
