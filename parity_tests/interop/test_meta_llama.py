"""Meta's original llama layout (issue 24 item 3): a folder of ``consolidated.NN.pth`` + ``params.json``
read by ``hf.from_pretrained``, ``hf.torch_from_pretrained`` and ``flax-transformer port``.

The folders are written here from a random tiny transformers ``LlamaForCausalLM`` (GQA: 4 query heads,
2 key/value heads of width 16; Llama 3.1's RoPE scaling; an MLP width from ``multiple_of`` and
``ffn_dim_multiplier``), its weights perturbed so that no norm is all ones. The writer is this file's
own (``meta_files``): it moves each head's q/k rows back to Meta's interleaved RoPE order and splits
tensors over model-parallel shards as Meta's code does. So that the writer and the reader cannot
share a mistake, ``meta_forward`` runs Meta's own forward pass (complex rotation of adjacent pairs)
on the written tensors and must give transformers' logits: the files are Meta's layout. Logits are
compared at positions 0.. and around 8,000 (where RoPE's angles are large and llama3's scaling
matters), at 1e-5 in fp32 (TOL).
"""

import copy
import json
import math

import numpy as np
import pytest
import torch

from flax_transformer.cli.commands import main
from flax_transformer.interop import converter_ops, hf, meta_llama
from flax_transformer.verification import verify
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

PARAMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, ffn_dim_multiplier=1.3,
              norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True)
INTERMEDIATE = 224  # Meta's FeedForward: 32 * ceil(int(1.3 * int(8 * 64 / 3)) / 32) = 32 * ceil(221 / 32)
LLAMA31 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
# Meta's split of each tensor over model-parallel shards: the axis, or None for a copy in each shard
SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "attention_norm": None,
         "ffn_norm": None, "norm": None}


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=INTERMEDIATE, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters=LLAMA31,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model


def to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' half-split q/k rows (x0, x1, ..., y0, y1, ...) per head -> Meta's (x0, y0, x1, y1, ...)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)  # (h, d/2, 2, in)


def meta_state(model) -> dict[str, torch.Tensor]:
    """A transformers Llama's weights under Meta's names and RoPE layout (one shard)."""
    sd, c = model.state_dict(), model.config
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out |= {f"layers.{i}.attention.wq.weight": to_interleaved(sd[a + "q_proj.weight"], c.num_attention_heads),
                f"layers.{i}.attention.wk.weight": to_interleaved(sd[a + "k_proj.weight"], c.num_key_value_heads),
                f"layers.{i}.attention.wv.weight": sd[a + "v_proj.weight"],
                f"layers.{i}.attention.wo.weight": sd[a + "o_proj.weight"],
                f"layers.{i}.feed_forward.w1.weight": sd[m + "gate_proj.weight"],
                f"layers.{i}.feed_forward.w2.weight": sd[m + "down_proj.weight"],
                f"layers.{i}.feed_forward.w3.weight": sd[m + "up_proj.weight"],
                f"layers.{i}.attention_norm.weight": sd[f"model.layers.{i}.input_layernorm.weight"],
                f"layers.{i}.ffn_norm.weight": sd[f"model.layers.{i}.post_attention_layernorm.weight"]}
    return out


