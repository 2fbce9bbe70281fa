"""Language modelling (notebooks 002 and 004) as a library: ``train_and_evaluate(config, run_dir)``.

A text file (Tiny Shakespeare by default) is tokenised at the character level, or at
the word level with notebook 002's preprocessing and vocabulary, into one token stream.
The first ``1 - val_fraction`` of it is trained on with random windows of ``context``
tokens, the rest is the validation stream. The model is ``gpt.GPTTransformer``
(notebook 002, default), ``former.GTransformer`` (notebook 004) or ``llama.LlamaForCausalLM``
(a Llama-style decoder: RMSNorm, RoPE, grouped-query attention, a gated MLP), or ``hf``: a
pretrained HuggingFace causal LM folder (``init``; Llama, Mistral, Qwen2/3, Gemma, GPT-2), fine-tuned
on the text through the folder's own tokenizer (``hf_init``). At the end the run prints its
validation loss and a sample continued from ``prompt``.

A llama preset (``LMConfig.tiny(model="llama")``, ``--model llama --preset tiny``) keeps the gpt
preset's layers, width, heads and context, and takes ``kv_heads = heads / 2`` and a narrower
``d_ff``, so that its parameter count is about the gpt preset's (``LLAMA_SIZES``).

``experts`` (``--experts E --experts-per-token k``, llama only) makes every feed-forward block a
mixture of E experts of which each token uses k, each expert ``d_ff / k`` wide: a token goes through as
many feed-forward weights as the dense llama of the same flags (equal active parameters; E / k times
as many in all). A mixture of experts (this one, or an ``hf`` folder of Mixtral, Qwen2-MoE, Qwen3-MoE or
OLMoE) trains on ``cross-entropy + router_aux_loss_coef * load-balancing loss``, as transformers'
``outputs.loss``; the load-balancing loss is logged as ``aux_loss``, the cross-entropy as ``lm_loss``,
and the validation loss is the cross-entropy alone (nats per token, comparable with a dense model's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.training import data, hf_init, lora_runs, tokenizers
from flax_transformer.training.batching import Windows
from flax_transformer.training.config_bounds import check_config
from flax_transformer.training.distributed import check_batch_size
from flax_transformer.training.errors import RunError
from flax_transformer.training.loop import batch_evaluator, fit
from flax_transformer.training.optim import OptimConfig, compute_dtype, from_task
from flax_transformer.training.preflight import check_memory, check_output, step_bytes
from flax_transformer.training.run_checkpoints import Checkpoints
from flax_transformer.training.run_config import LoRARunConfig, RunConfig, replace
from flax_transformer.training.rundir import (
    config_of_run,
    is_main_process,
    open_run,
    prepare_run_dir,
    read_run_config,
    read_tokenizer,
)
from flax_transformer.training.step import cross_entropy
from flax_transformer.training.torch_state import to_torch
from flax_transformer.verification import export


@dataclass(frozen=True)
class LMConfig:
    """One language-modelling run."""

    model: str = "gpt"  # "gpt" (gpt.GPTTransformer), "former" (former.GTransformer), "llama" (LlamaForCausalLM), "hf"
    init: str | None = None  # hf: the pretrained causal LM folder to fine-tune (its sizes, dropout and tokenizer)
    level: str = "char"  # "char" or "word" (notebook 002's tokenizer); hf: the folder's tokenizer
    text: str | None = None  # a text file; default tinyshakespeare/input.txt in the data folder
    vocab_size: int = 10_000  # word level only
    n_layers: int = 4
    d_embed: int = 128
    d_ff: int = 512
    heads: int = 4
    kv_heads: int | None = None  # llama only: key/value heads (grouped-query attention); None = heads
    experts: int | None = None  # llama only: a mixture of this many experts per layer; None = a dense MLP
    experts_per_token: int | None = None  # llama with experts: experts per token (k, default 2), each d_ff / k wide
    context: int = 128
    dropout: float = 0.1  # llama: its attention dropout (the only dropout a Llama has)
    val_fraction: float = 0.1
    eval_batches: int = 20  # validation windows read per evaluation: eval_batches * batch_size
    prompt: str = "ROMEO:"
    sample_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None
    run: RunConfig = RunConfig(batch_size=32, steps=2000, eval_every=500)
    optim: OptimConfig = OptimConfig(optimizer="adamw", lr=2e-3, warmup_steps=100, decay="cosine", weight_decay=0.1)
    lora: LoRARunConfig = LoRARunConfig()  # hf: LoRA adapters train, the model is frozen (lora_runs)

    def __post_init__(self):
        check_config(self)  # types and bounds of every field
        lora_runs.check_task(self)
        if self.run.steps is None:
            raise ValueError("--steps must be given")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.level not in ("char", "word"):
            raise ValueError(f"level must be 'char' or 'word', got {self.level!r}")
        if self.d_embed % self.heads:
            raise ValueError(f"d_embed ({self.d_embed}) must be divisible by heads ({self.heads})")
        if self.kv_heads is not None and self.model != "llama":
            raise ValueError(f"--kv-heads applies to --model llama only, not {self.model!r}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads {self.kv_heads} must divide the heads ({self.heads})")
        _check_experts(self)
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must lie in (0, 1), got {self.val_fraction}")
        if self.init is not None and self.model != "hf":
            raise ValueError(f"--init names a pretrained folder for --model hf, not --model {self.model}")
        if self.model == "hf":  # the folder decides these: a value other than the default would be silently ignored
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in HF_DECIDES:
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"--{name.replace('_', '-')} does not apply to --model hf: the model's sizes, "
                                     "dropout and tokenizer are its --init folder's")

    @classmethod
    def tiny(cls, **changes):
        """Seconds on 2 CPU cores, for tests."""
        return replace(cls(), **(_preset("tiny", dict(n_layers=1, d_embed=64, d_ff=256, heads=2, context=64, dropout=0.0,
                                                      batch_size=16, steps=80, lr=3e-3, warmup_steps=10, eval_batches=4,
                                                      eval_every=40, checkpoint_every=40, sample_tokens=60), changes)
                                 | changes))

    @classmethod
    def small(cls, **changes):
        """The 2-core CPU benchmark: character-level Tiny Shakespeare, 4 layers of width 128."""
        return replace(cls(), **(_preset("small", {}, changes) | changes))

    @classmethod
    def base(cls, **changes):
        """nanoGPT's Shakespeare-char size (6 layers of 384, context 256), for a GPU."""
        return replace(cls(), **(_preset("base", dict(n_layers=6, d_embed=384, d_ff=1536, heads=6, context=256,
                                                      dropout=0.2, batch_size=64, steps=5000, lr=1e-3,
                                                      warmup_steps=200, eval_batches=50, sample_tokens=500), changes)
                                 | changes))


