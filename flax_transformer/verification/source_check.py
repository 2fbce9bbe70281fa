"""Is this conversion right? A checkpoint converted by anyone, checked against its source
(``flax-transformer verify --checkpoint CONVERTED --source ORIGINAL``).

A certificate says that this library's export computes what the model it was written from
computes. A folder converted by another tool (MaxText, EasyDeL, a script of one's own) has none, and
``verify --checkpoint`` alone only shows that the folder loads and that the frameworks agree on what
it holds: a conversion that forgot Meta's RoPE permutation loads, runs and agrees with itself. The
question is whether CONVERTED computes what ORIGINAL computes, so each side is read by its own reader,
and the source by one that does not share the conversion's assumptions:

* CONVERTED: this library's reader (``checkpoints.load``, or the CLI's ``load``: an HF or Meta
  folder, an orbax folder, a self-describing safetensors file), as a Flax model.
* ORIGINAL: an HF folder through transformers itself (``AutoModelForCausalLM`` / ``AutoModel``) when
  its ``model_type`` is one of transformers' own; a Meta folder (``consolidated.NN.pth`` +
  ``params.json``) through the library's Meta reader, which applies its own RoPE rule; a torch
  ``state_dict`` file (a training checkpoint's ``model`` or ``state_dict`` entry is read, and the
  ``_orig_mod.`` prefix of a ``torch.compile``'d model stripped, each said on a line) or a
  safetensors file, loaded strictly into the model ``pair`` (``MODULE:FACTORY``) builds, or else into
  the torch twin of CONVERTED's architecture (its names as torch_reference's, or an HF folder's
  ``model_type`` names).

The source's torch model and the converted Flax model then run on the same example inputs (ids drawn
from the model's ``input_spec``, the last row padded; a ``pair``'s own arguments), compared by
``compare`` (max abs error, the float64 budget; for a language model KL and top-1/top-5 agreement,
``measure.lm_agreement``). Both state dicts are also compared tensor by tensor in canonical naming
(torch_reference's names and layouts), and the tensors whose values differ are named: ``q_proj`` and
``k_proj`` of every layer when the RoPE permutation was forgotten. Values equal after rounding to
bf16 or fp16 (a conversion that stored a lower precision) are not a difference, and the source is
then run rounded the same way. With ``bisect=True``, ``bisect.bisect`` names the first module that
diverges from the source. torch is imported at call time only.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flax_transformer.models.state_dict_errors import COMPILED_PREFIX, weights_entry
from flax_transformer.verification import reports
from flax_transformer.verification.reports import Report

TENSOR_RTOL = 1e-6  # a tensor copied, transposed or permuted is equal; 1e-6 of its scale allows a recomputed one
ROUNDINGS = ("bfloat16", "float16")  # what a conversion may have stored the weights as


@dataclass(frozen=True)
class Side:
    """How one side was read: its path, what it is, the reader, and what reading it did."""

    path: str
    kind: str
    reader: str
    notes: tuple[str, ...] = ()

    def line(self, role: str) -> str:
        return f"{role}: {self.path} ({self.kind}, read by {self.reader})" + "".join(
            f"\n  {note}" for note in self.notes)


@dataclass(frozen=True)
class TensorDiff:
    """Both state dicts in canonical naming, tensor by tensor."""

    compared: int
    differ: tuple[tuple[str, float, float], ...] = ()  # (name, max abs difference, the source's max |value|)
    source_only: tuple[str, ...] = ()
    converted_only: tuple[str, ...] = ()
    mis_shaped: tuple[tuple[str, tuple, tuple], ...] = ()  # (name, source shape, converted shape)
    rounded: str = ""  # "bfloat16": the converted values are the source's rounded to it

    @property
    def passed(self) -> bool:
        return not (self.differ or self.source_only or self.converted_only or self.mis_shaped)

    def names(self) -> list[str]:
        """The tensors that differ, grouped over layers: ``model.layers.*.self_attn.q_proj.weight (layers 0, 1)``."""
        groups: dict[str, list[str]] = {}
        for name in [d[0] for d in self.differ] + [m[0] for m in self.mis_shaped]:
            match = re.search(r"\.(\d+)\.", name)
            key = name if match is None else name[:match.start()] + ".*." + name[match.end():]
            groups.setdefault(key, []).extend([] if match is None else [match.group(1)])
        return [key + (f" (layers {', '.join(layers)})" if layers else "") for key, layers in groups.items()]

    def lines(self) -> list[str]:
        head = f"tensors in canonical names: {self.compared} compared"
        if self.rounded:
            head += f", the converted ones equal to the source's rounded to {self.rounded}"
        if self.passed:
            return [head + ", every one equal: pass"]
        out = [head + f": FAIL, {len(self.differ) + len(self.mis_shaped)} differ"]
        out += [f"  {name}: max abs difference {err:.2e} (source's values up to {size:.2e})"
                for name, err, size in self.differ]
        out += [f"  {name}: shape {list(a)} in the source, {list(b)} converted" for name, a, b in self.mis_shaped]
        for what, keys in (("only in the source", self.source_only), ("only converted", self.converted_only)):
            if keys:
                out.append(f"  {what} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
        return out

    def to_dict(self) -> dict:
        return {"compared": self.compared, "passed": self.passed, "rounded": self.rounded,
                "differ": [{"name": n, "max_abs_diff": e, "source_scale": s} for n, e, s in self.differ],
                "mis_shaped": [{"name": n, "source": list(a), "converted": list(b)} for n, a, b in self.mis_shaped],
                "source_only": list(self.source_only), "converted_only": list(self.converted_only)}


@dataclass
class SourceReport(Report):
    """``check``'s verdict: the logits of both sides, their tensors, and with ``bisect`` the first module."""

    source: Side
    converted: Side
    tensors: TensorDiff
    logits: object = None  # compare's CompareReport; None when the models could not be run together
    not_run: str = ""  # why they were not
    bisect: object = None  # bisect's BisectReport, when asked
    inputs: str = ""
    extra: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.logits is not None and self.logits.passed and self.tensors.passed
                    and (self.bisect is None or self.bisect.passed))

    def problems(self) -> list[str]:
        out = []
        if self.logits is None:
            out.append(f"not compared: {self.not_run}")
        elif not self.logits.passed:
            out.append(f"the logits differ (max abs err {self.logits.max_abs_err:.2e})")
        if not self.tensors.passed:
            out.append("tensors that differ: " + "; ".join(self.tensors.names() or [
                "none, but the key sets differ"]))
        if self.bisect is not None and not self.bisect.passed:
            out.append(f"bisect: first divergent module {self.bisect.first_divergent}")
        return out

    def summary(self) -> str:
        if self.passed:
            return (f"pass: {self.converted.path} computes what {self.source.path} computes "
                    f"(max abs err {self.logits.max_abs_err:.2e}; every tensor equal)")
        return f"FAIL: {self.converted.path} is not a right conversion of {self.source.path}: " + "; ".join(
            self.problems())

    def __str__(self) -> str:
        parts = [self.source.line("source"), self.converted.line("converted")]
        if self.inputs:
            parts.append(f"inputs: {self.inputs}")
        if self.logits is not None:
            parts.append(reports.format_table(list(self.logits.rows)))
            if self.logits.lm is not None:
                parts.append("\n".join(self.logits.lm.lines()))
        else:
            parts.append(f"logits: not compared: {self.not_run}")
        parts.append("\n".join(self.tensors.lines()))
        if self.bisect is not None:
            parts.append(str(self.bisect))
        return "\n\n".join(parts + [self.summary()])

    def to_dict(self) -> dict:
        return {"passed": self.passed, "summary": self.summary(),
                "source": vars(self.source) | {"notes": list(self.source.notes)},
                "converted": vars(self.converted) | {"notes": list(self.converted.notes)},
                "inputs": self.inputs, "tensors": self.tensors.to_dict(), "not_run": self.not_run,
                "logits": None if self.logits is None else self.logits.to_dict(),
                "bisect": None if self.bisect is None else self.bisect.to_dict()}


