"""``verify``'s "lora" rows: the library's LoRA (``models.lora``) against ``peft`` on the torch twin.

For the LoRA layer (``LoRALinear`` on ``nn.Linear``, with rsLoRA, and ``LoRAConv1D`` on GPT-2's Conv1D
layout, which PEFT adapts with ``fan_in_fan_out``) and one small adapted model of each family, the
torch side is ``peft.get_peft_model(twin, LoraConfig(r, lora_alpha, target_modules))`` on the torch
twin (or on transformers' own model, for the HF rows), its adapters given a random non-zero B (a fresh
B is zero: the adapter would add nothing and any bug in it would hide). The Flax side is the twin
ported to Flax (``porting.torch_to_flax``; ``hf.from_pretrained`` of the folder transformers wrote),
the adapter then loaded from the folder ``PeftModel.save_pretrained`` writes by ``interop.peft.load_peft``.
So a row also checks that ``load_peft`` reads PEFT's folder (names, the (r, in)/(out, r) transposes,
``r``, ``lora_alpha``, ``use_rslora``, ``fan_in_fan_out``, which layers ``target_modules`` selects).

Each case gives two rows: the outputs ("peft vs flax"), and the gradient of every adapter parameter
(``lora_A`` and ``lora_B`` of every adapted layer) of one scalar, ``sum(output * W)`` with a fixed
random W ("peft vs flax grads": the worst error relative to its gradient's scale, ``max(1, max |g|)``,
as ``verify --grads``; the note counts the gradients compared). Both are also measured against a
float64 copy of the peft model, by ``compare``'s budget rule. The grads row fails when an adapted module
of either side has no counterpart, or when no gradient was compared. Without ``peft`` (or transformers,
for the rows that need it) the rows are there, not run, and fail: a row not measured is not a pass.

torch, peft and transformers are imported at call time only (a verification module).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.models import lora
from flax_transformer.verification.measure import check
from flax_transformer.verification.precision import grad_budget
from flax_transformer.verification.reports import TOLERANCE, Row

FAMILY = "lora"  # the rows' family column: ``verify`` runs them with every family, not with --family
RANK, ALPHA = 4, 8  # scale alpha / r = 2 (rsLoRA: alpha / sqrt(r) = 4): a wrong scale changes the output
NOISE = 0.1  # as verify.NOISE: every base parameter gets it, so no leaf is a fresh one or zero
B_STD = 0.1  # the adapters' B: non-zero, so that the adapter changes the output by far more than 1e-5
# The Flax forward and backward compile with XLA's backend passes off: half the compile time, which is
# most of these rows' cost; the passes fuse and schedule, and change no operation's precision
# (jax_default_matmul_precision holds), and the rows measure whatever the program computes.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclass(frozen=True)
class Case:
    """One adapted layer or model: ``build(seed)`` -> (torch model, Flax model, args), the same weights,
    no adapter yet; ``targets``: PEFT's ``target_modules``; ``needs``: the packages it needs beyond peft."""

    module: str
    build: Callable[[int], tuple]
    targets: tuple[str, ...]
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    needs: tuple[str, ...] = ()
    hf: bool = False  # transformers' model: called with keywords, its output's .logits or .last_hidden_state


@dataclass(frozen=True)
class Result:
    """The two rows of a case, and how many adapter gradients the second compared."""

    forward: Row
    grads: Row
    compared: int


