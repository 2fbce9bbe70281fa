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
from flax_transformer.training.torch_state import torch_optimizer

MODELS = ("former", "encoder", "gpt", "classic", "llama")


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
        return _gap(self.torch_losses, self.jax_losses)


def _gap(a, b) -> float:
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


def _setup(name: str, rng: np.random.Generator):
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
    model, batch, torch_loss, flax_loss = _setup(name, rng)
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
        err = _gap(ours[key], theirs) / max(1.0, float(np.abs(theirs).max(initial=0.0)))
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


# ----------------------------------------------------------------------------- across a torch training checkpoint


@dataclass
class Continuity:
    """A run that switches framework after ``switch`` steps (through a torch training checkpoint)
    against the same run uninterrupted in the first framework, on the same batches.

    ``direction`` "torch->jax": ``switch`` torch steps, ``torch_state.import_torch_state``, then JAX
    steps, against the torch run; "jax->torch": JAX steps, ``torch_training_state``, then torch steps
    (``torch_optimizer`` loading the file), against the JAX run.
    """

    model: str
    optimizer: str
    direction: str
    switch: int
    losses: list[float] = field(default_factory=list)  # the run that switched framework
    reference: list[float] = field(default_factory=list)  # the uninterrupted run
    param_err: float = 0.0  # relative to max(1, max |reference|), as ``Trajectory``
    worst_param: str = ""
    moment_err: float = 0.0  # relative to the moment's own largest value, per tensor
    worst_moment: str = ""
    noise_params: dict = field(default_factory=dict)  # zero-gradient parameters: see ``Trajectory``
    noise_bound: float = 0.0

    @property
    def loss_err(self) -> float:
        return _gap(self.losses, self.reference)

    @property
    def passed(self) -> bool:
        # moments: 1e-4 of their own scale; their elements near zero are sums of cancelling
        # gradients, where float rounding is relatively larger than on the parameters
        return (self.loss_err <= 1e-5 and self.param_err <= 1e-5 and self.moment_err <= 1e-4
                and all(err <= self.noise_bound for err in self.noise_params.values()))


