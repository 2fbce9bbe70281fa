"""LoRA runs: ``train.classify --model hf --lora-rank R`` and ``train.lm --model hf --init FOLDER --lora-rank R``.

A LoRA run fine-tunes low-rank adapters (``models.lora``) on a pretrained base and freezes the base:

* Targets default to PEFT's per model type (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``:
  the llama family ``q_proj, v_proj``, GPT-2 ``c_attn``, BERT and RoBERTa ``query, value``; PEFT has
  none for DistilBERT, whose ``q_lin, v_lin`` are taken here, nor for DeepSeek-V3, whose attention's
  projections are: ``q_a_proj, q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa, kv_b_proj, o_proj``);
  alpha defaults to 2 * rank.
* The classifier trains the adapters and its head fully, as PEFT's ``modules_to_save=["classifier"]``
  does for ``SEQ_CLS``. PEFT wraps every module whose name *ends with* ``classifier``: BERT's
  ``classifier`` (our ``classifier``), DistilBERT's ``pre_classifier`` and ``classifier`` (ours have
  those names), RoBERTa's ``classifier`` head (``dense`` and ``out_proj``: our ``pre_classifier`` and
  ``classifier``). Those train here, exactly (checked against ``get_peft_model``); the pooler stays frozen.
* ``fit(..., wrt=...)`` trains only those; its checkpoints hold everything but the frozen base (the
  adapters, the head, RNG streams, the optimizer state). The run directory's ``lora.json`` records
  the LoRA settings and a checksum of every frozen tensor (``run_checkpoints.array_checksums``), written
  once at the start: a resume or ``load_run`` rebuilds the base from the init folder, adds LoRA with
  the recorded settings, refuses a folder whose weights changed, and restores the checkpoint.
* ``--init-adapter FOLDER`` starts from a PEFT adapter (``interop.peft.load_peft``), whose
  ``adapter_config.json`` decides the settings.
* At the end, ``--export-hf`` writes the model with the adapter folded in (on a copy), and
  ``--export-peft DIR`` the adapter as PEFT writes it, checked in ``peft`` when it is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.models import lora
from flax_transformer.training.errors import RunError
from flax_transformer.training.preflight import check_output
from flax_transformer.training.run_checkpoints import array_checksums
from flax_transformer.training.rundir import is_main_process

RECORD = "lora.json"
# PEFT's default target_modules per model_type (DistilBERT's: PEFT has none; its attention's q and v)
DEFAULT_TARGETS = {**{kind: ("q_proj", "v_proj") for kind in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                                                                 "gemma3_text")},
                   "gpt2": ("c_attn",), "bert": ("query", "value"), "roberta": ("query", "value"),
                   "distilbert": ("q_lin", "v_lin"),
                   # PEFT has none: every projection of multi-head latent attention (there is no v_proj; values and
                   # the keys' no-RoPE part come out of kv_b_proj, from the latent kv_a_proj_with_mqa makes), as
                   # DeepSeek fine-tunes with peft target them; q_proj in place of q_a_proj/q_b_proj when
                   # q_lora_rank is null (default_targets)
                   "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
# our head layers that PEFT's SEQ_CLS modules_to_save (["classifier", "score"], matched as suffixes of module
# names) trains, and the transformers modules they are
HEADS = {"bert": ("classifier",), "distilbert": ("pre_classifier", "classifier"), "roberta": ("pre_classifier", "classifier")}
MODULES_TO_SAVE = {"bert": ["classifier"], "distilbert": ["pre_classifier", "classifier"], "roberta": ["classifier"]}
TOLERANCE = 1e-4  # the --export-peft check: logits through peft against this library's


def check_task(config) -> None:
    """``ValueError`` (a flag error: exit 2, nothing created) for LoRA flags a task config cannot take."""
    if not config.lora.enabled:
        return
    what = "--init-adapter" if config.lora.init_adapter is not None else "--lora-rank"
    if config.model != "hf":
        raise ValueError(f"{what} adds LoRA to a pretrained model: it needs --model hf (and its --init folder), "
                         f"not --model {config.model}")
    if getattr(config, "freeze_encoder", False):
        raise ValueError(f"{what} trains adapters inside the encoder, --freeze-encoder trains the head alone on a "
                         "frozen one: choose one")


def check_flags(config, *, export_peft=None, overwrite: bool = False, init_from_torch=None,
                export_torch_state=None, pooling: str | None = None) -> None:
    """Before anything runs: ``--export-peft`` needs a LoRA run and a writable target; a torch training
    checkpoint (``--init-from-torch``, ``--export-torch-state``) holds a full fine-tune, not an adapter."""
    if config.lora.enabled:
        for flag, given in (("--init-from-torch", init_from_torch), ("--export-torch-state", export_torch_state)):
            if given is not None:
                raise RunError(f"{flag} is a torch training checkpoint of every weight; a LoRA run trains adapters "
                               "(--export-peft writes them, --export-hf the model with them folded in)")
    if export_peft is None:
        return
    if not config.lora.enabled:
        raise RunError("--export-peft writes a LoRA run's adapter: give --lora-rank R (or --init-adapter) with "
                       "--model hf")
    if pooling is not None and pooling != "cls":
        raise RunError("--export-peft: transformers' sequence classifiers read the first token; a --pooling mean "
                       "head has no equivalent there (train with --pooling cls)")
    check_output(export_peft, kind="dir", overwrite=overwrite, flag="--export-peft")


def default_targets(hf_config: dict) -> tuple[str, ...] | None:
    """The default LoRA targets for a model of ``hf_config`` (its config.json), None where there are none."""
    kind = hf_config.get("model_type")
    targets = DEFAULT_TARGETS.get(kind)
    if kind == "deepseek_v3" and hf_config.get("q_lora_rank") is None:  # queries through one q_proj
        targets = ("q_proj", *(t for t in targets if t not in ("q_a_proj", "q_b_proj")))
    return targets


def settings(config, hf_config: dict) -> dict:
    """``lora.apply``'s rank, alpha, dropout and targets for a run of ``config`` on the model of ``hf_config``."""
    given = config.lora
    targets = given.lora_targets or default_targets(hf_config)
    if targets is None:
        raise RunError(f"PEFT has no default LoRA targets for a {hf_config.get('model_type')!r} model: give "
                       "--lora-targets")
    alpha = given.lora_alpha if given.lora_alpha is not None else 2 * given.lora_rank
    return {"rank": given.lora_rank, "alpha": alpha, "dropout": given.lora_dropout, "targets": list(targets),
            "use_rslora": False}