def _check_experts(config: LMConfig) -> None:
    """--experts and --experts-per-token: llama only, k at most E, and d_ff divisible into k experts."""
    if config.experts is None:
        if config.experts_per_token is not None:
            raise ValueError("--experts-per-token needs --experts (the number of experts per layer)")
        return
    if config.model != "llama":
        raise ValueError(f"--experts applies to --model llama only, not {config.model!r} (an hf folder's "
                         "experts are its own)")
    k = expert_count_per_token(config)
    if k > config.experts:
        raise ValueError(f"--experts-per-token {k} must be at most --experts ({config.experts})")
    if config.d_ff % k:
        raise ValueError(f"the preset's d_ff ({config.d_ff}) must be divisible by --experts-per-token {k}: each expert is "
                         "d_ff / k wide, so that a token uses d_ff feed-forward units as the dense model's")


def expert_count_per_token(config: LMConfig) -> int:
    """k: ``experts_per_token``, default 2."""
    return 2 if config.experts_per_token is None else config.experts_per_token


MODELS = ("gpt", "former", "llama", "hf")
PRESETS = {"tiny": LMConfig.tiny, "small": LMConfig.small, "base": LMConfig.base}
# What a llama preset changes in the gpt preset of the same name. With kv_heads = heads / 2, q, k, v
# and o hold as many weights as gpt's q, k and v (notebook 002's attention has no output projection);
# the gated MLP's three d_embed x d_ff matrices hold about what gpt's two of 4 * d_embed, its biases,
# LayerNorm shifts and position embeddings (a Llama has none: RoPE) hold. On Tiny Shakespeare (65 characters):
# tiny 57,664 parameters (gpt 58,369), small 755,072 (gpt 759,105), base 9,897,600 (gpt 9,902,657).
LLAMA_SIZES = {"tiny": dict(d_ff=192, kv_heads=1), "small": dict(d_ff=352, kv_heads=2),
               "base": dict(d_ff=1040, kv_heads=3)}


