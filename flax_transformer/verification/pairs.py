"""A checkpoint as a (Flax, torch) pair, and example inputs for any whole model.

``verify --checkpoint`` and ``port --verify`` compare a checkpoint's Flax model with its
torch twin on the same inputs; both come from here, so the CLI holds no family knowledge:
the inputs are drawn from what the model says it reads (``model.input_spec()``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flax_transformer.models._shared import input_spec


def load_pair(src, family: str | None = None, cls: str | None = None, config: str | dict | None = None, *,
              load=None):
    """(flax model, torch model) of a checkpoint, each built from SRC itself where possible.

    SRC is an HF folder, a ``save_safetensors`` file or an orbax folder (they describe their
    model); a bare torch state_dict (``.pt``/``.bin``/``.safetensors`` without a description)
    needs ``family``, ``cls`` and ``config`` (constructor arguments, a dict or JSON text).
    ``load``: how a self-describing SRC becomes a Flax model (default ``checkpoints.load``); a
    layer above passes its own, e.g. the CLI's, which also reads training run directories.
    """
    from flax_transformer.interop import checkpoints, hf, porting

    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if family or cls or config:
        if not (family and cls):
            raise ValueError("--family and --class go together (with --config for the constructor arguments)")
        kwargs = config
        if isinstance(config, str) or config is None:
            try:
                kwargs = json.loads(config) if config else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"--config is not valid JSON: {error}") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--config must be a JSON object of constructor arguments, got {config!r}")
        torch_model = checkpoints.build({"family": family, "class": cls, "init_kwargs": kwargs}, framework="torch")
        weights = checkpoints.read_safetensors(path)[0] if path.suffix == ".safetensors" else hf.read_weights(path)
        torch_model.load_state_dict(hf.torch_state(weights))  # checked, not cast: see hf.torch_state
        torch_model.eval()
        return porting.torch_to_flax(torch_model), torch_model
    if path.is_dir() and (path / "config.json").exists():
        return hf.from_pretrained(path), hf.torch_from_pretrained(path)
    if path.suffix in (".pt", ".bin", ".pth") or (path.suffix == ".safetensors" and
                                                   checkpoints.read_safetensors(path)[1] is None):
        raise ValueError(f"{path} is a bare state_dict: say what it holds (port takes --family, --class and "
                         "--config; an HF checkpoint goes in a folder with its config.json)")
    flax_model = (load or checkpoints.load)(path)
    return flax_model, porting.flax_to_torch(flax_model)


def example_inputs(model, *, seed: int = 0, batch: int = 2, length: int = 9) -> tuple:
    """Random model-level inputs (numpy) for a whole model of either framework.

    ``(ids, mask)`` with the last row right-padded, or for an encoder-decoder
    ``(src_ids, tgt_ids, src_mask, None)`` (the model builds its own causal target mask).
    """
    spec = input_spec(model)
    rng = np.random.default_rng(seed)
    t = min(length, spec.max_length)
    ids = rng.integers(0, spec.vocab_size, size=(batch, t))
    mask = np.ones((batch, t), np.int64)
    mask[-1, max(1, t - 3):] = 0  # right padding
    if spec.encoder_decoder:
        return ids, rng.integers(0, spec.target_vocab_size, size=(batch, t)), mask, None
    return ids, mask