def trained(task: str, kind: str):
    """The nnx filter of what a LoRA run of ``task`` trains: the adapters, and the classifier's head."""
    if task != "classify":
        return lora.LoRAParam
    return nnx.Any(lora.LoRAParam, nnx.All(nnx.Param, nnx.Any(*(nnx.PathContains(n) for n in HEADS[kind]))))


def _frozen(wrt):
    return nnx.All(nnx.Param, nnx.Not(wrt))


def base_checksums(model, wrt) -> dict[str, str]:
    """A checksum of every frozen tensor of ``model`` (what the run does not train)."""
    return array_checksums(nnx.to_pure_dict(nnx.state(model, _frozen(wrt))))


def _rngs(config) -> nnx.Rngs:
    return nnx.Rngs(params=config.run.seed + 2, dropout=config.run.seed + 3)


def _read_record(run_dir) -> dict | None:
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunError(f"{path} is unreadable ({error})") from None


def _has_checkpoint(run_dir) -> bool:
    folder = Path(run_dir) / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


class Adapted:
    """A model with LoRA added for a run: ``wrt`` (what trains) and the record ``write`` keeps."""

    def __init__(self, model, wrt, record: dict):
        self.model, self.wrt, self.record = model, wrt, record

    def write(self, run_dir) -> None:
        """``lora.json`` in the run directory, once (a resumed run keeps the one its start wrote)."""
        path = Path(run_dir) / RECORD
        if is_main_process() and not path.is_file():
            files.write_text(path, json.dumps(self.record, indent=1) + "\n")


