"""Converter rows: every op and its inverse, laziness, the all-or-nothing checks, named-axis layouts,
and the mixture-of-experts formats against transformers 5's own (fused in memory, per expert on disk,
GPT-OSS's MXFP4, DeepSeek-V3's FP8 blocks)."""

import ml_dtypes
import numpy as np
import pytest
import torch

from flax_transformer.interop import converter, hf_tables, meta_llama, safetensors_io
from flax_transformer.interop.converter import Context, Row, from_canonical, to_canonical
from flax_transformer.interop.converter_ops import (
    FP8Blocks,
    Join,
    RopePermute,
    Split,
    Stack,
    Transpose,
    Unstack,
    mxfp4_dequantise,
    mxfp4_quantise,
)
from flax_transformer.interop.layer_kinds import AS_IS, CONV, TRANSPOSE, Layout, to_flax, to_torch, torch_shape
from flax_transformer.models.state_dict_errors import StateDictError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

RNG = np.random.default_rng(0)
TABLES = {"bert": hf_tables.BERT_ROWS, "distilbert": hf_tables.DISTILBERT_ROWS, "gpt2": hf_tables.GPT2_ROWS,
          "llama": hf_tables.LLAMA_ROWS, "moe": hf_tables.MOE_ROWS, "mixtral": hf_tables.MIXTRAL_ROWS,
          "gpt_oss_mxfp4": hf_tables.GPT_OSS_MXFP4_ROWS, "meta": meta_llama.META_LLAMA_ROWS,
          **{f"{k}-classifier": e.classifier_rows for k, e in hf_tables.ENCODERS.items()}}


@pytest.mark.parametrize("name", TABLES)
def test_every_table_of_the_library_is_well_formed(name):
    for row in TABLES[name]:
        row.check()


def test_a_row_whose_ops_leave_a_field_open_is_refused():
    with pytest.raises(ValueError, match=r"leave the fields \['e'\] open"):
        Row("x.{e}.w", "x.w").check()  # the experts are never stacked
    with pytest.raises(ValueError, match="same fields"):
        Row(("x.{e}.w", "y.w"), "x.w", (Stack("e"), Join("t"))).check()


# ------------------------------------------------------------------ each op both ways