def meta_files(folder, state, shards=1, embedding_axis=0, params=None):
    """Write ``state`` (Meta's names) as ``consolidated.NN.pth`` shards + ``params.json``: each tensor cut
    as Meta's model-parallel layers cut it (the embedding along ``embedding_axis``: 0 as Llama 3's
    VocabParallelEmbedding, 1 as Llama 1/2's ParallelEmbedding), copies cloned."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = [{} for _ in range(shards)]
    for key, value in state.items():
        name = "tok_embeddings" if key.startswith("tok_") else key.split(".")[-2]
        axis = embedding_axis if name == "tok_embeddings" else SPLIT[name]
        pieces = [value] * shards if axis is None else torch.chunk(value, shards, dim=axis)
        for part, piece in zip(parts, pieces, strict=True):
            part[key] = piece.clone()
    for n, part in enumerate(parts):
        torch.save(part, folder / f"consolidated.{n:02d}.pth")
    (folder / "params.json").write_text(json.dumps(params or PARAMS))
    return folder


def meta_forward(state, config, ids, positions, inv_freq):
    """Meta's llama forward (its model.py: RMSNorm, complex RoPE on adjacent pairs, repeat_kv, SwiGLU) in fp32,
    on Meta's names, with transformers' inverse frequencies (so that only the layout can differ)."""
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    hd, (b, t) = dim // heads, ids.shape

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    def rope(x):  # (b, t, h, hd): pairs (2j, 2j+1) are a complex number, turned by position * frequency
        cis = torch.polar(torch.ones(t, hd // 2), torch.outer(positions.float(), inv_freq))
        x = torch.view_as_complex(x.reshape(b, t, -1, hd // 2, 2))
        return torch.view_as_real(x * cis[None, :, None, :]).flatten(3)

    h = state["tok_embeddings.weight"][ids]
    causal = torch.full((t, t), float("-inf")).triu(1)
    for i in range(config.num_hidden_layers):
        w = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        x = rms(h, w["attention_norm.weight"])
        q = rope((x @ w["attention.wq.weight"].T).view(b, t, heads, hd))
        k = rope((x @ w["attention.wk.weight"].T).view(b, t, kv, hd)).repeat_interleave(heads // kv, dim=2)
        v = (x @ w["attention.wv.weight"].T).view(b, t, kv, hd).repeat_interleave(heads // kv, dim=2)
        scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(2, 3) / math.sqrt(hd) + causal  # (b, h, t, t)
        out = (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, dim)
        h = h + out @ w["attention.wo.weight"].T
        x = rms(h, w["ffn_norm.weight"])
        gated = torch.nn.functional.silu(x @ w["feed_forward.w1.weight"].T) * (x @ w["feed_forward.w3.weight"].T)
        h = h + gated @ w["feed_forward.w2.weight"].T
    return (rms(h, state["norm.weight"]) @ state["output.weight"].T).numpy()


IDS = np.random.default_rng(0).integers(0, 96, size=(2, 12))
STARTS = (0, 8185)  # positions 0..11, and 8185..8196 (across llama3's original context of 8192)


def _positions(start):
    return np.broadcast_to(np.arange(start, start + IDS.shape[1]), IDS.shape).copy()


def _transformers_logits(model, start):
    with torch.no_grad():
        return model(torch.from_numpy(IDS), position_ids=torch.from_numpy(_positions(start))).logits.numpy()


def _logits(model, start) -> np.ndarray:
    """Logits of a torch_reference or Flax (jitted) llama at positions start.."""
    ids, positions = IDS, _positions(start)
    if isinstance(model, torch.nn.Module):
        with torch.no_grad():
            return model(torch.from_numpy(ids), position_ids=torch.from_numpy(positions)).float().numpy()
    return np.asarray(verify.flax_module_call(model, ids, None, positions), np.float32)


def _err(a, b) -> float:
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module")
def want(reference):
    return {start: _transformers_logits(reference, start) for start in STARTS}


def test_the_writer_writes_metas_layout(reference, want):
    """Meta's own forward pass on the written tensors computes transformers' logits: the test's files are
    Meta's layout, not a mirror of the reader's (and without the interleaving they are not)."""
    state, inv_freq = meta_state(reference), reference.model.rotary_emb.inv_freq.float()
    for start in STARTS:
        assert _err(meta_forward(state, reference.config, torch.from_numpy(IDS), torch.arange(start, start + 12),
                                 inv_freq), want[start]) <= TOL
    plain = dict(state)  # transformers' q/k rows as they are: Meta's forward computes something else
    for i in range(2):
        for name in ("q", "k"):
            plain[f"layers.{i}.attention.w{name}.weight"] = reference.state_dict()[
                f"model.layers.{i}.self_attn.{name}_proj.weight"]
    assert _err(meta_forward(plain, reference.config, torch.from_numpy(IDS), torch.arange(8185, 8197), inv_freq),
                want[8185]) > 1e-2


@pytest.mark.parametrize("shards, embedding_axis", [(1, 0), (2, 0), (2, 1)],
                         ids=["one-shard", "two-shards-vocab-split", "two-shards-feature-split-vocab-minus-1"])
def test_meta_folder_imports(reference, want, tmp_path, shards, embedding_axis):
    """One shard, two shards with the embedding split as Llama 3 splits it (rows), and two as Llama 1/2
    split it (columns, with their ``vocab_size: -1``): the Flax model and the torch twin give
    transformers' logits at 1e-5, at positions 0.. and 8185.."""
    params = PARAMS if embedding_axis == 0 else {**PARAMS, "vocab_size": -1}
    folder = meta_files(tmp_path / "meta", meta_state(reference), shards, embedding_axis, params)
    flax_model, torch_model = hf.from_pretrained(folder), hf.torch_from_pretrained(folder)
    config = flax_model.config
    assert (config.vocab_size, config.intermediate_size, config.num_key_value_heads) == (96, INTERMEDIATE, 2)
    assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.original_max_position_embeddings == 8192
    for start in STARTS:
        assert _err(_logits(flax_model, start), want[start]) <= TOL
        assert _err(_logits(torch_model, start), want[start]) <= TOL


def test_bf16_shards(reference, tmp_path):
    """Meta's releases are bf16: read into float32 parameters exactly, they give the logits of transformers'
    model with the same bf16-rounded weights at 1e-5."""
    state = {k: v.bfloat16() for k, v in meta_state(reference).items()}
    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    model = hf.from_pretrained(meta_files(tmp_path / "meta", state, shards=2))
    assert _err(_logits(model, 8185), _transformers_logits(rounded, 8185)) <= TOL


