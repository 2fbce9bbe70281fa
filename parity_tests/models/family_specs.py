"""What each family's spec-driven parity test runs (test_family_parity.py), declared once per family.

In the manner of transformers' ``CausalLMModelTester``: a family lists its tiny modules by level
(attention, block, model), the shapes and mask cases each runs, and how a case becomes the module's
arguments in the family's own mask convention. One parametrised test runs every level x shape x mask
case in both directions (torch -> Flax and Flax -> torch, ``conftest.assert_both_directions``: TOL =
1e-5 with matmul precision "highest", no NaN or inf, within the float64 budget). A new family adds a
``FamilySpec`` here, not a file of copies; what is special to a family stays in its own test file.

Mask cases are ``verify.MASK_CASES``: ``none``, ``padding``, ``causal``, ``causal+padding`` (left
padding: the first query of a padded row sees nothing, a fully masked row under the causal mask) and
``fully-masked-row`` (a row with no token at all).
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import torch_reference.classic as tc
import torch_reference.encoder as te
import torch_reference.former as tf
import torch_reference.gpt as tg
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.verification.verify import MASK_CASES, _mask_for, full_mask, padding_mask


@dataclass(frozen=True)
class Level:
    """One module of a family, run at each of ``shapes`` with each of ``masks``.

    A shape is the sizes (or options, such as an encoder's ``norm_first``) a case runs at, as a tuple.
    ``module(shape, case)`` builds the torch module (causal where the case is); ``inputs(rng, case,
    shape)`` draws its arguments for a mask case. ``kind``: attention, block or model (default: the name). ``eager(case)``: also check it eagerly (op by op; costs more, so only where masks are
    hardest or at model level). ``keep``: the (shape, case) pairs the default run keeps, the others
    run with ``-m slow``; None keeps every case.
    """

    name: str
    module: Callable[[tuple, str], torch.nn.Module]
    inputs: Callable[[np.random.Generator, str, tuple], tuple]
    masks: tuple[str, ...]
    shapes: tuple[tuple, ...]
    keep: frozenset | None = None
    eager: Callable[[str], bool] = lambda case: False
    kind: str = ""

    @property
    def level_kind(self) -> str:
        return self.kind or self.name


@dataclass(frozen=True)
class FamilySpec:
    family: str
    levels: tuple[Level, ...]


def _case_id(family: str, level: Level, shape: tuple, case: str) -> str:
    return "-".join([family, level.name, *map(str, shape), case])


def cases(specs) -> list:
    """Every (family, level, shape, case) of ``specs`` as pytest parameters, with readable ids."""
    return [pytest.param(spec, level, shape, case, id=_case_id(spec.family, level, shape, case))
            for spec in specs for level in spec.levels for shape in level.shapes for case in level.masks]


def kept(specs) -> list[str]:
    """The ids of the cases the default run keeps (``keep_cases`` takes them)."""
    return [_case_id(spec.family, level, shape, case) for spec in specs for level in spec.levels
            for shape, case in (sorted(level.keep) if level.keep is not None else
                                [(shape, case) for shape in level.shapes for case in level.masks])]


def _floats(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ classic (notebook 003)
# Masks are True = masked out (the notebook's convention), the attention's of shape (b, t, t).


def _classic_attention_inputs(rng, case, shape):
    heads, b, t = shape
    keep, causal = _mask_for(case, rng, b, t)
    keep = full_mask(keep, b, t, causal)
    x = _floats(rng, b, t, 4 * heads)
    return x, x, x, None if keep is None else ~keep


CLASSIC_D = 16  # width; 4 heads, feed-forward 24


def _classic_stack_inputs(rng, case, shape):
    """Source (b, s) and target (b, t) of the encoder-decoder: the source's padding, the target causal."""
    b, s, t = shape
    src, _ = _mask_for(case, rng, b, s)
    tgt = None if src is None else padding_mask(rng, b, t, empty_row=False)
    x, enc = _floats(rng, b, t, CLASSIC_D), _floats(rng, b, s, CLASSIC_D)
    src_out = None if src is None else (src == 0)[:, None, :]  # (b, 1, s), True = masked out
    causal = np.triu(np.ones((t, t), bool), 1)[None]  # (1, t, t), True = masked out
    src_ids, tgt_ids = rng.integers(0, 40, size=(b, s)), rng.integers(0, 30, size=(b, t))
    return dict(x=x, enc=enc, src_out=src_out, causal=causal, src=src, tgt=tgt, src_ids=src_ids, tgt_ids=tgt_ids)


def _classic_level(name, module, pick, kind="block", **kw):
    return Level(name, module, lambda rng, case, shape: pick(_classic_stack_inputs(rng, case, shape)),
                 ("none", "padding", "fully-masked-row"), ((3, 7, 5),), keep=frozenset({((3, 7, 5), "fully-masked-row")}),
                 kind=kind, **kw)


CLASSIC = FamilySpec("classic", (
    Level("attention", lambda s, case: tc.MultiHeadAttention(4 * s[0], 4, s[0]), _classic_attention_inputs, MASK_CASES,
          ((1, 1, 1), (3, 2, 7), (8, 3, 5)),
          keep=frozenset({((1, 1, 1), "fully-masked-row"), ((3, 2, 7), "padding"), ((8, 3, 5), "causal+padding")}),
          eager=lambda case: case == "fully-masked-row"),
    _classic_level("encoder-block", lambda s, case: tc.EncoderBlock(CLASSIC_D, 4, 24, 4, dropout=0.3),
                   lambda a: (a["enc"], a["src_out"])),
    _classic_level("decoder-block", lambda s, case: tc.DecoderBlock(CLASSIC_D, 4, 24, 4),
                   lambda a: (a["x"], a["enc"], a["src_out"], a["causal"])),
    _classic_level("encoder", lambda s, case: tc.TransformerEncoder(2, CLASSIC_D, 4, 24), lambda a: (a["enc"], a["src_out"])),
    _classic_level("decoder", lambda s, case: tc.TransformerDecoder(2, CLASSIC_D, 4, 24, 4),
                   lambda a: (a["x"], a["enc"], a["src_out"], a["causal"])),
    _classic_level("model", lambda s, case: tc.Transformer(40, 30, CLASSIC_D, 4, 2, 24, max_len=9),
                   # eagerly in the padding case, which the slow run holds: the encoder-decoder's op-by-op run
                   # costs 18 s, and the default run checks every family's model eagerly but this one
                   lambda a: (a["src_ids"], a["tgt_ids"], a["src"], a["tgt"]), eager=lambda case: case == "padding",
                   kind="model"),
))


# ------------------------------------------------------------------ gpt (notebook 002)
# Every module is causal whatever the case; the mask is (b, t) padding, 1 = token. "causal+padding" is
# left padding (the notebook's fully masked rows), "fully-masked-row" a row with no token.

GPT_MASKS = {
    "none": lambda rng, b, t: None,
    "padding": lambda rng, b, t: padding_mask(rng, b, t, empty_row=False),
    "causal+padding": lambda rng, b, t: padding_mask(rng, b, t, empty_row=False, left=True),
    "fully-masked-row": lambda rng, b, t: padding_mask(rng, b, t, empty_row=True),
}
GPT_KEEP = frozenset({((3, 7), "fully-masked-row"), ((3, 7), "causal+padding")})


def _gpt_attention_inputs(rng, case, shape):
    heads, b, t = shape
    x = _floats(rng, b, t, 4 * heads)
    return x, GPT_MASKS[case](rng, b, t)


GPT = FamilySpec("gpt", (
    Level("attention", lambda s, case: tg.GPTMHAttention(4 * s[0], s[0]), _gpt_attention_inputs, tuple(GPT_MASKS),
          ((1, 1, 1), (2, 3, 7), (8, 1, 9)),
          keep=frozenset({((1, 1, 1), "causal+padding"), ((2, 3, 7), "padding"), ((8, 1, 9), "fully-masked-row")}),
          eager=lambda case: case == "fully-masked-row"),
    Level("layer", lambda s, case: tg.GPTMHTransformerLayer(16, 24, 4, dropout=0.3),
          lambda rng, case, s: (_floats(rng, *s, 16), GPT_MASKS[case](rng, *s)), tuple(GPT_MASKS), ((3, 7),),
          keep=GPT_KEEP, kind="block"),
    Level("model", lambda s, case: tg.GPTTransformer(3, 16, 24, 4, 50, 9),
          lambda rng, case, s: (rng.integers(0, 50, size=s), GPT_MASKS[case](rng, *s)), tuple(GPT_MASKS), ((3, 7),),
          keep=GPT_KEEP, eager=lambda case: True),
))


# ------------------------------------------------------------------ encoder (notebook 001)
# The attention and the layer take a (b, t, t) mask, True = may attend (padding and, if causal, no
# look-ahead); the models a (b, t) padding mask, 1 = token. A shape is (heads, b, t) for the
# attention, (norm_first,) for the layer and the models.


def _encoder_config(heads=4, head_dim=6, **kw):
    return EncoderConfig.tiny(hidden_size=heads * head_dim, num_attention_heads=heads, **kw)


def _encoder_attention_inputs(rng, case, shape):
    heads, b, t = shape
    mask, causal = _mask_for(case, rng, b, t)
    x = _floats(rng, b, t, _encoder_config(heads).hidden_size)
    return x, full_mask(mask, b, t, causal)


def _encoder_layer_config(shape):
    return _encoder_config(norm_first=shape[0], hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.2)


def _encoder_layer_inputs(rng, case, shape):
    mask, causal = _mask_for(case, rng, 3, 7)
    x = _floats(rng, 3, 7, _encoder_layer_config(shape).hidden_size)
    return x, full_mask(mask, 3, 7, causal)


def _encoder_model_inputs(rng, case, shape):
    mask, _ = _mask_for(case, rng, 3, 9)
    return rng.integers(0, _encoder_config().vocab_size, size=(3, 9)), mask


NORM_FIRST = ((True,), (False,))
MODEL_MASKS = ("none", "padding", "fully-masked-row")
ENCODER_MODEL_KEEP = frozenset({((False,), "padding"), ((False,), "fully-masked-row")})

ENCODER = FamilySpec("encoder", (
    Level("attention", lambda s, case: te.MultiHeadAttention(_encoder_config(s[0])), _encoder_attention_inputs, MASK_CASES,
          ((1, 1, 1), (3, 2, 7), (12, 3, 5)),
          keep=frozenset({((1, 1, 1), "fully-masked-row"), ((12, 3, 5), "causal+padding"), ((3, 2, 7), "padding")}),
          eager=lambda case: case == "fully-masked-row"),
    Level("layer", lambda s, case: te.TransformerEncoderLayer(_encoder_layer_config(s)), _encoder_layer_inputs, MASK_CASES,
          NORM_FIRST,
          keep=frozenset({((False,), "causal+padding"), ((True,), "fully-masked-row"), ((True,), "padding")}),
          eager=lambda case: case == "fully-masked-row", kind="block"),
    Level("model", lambda s, case: te.TransformerEncoder(_encoder_config(norm_first=s[0])), _encoder_model_inputs,
          MODEL_MASKS, NORM_FIRST, keep=ENCODER_MODEL_KEEP, eager=lambda case: True),
    Level("classifier", lambda s, case: te.TransformerForSequenceClassification(_encoder_config(norm_first=s[0])),
          _encoder_model_inputs, MODEL_MASKS, NORM_FIRST, keep=ENCODER_MODEL_KEEP, kind="model"),
))


# ------------------------------------------------------------------ former (notebooks 000, 004)
# Masks are (b, t) padding, 1 = token; a causal case builds the module causal. The attention's shape
# is (variant, heads, b, t): "narrow" (MHSelfAttention, width 4 x heads) or "wide" (SelfAttention,
# width 8), 1 to 12 heads, odd lengths, batch 1.


def _former_attention(shape, case):
    variant, heads, b, t = shape
    cls = tf.MHSelfAttention if variant == "narrow" else tf.SelfAttention
    return cls(4 * heads if variant == "narrow" else 8, heads, causal=case.startswith("causal"))


def _former_attention_inputs(rng, case, shape):
    variant, heads, b, t = shape
    mask, _ = _mask_for(case, rng, b, t)
    return _floats(rng, b, t, 4 * heads if variant == "narrow" else 8), mask


def _former_inputs(b, t, width=None, vocab=None):
    """(x or ids, padding mask) of (b, t), the mask drawn first."""
    def inputs(rng, case, shape):
        mask, _ = _mask_for(case, rng, b, t)
        return (_floats(rng, b, t, width) if width else rng.integers(0, vocab, size=(b, t))), mask
    return inputs


FORMER = FamilySpec("former", (
    Level("attention", _former_attention, _former_attention_inputs, MASK_CASES,
          (("narrow", 1, 1, 1), ("narrow", 3, 2, 7), ("narrow", 4, 1, 9), ("narrow", 12, 3, 11), ("wide", 1, 2, 5),
           ("wide", 6, 1, 3)),
          keep=frozenset({(("narrow", 1, 1, 1), "none"), (("narrow", 3, 2, 7), "causal+padding"),
                          (("narrow", 3, 2, 7), "fully-masked-row"), (("wide", 1, 2, 5), "padding"),
                          (("wide", 6, 1, 3), "fully-masked-row")}),
          eager=lambda case: case in ("fully-masked-row", "causal+padding")),
    Level("attention-scale-head", lambda s, case: tf.MHSelfAttention(24, 6, causal=case.startswith("causal"), scale="head"),
          _former_inputs(3, 7, width=24), MASK_CASES, ((),), kind="attention"),
    Level("block", lambda s, case: tf.TransformerBlock(16, 4, case.startswith("causal"), 20, ff_hidden_mult=3, dropout=0.3,
                                                       attention=s[0]),
          _former_inputs(3, 7, width=16), MASK_CASES, (("narrow",), ("wide",)),
          keep=frozenset({(("narrow",), "causal+padding"), (("narrow",), "padding"), (("wide",), "fully-masked-row")}),
          eager=lambda case: case == "fully-masked-row"),
    Level("ctransformer", lambda s, case: tf.CTransformer(16, 4, 2, 12, 40, 3, max_pool=s[0], dropout=0.2,
                                                          attention=["wide", "narrow"]),
          _former_inputs(3, 9, vocab=40), MODEL_MASKS, ((True,), (False,)),
          keep=frozenset({((False,), "none"), ((False,), "padding"), ((True,), "fully-masked-row")}),
          eager=lambda case: True, kind="model"),
    Level("gtransformer", lambda s, case: tf.GTransformer(12, 3, 3, 11, 30, scale="head"), _former_inputs(2, 11, vocab=30),
          MODEL_MASKS, ((),), keep=frozenset({((), "fully-masked-row")}), eager=lambda case: True, kind="model"),
))

SPECS = (CLASSIC, GPT, ENCODER, FORMER)
