"""Cross-framework verification: every module of every family, torch vs Flax.

``run()`` builds each module with random weights in one framework, ports it to the
other, runs both in eval mode on the same random inputs (with no mask, a padding
mask, a causal mask, both, and a row whose keys are all masked) and reports the
largest absolute difference, and JAX's error against a float64 torch copy with its budget
(``compare``; NaN or inf never passes). ``flax-transformer verify`` prints the table.

One comparison of any pair is ``compare.compare`` (a ``CompareReport``, gradients too with
``grads=True``); ``bisect.bisect`` finds the first submodule where a pair diverges;
``generation_bisect.bisect_generation`` the first step of greedy decoding that does.

torch is imported here at call time only (this is a verification module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.verification import llama_specs
from flax_transformer.verification.compare import compare
from flax_transformer.verification.frameworks import apply as apply_compiled
from flax_transformer.verification.frameworks import max_abs_err, to_numpy
from flax_transformer.verification.reports import TOLERANCE, Row, grads_row
from flax_transformer.verification.spec import Spec, floats, ids

# ------------------------------------------------------------------ inputs


def padding_mask(rng: np.random.Generator, b: int, t: int, *, empty_row: bool = True, left: bool = False) -> np.ndarray:
    """(b, t) of 1 = token / 0 = pad with random lengths; row 0 has no token at all if asked."""
    lengths = rng.integers(1, t + 1, size=b)
    positions = np.arange(t)[None, :]
    mask = positions >= (t - lengths[:, None]) if left else positions < lengths[:, None]
    mask = mask.astype(np.int64)
    if empty_row and b > 1:
        mask[0] = 0
    return mask


MASK_CASES = ("none", "padding", "causal", "causal+padding", "fully-masked-row")


def _mask_for(case: str, rng, b, t):
    """The padding mask for a case, and whether the module must be causal."""
    causal = case.startswith("causal")
    if case == "none" or case == "causal":
        return None, causal
    if case == "padding":
        return padding_mask(rng, b, t, empty_row=False), causal
    if case == "causal+padding":
        # left padding: the first query of a padded row sees only padding -> a fully masked row
        return padding_mask(rng, b, t, empty_row=False, left=True), causal
    return padding_mask(rng, b, t, empty_row=True), causal  # fully-masked-row


# ------------------------------------------------------------------- specs


def full_mask(padding: np.ndarray | None, b: int, t: int, causal: bool) -> np.ndarray | None:
    """(b, t, t) bool: padding of the keys and, if causal, no look-ahead."""
    if padding is None and not causal:
        return None
    keys = np.ones((b, t), bool) if padding is None else padding.astype(bool)
    mask = np.broadcast_to(keys[:, None, :], (b, t, t))
    return mask & np.tril(np.ones((t, t), bool)) if causal else mask.copy()


def specs(b: int = 3, t: int = 7) -> list[Spec]:
    """The modules ``verify`` covers, at attention, block and model level."""
    from flax_transformer.models.configs import EncoderConfig, GPTConfig
    from torch_reference import classic as tc
    from torch_reference import encoder as te
    from torch_reference import former as tf
    from torch_reference import gpt as tg

    emb, heads, vocab, seq = 24, 4, 50, 16
    attention_cases = MASK_CASES
    model_cases = ("none", "padding", "fully-masked-row")
    causal_cases = ("causal", "causal+padding", "fully-masked-row")
    enc = dict(causal_via_mask=True)
    x_in = lambda rng, m: ((floats(rng, b, t, emb), m), {})  # noqa: E731
    ids_in = lambda rng, m: ((ids(rng, vocab, b, t), m), {})  # noqa: E731
    cfg = EncoderConfig.tiny(vocab_size=vocab, hidden_size=emb, num_attention_heads=heads, max_position_embeddings=seq)
    post_ln = dataclasses.replace(cfg, norm_first=False)
    bert = EncoderConfig.bert(dataclasses.asdict(cfg))
    gpt2 = GPTConfig.tiny(vocab_size=vocab, n_positions=seq, n_embd=emb, n_head=heads)
    return [
        Spec("former", "MHSelfAttention", lambda c: tf.MHSelfAttention(emb, heads, causal=c), x_in, attention_cases),
        Spec("former", "MHSelfAttention(scale=head)",
             lambda c: tf.MHSelfAttention(emb, heads, causal=c, scale="head"), x_in, attention_cases),
        Spec("former", "SelfAttention", lambda c: tf.SelfAttention(emb, heads, causal=c), x_in, attention_cases),
        Spec("former", "TransformerBlock", lambda c: tf.TransformerBlock(emb, heads, c, seq), x_in, attention_cases),
        Spec("former", "TransformerBlock(wide)",
             lambda c: tf.TransformerBlock(emb, heads, c, seq, attention="wide"), x_in, attention_cases),
        Spec("former", "CTransformer(max)", lambda c: tf.CTransformer(emb, heads, 2, seq, vocab, 3), ids_in, model_cases),
        Spec("former", "CTransformer(mean)",
             lambda c: tf.CTransformer(emb, heads, 2, seq, vocab, 3, max_pool=False), ids_in, model_cases),
        Spec("former", "GTransformer",
             lambda c: tf.GTransformer(emb, heads, 2, seq, vocab, attention=("narrow", "wide")), ids_in, model_cases),
        Spec("encoder", "AttentionHead", lambda c: te.AttentionHead(emb, emb // heads),
             x_in, attention_cases, **enc),
        Spec("encoder", "MultiHeadAttention", lambda c: te.MultiHeadAttention(cfg),
             x_in, attention_cases, **enc),
        Spec("encoder", "FeedForward", lambda c: te.FeedForward(cfg), lambda rng, m: ((floats(rng, b, t, emb),), {}),
             ("none",)),
        Spec("encoder", "TransformerEncoderLayer", lambda c: te.TransformerEncoderLayer(cfg),
             x_in, attention_cases, **enc),
        Spec("encoder", "TransformerEncoderLayer(post-LN)", lambda c: te.TransformerEncoderLayer(post_ln),
             x_in, attention_cases, **enc),
        Spec("encoder", "Embeddings", lambda c: te.Embeddings(cfg), lambda rng, m: ((ids(rng, vocab, b, t),), {}),
             ("none",)),
        Spec("encoder", "TransformerEncoder", lambda c: te.TransformerEncoder(cfg), ids_in, model_cases),
        Spec("encoder", "TransformerForSequenceClassification",
             lambda c: te.TransformerForSequenceClassification(cfg), ids_in, model_cases),
        Spec("encoder", "TransformerForSequenceClassification(post-LN)",
             lambda c: te.TransformerForSequenceClassification(post_ln), ids_in, model_cases),
        # gpt: attention_mask (b, t), 1 = token; the GPT attentions are always causal
        Spec("gpt", "Attention", lambda c: tg.Attention(emb), x_in, model_cases),
        Spec("gpt", "GPTAttention", lambda c: tg.GPTAttention(emb), x_in, causal_cases),
        Spec("gpt", "GPTMHAttention", lambda c: tg.GPTMHAttention(emb, heads), x_in, causal_cases),
        Spec("gpt", "TransformerLayer", lambda c: tg.TransformerLayer(emb, 2 * emb), x_in, model_cases),
        Spec("gpt", "GPTTransformerLayer", lambda c: tg.GPTTransformerLayer(emb, 2 * emb), x_in, causal_cases),
        Spec("gpt", "GPTMHTransformerLayer", lambda c: tg.GPTMHTransformerLayer(emb, 2 * emb, heads), x_in,
             causal_cases),
        Spec("gpt", "GPTTransformer", lambda c: tg.GPTTransformer(2, emb, 2 * emb, heads, vocab, seq), ids_in,
             causal_cases),
        # classic: attention masks are True = masked out (the notebook's convention)
        Spec("classic", "MultiHeadAttention", lambda c: tc.MultiHeadAttention(emb, emb // heads, heads),
             lambda rng, m: (_self_att(rng, m), {}), attention_cases, **enc),
        Spec("classic", "EncoderBlock", lambda c: tc.EncoderBlock(emb, emb // heads, 2 * emb, heads),
             lambda rng, m: ((floats(rng, b, t, emb), _masked_out(m)), {}), attention_cases, **enc),
        Spec("classic", "DecoderBlock", lambda c: tc.DecoderBlock(emb, emb // heads, 2 * emb, heads),
             lambda rng, m: (_decoder_block_inputs(rng, m, b, t, emb), {}), model_cases),
        Spec("classic", "TransformerEncoder", lambda c: tc.TransformerEncoder(2, emb, heads, 2 * emb),
             lambda rng, m: ((floats(rng, b, t, emb), _masked_out(m)), {}), attention_cases, **enc),
        Spec("classic", "TransformerDecoder", lambda c: tc.TransformerDecoder(2, emb, emb // heads, 2 * emb, heads),
             lambda rng, m: (_decoder_block_inputs(rng, m, b, t, emb), {}), model_cases),
        Spec("classic", "Transformer", lambda c: tc.Transformer(vocab, vocab - 7, emb, heads, 2, 2 * emb, max_len=seq),
             lambda rng, m: (_seq2seq_inputs(rng, m, vocab, b, t), {}), model_cases),
        # HuggingFace shapes: BERT (post-LN, token types, pooler) and GPT-2 (pre-LN, tied head)
        Spec("encoder", "TransformerEncoder(BERT)", lambda c: te.TransformerEncoder(bert),
             lambda rng, m: ((ids(rng, vocab, b, t), m, rng.integers(0, 2, size=(b, t))), {}), model_cases),
        Spec("encoder", "TransformerForSequenceClassification(BERT)",  # [CLS] through the pooler: HF's
             lambda c: te.TransformerForSequenceClassification(bert), ids_in, model_cases),
        Spec("encoder", "TransformerForSequenceClassification(BERT, mean)",
             lambda c: te.TransformerForSequenceClassification(dataclasses.replace(bert, classifier_pooling="mean")),
             ids_in, model_cases),
        Spec("gpt", "GPT2LMHeadModel", lambda c: tg.GPT2LMHeadModel(gpt2), ids_in, ("none", "padding")),
        *llama_specs.llama_specs(b, t, emb, vocab),
        *llama_specs.moe_specs(b, t, emb, vocab),
        *llama_specs.gemma_specs(b, t, emb, vocab),
        *llama_specs.gpt_oss_specs(b, t, emb, vocab),
        *llama_specs.deepseek_specs(b, t, emb, vocab),
    ]


def _masked_out(keep):
    """This library's keep-mask -> the classic family's convention (True = masked out)."""
    return None if keep is None else ~keep


def _self_att(rng, keep):
    x = floats(rng, keep.shape[0] if keep is not None else 3, 7, 24)
    return x, x, x, _masked_out(keep)


def _decoder_block_inputs(rng, padding, b, t, emb):
    """Target states, encoder output (length t + 2), source padding and the causal target mask."""
    x, enc = floats(rng, b, t, emb), floats(rng, b, t + 2, emb)
    src = None if padding is None else np.concatenate([padding, np.ones((b, 2), padding.dtype)], 1) == 0
    tgt = np.triu(np.ones((t, t), bool), 1)[None]
    return x, enc, None if src is None else src[:, None, :], tgt


def _seq2seq_inputs(rng, padding, vocab, b, t):
    src = ids(rng, vocab, b, t)
    tgt = ids(rng, vocab - 7, b, t - 2)
    tgt_mask = None if padding is None else np.maximum(padding[:, : t - 2], np.eye(1, t - 2, dtype=padding.dtype))
    return src, tgt, padding, tgt_mask


def case_inputs(spec: Spec, case: str, seed: int, b: int = 3, t: int = 7):
    """(torch module, args, kwargs) for one spec and mask case, seeded (torch and numpy)."""
    import torch

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    mask, causal = _mask_for(case, rng, b, t)
    if spec.causal_via_mask:
        mask, causal = full_mask(mask, b, t, causal), False
    args, kwargs = spec.inputs(rng, mask)
    return spec.build(causal).eval(), args, kwargs


def run(*, seed: int = 0, use_jit: bool = True, families: tuple[str, ...] | None = None) -> Iterator[Row]:
    """Yield one Row per (module, mask case, direction), for all families or the ones named; for all
    of them, then the "lora" rows (LoRA vs peft, ``lora_rows.rows``)."""
    for i, spec in enumerate(specs()):
        if families and spec.family not in families:
            continue
        for case in spec.cases:
            torch_module, args, kwargs = case_inputs(spec, case, seed + i)
            for direction, report in both_directions(torch_module, args, kwargs, seed=seed + i, use_jit=use_jit,
                                                     reports=True):
                yield dataclasses.replace(report.rows[0], family=spec.family, module=spec.name, case=case,
                                          direction=direction)
    if not families:
        from flax_transformer.verification import lora_rows

        yield from lora_rows.rows(seed=seed)


def both_directions(torch_module, args: tuple, kwargs: dict | None = None, *, seed: int = 0, use_jit: bool = True,
                    reports: bool = False, tol: float = TOLERANCE):
    """Compare a torch module with its Flax twin both ways, in eval mode.

    torch->flax: the torch module's weights (perturbed, see ``NOISE``) ported to Flax.
    flax->torch: a Flax twin with weights of its own (``fresh_flax_twin``) ported to torch.

    Returns:
        [(direction, max abs err, all finite)] for the two directions; with ``reports=True``
        [(direction, ``CompareReport``)], whose ``passed`` is the whole verdict (the float64
        budget and non-finite values included; the abs error against ``tol``).
    """
    from flax_transformer.interop import porting

    torch_module.eval()
    perturb_torch(torch_module, seed)
    flax_module = porting.torch_to_flax(torch_module, seed=seed)
    results = [("torch->flax", compare(torch_module, flax_module, args, kwargs, use_jit=use_jit, tol=tol))]
    flax_module = fresh_flax_twin(torch_module, seed + 1)
    torch_twin = porting.flax_to_torch(flax_module)
    results.append(("flax->torch", compare(torch_twin, flax_module, args, kwargs, use_jit=use_jit, tol=tol)))
    return results if reports else [(direction, r.max_abs_err, r.finite) for direction, r in results]


# Fresh LayerNorms are exactly ones and zeros in both frameworks, and fresh biases
# are small: a porting bug in those leaves would hide. Noise on every parameter makes
# each one matter.
NOISE = 0.1


def fresh_flax_twin(torch_module, seed: int):
    """The Flax twin of ``torch_module`` with weights of its own, in eval mode, for the flax->torch
    direction: a fresh torch twin's initialisation (``torch.manual_seed(seed)``, the caller's torch RNG
    left as it was) ported over, then moved by numpy noise (``perturb_flax``). Built so, the twin
    records and compiles as the torch->flax one does (the two directions share one compiled program),
    and nothing is drawn in JAX, where each parameter shape compiles a program of its own."""
    import torch

    from flax_transformer.interop import porting

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(torch_module)(**torch_module.init_kwargs()).eval()
    flax_module = porting.torch_to_flax(fresh, seed=seed)
    flax_module.eval()
    perturb_flax(flax_module, seed)
    return flax_module


def perturb_torch(torch_module, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in torch_module.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=generator))


def perturb_flax(flax_module, seed: int) -> None:
    """The same noise on every Flax parameter, drawn in numpy: a JAX draw (and sum) compiles a program
    for each parameter shape, which cost a check of a small model more than the check itself."""
    generator = np.random.default_rng(seed)
    for _, variable in nnx.iter_graph(flax_module):
        if isinstance(variable, nnx.Param):
            value = variable[...]
            noisy = np.asarray(value, np.float32) + NOISE * generator.standard_normal(value.shape, np.float32)
            noisy = jnp.asarray(noisy.astype(value.dtype))  # uncommitted, as a fresh parameter is: one compile
            variable.set_value(jax.device_put(noisy, value.sharding) if len(value.sharding.device_set) > 1 else noisy)


# ------------------------------------------------------------------- gradients

# Full models, whose parameter gradients ``verify --grads`` compares.
MODELS = ("CTransformer(max)", "CTransformer(mean)", "GTransformer", "TransformerEncoder",
          "TransformerForSequenceClassification", "TransformerForSequenceClassification(post-LN)", "GPTTransformer",
          "Transformer", "TransformerEncoder(BERT)", "TransformerForSequenceClassification(BERT)",
          "TransformerForSequenceClassification(BERT, mean)", "GPT2LMHeadModel",
          "LlamaForCausalLM(untied, GQA, llama3 RoPE)", "LlamaForCausalLM(tied, Gemma)",
          "LlamaForCausalLM(Gemma 2: caps, sliding then full)",
          "LlamaForCausalLM(Gemma 3: local RoPE base, linear scaling on the full layer)",
          "LlamaForCausalLM(GPT-OSS: sinks, YaRN, sliding then full, top-2 of 4)",
          "LlamaForCausalLM(DeepSeek-V3: q_lora_rank, interleaved RoPE, dense then sparse)",
          "LlamaForCausalLM(DeepSeek-V3: q_proj, half-split RoPE, dense then sparse)")


def gradient_rows(*, seed: int = 0, families: tuple[str, ...] | None = None) -> Iterator[Row]:
    """One Row per (full model, mask case, direction): the worst relative parameter-gradient error."""
    from flax_transformer.interop import porting

    for i, spec in enumerate(specs()):
        if spec.name not in MODELS or (families and spec.family not in families):
            continue
        for case in spec.cases:
            torch_module, args, kwargs = case_inputs(spec, case, seed + i)
            perturb_torch(torch_module, seed + i)
            flax_module = porting.torch_to_flax(torch_module, seed=seed + i)
            report = compare(torch_module, flax_module, args, kwargs, grads=True, seed=seed + i)
            yield grads_row(report, spec.family, spec.name, case, "torch->flax grads")
            flax_module = fresh_flax_twin(torch_module, seed + i + 1)
            torch_twin = porting.flax_to_torch(flax_module).eval()
            report = compare(torch_twin, flax_module, args, kwargs, grads=True, seed=seed + i)
            yield grads_row(report, spec.family, spec.name, case, "flax->torch grads")


def checkpoint_rows(path, *, load=None) -> list[Row]:
    """Rows for one checkpoint: its torch twin vs its Flax model (no mask, padding), and
    transformers vs Flax when ``path`` is an HF folder and transformers is installed."""
    return checkpoint_report(path, load=load)[0]


def checkpoint_report(path, *, load=None, dtype: str = "fp32") -> tuple[list[Row], list[tuple[str, object]]]:
    """(``checkpoint_rows``' rows, [(what, ``measure.LMAgreement``)]): for a language model
    (``input_spec().generates``) each comparison also measures the next-token distributions,
    KL(torch || JAX) and top-1/top-5 agreement over the real tokens (the padding mask's ones);
    the list is empty for any other model. ``dtype="bf16"``: the Flax model computes in bf16
    (fp32 parameters) and every row is judged by bf16's float64 budget (``precision.py``),
    transformers' too, with the bf16 LM gates."""
    from pathlib import Path

    from flax_transformer.verification import certificate, measure
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    bare = Path(path).suffix in (".pt", ".bin", ".pth")  # a torch file says nothing of its model: its certificate does
    if dtype != "fp32" and (bare or (Path(path) / "run.json").is_file()):
        raise ValueError(f"--dtype {dtype} takes an HF folder, a safetensors file or an orbax folder; {path} is a "
                         f"{'bare state_dict' if bare else 'training run'} (port it first: flax-transformer port SRC DST)")
    flax_model, torch_model = (certificate.certified_pair(path) if bare and certificate.find(path) else
                               certificate_subjects.load_pair(path, load=load, dtype=dtype))
    family, name = type(flax_model).__module__.rpartition(".")[2], type(flax_model).__name__
    args = certificate_subjects.example_inputs(flax_model)
    spec = flax_model.input_spec()
    lm = spec.generates
    masks = 2 if spec.encoder_decoder else 1  # the trailing mask arguments
    no_mask = tuple(None if i >= len(args) - masks else a for i, a in enumerate(args))
    rows, agreements = [], []
    for case, inputs in (("none", no_mask), ("padding", args)):
        mask = certificate_subjects.lm_mask(flax_model, inputs) if lm else None
        report = compare(torch_model, flax_model, inputs, lm=lm, lm_mask=mask)
        rows.append(dataclasses.replace(report.rows[0], case=case, direction="torch twin vs flax"))
        if report.lm is not None:
            agreements.append((f"torch twin vs flax, {case}", report.lm))
    if Path(path).is_dir() and (Path(path) / "config.json").exists():
        try:
            import torch
            import transformers
        except ImportError:
            return rows, agreements
        # by the folder's model_type: AutoModel (BertModel, DistilBertModel, RobertaModel) or AutoModelForCausalLM
        reference = (transformers.AutoModel if name == "TransformerEncoder" else transformers.AutoModelForCausalLM)
        reference = reference.from_pretrained(path, dtype=torch.float32).eval()  # a bf16 folder widens exactly
        for case, (ids, mask) in (("none", no_mask), ("padding", args)):
            if dtype != "fp32":  # bf16: judged against transformers' model in float64, by bf16's budget
                report = compare(TransformersCall(reference, name == "TransformerEncoder"), flax_model, (ids, mask),
                                 lm=lm, lm_mask=certificate_subjects.lm_mask(flax_model, (ids, mask)) if lm else None)
                rows.append(dataclasses.replace(report.rows[0], case=case, direction="transformers vs flax"))
                if report.lm is not None:
                    agreements.append((f"transformers vs flax, {case}", report.lm))
                continue
            kwargs = {} if mask is None else {"attention_mask": torch.from_numpy(np.array(mask))}
            with torch.no_grad():
                out = reference(torch.from_numpy(np.array(ids)), **kwargs)
            want = out.last_hidden_state if name == "TransformerEncoder" else out.logits
            got = flax_module_call(flax_model, ids, mask)
            err, finite = max_abs_err(want, got)
            rows.append(Row(family, name, case, "transformers vs flax", err, finite))
            if lm:
                agreements.append((f"transformers vs flax, {case}", measure.lm_agreement(
                    to_numpy(want), to_numpy(got), certificate_subjects.lm_mask(flax_model, (ids, mask)))))
    return rows, agreements


class TransformersCall:
    """transformers' model as ``(ids, mask) -> last_hidden_state or logits``, the call the Flax twin
    takes, for ``compare`` (a torch module, made when first needed: torch is imported lazily)."""

    def __new__(cls, model, encoder: bool):
        import torch

        class Call(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, ids, mask=None):
                out = self.model(ids, attention_mask=mask, **({} if encoder else {"use_cache": False}))
                return out.last_hidden_state if encoder else out.logits

        return Call()


def flax_module_call(model, *args):
    return apply_compiled(model, tuple(None if a is None else jnp.asarray(a) for a in args), {})