# ------------------------------------------------------------------ the source's tensors


def unwrap(state: dict, where) -> tuple[dict, list[str]]:
    """A state_dict out of what a torch file held: a training checkpoint's ``model`` / ``state_dict``
    entry, and keys without a ``torch.compile``'d model's ``_orig_mod.`` prefix; the lines that say so."""
    notes = []
    entry = weights_entry(state)
    if entry is not None:
        left = [str(k) for k in state if k != entry]
        notes.append(f"a training checkpoint: its weights read from its {entry!r} entry"
                     + (f" (left out: {', '.join(left)})" if left else ""))
        state = state[entry]
    if any(isinstance(k, str) and k.startswith(COMPILED_PREFIX) for k in state):
        notes.append(f"keys start with `{COMPILED_PREFIX}` (a torch.compile'd model's state_dict): the prefix "
                     "stripped")
        state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
    bad = [k for k, v in state.items() if not (isinstance(k, str) and _is_array(v))]
    if bad:
        raise ValueError(f"{where} does not hold a state_dict (names -> tensors): {', '.join(map(str, bad[:5]))} "
                         "are not tensors")
    return state, notes


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def read_state_file(path) -> tuple[dict, list[str]]:
    """(numpy tensors, notes) of a torch or safetensors file, read with ``unwrap`` (a torch file by
    ``safetensors_io.read_torch_pickle``: ``weights_only``, a training checkpoint's entry said in a warning)."""
    from flax_transformer.interop import checkpoints, safetensors_io

    path = Path(path)
    tensors = (checkpoints.read_safetensors(path)[0] if path.suffix == ".safetensors"
               else safetensors_io.read_torch_pickle(path))
    state, notes = unwrap(tensors, path)
    return dict(state), notes