def adapt(model, config, *, task: str, folder: Path, run_dir=None, fresh: bool = False) -> Adapted:
    """Add LoRA to ``model`` (the base, as built from ``folder``) in place, for a run of ``config``.

    A run that starts (``fresh``) takes the adapter folder (``--init-adapter``) or the config's settings;
    a resumed or loaded one (``fresh=False``) the settings its ``lora.json`` recorded, and its base must
    be the one recorded there (``RunError`` naming the init folder otherwise)."""
    from flax_transformer.interop import hf

    hf_config = hf.read_config(folder)
    kind = hf_config.get("model_type")
    record = _read_record(run_dir) if run_dir is not None else None
    wrt = trained(task, kind)
    if not fresh and config.lora.init_adapter is not None and not _has_checkpoint(run_dir):
        fresh = True  # resumed before its first checkpoint: the adapter is the folder's still
    if fresh or record is None:
        if config.lora.init_adapter is not None:
            from flax_transformer.interop import peft

            source = Path(config.lora.init_adapter)
            if not source.is_dir():
                raise RunError(f"--init-adapter {source}: no such folder")
            try:
                peft.check_base(source, folder)  # an adapter for another base, where it says which
                peft.load_peft(model, source, rngs=_rngs(config))
            except (ValueError, OSError) as error:
                raise RunError(f"--init-adapter {source}: {error}") from None
        else:
            try:
                lora.apply(model, **settings(config, hf_config), rngs=_rngs(config))
            except ValueError as error:
                raise RunError(f"--lora-targets: {error}") from None
    else:
        lora.apply(model, **record["lora"], rngs=_rngs(config))
        lost = sorted(set(record.get("layers", [])) - set(lora.layers(model)))
        if lost:  # a record that names its adapters' targets but not all of them (no expert "parameters")
            raise RunError(f"{Path(run_dir) / RECORD} does not rebuild the run's LoRA: {len(lost)} of its layers are "
                           f"not adapted by its settings {record['lora']} (e.g. {lost[0]})")
    applied = lora.config_of(model)
    sums = base_checksums(model, wrt)
    if record is not None:
        differ = sorted(k for k in set(sums) | set(record["base"]) if sums.get(k) != record["base"].get(k))
        if differ:
            raise RunError(f"{folder} holds other weights than the base {run_dir} was fine-tuned from ({len(differ)} of "
                           f"its {len(record['base'])} frozen tensors differ, e.g. {differ[0]}): put back the folder "
                           "the run started from")
    record = record or {
        "lora": {**_apply_args(applied), "targets": list(applied.targets), "parameters": list(applied.parameters)},
        "layers": list(lora.layers(model)), "init": str(folder), "init_adapter": config.lora.init_adapter,
        "base": sums}
    sizes = lora.state_sizes(model)
    if fresh and is_main_process():
        print(f"LoRA r={applied.rank}, alpha={applied.alpha:g} on {len(record['layers'])} layers "
              f"({', '.join((*applied.targets, *applied.parameters))}): {sizes.adapted:,} adapter parameters, "
              f"{sizes.fraction:.2%} of the base's {sizes.full:,}", file=sys.stderr)
    return Adapted(model, wrt, record)


def _apply_args(applied: lora.LoRAConfig) -> dict:
    """``lora.apply``'s arguments for the LoRA ``applied`` describes (``lora.config_of``): the linear layers'
    targets and the experts' weights (``parameters``) both, so that the model rebuilt has every adapter."""
    return {"rank": applied.rank, "alpha": applied.alpha, "dropout": applied.dropout, "targets": applied.targets,
            "use_rslora": applied.use_rslora, "parameters": applied.parameters}


def merged(model):
    """A copy of ``model`` with its adapters folded into the base weights, as a plain model (``--export-hf``)."""
    return lora.remove(nnx.clone(model), merge_weights=True)


# ------------------------------------------------------------------------------- --export-peft


