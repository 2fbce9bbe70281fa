"""A run continued across a torch training checkpoint, both ways (``verify --through-torch-state``).

    torch_to_jax, jax_to_torch = continuity("gpt", steps=3)
    torch_to_jax.passed, torch_to_jax.loss_err, jax_to_torch.moment_err

The same family, weights and batches as ``parity.trajectory``: ``steps`` updates in one framework,
the switch through a torch file, ``steps`` in the other, against the run that did not switch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.parity import gap, setup
from flax_transformer.training.step import make_steps
from flax_transformer.training.torch_state.to_jax import torch_optimizer


@dataclass
class Continuity:
    """A run that switches framework after ``switch`` steps (through a torch training checkpoint)
    against the same run uninterrupted in the first framework, on the same batches.

    ``direction`` "torch->jax": ``switch`` torch steps, ``to_jax.import_torch_state``, then JAX
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
        return gap(self.losses, self.reference)

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
    from flax_transformer.training.torch_state.to_jax import import_torch_state
    from flax_transformer.training.torch_state.to_torch import torch_training_state

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, batch, torch_loss, flax_loss = setup(name, rng)
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
        err = gap(ours["model"][key].numpy(), p.numpy()) / max(1.0, float(p.abs().max()))
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
            err = gap(mine[key][moment].numpy(), b)
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