class _Holder(nnx.Module):
    """One Flax layer under the name ``layer``, as the torch holder holds its own: PEFT adapts a module by name."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return self.layer(x)


def _torch_holder(layer):
    import torch

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)

    return Holder()


def _noisy(model, seed: int):
    """``model`` with ``NOISE`` * N(0, 1) added to every parameter (verify's perturbation), in eval mode."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=generator))
    return model.eval()


def _ported(torch_model, seed: int):
    from flax_transformer.interop import porting

    return porting.torch_to_flax(torch_model, seed=seed)


def _floats(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _ids_mask(rng, vocab: int, b: int = 2, t: int = 7):
    """(ids (b, t), padding mask (b, t): 1 = token, row 1 shorter)."""
    mask = np.ones((b, t), np.int64)
    mask[1, t - 3:] = 0
    return rng.integers(0, vocab, size=(b, t)).astype(np.int64), mask


# ------------------------------------------------------------------ the cases


def _linear(seed: int):
    import torch

    torch.manual_seed(seed)
    twin = _noisy(_torch_holder(torch.nn.Linear(12, 10)), seed)
    flax = _Holder(nnx.Linear(12, 10, rngs=nnx.Rngs(seed)))
    flax.layer.kernel.set_value(jnp.asarray(twin.layer.weight.detach().numpy().T))
    flax.layer.bias.set_value(jnp.asarray(twin.layer.bias.detach().numpy()))
    return twin, flax, (_floats(np.random.default_rng(seed), 3, 5, 12),)


def _conv1d(seed: int):
    """transformers' Conv1D (GPT-2's layer: x @ weight + bias, weight (in, out)) and ``gpt.Linear``."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from flax_transformer.models import gpt

    torch.manual_seed(seed)
    twin = _noisy(_torch_holder(Conv1D(10, 12)), seed)
    flax = _Holder(gpt.Linear(12, 10, rngs=nnx.Rngs(seed)))
    flax.layer.matrix.set_value(jnp.asarray(twin.layer.weight.detach().numpy()))
    flax.layer.bias.set_value(jnp.asarray(twin.layer.bias.detach().numpy()))
    return twin, flax, (_floats(np.random.default_rng(seed), 3, 5, 12),)


def _twin(make, inputs):
    """build(seed) for a torch_reference twin: built, noised, ported; ``inputs(rng)`` its arguments."""
    def build(seed: int):
        import torch

        torch.manual_seed(seed)
        twin = _noisy(make(), seed)
        return twin, _ported(twin, seed), inputs(np.random.default_rng(seed))
    return build


def _former():
    from torch_reference import former as tf

    return tf.GTransformer(24, 4, 1, 16, 50)


def _encoder():
    from flax_transformer.models.configs import EncoderConfig
    from torch_reference import encoder as te

    return te.TransformerForSequenceClassification(EncoderConfig.tiny(
        vocab_size=50, hidden_size=24, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=16))


def _classic():
    from torch_reference import classic as tc

    return tc.Transformer(50, 43, 24, 2, 1, 48, max_len=16)


def _seq2seq(rng):
    return rng.integers(0, 50, size=(2, 7)).astype(np.int64), rng.integers(0, 43, size=(2, 5)).astype(np.int64)


def _hf(make):
    """build(seed) for transformers' own model: made, noised, written to a folder that ``hf.from_pretrained`` reads."""
    def build(seed: int):
        import torch

        from flax_transformer.interop import hf

        torch.manual_seed(seed)
        model = _noisy(make(), seed)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            flax = hf.from_pretrained(folder)
        return model, flax, _ids_mask(np.random.default_rng(seed), 50)
    return build


def _hf_bert():
    import transformers

    return transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=24, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=16))


def _hf_gpt2():
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=24, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0))


def _hf_llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def cases() -> list[Case]:
    """What the rows cover: the layer three ways, then one model of each family with the targets PEFT
    users give it (the notebook twins: attention projections and a feed-forward layer by module name)."""
    ids = lambda rng: _ids_mask(rng, 50)  # noqa: E731
    return [
        Case("LoRALinear", _linear, ("layer",)),
        Case("LoRALinear(rsLoRA)", _linear, ("layer",), use_rslora=True),
        Case("LoRAConv1D(fan_in_fan_out)", _conv1d, ("layer",), fan_in_fan_out=True, needs=("transformers",)),
        Case("former GTransformer", _twin(_former, lambda rng: ids(rng)[:1]), ("toqueries", "tovalues", "ff.0")),
        Case("encoder TransformerForSequenceClassification", _twin(_encoder, ids), ("q", "v", "linear_1")),
        Case("classic Transformer", _twin(_classic, _seq2seq), ("query_tfm", "value_tfm", "position_wise_feed_forward.0")),
        Case("hf BertModel", _hf(_hf_bert), ("query", "value"), needs=("transformers",), hf=True),
        Case("hf GPT2LMHeadModel", _hf(_hf_gpt2), ("c_attn", "c_fc"), fan_in_fan_out=True,
             needs=("transformers",), hf=True),
        Case("hf LlamaForCausalLM", _hf(_hf_llama), ("q_proj", "v_proj"), needs=("transformers",), hf=True),
    ]


