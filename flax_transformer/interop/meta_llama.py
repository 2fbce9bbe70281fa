"""Meta's original llama checkpoints: a folder of ``consolidated.NN.pth`` + ``params.json`` (the layout of
Meta's Llama 1, 2 and 3.x releases) -> the llama family's names, for ``hf.from_pretrained``,
``hf.torch_from_pretrained`` and ``flax-transformer port``.

Meta's names differ from transformers' (``tok_embeddings``, ``layers.N.attention.wq``,
``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``output``), and so does its RoPE:
Meta rotates adjacent pairs of a head's features (rows 2j and 2j+1 of ``wq``/``wk``, the real and
imaginary parts of a complex number), transformers the two halves (rows j and j + head_dim/2).
The table below renames and, for ``wq`` and ``wk``, moves each head's rows from the interleaved
order to the half-split one (``converter_ops.RopePermute``, the ``permute`` of transformers'
``convert_llama_weights_to_hf.py``): ``wq`` per query head, ``wk`` per key/value head (GQA).

Model-parallel shards (``consolidated.00.pth``, ``.01.pth``, ...) are joined as Meta split them:
column-parallel weights (``wq``, ``wk``, ``wv``, ``w1``, ``w3``, ``output``) along their rows,
row-parallel ones (``wo``, ``w2``) along their columns; the token embedding along its columns
(Llama 1/2's ``ParallelEmbedding``) or its rows (Llama 3's ``VocabParallelEmbedding``), told apart
by the shards' shapes; the norms are replicated, and must be equal in every shard.

``params.json`` gives the shape: ``intermediate_size`` is computed from ``multiple_of`` and
``ffn_dim_multiplier`` as Meta's ``FeedForward`` does and checked against ``w1``; ``vocab_size: -1``
(Llama 1 and 2) is the embedding's row count; ``use_scaled_rope`` is Llama 3.1's scaling (factor 8,
low 1, high 4, original context 8192, as Meta's ``apply_scaling``). A field that would change the
model and is not one of these (a mixture of experts, quantization, LoRA, vision) is refused.

Loading is strict and all or nothing: every missing, unexpected and mis-shaped tensor of every shard
is named, in Meta's names, in one line (``MetaLayoutError``). Files are read only with
``torch.load(weights_only=True, mmap=True)``: a pickle that carries code is refused, and a tensor's
bytes are read (from the mapped file) only when the model is filled with it.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np

from flax_transformer.interop.converter import Context, Row, pattern, to_canonical
from flax_transformer.interop.converter_ops import EmbeddingShards, Join, Replicated, RopePermute, concat
from flax_transformer.interop.safetensors_io import Lazy, read
from flax_transformer.interop.values import to_numpy
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.rope import RopeScaling
from flax_transformer.models.state_dict_errors import StateDictError

# how model-parallel shards hold a tensor: split along its rows (column-parallel), its columns
# (row-parallel), either for the embedding (told by the shapes), or a copy in each (the norms)
ROWS, COLUMNS = Join("s", 0, "shards"), Join("s", 1, "shards")
EMBEDDING, REPLICATED = EmbeddingShards("s", "hidden_size", "shards"), Replicated("s", "shards")
# wq's rows per query head, wk's per key/value head, from Meta's interleaved RoPE to the half split
ROPE_Q, ROPE_K = RopePermute("num_attention_heads"), RopePermute("num_key_value_heads")

META_LLAMA_ROWS = [  # Meta's name in shard {s} -> torch_reference's (transformers') name: shards joined, then RoPE
    Row("{s}/tok_embeddings.weight", "model.embed_tokens.weight", (EMBEDDING,)),
    Row("{s}/layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", (ROWS, ROPE_Q)),
    Row("{s}/layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", (ROWS, ROPE_K)),
    Row("{s}/layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight", (ROWS,)),
    Row("{s}/layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight", (COLUMNS,)),
    Row("{s}/layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight", (ROWS,)),
    Row("{s}/layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight", (COLUMNS,)),
    Row("{s}/layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight", (ROWS,)),
    Row("{s}/layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight", (REPLICATED,)),
    Row("{s}/layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", (REPLICATED,)),
    Row("{s}/norm.weight", "model.norm.weight", (REPLICATED,)),
    Row("{s}/output.weight", "lm_head.weight", (ROWS,)),
]
META_BUFFERS = ("rope.freqs",)  # Llama 1's RoPE table: computed, not a weight (as transformers' inv_freq)

# params.json: the fields that make the model, and those that only size Meta's inference caches
PARAMS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier", "norm_eps",
          "rope_theta", "use_scaled_rope")
RUNTIME_PARAMS = ("max_batch_size", "max_seq_len")
# accepted only at the values that compute nothing different (llama2.c's ModelArgs writes both)
INERT_PARAMS = {"dropout": ((0, None), "training's dropout (llama2.c): 0 or null computes nothing different"),
                "hidden_dim": ((None,), "llama2.c's MLP width: null is Meta's rule (dim, multiple_of, "
                                        "ffn_dim_multiplier); a width is given by ffn_dim_multiplier")}
SHARD = re.compile(r"consolidated\.(\d+)\.pth")


class MetaLayoutError(StateDictError):
    """A Meta folder's tensors do not fit its params.json: every problem, in Meta's names, on one line."""

    def __init__(self, folder, missing=(), unexpected=(), mismatched=(), notes=()):
        super().__init__(missing, unexpected, mismatched)
        parts = [f"missing ({len(self.missing)}): " + ", ".join(self.missing)] if self.missing else []
        if self.unexpected:
            parts.append(f"unexpected ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        if self.mismatched:
            parts.append(f"mis-shaped ({len(self.mismatched)}): " + ", ".join(
                f"{k} {a} vs {b}" for k, a, b in self.mismatched))
        self.args = (f"{folder}: Meta checkpoint does not match its params.json, nothing was loaded: "
                     + "; ".join([*parts, *notes]),)


def is_meta_folder(path) -> bool:
    """A folder in Meta's layout: ``params.json`` or ``consolidated.*.pth``, and no HF ``config.json``."""
    path = Path(path)
    return (path.is_dir() and not (path / "config.json").exists()
            and ((path / "params.json").is_file() or any(_shard_number(p) is not None for p in path.iterdir())))