def canonical(torch_model) -> dict[str, np.ndarray]:
    """A torch model's parameters (every name of a tied one) as numpy, float64 for the comparison."""
    from flax_transformer.interop.values import to_numpy

    params = {name for name, _ in torch_model.named_parameters(remove_duplicate=False)}
    return {k: to_numpy(v.detach()) for k, v in torch_model.state_dict().items() if k in params}


def diff(source: dict, converted: dict) -> TensorDiff:
    """Every tensor of both sides by name: values beyond ``TENSOR_RTOL`` of the source's scale differ,
    unless the converted ones are the source's rounded to bf16 or fp16 (then ``rounded`` says so)."""
    import ml_dtypes

    differ, mis_shaped, rounded = [], [], set()
    both = [k for k in source if k in converted]
    for name in both:
        a, b = np.asarray(source[name], np.float64), np.asarray(converted[name], np.float64)
        if a.shape != b.shape:
            mis_shaped.append((name, a.shape, b.shape))
            continue
        size = float(np.max(np.abs(a))) if a.size else 0.0
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        if not np.isfinite(err) or err > TENSOR_RTOL * max(1.0, size):
            at = next((d for d in ROUNDINGS if _rounds_to(a, b, getattr(ml_dtypes, d, np.float16))), None)
            if at is None:
                differ.append((name, err, size))
            else:
                rounded.add(at)
    return TensorDiff(len(both), tuple(differ), tuple(k for k in source if k not in converted),
                      tuple(k for k in converted if k not in source), tuple(mis_shaped),
                      " and ".join(sorted(rounded)))


def _rounds_to(a: np.ndarray, b: np.ndarray, dtype) -> bool:
    """``b`` holds exactly ``dtype``'s values, and they are ``a``'s rounded to ``dtype``."""
    low = b.astype(dtype)
    return bool(np.array_equal(low.astype(np.float64), b) and np.array_equal(a.astype(dtype), low))


