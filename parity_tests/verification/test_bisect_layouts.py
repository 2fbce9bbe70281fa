"""``bisect`` through a known permutation (issue 36 item 5): Meta's reference llama (its ``model.py``:
``tok_embeddings``, ``layers.N.attention.wq``, complex RoPE on adjacent pairs) against the llama
family's Flax model of the same weights. Meta's ``wq``/``wk`` hold each head's features interleaved,
transformers' (and the Flax model's) half split: the outputs agree, and without being told, ``bisect``
read the permuted query as a divergence at ``wq``. ``layouts.meta_llama(config)`` (the porting table's
RoPE rule) compares through it, forward and gradients; a port that forgot the permutation is named at ``wq``.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from flax_transformer.interop import hf
from flax_transformer.interop.converter_ops import half_split_to_interleaved
from flax_transformer.verification import bisect, layouts

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")
IDS = np.random.default_rng(0).integers(0, 64, (2, 7))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):  # Meta's names and its RoPE: pairs (2j, 2j+1) of a head turned as complex numbers
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv, self.wo = nn.Linear(dim, kv_heads * self.hd, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape

        def rope(y, n):
            y = torch.view_as_complex(y.view(b, t, n, self.hd // 2, 2))
            return torch.view_as_real(y * freqs_cis[None, :, None, :]).flatten(3).to(x.dtype)

        q, k = rope(self.wq(x), self.heads), rope(self.wk(x), self.kv_heads)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd)
        k, v = (a.repeat_interleave(self.heads // self.kv_heads, dim=2).transpose(1, 2) for a in (k, v))
        scores = q.transpose(1, 2) @ k.transpose(2, 3) / math.sqrt(self.hd)
        scores = scores + torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
        self.feed_forward = FeedForward(c.hidden_size, c.intermediate_size)
        self.attention_norm, self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps), RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(c) for _ in range(c.num_hidden_layers))
        self.norm, self.output = RMSNorm(c.hidden_size, c.rms_norm_eps), nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.hd, self.theta = c.hidden_size // c.num_attention_heads, 10000.0  # the config's rope_theta

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.outer(torch.arange(tokens.shape[1], dtype=torch.float64), freqs)
        freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex128 if h.dtype == torch.float64
                                                                      else torch.complex64)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Meta's model and the Flax model of one transformers Llama's weights (Meta's layout made from it)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    flax_model = hf.from_pretrained(folder)
    meta = Transformer(config).eval()
    rename = layouts.meta_llama(flax_model.config)["rename"]
    theirs = {}
    for key, value in model.state_dict().items():
        if "rotary" in key:
            continue
        name = next(k for k in (f"{m}.weight" for m in _meta_modules(meta)) if _renamed(k, rename) == key)
        heads = {"wq": config.num_attention_heads, "wk": config.num_key_value_heads}.get(name.split(".")[-2])
        theirs[name] = half_split_to_interleaved(value, heads) if heads else value
    meta.load_state_dict(theirs, strict=True)
    return meta, flax_model


def _meta_modules(meta):
    return [name for name, m in meta.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _renamed(key, rename):
    import re

    for pattern, to in rename:
        key = re.sub(pattern, to, key)
    return key


def test_meta_reference_bisects_through_the_rope_permutation(pair):
    meta, flax_model = pair
    known = layouts.meta_llama(flax_model.config)
    report = bisect.bisect(meta, flax_model, (IDS,), grads=True, **known)
    assert report.passed, report.tree()
    rows = {r.path: r for r in report.rows}
    assert rows["layers.0.attention.wq"].note.startswith("compared through Meta's RoPE order")
    assert rows["layers.0.attention.wq"].jax_err <= rows["layers.0.attention.wq"].budget
    told_nothing = bisect.bisect(meta, flax_model, (IDS,), rename=known["rename"])  # outputs agree, wq does not
    assert rows[""].status == "ok" and told_nothing.first_divergent == "layers.0.attention.wq", told_nothing.summary()


def test_a_port_that_forgot_the_permutation_is_named_at_wq(pair):
    from flax import nnx

    meta, flax_model = pair
    forgot = nnx.clone(flax_model)
    q = forgot.model.layers[0].self_attn.q_proj.kernel  # (in, out): Meta's interleaved rows copied as they are
    q.set_value(half_split_to_interleaved(np.asarray(q[...]).T, 2).T)
    report = bisect.bisect(meta, forgot, (IDS,), **layouts.meta_llama(forgot.config))
    assert report.first_divergent == "layers.0.attention.wq", report.summary()
    wq = next(r for r in report.rows if r.path == "layers.0.attention.wq")  # rerun alone through the permutation too
    assert wq.status == "introduced" and wq.local_jax_err > wq.local_torch_err * 10, wq


def test_features_that_are_not_whole_rope_pairs_are_not_permuted():
    assert layouts.to_rope_order(np.zeros((2, 16)), 16, -1) is None  # 16 features: 16 heads of one, no pairs
    assert layouts.to_rope_order(np.arange(8.0)[None], 2, -1).tolist() == [[0, 2, 1, 3, 4, 6, 5, 7]]


def test_permutations_are_checked_before_any_work(pair):
    meta, flax_model = pair
    with pytest.raises(ValueError, match=r"permutations\[0\] must be"):
        bisect.bisect(meta, flax_model, (IDS,), permutations=[("wq", 0)])


# ------------------------------------------------ probe 2's survivors (#11 #12 #13): the layouts' pure functions


@pytest.mark.parametrize("ndim", [3, 4])
def test_to_torch_layout_moves_channels_last_to_torchs_channels_first(ndim):
    """Mutants #11 (``a.ndim > 3``: a 1-d convolution's (b, t, c) left as it is) and #12 (the forward
    axes for their inverse: a 2-d map's (b, h, w, c) read as (b, w, c, h)). Shapes all distinct."""
    torch_side = np.arange(np.prod((2, 3, 4, 5)[:ndim]), dtype=np.float32).reshape((2, 3, 4, 5)[:ndim])  # (b, c, ...)
    flax_side = np.moveaxis(torch_side, 1, -1)  # (b, ..., c)
    np.testing.assert_array_equal(layouts.to_torch_layout(flax_side, torch_side.shape, True), torch_side)
    assert layouts.to_torch_layout(flax_side, torch_side.shape, False) is None  # not moved: not torch's shape


def test_permuted_heads_takes_the_whole_path_only():
    """Mutant #13: ``match`` for ``fullmatch``: the pattern of ``a.wq`` also took ``a.wq.lora``'s module."""
    permutations = layouts.check_permutations([(r"a\.wq", 2)])
    assert layouts.permuted_heads("a.wq", permutations) == 2
    assert layouts.permuted_heads("a.wq.lora", permutations) is None