@pytest.mark.parametrize("bug", ["no permutation", "the inverse", "k per query head"])
def test_a_wrong_permutation_is_caught(reference, want, tmp_path, monkeypatch, bug):
    """The comparison above fails on each planted mistake in the q/k permutation: none, its inverse
    (head width 16, so the inverse is another permutation), or wk's rows grouped by query heads
    instead of key/value heads (GQA)."""
    if bug == "no permutation":
        monkeypatch.setattr(converter_ops, "interleaved_to_half_split", lambda w, heads: w)
    elif bug == "the inverse":
        def inverse(w, heads):  # half split -> interleaved
            rows, cols = w.shape
            return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
        monkeypatch.setattr(converter_ops, "interleaved_to_half_split", inverse)
    else:
        monkeypatch.setattr(meta_llama.ROPE_K, "heads", "num_attention_heads")
    folder = meta_files(tmp_path / "meta", meta_state(reference))
    assert _err(_logits(hf.torch_from_pretrained(folder), 8185), want[8185]) > 1e-2


def test_port_to_an_hf_folder(reference, want, tmp_path, capsys):
    """``flax-transformer port META_FOLDER DST``: an HF folder transformers loads with nothing missing or
    unexpected, computing the reference's logits; the export is certified (verification.json)."""
    folder = meta_files(tmp_path / "meta", meta_state(reference), shards=2)
    assert main(["port", str(folder), str(tmp_path / "hf")]) == 0, capsys.readouterr()
    assert (tmp_path / "hf" / "verification.json").is_file()
    again, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}
    for start in STARTS:
        assert _err(_transformers_logits(again.eval(), start), want[start]) <= TOL


def _refused(capsys, folder, tmp_path) -> str:
    """The CLI's port of ``folder``: exit 2, one line on stderr, no traceback; the line."""
    assert main(["port", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    return err


class Code:
    """A pickled object whose unpickling calls a function: what weights_only refuses."""

    def __reduce__(self):
        return (print, ("this ran while unpickling",))


@pytest.mark.parametrize("theta, scaled, positions, release", [
    (500000.0, True, 131072, "Llama 3.1: llama3-scaled RoPE"),
    (500000.0, False, 8192, "Llama 3: theta 500000, RoPE unscaled"),
    (1000000.0, False, 16384, "Code Llama: theta 1e6"),
    (10000.0, False, 4096, "Llama 2"),
    (None, False, 4096, "Llama 1/2 without rope_theta"),
])
def test_the_context_each_release_was_trained_for(theta, scaled, positions, release):
    """params.json does not say the context; it follows from the RoPE fields as transformers' converter chose it."""
    params = {k: v for k, v in {**PARAMS, "rope_theta": theta, "use_scaled_rope": scaled}.items() if v is not None}
    config = meta_llama.config_of(params, 96, "params.json")
    assert config.max_position_embeddings == positions, release
    assert (config.rope_scaling is not None) is scaled, release


def test_refusals(reference, tmp_path, capsys):
    """Each in one line (exit 2 on the command line, before anything is written): no params.json; a shard
    without a tensor the others have; replicated norms that differ between shards; a pickle with code;
    an MLP width that params.json does not give; a params.json field this model does not compute."""
    state = meta_state(reference)
    folder = meta_files(tmp_path / "no-params", state)
    (folder / "params.json").unlink()
    assert "no params.json" in _refused(capsys, folder, tmp_path)

    folder = meta_files(tmp_path / "half", state, shards=2)
    half = torch.load(folder / "consolidated.01.pth", weights_only=True)
    del half["layers.1.feed_forward.w3.weight"]
    torch.save(half, folder / "consolidated.01.pth")
    err = _refused(capsys, folder, tmp_path)
    assert "missing (1): layers.1.feed_forward.w3.weight (consolidated.01.pth)" in err

    folder = meta_files(tmp_path / "norms", state, shards=2)
    other = torch.load(folder / "consolidated.01.pth", weights_only=True)
    other["layers.0.ffn_norm.weight"][3] += 1e-3
    torch.save(other, folder / "consolidated.01.pth")
    err = _refused(capsys, folder, tmp_path)
    assert "layers.0.ffn_norm.weight differs in consolidated.01.pth from consolidated.00.pth" in err

    folder = meta_files(tmp_path / "code", state)
    torch.save({**state, "evil": Code()}, folder / "consolidated.00.pth")
    err = _refused(capsys, folder, tmp_path)
    assert "refusing to load" in err and "weights_only=True" in err and "this ran" not in capsys.readouterr().out

    folder = meta_files(tmp_path / "width", state, params={**PARAMS, "multiple_of": 64})  # 256 wide, not 224
    err = _refused(capsys, folder, tmp_path)
    assert "layers.0.feed_forward.w1.weight [224, 64] vs [256, 64]" in err and "MLP width 256" in err

    folder = meta_files(tmp_path / "moe", state, params={**PARAMS, "moe_args": {"num_experts": 16}})
    assert "fields this llama model does not compute: moe_args" in _refused(capsys, folder, tmp_path)

    with pytest.raises(meta_llama.MetaLayoutError) as error:  # the library's own error lists every key
        hf.from_pretrained(meta_files(tmp_path / "half2", {k: v for k, v in state.items() if "layers.1." not in k}))
    assert len(error.value.missing) == 9 and str(error.value).count("\n") == 0