# A fine-tune (model "hf") keeps the folder's sizes and takes a small learning rate. Its context is the
# preset's, cut to the model's positions when --context is not given (train.lm, hf_init.default_context).
# tiny: seconds on 2 CPU cores, for tests; small: the 2-core CPU fine-tune; base: a GPU run.
HF_PRESETS = {
    "tiny": dict(context=64, batch_size=8, steps=20, lr=1e-4, warmup_steps=2, decay="linear", weight_decay=0.01,
                 eval_batches=2, eval_every=10, checkpoint_every=10, sample_tokens=30),
    "small": dict(context=256, batch_size=8, steps=500, lr=5e-5, warmup_steps=50, decay="linear", weight_decay=0.01,
                  eval_batches=10, eval_every=100, sample_tokens=100),
    "base": dict(context=1024, batch_size=16, steps=2000, lr=2e-5, warmup_steps=100, decay="linear",
                 weight_decay=0.01, eval_batches=20, eval_every=500, sample_tokens=200),
}
# the fields a model "hf" run takes from its folder (left at their defaults in its config)
HF_DECIDES = ("level", "vocab_size", "n_layers", "d_embed", "d_ff", "heads", "kv_heads", "dropout", "experts",
              "experts_per_token")
# a mixture of experts' load-balancing loss weight in a from-scratch llama run: the Switch Transformer's and
# OLMoE's (Mixtral and the Qwens default to 0.001); an hf folder keeps its config's router_aux_loss_coef
AUX_LOSS_COEF = 0.01


def _preset(preset: str, sizes: dict, changes: dict) -> dict:
    """What a preset changes in the defaults: its sizes and run (a llama's sized to the gpt's), or a fine-tune's."""
    if changes.get("model") == "hf":
        return HF_PRESETS[preset]
    return sizes | (LLAMA_SIZES[preset] if changes.get("model") == "llama" else {})


def presets(model: str | None = None) -> dict:
    """The presets for ``model`` (``--model``): ``PRESETS`` with the model given (a llama preset is sized
    to the gpt one's parameter count), or ``PRESETS`` itself for None."""
    if model is None:
        return PRESETS
    return {name: functools.partial(preset, model=model) for name, preset in PRESETS.items()}


def read_corpus(config: LMConfig, data_dir=None) -> str:
    path = Path(config.text) if config.text else data.tinyshakespeare(data_dir)
    text = data.read_text(path)
    if not text.strip():
        raise RunError(f"{path} is empty: nothing to train on")
    return text


def build_tokenizer(config: LMConfig, text: str):
    if config.level == "char":
        return tokenizers.characters(text)
    tokenizer = tokenizers.notebook_002(text.splitlines(), max_voc=config.vocab_size)
    tokenizer.no_truncation()
    return tokenizer


def encode(config: LMConfig, tokenizer, text: str) -> np.ndarray:
    if config.model == "hf":
        return hf_init.encode(tokenizer, text)
    if config.level == "char":
        return np.asarray(tokenizer.encode(text).ids, dtype=np.int32)
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def decode(config: LMConfig, tokenizer, ids) -> str:
    if config.model == "hf":
        return hf_init.decode(tokenizer, ids)
    if config.level == "char":
        return tokenizer.decode([int(i) for i in ids])
    return " ".join(tokenizer.id_to_token(int(i)) for i in ids)


