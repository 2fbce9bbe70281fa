"""Training-level parity: the notebooks' PyTorch training setup against this library's optax chain.

    result = trajectory("gpt", steps=10, optimizer="adamw")
    result.torch_losses, result.jax_losses, result.param_err

From the same weights (torch's, ported) on the same batches, K updates run in torch with
``torch.optim.Adam``/``AdamW`` (parameter groups: weight decay only on 2-D projection
weights), ``LambdaLR(lambda i: min(i / warmup, 1))`` and ``clip_grad_norm_``, and in JAX
with ``make_optimizer`` (``clip_by_global_norm`` -> adam/adamw with the same warmup and
``decay_mask``) inside the training library's jitted step. The per-step losses and the
final parameters are compared. How the two setups map is written in ``optim.py``.
Dropout is off (0) in these models: the two frameworks draw different masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.step import cross_entropy, make_steps
from flax_transformer.training.torch_state.to_jax import torch_optimizer

MODELS = ("former", "encoder", "gpt", "classic", "llama", "gemma", "gpt_oss")


@dataclass
class Trajectory:
    model: str
    optimizer: str
    torch_losses: list[float] = field(default_factory=list)
    jax_losses: list[float] = field(default_factory=list)
    param_err: float = 0.0  # max over parameters of |torch - jax| / max(1, max |torch|)
    worst_param: str = ""
    # Parameters whose gradient is zero in exact arithmetic (an attention key bias: adding
    # q.b to every score of a row leaves the softmax unchanged), so only rounding noise of
    # ~1e-9 reaches them. Adam divides that noise by its own RMS, so both frameworks move
    # them by up to lr per step, in directions set by noise. They are not compared with
    # the others; their error is reported with its bound, lr * steps.
    noise_params: dict = field(default_factory=dict)

    noise_bound: float = 0.0

    @property
    def passed(self) -> bool:
        return (self.loss_err <= 1e-5 and self.param_err <= 1e-5
                and all(err <= self.noise_bound for err in self.noise_params.values()))

    @property
    def loss_err(self) -> float:
        return gap(self.torch_losses, self.jax_losses)


def gap(a, b) -> float:
    """max |a - b| in float64; inf when either side holds a NaN or inf: non-finite values never
    agree, so a run whose losses or parameters go NaN (in one framework or both) fails."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    return float(np.abs(a - b).max(initial=0.0))


def _next_token_task(rng: np.random.Generator, b: int, t: int, vocab: int):
    """(batch maker, torch loss, flax loss) of next-token prediction, for the decoders (gpt, llama)."""
    import torch
    import torch.nn.functional as F

    def batch():
        ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
        return {"ids": ids[:, :-1], "labels": ids[:, 1:]}

    def torch_loss(m, x):
        logits = m(torch.from_numpy(x["ids"]).long())
        return F.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(x["labels"]).long().reshape(-1))

    def flax_loss(m, x):
        return cross_entropy(m(x["ids"]), x["labels"])

    return batch, torch_loss, flax_loss


def setup(name: str, rng: np.random.Generator):
    """(torch model, batch maker, torch loss, flax loss) for one family's full model, dropout 0."""
    import torch
    import torch.nn.functional as F

    b, t, vocab = 4, 12, 60
    if name == "former":
        from torch_reference.former import CTransformer

        model = CTransformer(32, 4, 2, t, vocab, 3, max_pool=False)

        def batch():
            return {"ids": rng.integers(0, vocab, (b, t)).astype(np.int32), "labels": rng.integers(0, 3, b).astype(np.int32)}

        torch_loss = lambda m, x: F.nll_loss(m(torch.from_numpy(x["ids"]).long()), torch.from_numpy(x["labels"]).long())  # noqa: E731
        flax_loss = lambda m, x: cross_entropy(m(x["ids"]), x["labels"])  # noqa: E731
    elif name == "encoder":
        from flax_transformer.models.configs import EncoderConfig
        from torch_reference.encoder import TransformerForSequenceClassification

        config = EncoderConfig.tiny(vocab_size=vocab, hidden_size=32, num_attention_heads=4, max_position_embeddings=t,
                                    num_labels=3, hidden_dropout_prob=0.0)
        model = TransformerForSequenceClassification(config)

        def batch():
            return {"ids": rng.integers(0, vocab, (b, t)).astype(np.int32), "labels": rng.integers(0, 3, b).astype(np.int32)}

        torch_loss = lambda m, x: F.cross_entropy(m(torch.from_numpy(x["ids"]).long()), torch.from_numpy(x["labels"]).long())  # noqa: E731
        flax_loss = lambda m, x: cross_entropy(m(x["ids"]), x["labels"])  # noqa: E731
    elif name == "gpt":
        from torch_reference.gpt import GPTTransformer

        model = GPTTransformer(2, 32, 64, 4, vocab, t, dropout=0.0)
        batch, torch_loss, flax_loss = _next_token_task(rng, b, t, vocab)
    elif name == "classic":
        from torch_reference.classic import Transformer

        model = Transformer(vocab, vocab, 32, 4, 1, 64, dropout=0.0, max_len=t)

        def batch():
            return {"src": rng.integers(0, vocab, (b, t)).astype(np.int32),
                    "tgt": rng.integers(0, vocab, (b, t)).astype(np.int32), "out": rng.integers(0, vocab, (b, t)).astype(np.int32)}

        def torch_loss(m, x):
            logits = m(torch.from_numpy(x["src"]).long(), torch.from_numpy(x["tgt"]).long())
            return F.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(x["out"]).long().reshape(-1))

        flax_loss = lambda m, x: cross_entropy(m(x["src"], x["tgt"]), x["out"])  # noqa: E731
    elif name == "llama":  # grouped-query attention, a tied head (its gradient sums both uses)
        from flax_transformer.models.llama_config import LlamaConfig
        from torch_reference.llama import LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig.tiny(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                  max_position_embeddings=t, tie_word_embeddings=True))
        batch, torch_loss, flax_loss = _next_token_task(rng, b, t, vocab)
    elif name == "gemma":  # Gemma 2: a sliding layer then a full one, caps, sandwich norms, 1 + w norms, tied
        from flax_transformer.models.llama_config import LlamaConfig
        from torch_reference.llama import LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig.tiny(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, max_position_embeddings=t, num_hidden_layers=2,
            layer_types=("sliding_attention", "full_attention"), sliding_window=4, hidden_act="gelu_pytorch_tanh",
            norm_plus_one=True, embed_scale=32 ** 0.5, sandwich_norms=True, query_pre_attn_scalar=6.0,
            attn_logit_softcapping=1.0, final_logit_softcapping=2.0, tie_word_embeddings=True, model_type="gemma2"))
        batch, torch_loss, flax_loss = _next_token_task(rng, b, t, vocab)
    elif name == "gpt_oss":  # sinks, YaRN past its original context, sliding then full, top-2 of 4 experts
        from flax_transformer.models.llama_config import LlamaConfig
        from flax_transformer.models.moe_config import MoeConfig
        from torch_reference.llama import LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig.tiny(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, max_position_embeddings=t, num_hidden_layers=2,
            layer_types=("sliding_attention", "full_attention"), sliding_window=4, attention_bias=True,
            attention_sinks=True, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4),
            moe=MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), model_type="gpt_oss"))
        batch, torch_loss, flax_loss = _next_token_task(rng, b, t, vocab)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return model, batch, torch_loss, flax_loss