def round_like(torch_model, rounded: str):
    """A copy of ``torch_model`` whose weights are rounded to ``rounded`` (as the conversion stored them)."""
    import torch

    if not rounded or " and " in rounded:
        return torch_model
    dtype = getattr(torch, rounded)
    model = copy.deepcopy(torch_model)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))
    return model


# ------------------------------------------------------------------ reading each side


def read_converted(path, *, load=None, pair_model=None):
    """(Flax model, ``Side``) of CONVERTED, by this library's reader; with ``pair_model`` (a pair's
    Flax model), a file of tensors under its torch names fills a copy of it (strictly)."""
    from flax_transformer.interop import checkpoints, hf, meta_llama, porting

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    described = path.is_dir() or (path.suffix == ".safetensors" and checkpoints.read_safetensors(path)[1])
    if pair_model is not None and not described:
        from flax import nnx

        tensors, notes = read_state_file(path)
        model = nnx.clone(pair_model)
        porting.load_state_dict(model, tensors, strict=True)
        return model, Side(str(path), "a state_dict file", "porting.load_state_dict into the pair's Flax model",
                           tuple(notes))
    model = (load or checkpoints.load)(path)
    kind = ("a Meta folder" if meta_llama.is_meta_folder(path) else "an HF folder" if hf.is_model_folder(path)
            else "a folder" if path.is_dir() else "a checkpoint file")
    return model, Side(str(path), kind, "flax_transformer")


@dataclass
class Source:
    """The source, read: the model whose outputs are the reference, and the torch twin (canonical
    names) whose tensors are compared and which ``bisect`` walks."""

    side: Side
    reference: object
    twin: object


def read_source(path, flax_model, converted: Path, *, pair_model=None) -> Source:
    """ORIGINAL read by the reader that does not share the conversion's assumptions (module docstring)."""
    from flax_transformer.interop import hf, meta_llama

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such source: {path}")
    if path.is_dir() and meta_llama.is_meta_folder(path):
        twin = hf.torch_from_pretrained(path)
        return Source(Side(str(path), "a Meta folder", "flax_transformer's Meta reader (its own RoPE rule: "
                           "interleaved -> half split)"), twin, twin)
    if path.is_dir() and hf.is_model_folder(path):
        return _hf_source(path, flax_model)
    if path.is_dir():
        raise ValueError(f"{path} is neither an HF folder (config.json) nor a Meta folder (params.json, "
                         "consolidated.NN.pth); give the source's folder or its state_dict file")
    if path.suffix not in (".pt", ".bin", ".pth", ".safetensors"):
        raise ValueError(f"--source {path}: expected an HF or Meta folder, a torch state_dict (.pt/.bin/.pth) "
                         "or a .safetensors file")
    tensors, notes = read_state_file(path)
    if pair_model is not None:
        twin = pair_model
        reader = "strict load_state_dict into the pair's torch model"
    else:
        twin, how, tensors = _twin_of(flax_model, converted, tensors)
        reader, notes = f"strict load_state_dict into {type(twin).__name__}", notes + [how]
    twin.load_state_dict(hf.torch_state(tensors), strict=True)
    twin.eval()
    return Source(Side(str(path), "a state_dict file", reader, tuple(notes)), twin, twin)


def _hf_source(path: Path, flax_model) -> Source:
    from flax_transformer.interop import hf
    from flax_transformer.verification.verify import TransformersCall

    twin = hf.torch_from_pretrained(path)  # the tensors in canonical names, and what bisect walks
    encoder = type(flax_model).__name__ == "TransformerEncoder"
    try:
        model, missing = hf.transformers_from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - not installed, or a model_type it does not know
        why = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return Source(Side(str(path), "an HF folder", "flax_transformer's HF reader", (
            f"transformers could not read it ({type(error).__name__}: {why}): its outputs are this library's "
            "reading of the folder, which shares a conversion's assumptions",)), twin, twin)
    notes = (f"transformers initialised {len(missing)} missing keys: {', '.join(missing[:5])}",) if missing else ()
    return Source(Side(str(path), "an HF folder", f"transformers ({type(model).__name__})", notes),
                  TransformersCall(model, encoder), twin)