# ------------------------------------------------------------------ measuring


def _missing(case: Case) -> str:
    """The first package the case needs that does not import ("" when all do)."""
    import importlib

    for name in ("torch", "peft", *case.needs):
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return ""


def _torch_output(model, args, hf: bool):
    import torch

    if not hf:
        return model(*(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args))
    ids, mask = (torch.from_numpy(a) for a in args)
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _torch_grads(model, args, weight, hf: bool):
    """(output, {module path: (grad of lora_A (r, in), grad of lora_B (out, r))}) of ``sum(output * weight)``."""
    import torch
    from peft.tuners.lora import LoraLayer

    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = _torch_output(model, args, hf)
        (out * torch.from_numpy(weight).to(out.dtype)).sum().backward()
    grads = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad
            zeros = lambda p: torch.zeros_like(p)  # noqa: E731  (not reached by the loss: a zero gradient)
            grads[name.removeprefix("base_model.model.")] = (
                (a if a is not None else zeros(module.lora_A["default"].weight)).detach().double().numpy(),
                (b if b is not None else zeros(module.lora_B["default"].weight)).detach().double().numpy())
    return out.detach().double().numpy(), grads


def _flax_grads(model, args, weight):
    """(output, {dotted path: (grad of lora_A (in, r), grad of lora_B (r, out))}): one compiled program,
    compiled without XLA's optimization passes (``FAST_COMPILE``)."""
    graphdef, adapters, rest = nnx.split(model, lora.LoRAParam, ...)

    def loss(adapters, rest, args, weight):
        out = nnx.merge(graphdef, adapters, rest)(*args)
        return jnp.sum(out * weight), out

    run = jax.jit(jax.grad(loss, has_aux=True), compiler_options=FAST_COMPILE)
    grads, out = run(adapters, rest, tuple(None if a is None else jnp.asarray(a) for a in args), jnp.asarray(weight))
    flat = {".".join(map(str, path)): np.asarray(value[...]) for path, value in nnx.to_flat_state(grads)}
    return np.asarray(out), {path: (flat[f"{path}.lora_A"], flat[f"{path}.lora_B"]) for path in lora.layers(model)}


def _adapted(case: Case, seed: int):
    """(peft model with random B, Flax model with the same adapter loaded by ``load_peft``, args)."""
    import warnings

    import peft
    import torch

    from flax_transformer.interop import peft as peft_io

    twin, flax_model, args = case.build(seed)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(case.targets),
                             use_rslora=case.use_rslora, fan_in_fan_out=case.fan_in_fan_out)
    torch.manual_seed(seed + 1)  # peft draws A
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations, called by peft
        theirs = peft.get_peft_model(twin, config).eval()
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(B_STD * torch.randn(p.shape, generator=generator))
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        peft_io.load_peft(flax_model, Path(folder))
    flax_model.eval()
    return theirs, flax_model, args


def measure(case: Case, *, seed: int = 0, tamper: Callable | None = None) -> Result:
    """The case's two rows. ``tamper(flax_model)``, when given, runs after the adapter is loaded (the
    tests plant bugs with it). A case that raises gives two failing rows that say what it raised."""
    missing = _missing(case)
    if missing:
        return _failed(case, f"not run: {missing} is not installed")
    try:
        with _quiet():
            return _measure(case, seed, tamper)
    except Exception as error:  # noqa: BLE001 - whatever it raised, the row was not measured
        message = (str(error).strip().splitlines() or [""])[0]
        return _failed(case, f"did not run ({type(error).__name__}: {message})")