def _shard_number(path: Path) -> int | None:
    match = SHARD.fullmatch(path.name)
    return int(match.group(1)) if match else None


def shard_files(folder: Path) -> list[Path]:
    """``consolidated.00.pth``, ``.01.pth``, ... in order; a gap in the numbers is refused."""
    numbered = sorted((n, p) for p in folder.iterdir() if (n := _shard_number(p)) is not None)
    if not numbered:
        raise FileNotFoundError(f"{folder} has a params.json but no consolidated.NN.pth weights")
    numbers = [n for n, _ in numbered]
    if numbers != list(range(len(numbers))):
        raise ValueError(f"{folder}: model-parallel shards must be consolidated.00.pth to .{len(numbers) - 1:02d}.pth "
                         f"without gaps or repeats; found {', '.join(p.name for _, p in numbered)}")
    return [p for _, p in numbered]


# ------------------------------------------------------------------ params.json


def read_params(folder: Path) -> dict:
    file = folder / "params.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} holds consolidated.*.pth weights but no params.json (Meta's layout needs "
                                "it for the model's shape)")
    try:
        params = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    if isinstance(params, dict) and isinstance(params.get("model"), dict):
        params = params["model"]  # some releases nest the model's fields (as transformers' converter reads them)
    if not isinstance(params, dict):
        raise ValueError(f"{file} must hold a JSON object, not a {type(params).__name__}")
    unknown = sorted(set(params) - set(PARAMS) - set(RUNTIME_PARAMS) - set(INERT_PARAMS))
    if unknown:
        raise ValueError(f"{file}: fields this llama model does not compute: {', '.join(unknown)} (a Meta llama "
                         f"params.json has {', '.join(PARAMS)}; ignored: {', '.join(RUNTIME_PARAMS)}, and "
                         f"{', '.join(INERT_PARAMS)} when null or 0)")
    for name in ("dim", "n_layers", "n_heads"):
        if name not in params:
            raise ValueError(f"{file} has no {name!r}")
    if params.get("dropout") not in INERT_PARAMS["dropout"][0] or isinstance(params.get("dropout"), bool):
        raise ValueError(f"{file}: dropout={params['dropout']!r} is not computed here (accepted: 0 or null, "
                         "which computes nothing different at inference)")
    if params.get("hidden_dim") is not None:
        raise ValueError(f"{file}: hidden_dim={params['hidden_dim']!r} (llama2.c's MLP width) is not read from a "
                         f"params.json: Meta's layout gives the width by ffn_dim_multiplier; "
                         f"{width_hint(params, params['hidden_dim'])}, and hidden_dim null")
    vocab = params.get("vocab_size", -1)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or (vocab < 1 and vocab != -1):
        raise ValueError(f"{file}: vocab_size must be a positive integer or -1 (the embedding's rows), got {vocab!r}")
    return params


def _integer(file, params, name, default=None, least=1) -> int | None:
    value = params.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{file}: {name} must be an integer >= {least}, got {value!r}")
    return value


def multiplier_for(dim: int, multiple_of: int, width: int) -> float | None:
    """The shortest ``ffn_dim_multiplier`` with which Meta's rule gives the MLP width ``width``, or None."""
    base = int(2 * (4 * dim) / 3)
    for digits in range(1, 9):
        for guess in (round(width / base, digits), round((width - multiple_of + 1) / base, digits)):
            if guess > 0 and intermediate_size(dim, multiple_of, guess) == width:
                return 1.0 if guess == 1 else guess
    return None