def _twin_of(flax_model, converted: Path, tensors: dict):
    """(the torch twin of CONVERTED's architecture to load a source state_dict into, a line saying so,
    the tensors under its names: an HF folder's ``model_type`` names read through its table)."""
    from flax_transformer.interop import hf, porting
    from flax_transformer.interop.hf_tables import hf_to_ours

    twin = porting.flax_to_torch(flax_model)
    how = f"the architecture read from {converted} (give --pair MODULE:FACTORY to build it yourself)"
    if set(tensors) - set(twin.state_dict()) and converted.is_dir() and (converted / "config.json").is_file():
        kind = hf.read_config(converted).get("model_type")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # task heads the base lacks: the strict load names what is left
            tensors = hf_to_ours(kind, dict(tensors), flax_model.config)
        how += f"; its tensors under transformers' {kind} names"
    return twin, how, tensors


# ------------------------------------------------------------------ the check


def check(converted, source, *, load=None, pair: str | None = None, seed: int = 0, bisect: bool = False,
          use_jit: bool = True) -> SourceReport:
    """CONVERTED checked against SOURCE (module docstring); a ``SourceReport``.

    Args:
        load: how CONVERTED becomes a Flax model (default ``checkpoints.load``; the CLI's reads run
            directories too).
        pair: ``MODULE:FACTORY`` returning (torch model, Flax model, args[, kwargs]): a state_dict
            SOURCE loads into its torch model, a file of tensors CONVERTED into its Flax model, and
            the models run on its arguments.
        bisect: also name the first module that diverges from the source (``bisect.bisect``).
    """
    from flax_transformer.verification import bisect as bisect_module
    from flax_transformer.verification import compare, measure
    from flax_transformer.verification.certificate import subjects

    torch_pair = flax_pair = None
    args, kwargs = (), {}
    if pair is not None:
        torch_pair, flax_pair, args, kwargs = subjects.call_factory(pair)
    flax_model, converted_side = read_converted(converted, load=load, pair_model=flax_pair)
    with warnings.catch_warnings(record=True) as caught:  # what reading the source left out: lines of its own
        warnings.simplefilter("always")
        src = read_source(source, flax_model, Path(converted), pair_model=torch_pair)
    if caught:
        src.side = Side(src.side.path, src.side.kind, src.side.reader,
                        src.side.notes + tuple(str(w.message) for w in caught))
    from flax_transformer.interop import porting

    tensors = diff(canonical(src.twin), porting.state_dict(flax_model))
    if pair is None:
        args = subjects.example_inputs(flax_model, seed=seed)
        inputs = (f"ids {list(np.shape(args[0]))} drawn from the model's input_spec (seed {seed}), "
                  "the last row right-padded")
    else:
        inputs = f"the arguments {pair} returns"
    args, kwargs = measure.fp32_inputs(tuple(args)), measure.fp32_inputs(kwargs)
    spec = flax_model.input_spec() if hasattr(flax_model, "input_spec") else None
    lm = bool(spec is not None and spec.generates and pair is None)
    reference = round_like(src.reference, tensors.rounded)
    report = SourceReport(src.side, converted_side, tensors, inputs=inputs)
    try:
        report.logits = compare.compare(reference, flax_model, args, kwargs, lm=lm, seed=seed, use_jit=use_jit,
                                        lm_mask=subjects.lm_mask(flax_model, args) if lm else None)
    except Exception as error:  # noqa: BLE001 - two models that cannot run on one input: not the same model
        report.not_run = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    if bisect and report.logits is not None:
        report.bisect = bisect_module.bisect(round_like(src.twin, tensors.rounded), flax_model, args, kwargs,
                                             seed=seed, use_jit=use_jit)
    return report