def _peft_keys(peft_model, path) -> dict:
    """The adapter's keys that ``peft`` did not load into ``peft_model`` or found no place for."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, load_peft_weights(str(path)))
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    return {"missing_keys": sorted(missing), "unexpected_keys": sorted(result.unexpected_keys)}


def check_peft(path, folder, model, *, task: str, texts=None, ids=None, num_labels: int = 2,
               max_length: int = 512) -> dict:
    """Load the adapter ``path`` in ``peft`` onto transformers' model of ``folder``
    (``AutoModelForSequenceClassification`` or ``AutoModelForCausalLM``) and compare its logits with
    ``model``'s (this library's, eval mode): on ``texts`` (classify) or the token ``ids`` (lm).
    Returns {"max_abs_diff", "loading_info"}; ``loading_info`` names the missing and unexpected adapter keys,
    and the ``lora_B`` tensors that arrived at zero in ``peft`` (when this library's are not all zero)."""
    import torch
    import transformers
    from peft import PeftModel

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" warning: peft loads it
    try:
        if task == "classify":
            base = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=num_labels)
        else:
            base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        theirs = PeftModel.from_pretrained(base, str(path)).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    info = _peft_keys(theirs, path)
    # an adapter that loads "fine" but with lora_B at zero is the base model (the Relax #262 pitfall)
    info["zero_lora_B"] = sorted(n for n, p in theirs.named_parameters() if "lora_B" in n and not p.abs().max() > 0)
    ours_zero = sum(not np.abs(np.asarray(layer.lora_B[...])).max() > 0 for layer in lora.layers(model).values())
    if ours_zero == len(lora.layers(model)):
        info["zero_lora_B"] = []  # an adapter that has not trained yet is zero here too
    if task == "classify":
        batch = transformers.AutoTokenizer.from_pretrained(str(folder))(
            list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        inputs = (batch["input_ids"].numpy(), batch["attention_mask"].numpy())
        with torch.no_grad():
            expected = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.numpy()
    else:
        inputs = (np.asarray(ids)[None],)
        with torch.no_grad():
            expected = theirs(input_ids=torch.from_numpy(inputs[0].astype(np.int64))).logits.float().numpy()
    model.eval()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(nnx.jit(lambda m, *x: m(*x))(model, *inputs), np.float32)
    return {"max_abs_diff": float(np.abs(ours - expected).max()), "loading_info": info}


def _float32_twin(model, base):
    """``base`` (the run's base model built to compute in float32) with ``model``'s LoRA and parameters: what a
    bf16 run's model computes, in float32, to compare with peft's float32 model (``measure.fp32_twin``)."""
    from flax_transformer.verification import measure

    def adapted():
        lora.apply(base, **_apply_args(lora.config_of(model)), rngs=nnx.Rngs(0))
        return base

    # float32 storage either way: the same values
    return measure.fp32_twin(model, build=adapted, fill=lambda twin: nnx.update(twin, nnx.state(model, nnx.Param)),
                             values_differ=True)


def peft_options(task: str, folder) -> dict:
    """``save_peft``'s ``task_type`` and ``modules_to_save`` for a run of ``task`` on the HF folder ``folder``."""
    from flax_transformer.interop import hf

    saved = MODULES_TO_SAVE[hf.read_config(folder)["model_type"]] if task == "classify" else None
    return {"task_type": "SEQ_CLS" if task == "classify" else "CAUSAL_LM", "modules_to_save": saved}


def export_peft(model, path, *, folder: Path, task: str, overwrite: bool = False, float32_base=None, run_dir=None,
                **check) -> dict | None:
    """Write the run's adapter as a PEFT folder (``verification.export.save_peft``, certified: see
    ``certificate.peft``; the classifier's head as ``modules_to_save``), and check it in ``peft``
    (``check_peft``) on real inputs when torch, transformers and peft are installed: no missing or
    unexpected adapter keys, logits within 1e-4 of this library's
    (``float32_base()``, for a run that computes in another dtype: its base built in float32, which
    gets the run's adapters and weights for the comparison). ``RunError`` when the check fails (the
    folder stays, for a look), or when the folder cannot be written (a full disk: the line names it and
    says that ``run_dir``'s checkpoint holds the trained adapter, which ``port --to peft`` writes later)."""
    from flax_transformer.verification import export

    try:
        import peft as _peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        checked = False
    else:
        checked = True
    ours = model if float32_base is None or not checked else _float32_twin(model, float32_base())
    # certified: peft loads the written folder onto the base and computes this model's output and gradients
    try:
        export.save_peft(ours, path, base=folder, overwrite=overwrite, certify=checked, **peft_options(task, folder))
    except OSError as error:  # after the whole run: say what is safe and how to write it again
        run = str(run_dir) if run_dir is not None else "RUN_DIR"
        raise RunError(f"--export-peft {path}: not written ({error.strerror or error}); training finished and its "
                       f"checkpoint is saved in {run}: make room and write the adapter with `flax-transformer port "
                       f"{run} {path} --to peft`") from None
    if not checked:
        print(f"Exported {path} (torch, transformers or peft is not installed here, so it was not checked)",
              file=sys.stderr)
        return None
    report = check_peft(path, folder, ours, task=task, **check)
    problems = [f"{k}: {v}" for k, v in report["loading_info"].items() if v]
    if problems or not report["max_abs_diff"] <= TOLERANCE:
        raise RunError(f"--export-peft {path} does not match in peft: {problems}, max abs logit difference "
                       f"{report['max_abs_diff']:.2e}")
    print(f"Exported {path}: peft's PeftModel loads it onto {folder} with no missing or unexpected adapter keys, and "
          f"its logits are within {report['max_abs_diff']:.1e} of this library's", file=sys.stderr)
    return report