def width_hint(params: dict, width) -> str:
    """What gives the MLP width ``width`` in a params.json: the ffn_dim_multiplier to set, or why none does."""
    dim, multiple_of = params.get("dim"), params.get("multiple_of", 256)
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (dim, multiple_of, width))
    found = multiplier_for(dim, multiple_of, width) if valid else None
    if found is not None:
        return f'"ffn_dim_multiplier": {found} gives the width {width} (dim {dim}, multiple_of {multiple_of})'
    return (f"no ffn_dim_multiplier gives the width {width} with dim {dim} and multiple_of {multiple_of} "
            "(the width is rounded up to a multiple of multiple_of)")


def intermediate_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The gated MLP's width, as Meta's ``FeedForward`` computes it from ``hidden_dim = 4 * dim``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def config_of(params: dict, vocab_size: int, file) -> LlamaConfig:
    """The ``LlamaConfig`` of a params.json (``vocab_size`` given: -1 in Llama 1/2's, read off the embedding)."""
    dim, heads = _integer(file, params, "dim"), _integer(file, params, "n_heads")
    layers = _integer(file, params, "n_layers")
    kv = _integer(file, params, "n_kv_heads") or heads
    multiple_of = _integer(file, params, "multiple_of", 256)
    multiplier = params.get("ffn_dim_multiplier")
    if multiplier is not None and (isinstance(multiplier, bool) or not isinstance(multiplier, (int, float))
                                   or not multiplier > 0):
        raise ValueError(f"{file}: ffn_dim_multiplier must be a positive number or null, got {multiplier!r}")
    if dim % heads:
        raise ValueError(f"{file}: dim ({dim}) must be divisible by n_heads ({heads})")
    scaled = params.get("use_scaled_rope", False)
    if not isinstance(scaled, bool):
        raise ValueError(f"{file}: use_scaled_rope must be true or false, got {scaled!r}")
    theta = params.get("rope_theta", 10000.0)  # absent in Llama 1/2's files: their code's 10000
    # the context the release was trained for (params.json does not say; transformers' converter's choice):
    # Llama 3.1 128k, Llama 3 (theta 500000) 8k, Code Llama (theta 1e6) and any other theta above 10000 16k,
    # Llama 2 4k
    positions = (131072 if scaled else 8192 if isinstance(theta, (int, float)) and theta == 500000
                 else 16384 if isinstance(theta, (int, float)) and theta > 10000 else 4096)
    try:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, intermediate_size=intermediate_size(dim, multiple_of, multiplier),
            rms_norm_eps=params.get("norm_eps", 1e-5), rope_theta=theta, max_position_embeddings=positions,
            rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192) if scaled else None,
            tie_word_embeddings=False, model_type="llama")
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None


# ------------------------------------------------------------------ tensors


def _lazy(tensor) -> Lazy:
    """A torch tensor (mapped from its file) as a ``Lazy``: its bytes are read by ``read()``."""
    dtype = to_numpy(tensor.reshape(-1)[:0]).dtype
    return Lazy(tuple(tensor.shape), dtype, lambda: to_numpy(tensor))


def load_shard(file: Path) -> dict[str, Lazy]:
    """One ``consolidated.NN.pth``: ``torch.load(weights_only=True, mmap=True)``, each tensor a ``Lazy``."""
    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"refusing to load {file}: torch.load(weights_only=True) rejected it, so unpickling it would "
                         f"run code from the file ({str(error).splitlines()[0]})") from None
    except Exception as error:  # noqa: BLE001 - a truncated, legacy or corrupted file fails in many ways
        first = (str(error).splitlines() or [""])[0]
        raise ValueError(f"{file} is not a torch checkpoint that torch.load(weights_only=True, mmap=True) reads: "
                         f"{type(error).__name__}: {first}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{file} does not hold a state_dict (a mapping of names to tensors)")
    return {k: _lazy(v) for k, v in state.items()}


def _shard_rule(key: str):
    """How model-parallel shards hold the Meta tensor ``key`` (the first op of its row), or None for no row."""
    for row in META_LLAMA_ROWS:
        if pattern(row.source.removeprefix("{s}/")).fullmatch(key):
            return row.ops[0]
    return None


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple]:
    """Every Meta name of the model, with its full (joined) shape."""
    dim, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out = {"tok_embeddings.weight": (config.vocab_size, dim), "norm.weight": (dim,),
           "output.weight": (config.vocab_size, dim)}
    for i in range(config.num_hidden_layers):
        out |= {f"layers.{i}.attention.wq.weight": (q, dim), f"layers.{i}.attention.wk.weight": (kv, dim),
                f"layers.{i}.attention.wv.weight": (kv, dim), f"layers.{i}.attention.wo.weight": (dim, q),
                f"layers.{i}.feed_forward.w1.weight": (inter, dim), f"layers.{i}.feed_forward.w2.weight": (dim, inter),
                f"layers.{i}.feed_forward.w3.weight": (inter, dim), f"layers.{i}.attention_norm.weight": (dim,),
                f"layers.{i}.ffn_norm.weight": (dim,)}
    return out


