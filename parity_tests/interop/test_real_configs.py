"""The ``config.json`` files of widely used checkpoints, as their model repositories publish them
(``data/real_configs.json``: BERT, RoBERTa, DistilBERT, GPT-2, Llama 2 and 3.1, Mistral, Qwen2 and 3,
Gemma 1-3, Mixtral, Qwen1.5-MoE, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3; written by transformers 4.6 to 4.55).

The readers refuse every field they neither compute nor know to be ignorable (issue 36 item 6); the
fields of real folders, old bookkeeping included (``gradient_checkpointing``, ``pretraining_tp``,
``n_ctx``, ``summary_*``, DeepSeek's ``ep_size``), must still read. Each is read the same way as
transformers reads it: the config transformers builds from the file, written back by its
``to_dict()``, gives this library the same config as the file itself.
"""

import json
import warnings
from pathlib import Path

import pytest

from flax_transformer.interop.hf_tables import config_of

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")
REAL = json.loads((Path(__file__).parent / "data" / "real_configs.json").read_text())


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_published_config_reads_as_transformers_reads_it(name):
    raw = REAL[name]
    kind, ours = config_of(dict(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoConfig.for_model(**raw).to_dict()
    assert config_of(theirs) == (kind, ours), name


def test_what_the_published_configs_compute():
    """A few fields each reader must read from these files, not default."""
    assert config_of(REAL["Llama-3.1-8B"])[1].rope_scaling.factor == 8.0
    assert config_of(REAL["Mistral-7B-v0.1"])[1].sliding_window == 4096
    assert config_of(REAL["Qwen2-7B"])[1].sliding_window is None  # use_sliding_window false: no window
    gemma2 = config_of(REAL["gemma-2-2b"])[1]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.sliding_window) == (50.0, 30.0, 4096)
    assert config_of(REAL["DeepSeek-V3"])[1].moe.first_k_dense_replace == 3