def build_model(config: LMConfig, vocab_size: int):
    from flax_transformer.models.attention import set_attention
    from flax_transformer.models.former import GTransformer
    from flax_transformer.models.gpt import GPTTransformer
    from flax_transformer.models.llama import LlamaForCausalLM

    kw = dict(rngs=nnx.Rngs(params=config.run.seed, dropout=config.run.seed + 1), dtype=compute_dtype(config.run.dtype))
    if config.model == "gpt":
        model = GPTTransformer(config.n_layers, config.d_embed, config.d_ff, config.heads, vocab_size, config.context,
                               config.dropout, **kw)
    elif config.model == "llama":
        model = LlamaForCausalLM(llama_config(config, vocab_size), **kw)
    else:
        model = GTransformer(config.d_embed, config.heads, config.n_layers, config.context, vocab_size,
                             dropout=config.dropout, **kw)
    set_attention(model, config.run.attention)
    return model


def llama_config(config: LMConfig, vocab_size: int):
    """The ``LlamaConfig`` of a ``model="llama"`` run: Llama's defaults (RoPE theta 10,000, SiLU, no
    biases, an untied head), the run's sizes, ``max_position_embeddings`` = ``context``. With ``experts``,
    every layer is a mixture of experts as Mixtral's (``model_type`` "mixtral": top-k renormalised), each expert ``d_ff / k`` wide,
    its load-balancing loss weighted ``AUX_LOSS_COEF``."""
    from flax_transformer.models.llama_config import LlamaConfig
    from flax_transformer.models.moe_config import MoeConfig

    k = expert_count_per_token(config)
    moe = None if config.experts is None else MoeConfig(
        num_experts=config.experts, num_experts_per_tok=k, moe_intermediate_size=config.d_ff // k,
        norm_topk_prob=True, fp32_routing_weights=True, router_aux_loss_coef=AUX_LOSS_COEF)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=config.d_embed, intermediate_size=config.d_ff,
                       num_hidden_layers=config.n_layers, num_attention_heads=config.heads,
                       num_key_value_heads=config.kv_heads, max_position_embeddings=config.context,
                       attention_dropout=config.dropout, moe=moe, model_type="llama" if moe is None else "mixtral")


def moe_of(model):
    """The ``MoeConfig`` of a llama-family mixture of experts, else None (a dense model of any family)."""
    from flax_transformer.models.llama import LlamaForCausalLM

    return model.config.moe if isinstance(model, LlamaForCausalLM) else None


def _losses(model, batch):
    """(cross-entropy, load-balancing loss or None, metrics) of one (b, t) window."""
    count = {"count": jnp.asarray(batch["ids"].size, jnp.float32)}
    moe = moe_of(model)
    if moe is None:
        return cross_entropy(model(batch["ids"]), batch["labels"]), None, count
    from flax_transformer.models.moe import load_balancing_loss

    logits, router_logits = model(batch["ids"], output_router_logits=True)
    ce = cross_entropy(logits, batch["labels"])
    aux = load_balancing_loss(router_logits, moe.num_experts, moe.num_experts_per_tok)  # windows hold no padding
    return ce, aux, count | {"lm_loss": ce, "aux_loss": aux}


def loss_fn(model, batch):
    """The training objective: the mean next-token cross-entropy over the (b, t) window, plus
    ``router_aux_loss_coef`` times the load-balancing loss for a mixture of experts (transformers'
    ``outputs.loss`` with ``output_router_logits=True``; ``lm_loss`` and ``aux_loss`` among the metrics).
    Returns (loss, metrics)."""
    ce, aux, metrics = _losses(model, batch)
    return (ce if aux is None else ce + moe_of(model).router_aux_loss_coef * aux), metrics


def eval_loss_fn(model, batch):
    """The validation loss: the cross-entropy alone (nats per token, whatever the model), a mixture of
    experts' load-balancing loss among the metrics. Returns (loss, metrics)."""
    ce, _, metrics = _losses(model, batch)
    return ce, metrics


