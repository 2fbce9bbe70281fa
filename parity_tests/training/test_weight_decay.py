"""The weight-decay mask, hard-coded per family: no decay on biases, norms and embeddings, decay on
every 2-D projection.

The torch trajectory test derives torch's groups from the mask itself, so it cannot see a wrong one
(issue 17, item 6).
"""

import dataclasses

import jax
import pytest

# No decay on biases, norms and embeddings; decay on every 2-D projection (kernel, and the
# notebook-002 / GPT-2 ``matrix``). Written out per family, one layer and one head each.

NO_DECAY = {
    "former": """pos_embedding.embedding token_embedding.embedding toprobs.bias tblocks.0.ff.0.bias tblocks.0.ff.2.bias
        tblocks.0.mhattention.unifyheads.bias tblocks.0.norm1.bias tblocks.0.norm1.scale tblocks.0.norm2.bias
        tblocks.0.norm2.scale""",
    "encoder": """classifier.bias encoder.embeddings.layer_norm.bias encoder.embeddings.layer_norm.scale
        encoder.embeddings.position_embeddings.embedding encoder.embeddings.token_embeddings.embedding
        encoder.layers.0.attention.heads.0.k.bias encoder.layers.0.attention.heads.0.q.bias
        encoder.layers.0.attention.heads.0.v.bias encoder.layers.0.attention.output_linear.bias
        encoder.layers.0.feed_forward.linear_1.bias encoder.layers.0.feed_forward.linear_2.bias
        encoder.layers.0.layer_norm_1.bias encoder.layers.0.layer_norm_1.scale encoder.layers.0.layer_norm_2.bias
        encoder.layers.0.layer_norm_2.scale""",
    "bert": """classifier.bias encoder.embeddings.layer_norm.bias encoder.embeddings.layer_norm.scale
        encoder.embeddings.position_embeddings.embedding encoder.embeddings.token_embeddings.embedding
        encoder.embeddings.token_type_embeddings.embedding encoder.pooler.bias
        encoder.layers.0.attention.heads.0.k.bias encoder.layers.0.attention.heads.0.q.bias
        encoder.layers.0.attention.heads.0.v.bias encoder.layers.0.attention.output_linear.bias
        encoder.layers.0.feed_forward.linear_1.bias encoder.layers.0.feed_forward.linear_2.bias
        encoder.layers.0.layer_norm_1.bias encoder.layers.0.layer_norm_1.scale encoder.layers.0.layer_norm_2.bias
        encoder.layers.0.layer_norm_2.scale""",
    "gpt": """embedding_norm.beta embedding_norm.gamma out_layer_norm.beta out_layer_norm.gamma lm_head.bias
        position_embeddings.embedding token_embeddings.embedding transformer_stack.0.feed_forward.w1.bias
        transformer_stack.0.feed_forward.w2.bias transformer_stack.0.layer_norm_attention.beta
        transformer_stack.0.layer_norm_attention.gamma transformer_stack.0.layer_norm_feed_forward.beta
        transformer_stack.0.layer_norm_feed_forward.gamma""",
    "gpt2": """transformer.wpe.embedding transformer.wte.embedding transformer.ln_f.bias transformer.ln_f.scale
        transformer.h.0.attn.c_attn.bias transformer.h.0.attn.c_proj.bias transformer.h.0.mlp.c_fc.bias
        transformer.h.0.mlp.c_proj.bias transformer.h.0.ln_1.bias transformer.h.0.ln_1.scale
        transformer.h.0.ln_2.bias transformer.h.0.ln_2.scale""",
    "classic": " ".join(
        [f"{side}.{block}.{part}.bias" for side, block in (("encoder", "encoders.0"), ("decoder", "decoders.0"))
         for part in ("attn_head.attn_heads.0.key_tfm", "attn_head.attn_heads.0.query_tfm",
                      "attn_head.attn_heads.0.value_tfm", "attn_head.projection", "position_wise_feed_forward.0",
                      "position_wise_feed_forward.2", "layer_norm1", "layer_norm2")]
        + [f"decoder.decoders.0.{part}" for part in (
            "layer_norm1.scale", "layer_norm2.scale", "layer_norm3.scale", "layer_norm3.bias",
            "masked_attn_head.attn_heads.0.key_tfm.bias", "masked_attn_head.attn_heads.0.query_tfm.bias",
            "masked_attn_head.attn_heads.0.value_tfm.bias", "masked_attn_head.projection.bias")]
        + ["encoder.encoders.0.layer_norm1.scale", "encoder.encoders.0.layer_norm2.scale", "out.bias",
           "src_embedding.embedding", "tgt_embedding.embedding"]),
}


DECAYED_PROJECTIONS = {"former": 7, "encoder": 7, "bert": 8, "gpt": 6, "gpt2": 4, "classic": 17}


def _one_layer_model(family):
    from flax import nnx

    from flax_transformer.models import classic, encoder, former, gpt
    from flax_transformer.models.configs import EncoderConfig, GPTConfig

    enc = EncoderConfig.tiny(vocab_size=20, hidden_size=8, num_attention_heads=1, num_hidden_layers=1,
                             intermediate_size=16, max_position_embeddings=6, num_labels=2)
    build = {
        "former": lambda: former.CTransformer(8, 1, 1, 6, 20, 2, rngs=nnx.Rngs(0)),
        "encoder": lambda: encoder.TransformerForSequenceClassification(enc, rngs=nnx.Rngs(0)),
        "bert": lambda: encoder.TransformerForSequenceClassification(
            EncoderConfig.bert(dataclasses.asdict(enc)), rngs=nnx.Rngs(0)),
        "gpt": lambda: gpt.GPTTransformer(1, 8, 16, 1, 20, 6, rngs=nnx.Rngs(0)),
        "gpt2": lambda: gpt.GPT2LMHeadModel(GPTConfig.tiny(vocab_size=20, n_positions=6, n_embd=8, n_head=1,
                                                           n_layer=1), rngs=nnx.Rngs(0)),
        "classic": lambda: classic.Transformer(20, 20, 8, 1, 1, 16, max_len=6, rngs=nnx.Rngs(0)),
    }[family]
    return nnx.eval_shape(build)


@pytest.mark.parametrize("family", NO_DECAY)
def test_weight_decay_spares_exactly_these_parameters(family):
    from flax import nnx

    from flax_transformer.training.optim import decay_mask

    mask = decay_mask(nnx.state(_one_layer_model(family), nnx.Param))
    flags = {".".join(str(getattr(p, "key", p)) for p in path[:-1]): bool(flag)
             for path, flag in jax.tree_util.tree_flatten_with_path(mask)[0]}
    spared = {name for name, flag in flags.items() if not flag}
    assert spared == set(NO_DECAY[family].split())
    decayed = {name for name, flag in flags.items() if flag}
    assert len(decayed) == DECAYED_PROJECTIONS[family]
    assert all(name.endswith((".kernel", ".matrix")) for name in decayed), sorted(decayed)