def trajectory(name: str, *, steps: int = 10, optimizer: str = "adamw", lr: float = 3e-3, warmup_steps: int = 3,
               weight_decay: float = 0.1, clip_norm: float = 0.5, seed: int = 0) -> Trajectory:
    """Run ``steps`` updates of family ``name``'s full model in torch and in JAX and compare."""
    import torch

    from flax_transformer.interop import porting

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, batch, torch_loss, flax_loss = setup(name, rng)
    model.train()  # dropout is 0: train and eval compute the same
    flax_model = porting.torch_to_flax(model)
    config = OptimConfig(optimizer=optimizer, lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay,
                         clip_norm=clip_norm)
    named = dict(model.named_parameters())
    opt, sched = torch_optimizer(model, config)  # the groups the library documents: one definition

    tx = nnx.Optimizer(flax_model, make_optimizer(config), wrt=nnx.Param)
    train_step, _ = make_steps(lambda m, x: (flax_loss(m, x), {}))
    flax_model.train()
    result = Trajectory(name, optimizer)
    largest_grad = {k: 0.0 for k in named}
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a Python float with its int32 count
        for _ in range(steps):
            x = batch()
            opt.zero_grad()
            loss = torch_loss(model, x)
            loss.backward()
            for k, p in named.items():
                largest_grad[k] = max(largest_grad[k], float(p.grad.abs().max()) if p.grad is not None else 0.0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            opt.step()
            sched.step()
            result.torch_losses.append(loss.item())
            result.jax_losses.append(float(train_step(flax_model, tx, {k: jnp.asarray(v) for k, v in x.items()})["loss"]))
    ours = porting.state_dict(flax_model)
    scale = max(largest_grad.values())
    again = {name for group in porting.tied_keys(model) for name in group[1:]}  # a tied tensor: once, by its first name
    for key, p in model.state_dict().items():
        if key in again:
            continue
        theirs = p.detach().numpy()
        err = gap(ours[key], theirs) / max(1.0, float(np.abs(theirs).max(initial=0.0)))
        if largest_grad.get(key, scale) <= 1e-6 * scale:
            result.noise_params[key] = err
        elif err >= result.param_err:
            result.param_err, result.worst_param = err, key
    result.noise_bound = lr * steps
    return result


def format_trajectory(result: Trajectory) -> str:
    lines = [f"{result.model} ({result.optimizer}): step  torch loss   jax loss     |diff|"]
    for i, (a, b) in enumerate(zip(result.torch_losses, result.jax_losses), 1):
        lines.append(f"{'':>{len(result.model) + len(result.optimizer) + 4}} {i:>4}  {a:.7f}  {b:.7f}  {abs(a - b):.1e}")
    lines.append(f"  final parameters: max relative error {result.param_err:.2e} ({result.worst_param})")
    if result.noise_params:
        worst = max(result.noise_params.values())
        names = ", ".join(sorted(result.noise_params)[:2]) + (", ..." if len(result.noise_params) > 2 else "")
        lines.append(f"  {len(result.noise_params)} parameters with an exactly-zero gradient ({names}: rounding noise, "
                     f"amplified by Adam) differ by up to {worst:.1e} (bound lr * steps = {result.noise_bound:.1e})")
    return "\n".join(lines)