CASES = {  # row, the source state, the Context
    "split heads": (Row("q.{p}", "heads.{h}.q.{p}", (Split("h", 0, "heads"),)),
                    {"q.weight": RNG.normal(size=(6, 4)), "q.bias": RNG.normal(size=6)}, Context(heads=3)),
    "experts, gate and up": (Row(("e.{e}.gate", "e.{e}.up"), "gate_up", (Stack("e", 0, "experts"), Join("t", 1))),
                             {f"e.{e}.{w}": RNG.normal(size=(2, 5)) for e in range(3) for w in ("gate", "up")},
                             Context(experts=3)),
    "interleaved gate and up": (Row(("g.{e}", "u.{e}"), "gu", (Stack("e"), Transpose("e o i", "e i o"),
                                                               Join("t", 2, interleave=True))),
                                {f"{w}.{e}": RNG.normal(size=(3, 4)) for e in range(2) for w in "gu"}, Context()),
    "unstack": (Row("w", "w.{e}", (Unstack("e", 0, "experts"),)), {"w": RNG.normal(size=(4, 2, 3))}, Context(experts=4)),
    "named transpose": (Row("w", "w", (Transpose("e out in", "e in out"),)), {"w": RNG.normal(size=(2, 3, 5))}, Context()),
    "meta rope": (Row("wq", "q", (RopePermute("heads"),)), {"wq": RNG.normal(size=(32, 3))}, Context(heads=2)),
    "meta shards": (meta_llama.META_LLAMA_ROWS,
                    {**{f"{s}/layers.0.attention.wq.weight": RNG.normal(size=(4, 8)) for s in range(2)},
                     **{f"{s}/layers.0.attention.wo.weight": RNG.normal(size=(8, 4)) for s in range(2)},
                     **{f"{s}/tok_embeddings.weight": RNG.normal(size=(5, 8)) for s in range(2)},
                     **{f"{s}/norm.weight": np.arange(8.0) for s in range(2)}},
                    Context(num_attention_heads=2, hidden_size=8, shards=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_op_and_its_inverse_give_the_source_back_exactly(case):
    rows, state, ctx = CASES[case]
    rows = [rows] if isinstance(rows, Row) else rows
    canonical = to_canonical(rows, state, context=ctx)
    assert not set(canonical) & set(state) or case == "named transpose"
    back = from_canonical(rows, canonical, context=ctx)
    assert set(back) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(safetensors_io.read(back[key]), value, err_msg=key)


def test_the_ops_compute_what_they_say():
    _, state, ctx = CASES["experts, gate and up"]
    fused = to_canonical(CASES["experts, gate and up"][0:1], state, context=ctx)["gate_up"]
    assert fused.shape == (3, 4, 5)  # (E, 2I, H): gate's rows, then up's
    np.testing.assert_array_equal(fused[1, :2], state["e.1.gate"])
    np.testing.assert_array_equal(fused[1, 2:], state["e.1.up"])
    _, state, ctx = CASES["interleaved gate and up"]
    gu = to_canonical(CASES["interleaved gate and up"][0:1], state, context=ctx)["gu"]
    assert gu.shape == (2, 4, 6)  # (E, H, 2I), gate and up in turn
    np.testing.assert_array_equal(gu[1, :, 0::2], state["g.1"].T)
    np.testing.assert_array_equal(gu[1, :, 1::2], state["u.1"].T)
    rows, state, ctx = CASES["meta shards"]
    out = to_canonical(rows, state, context=ctx)
    assert out["model.layers.0.self_attn.q_proj.weight"].shape == (8, 8)  # rows joined
    assert out["model.layers.0.self_attn.o_proj.weight"].shape == (8, 8)  # columns joined
    assert out["model.embed_tokens.weight"].shape == (10, 8)  # the vocabulary's rows (Llama 3)
    np.testing.assert_array_equal(safetensors_io.read(out["model.norm.weight"]), np.arange(8.0))


def test_meta_s_rope_order_moves_rows_as_its_formula_says():
    """Row j + c * d/2 of a head takes Meta's row 2j + c (d = 16 here: no permutation of this size is
    its own inverse, so a forward used as its own inverse fails)."""
    heads, d = 2, 16
    wq = RNG.normal(size=(heads * d, 3))
    q = to_canonical([CASES["meta rope"][0]], {"wq": wq}, context=Context(heads=heads))["q"]
    for h in range(heads):
        for j in range(d // 2):
            for c in (0, 1):
                np.testing.assert_array_equal(q[h * d + j + c * d // 2], wq[h * d + 2 * j + c])
    twice = to_canonical([CASES["meta rope"][0]], {"wq": q}, context=Context(heads=heads))["q"]
    assert not np.array_equal(twice, wq)


def test_meta_rope_rows_not_whole_pairs_per_head_are_named():
    """wq with 6 rows for 2 heads (a multiple of the heads, not of their RoPE pairs): the tensor is named with
    the shape it needs, before any reshape fails without a name."""
    with pytest.raises(StateDictError) as error:
        to_canonical([CASES["meta rope"][0]], {"wq": RNG.normal(size=(6, 3))}, context=Context(heads=2))
    assert error.value.mismatched == [("wq", (6, 3), "(a multiple of 2 * heads=4, in)")]


def test_the_context_s_overrides_win_over_the_config():
    class Config:
        num_experts = 4
    assert Context(Config(), num_experts=2).size("num_experts") == 2
    assert Context(Config()).size("num_experts") == 4 and Context(None).size("num_experts") is None
    with pytest.raises(ValueError, match="needs 'num_experts', and no config was given"):
        Context(None).size("num_experts", required=True)


def test_conversion_is_lazy_and_a_slice_reads_only_its_rows():
    reads = []
    full = RNG.normal(size=(6, 4)).astype(np.float32)
    lazy = safetensors_io.Lazy(full.shape, full.dtype, lambda: reads.append("all") or full,
                               lambda a, b: reads.append((a, b)) or full[a:b])
    out = to_canonical(hf_tables.BERT_ROWS, {"encoder.layer.0.attention.self.query.weight": lazy},
                       context=Context(num_attention_heads=3))
    assert reads == []
    np.testing.assert_array_equal(out["layers.0.attention.heads.1.q.weight"].read(), full[2:4])
    assert reads == [(2, 4)]
    back = from_canonical(hf_tables.BERT_ROWS, out, context=Context(num_attention_heads=3))
    assert reads == [(2, 4)]  # joining again reads nothing until it is read
    np.testing.assert_array_equal(back["encoder.layer.0.attention.self.query.weight"].read(), full)
    experts = np.arange(24.0).reshape(3, 2, 4)  # a lazy stacked tensor taken apart: each expert its own rows
    lazy = safetensors_io.Lazy(experts.shape, experts.dtype, lambda: experts, lambda a, b: experts[a:b])
    parts = from_canonical(hf_tables.MOE_ROWS[1:2], {"model.layers.0.mlp.experts.down_proj": lazy})
    for e in range(3):
        np.testing.assert_array_equal(parts[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].read(), experts[e])


# ------------------------------------------------------------------ all or nothing


def _experts(n=3, layers=1, skip=(), shape=lambda e, w: (4, 6)):
    return {f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight": RNG.normal(size=shape(e, w)).astype(np.float32)
            for i in range(layers) for e in range(n) for w in ("gate", "up", "down")
            if (i, e, w) not in skip}


def test_a_missing_expert_tensor_is_named_by_layer_and_expert():
    with pytest.raises(StateDictError) as error:
        to_canonical(hf_tables.MOE_ROWS, _experts(layers=2, skip={(1, 1, "up")}), context=Context(num_experts=3))
    assert error.value.missing == ["model.layers.1.mlp.experts.1.up_proj.weight"]


def test_experts_beyond_the_config_s_count_and_gaps_are_refused():
    with pytest.raises(StateDictError) as error:
        to_canonical(hf_tables.MOE_ROWS, _experts(n=4), context=Context(num_experts=3))
    assert set(error.value.unexpected) == {f"model.layers.0.mlp.experts.3.{w}_proj.weight" for w in ("gate", "up", "down")}
    state = {k: v for k, v in _experts(n=3).items() if ".experts.1." not in k}
    with pytest.raises(StateDictError) as error:  # no config: the indices must still run from 0 without a gap
        to_canonical(hf_tables.MOE_ROWS, state)
    assert set(error.value.missing) == {f"model.layers.0.mlp.experts.1.{w}_proj.weight" for w in ("gate", "up", "down")}


def test_an_expert_out_of_range_is_named_unexpected_and_the_rest_not_stacked():
    """Expert 3 of a 3-expert config (another model's, of another width): named as unexpected, and the group
    is not stacked with it (which would also report the in-range experts' equal shapes as mismatched)."""
    state = _experts(n=4, shape=lambda e, w: (5, 6) if e == 3 else (4, 6))
    with pytest.raises(StateDictError) as error:
        to_canonical(hf_tables.MOE_ROWS, state, context=Context(num_experts=3))
    assert set(error.value.unexpected) == {f"model.layers.0.mlp.experts.3.{w}_proj.weight" for w in ("gate", "up", "down")}
    assert error.value.missing == [] and error.value.mismatched == []


def test_a_file_with_both_the_fused_and_the_per_expert_layout_is_refused():
    state = _experts() | {"model.layers.0.mlp.experts.down_proj": np.zeros((3, 4, 6), np.float32)}
    with pytest.raises(StateDictError, match=r"model\.layers\.0\.mlp\.experts\.down_proj \(made twice"):
        to_canonical(hf_tables.MOE_ROWS, state, context=Context(num_experts=3))


def test_a_kept_unknown_key_that_a_row_also_makes_is_refused():
    state = {"layers.0.attention.output_linear.weight": np.zeros(2),  # already canonical: kept as it is
             "encoder.layer.0.attention.output.dense.weight": np.ones(2)}  # and made from the HF name
    with pytest.raises(StateDictError, match=r"layers\.0\.attention\.output_linear\.weight \(made twice"):
        to_canonical(hf_tables.BERT_ROWS, state)


def test_an_expert_of_another_shape_is_named_with_every_expert_s_shape():
    state = _experts(shape=lambda e, w: (5, 6) if (e, w) == (2, "gate") else (4, 6))
    with pytest.raises(StateDictError) as error:
        to_canonical(hf_tables.MOE_ROWS, state, context=Context(num_experts=3))
    assert error.value.mismatched == [("model.layers.0.mlp.experts.{e}.gate_proj.weight",
                                       "0: [4, 6], 1: [4, 6], 2: [5, 6]", "equal shapes")]


def test_coming_back_every_part_must_be_there_and_unknown_keys_are_refused():
    heads = {f"layers.0.attention.heads.{h}.q.weight": np.zeros((2, 6)) for h in (0, 2)}
    with pytest.raises(StateDictError) as error:
        from_canonical(hf_tables.BERT_ROWS, heads, context=Context(num_attention_heads=3))
    assert error.value.missing == ["layers.0.attention.heads.1.q.weight"]
    heads = {f"layers.0.attention.heads.{h}.q.bias": np.zeros(2) for h in (1, 2)}
    with pytest.raises(StateDictError) as error:  # no config: the heads must still start at 0
        from_canonical(hf_tables.BERT_ROWS, heads)
    assert error.value.missing == ["layers.0.attention.heads.0.q.bias"]
    with pytest.raises(ValueError, match="nothing.weight: no HuggingFace name"):
        from_canonical(hf_tables.BERT_ROWS, {"nothing.weight": np.zeros(1)}, format_name="HuggingFace")
    assert to_canonical(hf_tables.BERT_ROWS, {"nothing.weight": 1}) == {"nothing.weight": 1}  # for the strict load


def test_source_name_of_one_key():
    assert converter.source_name(hf_tables.BERT_ROWS, "layers.3.attention.output_linear.bias") == \
        "encoder.layer.3.attention.output.dense.bias"
    assert converter.source_name(hf_tables.BERT_ROWS, "layers.3.attention.heads.1.q.weight") is None  # a slice
    assert converter.source_name(hf_tables.BERT_ROWS, "layers.3.attention.heads.1.q.weight", whole=True) == \
        "encoder.layer.3.attention.self.query.weight"
    assert converter.source_name(hf_tables.MOE_ROWS, "model.layers.0.mlp.experts.down_proj") is None  # gathered


# ------------------------------------------------------------------ named-axis layouts


def test_layouts_move_axes_by_name():
    a = RNG.normal(size=(2, 3, 5))
    experts = Layout("e out in", "e in out")
    assert to_flax(experts, a).shape == (2, 5, 3)  # the expert axis stays first
    np.testing.assert_array_equal(to_torch(experts, to_flax(experts, a)), a)
    assert torch_shape(experts, (2, 5, 3)) == (2, 3, 5)
    assert to_flax(TRANSPOSE, a[0]).shape == (5, 3)
    with pytest.raises(ValueError, match="does not fit the layout"):
        to_flax(TRANSPOSE, a)  # a 3-d tensor is not a linear weight: refused, not reversed
    assert to_flax(CONV, RNG.normal(size=(8, 4, 3))).shape == (3, 4, 8)  # (out, in, w) -> (w, in, out)
    conv2d = RNG.normal(size=(8, 4, 3, 2))  # (out, in, h, w): a permutation that is not its own inverse
    assert to_flax(CONV, conv2d).shape == (3, 2, 4, 8)
    np.testing.assert_array_equal(to_torch(CONV, to_flax(CONV, conv2d)), conv2d)
    assert torch_shape(CONV, (3, 2, 4, 8)) == (8, 4, 3, 2)
    assert to_flax(AS_IS, a).shape == a.shape and to_flax(AS_IS, np.float32(1)).shape == ()


# ------------------------------------------------------------------ transformers 5's MoE formats

MOE_CONFIGS = {
    "qwen2_moe": (hf_tables.MOE_ROWS, lambda: transformers.Qwen2MoeConfig(
        num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
        intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=3)),
    "qwen3_moe": (hf_tables.MOE_ROWS, lambda: transformers.Qwen3MoeConfig(
        num_experts=5, num_experts_per_tok=3, moe_intermediate_size=8, intermediate_size=16, mlp_only_layers=[1],
        num_hidden_layers=2)),
    "olmoe": (hf_tables.MOE_ROWS, lambda: transformers.OlmoeConfig(
        num_experts=3, num_experts_per_tok=1, intermediate_size=8, num_hidden_layers=2)),
    "mixtral": (hf_tables.MIXTRAL_ROWS, lambda: transformers.MixtralConfig(
        num_local_experts=3, num_experts_per_tok=2, intermediate_size=8, num_hidden_layers=2)),
}


@pytest.mark.parametrize("kind", MOE_CONFIGS)
def test_moe_files_read_as_transformers_holds_them_and_write_as_it_saves_them(kind, tmp_path):
    """A random model's ``save_pretrained`` folder (per expert) converts to its in-memory state_dict
    (fused) exactly, and that state_dict converts back to the folder's tensors exactly; a folder of
    the fused tensors reads the same."""
    rows, make = MOE_CONFIGS[kind]
    config = make()
    config.update(dict(vocab_size=32, hidden_size=16, num_attention_heads=2, num_key_value_heads=1))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "hf")
    disk = {k: safetensors_io.read(v) for k, v in safetensors_io.open_weights(tmp_path / "hf").items()}
    memory = {k: v.numpy() for k, v in model.state_dict().items()}
    assert any(".experts.0." in k for k in disk) and any(k.endswith("experts.gate_up_proj") for k in memory)
    canonical = to_canonical(rows, disk, config=config)
    assert set(canonical) == set(memory)
    for key, value in memory.items():
        np.testing.assert_array_equal(canonical[key], value, err_msg=key)
    back = from_canonical(rows, memory, config=config)
    assert set(back) == set(disk)
    for key, value in disk.items():
        np.testing.assert_array_equal(safetensors_io.read(back[key]), value, err_msg=key)
    fused = to_canonical(rows, memory, config=config)  # a file of transformers' in-memory layout
    assert all(np.array_equal(fused[k], v) for k, v in memory.items())


def test_mxfp4_dequantises_as_transformers_and_quantises_back_exactly():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = RNG.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)  # (E, N, G, B): K = 2 * 16 * 2 = 64
    scales = RNG.integers(118, 134, (3, 8, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    ours = to_canonical(hf_tables.GPT_OSS_MXFP4_ROWS, {"model.layers.0.mlp.experts.down_proj_blocks": blocks,
                                                      "model.layers.0.mlp.experts.down_proj_scales": scales})
    weight = ours["model.layers.0.mlp.experts.down_proj"]
    assert weight.dtype == ml_dtypes.bfloat16 and weight.shape == (3, 64, 8)
    np.testing.assert_array_equal(weight.astype(np.float32), theirs.float().numpy())
    again = mxfp4_dequantise(*mxfp4_quantise(weight))  # another encoding may be chosen, never another value
    np.testing.assert_array_equal(again.astype(np.float32), weight.astype(np.float32))
    back = from_canonical(hf_tables.GPT_OSS_MXFP4_ROWS, ours)
    assert back["model.layers.0.mlp.experts.down_proj_blocks"].shape == blocks.shape
    np.testing.assert_array_equal(to_canonical(hf_tables.GPT_OSS_MXFP4_ROWS, back)[
        "model.layers.0.mlp.experts.down_proj"].astype(np.float32), weight.astype(np.float32))


def test_fp8_blocks_dequantise_as_transformers_with_partial_edge_tiles():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = RNG.normal(size=(130, 200)).astype(ml_dtypes.float8_e4m3fn)  # tiles (2, 2), the last ones partial
    scale = RNG.uniform(0.5, 2.0, (2, 2)).astype(np.float32)
    row = Row(("w.weight", "w.weight_scale_inv"), "w.weight", (FP8Blocks(128),))
    ours = to_canonical([row], {"w.weight": weight, "w.weight_scale_inv": scale})["w.weight"]
    theirs = _dequantize_fp8_weight(torch.from_numpy(weight.view(np.uint8)).view(torch.float8_e4m3fn),
                                    torch.from_numpy(scale), [128, 128], torch.float32)
    np.testing.assert_array_equal(ours, theirs.numpy())
    back = from_canonical([row], {"w.weight": ours})
    assert back["w.weight_scale_inv"].shape == (2, 2)
    again = to_canonical([row], back)["w.weight"]
    assert np.abs(again - ours).max() <= np.abs(ours).max() * 2 ** -3  # float8 keeps 3 mantissa bits
    exact = {"w.weight": RNG.normal(size=(256, 128)).astype(ml_dtypes.float8_e4m3fn),  # whole tiles only
             "w.weight_scale_inv": np.full((2, 1), 0.5, np.float32)}
    assert to_canonical([row], exact)["w.weight"].shape == (256, 128)
    with pytest.raises(StateDictError, match=r"scale \[3, 2\]"):
        to_canonical([row], exact | {"w.weight_scale_inv": np.ones((3, 2), np.float32)})
