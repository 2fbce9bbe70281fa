"""``flax-transformer generate --checkpoint FOLDER``: continue a prompt with an HF causal LM folder (GPT-2, the
llama family) or a Meta folder (``consolidated.NN.pth`` + ``params.json``), read with its own tokenizer
(``training.prompts.folder_tokenizer``).

The flags are the run path's. Without ``--greedy`` or a sampling flag, the folder's ``generation_config.json``
decides, as it does for transformers' ``generate``: ``do_sample`` (absent: greedy), ``temperature``, ``top_k``,
``top_p`` (transformers' defaults where it sets none: 1.0, 50, 1.0), ``max_new_tokens`` (or ``max_length``
less the prompt; neither: 32 new tokens, cut to the position table), the stop ids. ``--temperature``,
``--top-k`` or ``--top-p`` sample with the folder's values for the flags not given; ``--greedy`` takes the
argmax. Its fields that change the tokens and that this loop does not compute (``repetition_penalty``,
``num_beams``, ...) are named on stderr: the tokens are then not those transformers' ``generate`` gives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flax_transformer.interop import files

DEFAULT_NEW_TOKENS = 32
# transformers' GenerationConfig defaults for the fields a sampled step reads
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
# generation_config.json fields that change the tokens, at the value that changes nothing
NOT_COMPUTED = {"repetition_penalty": 1.0, "num_beams": 1, "no_repeat_ngram_size": 0, "min_length": 0,
                "min_new_tokens": 0, "typical_p": 1.0, "min_p": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None, "encoder_repetition_penalty": 1.0,
                "penalty_alpha": None, "sequence_bias": None, "guidance_scale": None, "num_beam_groups": 1,
                "diversity_penalty": 0.0, "exponential_decay_length_penalty": None, "top_h": None}


@dataclass(frozen=True)
class Continuation:
    """The prompt's ids, the new ids (up to and with the first stop id) and the whole text."""

    prompt: np.ndarray
    new: np.ndarray
    text: str
    notes: tuple[str, ...]


def sampling(generation: dict, *, greedy: bool, temperature, top_k, top_p) -> dict:
    """``generate``'s sampling arguments from the flags, the folder's ``generation_config.json`` and transformers'
    defaults, in that order."""
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    sample = not greedy and (any(v is not None for v in flags.values()) or bool(generation.get("do_sample")))
    if not sample:
        return dict(greedy=True)
    chosen = {name: value if value is not None else generation.get(name) if generation.get(name) is not None
              else SAMPLING_DEFAULTS[name] for name, value in flags.items()}
    return dict(greedy=False, temperature=float(chosen["temperature"]),
                top_k=int(chosen["top_k"]) or None, top_p=float(chosen["top_p"]))  # top_k 0: no cut, as transformers


def not_computed(generation: dict) -> tuple[str, ...]:
    """One line for each field of ``generation_config.json`` that changes the tokens and is not computed here."""
    return tuple(f"{name}={generation[name]!r}" for name, neutral in NOT_COMPUTED.items()
                 if generation.get(name, neutral) not in (neutral, None, []))


def continue_folder(folder, prompt: str, *, max_new_tokens: int | None = None, greedy: bool = False,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None) -> Continuation:
    """``prompt`` continued by the folder's model with its own tokenizer (see the module's docstring)."""
    from flax_transformer.interop import hf
    from flax_transformer.models.generate import generate
    from flax_transformer.models.input_specs import input_spec
    from flax_transformer.training import prompts

    folder = Path(folder)
    if not hf.is_model_folder(folder):
        raise ValueError(f"{folder} is neither a train.lm run (run.json), an HF folder (config.json) nor a Meta "
                         "folder (params.json, consolidated.NN.pth)")
    tokens = prompts.folder_tokenizer(folder)  # before the weights: a folder without a tokenizer fails at once
    generation = files.read_json_object(folder, "generation_config.json") if (
        folder / "generation_config.json").is_file() else {}
    ids = prompts.prompt_ids(tokens.tokenizer, prompt, prefix=tokens.prefix)
    model = hf.from_pretrained(folder)
    spec = input_spec(model)
    if not spec.generates:
        raise ValueError(f"{folder} holds a {type(model).__name__}, not a causal language model: nothing to generate")
    have = tokens.tokenizer.get_vocab_size(with_added_tokens=True)
    if have > spec.output_vocab_size:
        raise ValueError(f"{folder}'s {tokens.source} has {have:,} tokens but its model only "
                         f"{spec.output_vocab_size:,}: the tokenizer does not belong to these weights")
    room = spec.max_length - len(ids)
    if max_new_tokens is None:
        given = generation.get("max_new_tokens")
        if given is None and generation.get("max_length") is not None:
            given = generation["max_length"] - len(ids)
        max_new_tokens = max(1, min(room, DEFAULT_NEW_TOKENS if given is None else given))
    settings = sampling(generation, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    stops = tokens.eos_ids
    new = np.asarray(generate(model, ids[None], max_new_tokens, eos_id=stops[0] if stops else None,
                              seed=0 if seed is None else seed, **settings))[0]
    ends = np.flatnonzero(np.isin(new, stops)) if stops else []
    if len(ends):  # the first stop id of any kind ends the text, kept as transformers keeps it
        new = new[:ends[0] + 1]
    text = tokens.tokenizer.decode([int(i) for i in np.concatenate([ids, new])], skip_special_tokens=True)
    return Continuation(ids, new, text, not_computed(generation))


def run(args) -> int:
    """``generate --checkpoint FOLDER``: print the prompt and its continuation."""
    result = continue_folder(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, greedy=args.greedy,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if result.notes:
        print(f"note: {args.checkpoint}/generation_config.json sets {', '.join(result.notes)}, which generate does "
              "not compute: these tokens are not what transformers' generate gives", file=sys.stderr)
    print(result.text)
    return 0