def _measure(case: Case, seed: int, tamper) -> Result:
    import torch

    from flax_transformer.interop import peft as peft_io

    theirs, ours, args = _adapted(case, seed)
    if tamper is not None:
        tamper(ours)
    with torch.no_grad():
        shape = tuple(_torch_output(theirs, args, case.hf).shape)
    weight = np.random.default_rng(seed + 3).standard_normal(shape).astype(np.float32)
    out32, g32 = _torch_grads(theirs, args, weight, case.hf)
    out64, g64 = _torch_grads(copy.deepcopy(theirs).double(), tuple(map(_double, args)), weight.astype(np.float64),
                              case.hf)
    out_j, g_j = _flax_grads(ours, args, weight)
    forward = check(out32, out_j, out64, measured=True)
    forward_row = _row(case, "peft vs flax", [forward], forward["max_abs_err"], forward["skipped"])
    modules = peft_io.hf_module_paths(ours)  # our path -> the module path peft names the adapter by
    ours_by_module = {modules.get(path, path): grads for path, grads in g_j.items()}
    checks, skipped = {}, []
    for module, (a, b) in g32.items():
        if module not in ours_by_module:
            skipped.append(f"{module}: peft adapts it, the Flax model does not")
            continue
        ja, jb = ours_by_module[module]  # (in, r), (r, out): torch's transposes
        checks[f"{module}.lora_A"] = check(a, ja.T, g64[module][0], measured=True)
        checks[f"{module}.lora_B"] = check(b, jb.T, g64[module][1], measured=True)
    skipped += [f"{module}: the Flax model adapts it, peft does not" for module in ours_by_module if module not in g32]
    if not checks:
        skipped.append("no adapter gradient compared")
    # one budget for all of the model's adapter gradients, as compare's (precision.grad_budget)
    scale, limit = grad_budget({k: (c["torch_err"], c["scale"]) for k, c in checks.items() if c["budget"] is not None})
    for c in checks.values():
        if c["budget"] is not None:
            c.update(scale=scale, budget=limit)
    skipped += [f"{k}: {c['skipped']}" for k, c in checks.items() if c["skipped"]]
    worst = max((c["max_abs_err"] / max(1.0, c["torch_scale"]) for c in checks.values()), default=0.0)
    grads_row = _row(case, "peft vs flax grads", list(checks.values()), worst, "; ".join(skipped),
                     note=f"{len(checks)} adapter gradients")
    return Result(forward_row, grads_row, len(checks))


class _quiet:
    """transformers' progress bars (``save_pretrained``'s "Writing model shards") off, and back on after."""

    def __enter__(self):
        try:
            from transformers.utils import logging
        except ImportError:
            self.logging = None
            return self
        self.logging, self.bar = logging, logging.is_progress_bar_enabled()
        logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        if self.logging is not None and self.bar:
            self.logging.enable_progress_bar()


def _double(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a


def _row(case: Case, direction: str, checks: list[dict], err: float, skipped: str, note: str = "") -> Row:
    """A Row of some checks: ``err`` the worst error, the float64 figures of the check nearest its budget."""
    measured = [c for c in checks if c["budget"] is not None]
    worst = max(measured, key=lambda c: c["jax_err"] / c["budget"] if c["budget"] > 0
                else (0.0 if c["jax_err"] == 0 else float("inf")), default=None)
    return Row(FAMILY, case.module, _case_column(case), direction, err, all(c["finite"] for c in checks), TOLERANCE,
               jax_err=None if worst is None else worst["jax_err"],
               torch_err=None if worst is None else worst["torch_err"],
               budget=None if worst is None else worst["budget"],
               nonfinite_jax=sum(c["nonfinite_jax"] for c in checks),
               nonfinite_torch=sum(c["nonfinite_torch"] for c in checks),
               nonfinite_both=sum(c["nonfinite_both"] for c in checks), skipped=skipped, note=note)


def _case_column(case: Case) -> str:
    return ",".join(case.targets) + (" rsLoRA" if case.use_rslora else "")


def _failed(case: Case, why: str) -> Result:
    """Two rows that were not measured, and fail saying why."""
    return Result(*(Row(FAMILY, case.module, _case_column(case), direction, 0.0, True, TOLERANCE, skipped=why)
                    for direction in ("peft vs flax", "peft vs flax grads")), 0)


def rows(*, seed: int = 0) -> Iterator[Row]:
    """verify's "lora" rows: two per case (``cases``), forward and adapter gradients."""
    for i, case in enumerate(cases()):
        result = measure(case, seed=seed + i)
        yield result.forward
        yield result.grads