def prompt_ids(config: LMConfig, tokenizer) -> np.ndarray:
    """The prompt's token ids; ``RunError`` unless it has 1 to ``context - 1`` of them."""
    from flax_transformer.training.prompts import PromptError

    try:
        prompt = (hf_init.prompt_ids(tokenizer, config.prompt) if config.model == "hf"
                  else encode(config, tokenizer, config.prompt))
    except PromptError as error:  # characters an hf run's tokenizer cannot encode, named
        raise RunError(str(error)) from None
    except Exception:  # the Rust tokenizer refuses a character it has no id for (no unknown token at char level)
        unknown = sorted(set(config.prompt) - set(tokenizer.get_vocab()))
        raise RunError(f"--prompt {config.prompt!r} has characters the text does not have ({''.join(unknown)!r}), "
                       "so the model has no token for them") from None
    if len(prompt) == 0 or len(prompt) >= config.context:
        raise RunError(f"--prompt {config.prompt!r} encodes to {len(prompt)} tokens; it needs 1 to "
                       f"{config.context - 1} (--context {config.context})")
    return prompt


def sample(config: LMConfig, model, tokenizer, *, seed: int | None = None) -> str:
    """``prompt`` continued by up to ``sample_tokens`` tokens (within the model's context)."""
    return continue_text(config, model, tokenizer, config.prompt, seed=seed)


def continue_text(config: LMConfig, model, tokenizer, prompt: str, *, max_new_tokens: int | None = None,
                  temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                  greedy: bool = False, seed: int | None = None) -> str:
    """``prompt`` and its continuation by up to ``max_new_tokens`` (default: the run's ``sample_tokens``)
    tokens, within the model's context. Sampling settings default to the run's; ``RunError`` for a
    prompt the tokenizer cannot encode or that leaves no room in the context."""
    from flax_transformer.models.generate import generate

    ids = prompt_ids(dataclasses.replace(config, prompt=prompt), tokenizer)
    room = config.context - len(ids)
    new = room if max_new_tokens is None and config.sample_tokens > room else (max_new_tokens or config.sample_tokens)
    if new > room:
        raise RunError(f"the prompt has {len(ids)} tokens: at most {room} new ones fit in the context ({config.context})")
    tokens = generate(model, ids[None], new, temperature=config.temperature if temperature is None else temperature,
                      top_k=config.top_k if top_k is None else top_k, top_p=top_p, greedy=greedy,
                      seed=config.run.seed if seed is None else seed)
    return decode(config, tokenizer, np.concatenate([ids, np.asarray(tokens)[0]]))


def _windows(config: LMConfig, stream: np.ndarray, cut: int, source) -> tuple[Windows, Windows]:
    """The train and validation windows, refused (``RunError``) when either part is shorter than one window."""
    for part, tokens in (("training", cut), ("validation", len(stream) - cut)):
        if tokens < config.context + 1:
            raise RunError(f"{source}: its {part} part has {tokens:,} tokens, less than one window of --context "
                           f"{config.context} (+1): use a longer text or a smaller --context")
    return (Windows(stream[:cut], batch_size=config.run.batch_size, length=config.context, seed=config.run.seed),
            Windows(stream[cut:], batch_size=config.run.batch_size, length=config.context, seed=config.run.seed))