def _shard_axis(split, shapes: list[tuple], dim: int) -> int | None:
    """The axis the shards of a tensor join along, or None when their shapes cannot be Meta's split."""
    n, first = len(shapes), shapes[0]
    if any(s != first for s in shapes):
        return None  # Meta splits evenly: every shard holds the same shape
    if split == EMBEDDING:  # Llama 3 splits the vocabulary (rows), Llama 1/2 the features (columns)
        return None if len(first) != 2 else 0 if n == 1 or first[1] == dim else 1 if first[1] * n == dim else None
    axis = split.axis if isinstance(split, Join) else 0
    return axis if len(first) > axis else None


def open_folder(folder) -> tuple[LlamaConfig, dict]:
    """(``LlamaConfig``, tensors under torch_reference's names, unread) of a Meta folder, checked whole."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such Meta checkpoint folder: {folder}")
    params = read_params(folder)
    file = folder / "params.json"
    config_of(params, 1, file)  # the params are checked before any weights are read
    files = shard_files(folder)
    n, dim = len(files), params["dim"]
    for name, heads in (("n_heads", params["n_heads"]), ("n_kv_heads", params.get("n_kv_heads") or params["n_heads"])):
        if heads % n:
            raise ValueError(f"{folder}: {n} model-parallel shards cannot split {name}={heads} heads evenly")
    shards = [load_shard(f) for f in files]
    missing, unexpected, mismatched, joined = [], [], [], {}
    names = sorted({k for s in shards for k in s if not k.startswith(META_BUFFERS)})
    for key in names:
        holders = [f for f, s in zip(files, shards, strict=True) if key in s]
        split = _shard_rule(key)
        if split is None:
            unexpected.append(key if n == 1 else f"{key} ({', '.join(f.name for f in holders)})")
            continue
        if len(holders) < n:
            missing += [f"{key} ({f.name})" for f, s in zip(files, shards, strict=True) if key not in s]
            continue
        parts = [s[key] for s in shards]
        axis = _shard_axis(split, [p.shape for p in parts], dim)
        if axis is None or len({p.dtype for p in parts}) > 1:
            mismatched.append((key, " / ".join(f"{p.dtype}{list(p.shape)}" for p in parts), f"{n} equal parts"))
        elif split == REPLICATED:
            joined[key] = parts[0]
            values = [read(p) for p in parts] if n > 1 else []
            differ = [f.name for f, v in zip(files[1:], values[1:], strict=True) if not np.array_equal(v, values[0])]
            if differ:  # a norm is a copy in every shard: which one would be the model's?
                mismatched.append((key, f"differs in {', '.join(differ)} from {files[0].name}", "replicated (equal)"))
        else:
            joined[key] = parts[0] if n == 1 else concat(parts, axis)
    vocab = params.get("vocab_size", -1)
    if vocab == -1:  # Llama 1 and 2: the tokenizer's size, which the embedding (and the head) has
        table = joined.get("tok_embeddings.weight", joined.get("output.weight"))
        vocab = table.shape[0] if table is not None and len(table.shape) == 2 else 1
    config = config_of({**params, "vocab_size": vocab}, vocab, file)
    notes, expected = [], _expected_shapes(config)
    named = {m.split(" (")[0] for m in missing} | {m[0] for m in mismatched}  # already reported per shard
    for key, shape in expected.items():
        if key not in joined and key not in named:
            missing.append(key)  # in no shard
        elif key in joined and tuple(joined[key].shape) != shape:
            mismatched.append((key, list(joined[key].shape), list(shape)))
            if ".feed_forward." in key and not notes:
                width = joined[key].shape[0 if key.endswith(("w1.weight", "w3.weight")) else 1]
                notes.append(f"the MLP width {config.intermediate_size} is Meta's from dim {dim}, multiple_of "
                             f"{params.get('multiple_of', 256)}, ffn_dim_multiplier {params.get('ffn_dim_multiplier')}; "
                             f"{key} holds {width}: {width_hint(params, width)}")
    unexpected += [k for k in joined if k not in expected]  # a layer beyond n_layers
    if missing or unexpected or mismatched:
        raise MetaLayoutError(folder, missing, sorted(unexpected), mismatched, notes)
    numbered = {f"{n}/{key}": value for n, shard in enumerate(shards) for key, value in shard.items()
                if key in joined}
    return config, to_canonical(META_LLAMA_ROWS, numbered, context=Context(config, shards=len(shards)))