def continuity(name: str, *, steps: int = 3, optimizer: str = "adamw", lr: float = 3e-3, warmup_steps: int = 2,
               weight_decay: float = 0.1, clip_norm: float = 0.5, seed: int = 0,
               make_batch=None) -> tuple[Continuity, Continuity]:
    """Both directions: ``steps`` updates in one framework, the switch through a torch file
    (``torch.save``, ``torch.load(weights_only=True)``), ``steps`` in the other, each against
    ``2 * steps`` updates uninterrupted in the first. Returns (torch->jax, jax->torch).

    The schedule is the library's warmup then cosine decay over the ``2 * steps`` updates, so the
    switch lands inside it. Losses every step; parameters and Adam moments at the end.
    ``make_batch(rng)`` replaces the family's random batches (same keys), e.g. with a learnable task.
    """
    import io

    import torch

    from flax_transformer.interop import porting
    from flax_transformer.training.torch_state import import_torch_state
    from flax_transformer.training.torch_write import torch_training_state

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, batch, torch_loss, flax_loss = _setup(name, rng)
    model.train()
    batches = [batch() if make_batch is None else make_batch(rng) for _ in range(2 * steps)]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    config = OptimConfig(optimizer=optimizer, lr=lr, warmup_steps=min(warmup_steps, 2 * steps - 1), decay="cosine",
                         total_steps=2 * steps, end_lr_ratio=0.1, weight_decay=weight_decay, clip_norm=clip_norm)
    train_step, _ = make_steps(lambda m, x: (flax_loss(m, x), {}))  # one compilation for both directions
    largest_grad = {k: 0.0 for k, _ in model.named_parameters()}

    def torch_steps(opt, sched, some):
        out = []
        for x in some:
            opt.zero_grad()
            loss = torch_loss(model, x)
            loss.backward()
            for k, p in model.named_parameters():
                largest_grad[k] = max(largest_grad[k], float(p.grad.abs().max()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            opt.step()
            sched.step()
            out.append(loss.item())
        return out

    def jax_steps(flax_model, tx, some):
        return [float(train_step(flax_model, tx, {k: jnp.asarray(v) for k, v in x.items()})["loss"]) for x in some]

    def through_file(state: dict):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    results = []
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a Python float with its int32 count
        # torch, the switch, JAX; against torch throughout
        result = Continuity(name, optimizer, "torch->jax", steps)
        flax_model = porting.torch_to_flax(model)
        opt, sched = torch_optimizer(model, config)
        result.reference = torch_steps(opt, sched, batches[:steps])
        saved = through_file({"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "scheduler": sched.state_dict(), "step": steps})
        result.reference += torch_steps(opt, sched, batches[steps:])
        chain = make_optimizer(config)  # one chain object for both directions: one compiled step
        tx, _ = import_torch_state(saved, flax_model, config, tx=chain)
        result.losses = result.reference[:steps] + jax_steps(flax_model, tx, batches[steps:])
        _compare(result, torch_training_state(flax_model, tx, config), model, opt, largest_grad)
        results.append(result)

        # JAX, the switch, torch; against JAX throughout
        result = Continuity(name, optimizer, "jax->torch", steps)
        model.load_state_dict(start)
        flax_model = porting.torch_to_flax(model)
        tx = nnx.Optimizer(flax_model, chain, wrt=nnx.Param)
        result.reference = jax_steps(flax_model, tx, batches[:steps])
        saved = through_file(torch_training_state(flax_model, tx, config))
        result.reference += jax_steps(flax_model, tx, batches[steps:])
        model.load_state_dict(saved["model"])
        opt, sched = torch_optimizer(model, config)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        result.losses = result.reference[:steps] + torch_steps(opt, sched, batches[steps:])
        _compare(result, torch_training_state(flax_model, tx, config), model, opt, largest_grad)
        results.append(result)
    for result in results:
        result.noise_bound = lr * 2 * steps
    return results[0], results[1]


def _compare(result: Continuity, ours: dict, model, opt, largest_grad: dict) -> None:
    """Fill ``result``'s errors: JAX's final state (``torch_training_state``) against torch's, by name."""
    theirs = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    scale = max(largest_grad.values())
    for key, p in theirs["model"].items():
        if key not in largest_grad:  # a tied tensor's second name (named_parameters gives it once)
            continue
        err = _gap(ours["model"][key].numpy(), p.numpy()) / max(1.0, float(p.abs().max()))
        if largest_grad[key] <= 1e-6 * scale:
            result.noise_params[key] = err
        elif err >= result.param_err:
            result.param_err, result.worst_param = err, key

    def by_name(opt_sd):
        return {n: opt_sd["state"][i] for g in opt_sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}

    mine, other = by_name(ours["optimizer"]), by_name(theirs["optimizer"])
    for key, state in other.items():
        if key in result.noise_params:
            continue  # its moments are rounding noise
        for moment in ("exp_avg", "exp_avg_sq"):
            b = state[moment].numpy()
            err = _gap(mine[key][moment].numpy(), b)
            err = err / max(float(np.abs(b).max()), 1e-30) if math.isfinite(err) else math.inf
            if err >= result.moment_err:
                result.moment_err, result.worst_moment = err, f"{key} {moment}"
        if float(mine[key]["step"]) != float(state["step"]):
            result.moment_err, result.worst_moment = math.inf, f"{key} step {float(mine[key]['step'])}"


def format_continuity(result: Continuity) -> str:
    first, second = result.direction.split("->")
    lines = [f"{result.model} ({result.optimizer}, {result.direction}): step  {first} then {second:<5}  "
             f"{first} throughout   |diff|"]
    for i, (a, b) in enumerate(zip(result.losses, result.reference), 1):
        mark = "  <- switch" if i == result.switch + 1 else ""
        lines.append(f"{'':>10} {i:>4}  {a:.7f}          {b:.7f}           {abs(a - b):.1e}{mark}")
    lines.append(f"  final parameters: max relative error {result.param_err:.2e} ({result.worst_param}); "
                 f"Adam moments {result.moment_err:.2e} of their scale ({result.worst_moment})")
    if result.noise_params:
        lines.append(f"  {len(result.noise_params)} zero-gradient parameters (rounding noise, amplified by Adam) differ "
                     f"by up to {max(result.noise_params.values()):.1e} (bound {result.noise_bound:.1e})")
    return "\n".join(lines)