def train_and_evaluate(config: LMConfig, run_dir, *, data_dir=None, resume: bool = False, progress: bool = True,
                       export_torch=None, overwrite: bool = False, mesh=None, init_from_torch=None,
                       export_torch_state=None, export_hf=None, export_peft=None) -> dict:
    """Train, then report validation loss (nats per token) and a sample; returns the metrics.

    Everything that can be checked is checked before the run directory is made: the
    configuration, the init folder and its tokenizer (model "hf"), the text (long enough for a
    window in both parts), the prompt, ``export_torch`` and ``export_hf`` (an existing output is
    replaced only with ``overwrite``), the batch against the mesh, and whether a step fits in memory.
    A fine-tune (model "hf") also reports ``init_val_loss``, the init model's validation loss; a LoRA one
    (``config.lora``: ``lora_runs``) can write ``export_peft``, its adapter as a PEFT folder."""
    run_dir = Path(run_dir)
    run_config = {"task": "lm", **dataclasses.asdict(config)}
    if config.init is None:  # run.json as before the field: a run begun then still resumes (its fields compared)
        del run_config["init"]
    kept = _saved_fields(run_dir) if resume else set()
    for name in ("experts", "experts_per_token"):  # the same for these, unless the run being resumed wrote them
        if run_config[name] is None and name not in kept:
            del run_config[name]
    prepare_run_dir(run_dir, run_config, resume=resume)
    folder = hf_init.lm_folder(config, run_dir=run_dir if resume else None) if config.model == "hf" else None
    hf_tokenizer = hf_init.lm_tokenizer(config, folder) if folder is not None else None
    hf_init.check_lm_export_target(config, export_hf, overwrite)
    check_output(export_torch, kind="file", overwrite=overwrite, flag="--export-torch")
    lora_runs.check_flags(config, export_peft=export_peft, overwrite=overwrite, init_from_torch=init_from_torch,
                          export_torch_state=export_torch_state)
    to_torch.check_entry_flags(config, init_from_torch=init_from_torch, export_torch_state=export_torch_state,
                                  overwrite=overwrite, resume=resume)
    check_batch_size(config.run.batch_size, mesh)
    text = read_corpus(config, data_dir)
    tok_path = run_dir / "tokenizer.json"
    saved_tokenizer = resume and tok_path.is_file()
    # every process builds the same tokenizer; process 0 writes it
    tokenizer = (read_tokenizer(tok_path) if saved_tokenizer
                 else hf_tokenizer if hf_tokenizer is not None else build_tokenizer(config, text))
    stream = encode(config, tokenizer, text)
    cut = int(len(stream) * (1 - config.val_fraction))
    train, val = _windows(config, stream, cut, config.text or "the text")
    prompt_ids(config, tokenizer)
    vocab = tokenizer.get_vocab_size()
    sizes = (hf_init.step_sizes(folder) if folder is not None else dict(
        width=max(config.d_embed, config.d_ff // 4), heads=config.heads, layers=config.n_layers, vocab=vocab))
    check_memory(step_bytes(batch=config.run.batch_size, length=config.context, attention=config.run.attention,
                            devices=mesh.size if mesh is not None else 1, **sizes), "--context or --batch-size")
    model = hf_init.build_lm(config, folder, mesh) if folder is not None else build_model(config, vocab)
    adapted = (lora_runs.adapt(model, config, task="lm", folder=folder, run_dir=run_dir, fresh=not resume)
               if config.lora.enabled else None)
    what = hf_init.describe(folder) if folder is not None else f"{config.model} at {config.level} level"
    if moe_of(model) is not None:
        moe = moe_of(model)
        what += (f", a mixture of {moe.num_experts} experts ({moe.num_experts_per_tok} per token, load-balancing "
                 f"loss x {moe.router_aux_loss_coef:g})")
    with open_run(run_dir, run_config, resume=resume):
        if not saved_tokenizer and is_main_process():
            files.write_file(tok_path, lambda tmp: tokenizer.save(str(tmp)), overwrite=True)
            if folder is not None:
                hf_init.record_init(run_dir, folder)
        if adapted is not None:
            adapted.write(run_dir)
        print(f"lm: {what}: {len(stream):,} tokens ({cut:,} train), vocabulary "
              f"{vocab}, {config.run.steps} steps of {config.run.batch_size} x {config.context} tokens "
              f"({config.run.steps * config.run.batch_size * config.context / cut:.1f} passes)", file=sys.stderr)
        evaluate = batch_evaluator(eval_loss_fn, lambda: val.fixed(config.eval_batches))
        before = {}
        if folder is not None and not resume:  # where the fine-tune starts from, on the same validation windows
            if mesh is None:  # committed to the device as fit's arrays are: the final evaluation reuses this program
                nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
            before = {"init_val_loss": evaluate(model)["loss"]}
            print(f"the init model's validation loss: {before['init_val_loss']:.4f} nats/token", file=sys.stderr)
        result = fit(model, from_task(config, config.run.steps), loss_fn, train, run_dir=run_dir, steps=config.run.steps,
                     run_config=run_config, evaluate=evaluate, eval_every=config.run.eval_every,
                     checkpoint_every=config.run.checkpoint_every, keep=config.run.keep, resume=resume, progress=progress,
                     mesh=mesh, description="lm-hf" if folder is not None else f"lm-{config.model}-{config.level}",
                     init_from_torch=init_from_torch, wrt=adapted.wrt if adapted else nnx.Param)
        metrics = {"step": result.step, "interrupted": result.interrupted, **before,
                   **{f"val_{k}": v for k, v in result.metrics.items() if k != "count"}}
        if not result.interrupted:
            metrics["val_bits_per_token"] = metrics["val_loss"] / math.log(2)
            metrics["sample"] = sample(config, result.model, tokenizer)
            if is_main_process():
                files.write_text(run_dir / "sample.txt", metrics["sample"] + "\n", overwrite=True)
        final = result.model
        if adapted is not None and not result.interrupted and is_main_process():
            if export_peft is not None:
                metrics["peft_check"] = lora_runs.export_peft(
                    final, export_peft, folder=folder, task="lm", overwrite=overwrite, ids=next(val.fixed(1))["ids"][0],
                    run_dir=run_dir,
                    float32_base=None if config.run.dtype == "float32" else lambda: hf_init.build_lm(
                        replace(config, dtype="float32"), folder))
            final = lora_runs.merged(final)  # --export-hf and --export-torch: the adapters folded in
        if export_torch is not None and is_main_process():
            export.save_safetensors(final, export_torch, overwrite=overwrite)
            print(f"Exported {export_torch}: the trained weights under torch_reference's names (safetensors), checked "
                  "in torch, with their certificate beside them", file=sys.stderr)
        if export_torch_state is not None and not result.interrupted and is_main_process():
            to_torch.export_checkpoint(run_dir, export_torch_state, load_run(run_dir)[0],
                                          from_task(config, config.run.steps), overwrite=overwrite)
            print(f"Exported {export_torch_state}: a torch training checkpoint at step {result.step} (model, Adam moments,"
                  " LambdaLR, step) that a plain torch loop or --init-from-torch continues", file=sys.stderr)
        if export_hf is not None and not result.interrupted and is_main_process():
            metrics["export_check"] = hf_init.export_lm(
                final, export_hf, folder=folder, text=text[-20 * config.context:], length=config.context,
                overwrite=overwrite)
    return metrics


def _saved_fields(run_dir: Path) -> set[str]:
    """The fields of ``run_dir``'s run.json; none when it cannot be read (``prepare_run_dir`` says why)."""
    try:
        return set(read_run_config(run_dir))
    except RunError:
        return set()


def load_run(run_dir, *, step: int | None = None):
    """(model, tokenizer, config) of an lm run directory's latest (or given) checkpoint."""
    run_dir = Path(run_dir)
    config = config_of_run(run_dir, "lm", LMConfig)
    tokenizer = read_tokenizer(run_dir / "tokenizer.json")
    model = (hf_init.build_lm(config, hf_init.lm_folder(config, run_dir=run_dir))
             if config.model == "hf" else build_model(config, tokenizer.get_vocab_size()))
    wrt = nnx.Param
    if config.lora.enabled:  # the checkpoints hold the adapters; the base is the init folder's
        wrt = lora_runs.adapt(model, config, task="lm", folder=Path(config.init), run_dir=run_dir).wrt
    checkpoints = Checkpoints(run_dir, keep=config.run.keep, read_only=True)
    try:
        model, _ = checkpoints.restore_model(model, step, wrt=wrt)
    finally:
        checkpoints.close()
    model.eval()
    return model, tokenizer, config
