"""``python -m train.lm --model hf --init FOLDER``: a pretrained HF causal LM fine-tuned with its own tokenizer.

The folders are tiny and random (width 32, one layer), with a BPE tokenizer of under 200 tokens
trained here on the text, saved as transformers saves them. One llama run is trained once per
module with ``--export-hf``; the tests read it: the loss falls from the init model's, the export
loads in transformers with no missing or unexpected keys and its logits equal the run's model's
at 1e-5, an interrupted run resumed equals it bit for bit, ``load_run`` rebuilds it (and says
so when the init folder has moved). Then each refusal, before anything is written, and a GPT-2 folder.
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from flax_transformer.training import errors, lm, run_checkpoints, rundir
from flax_transformer.training.run_loading import load_model, load_run

LINES = ["ROMEO: but soft, what light through yonder window breaks?",
         "JULIET: O Romeo, Romeo! wherefore art thou Romeo?",
         "MERCUTIO: a plague o' both your houses! they have made worms' meat of me."]
TEXT = "\n".join(LINES * 60) + "\n"
STEPS = 8
GEMMAS = {  # model_type -> (transformers' config class, switches): Gemma 2's caps that bite; Gemma 3's q/k norms,
    # linear scaling on its full layer and its sliding layer's own base
    "gemma2": ("Gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3Text", dict(layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
        sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
}


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _tokenizer():
    """A Llama-like BPE (Metaspace pieces, ``<s>`` before a text) of fewer than 200 tokens, trained on LINES."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _folder(path, kind="llama", tokenizer=True, **changes):
    """A random tiny HF folder of ``kind`` ("llama", "gpt2", "bert") as transformers writes it."""
    import torch
    import transformers

    fast = _tokenizer()
    vocab = len(fast)
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                          bos_token_id=1, eos_token_id=2, **changes)
        model = transformers.LlamaForCausalLM(config)
    elif kind in GEMMAS:  # two layers: a 4-key window on the first, Gemma's sandwich norms, a scalar not head_dim
        family, switches = GEMMAS[kind]
        config = getattr(transformers, f"{family}Config")(
            vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, sliding_window=4, query_pre_attn_scalar=12, **switches, **changes)
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(**{"vocab_size": vocab, "n_positions": 64, "n_embd": 32, "n_layer": 1,
                                            "n_head": 2, "bos_token_id": 1, "eos_token_id": 2, **changes})
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64)
        model = transformers.BertModel(config)
    model.save_pretrained(path)
    if tokenizer:
        fast.save_pretrained(path)
    return path


def _config(folder, text, **changes):
    return lm.LMConfig.tiny(**{"model": "hf", "init": str(folder), "text": str(text), "context": 32,
                               "steps": STEPS, "lr": 3e-3, "eval_every": 4, "checkpoint_every": 4,
                               "eval_batches": 2, "sample_tokens": 12, **changes})


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted llama run with --export-hf: (tmp folder, metrics)."""
    tmp = tmp_path_factory.mktemp("lm_hf")
    (tmp / "text.txt").write_text(TEXT)
    _folder(tmp / "init", attention_dropout=0.1)  # dropout on: the saved RNG streams matter for resume
    with jax.numpy_dtype_promotion("standard"):
        metrics = lm.train_and_evaluate(_config(tmp / "init", tmp / "text.txt"), tmp / "whole", progress=False,
                                        export_hf=tmp / "export")
    return tmp, metrics


@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state (an HF folder "
                  "trained), test_gpt2_folder_exports_and_the_default_context")
def test_fine_tune_lowers_the_loss_and_exports_a_folder_transformers_loads(whole):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, metrics = whole
    assert metrics["step"] == STEPS and not metrics["interrupted"]
    assert metrics["val_loss"] < metrics["init_val_loss"] - 0.5  # it learnt from where the folder started
    assert metrics["sample"].startswith("ROMEO:") and len(metrics["sample"]) > len("ROMEO:")
    saved = json.loads((tmp / "whole" / "run.json").read_text())
    assert saved["model"] == "hf" and saved["init"] == str(tmp / "init") and saved["context"] == 32
    assert (tmp / "whole" / "init_config.json").is_file() and (tmp / "whole" / "tokenizer.json").is_file()

    # the export: transformers' own loader, no missing or unexpected keys, the run's model's logits at 1e-5
    check = metrics["export_check"]
    assert check["same_ids"] and not any(check["loading_info"].values()) and check["max_abs_diff"] < 1e-5
    export = tmp / "export"
    assert (export / "verification.json").is_file() and (export / "tokenizer_config.json").is_file()
    assert json.loads((export / "config.json").read_text())["bos_token_id"] == 1  # carried from the init folder
    theirs, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model, tokenizer, config = lm.load_run(tmp / "whole")
    ids = lm.encode(config, tokenizer, TEXT[:400])[None, :32]
    assert AutoTokenizer.from_pretrained(export)(TEXT[:400], add_special_tokens=False)["input_ids"][:32] == ids[0].tolist()
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=1e-5, rtol=0)
    # not the init folder's logits: the export holds the fine-tuned weights
    init = AutoModelForCausalLM.from_pretrained(tmp / "init").eval()
    with torch.no_grad():
        assert np.abs(init(torch.from_numpy(ids.astype(np.int64))).logits.numpy() - expected).max() > 1e-2

    # the run back as a Run and a model; a moved init folder is named
    assert load_run(tmp / "whole").task == "lm" and type(load_model(tmp / "whole")).__name__ == "LlamaForCausalLM"
    moved = tmp / "moved"
    (tmp / "init").rename(moved)
    try:
        with pytest.raises(errors.RunError, match="not there any more"):
            lm.load_run(tmp / "whole")
    finally:
        moved.rename(tmp / "init")


@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state (an HF folder "
                  "trained), test_gpt2_folder_exports_and_the_default_context")
def test_the_stream_has_no_special_tokens_and_the_prompt_starts_as_the_template_says(whole, tmp_path):
    from flax_transformer.training import hf_init

    tmp, _ = whole
    config = _config(tmp / "init", tmp / "text.txt")
    tokenizer = hf_init.lm_tokenizer(config, tmp / "init")
    stream = hf_init.encode(tokenizer, TEXT)
    assert 1 not in stream and 2 not in stream and len(stream) > 1000  # no <s> or </s> inside the text
    prompt = hf_init.prompt_ids(tokenizer, "ROMEO: but")
    assert prompt[0] == 1 and prompt[1:].tolist() == hf_init.encode(tokenizer, "ROMEO: but").tolist()
    assert hf_init.decode(tokenizer, prompt) == "ROMEO: but"
    tokenizer.post_processor = None  # a template that adds nothing (GPT-2's, Qwen's): nothing before the prompt
    assert hf_init.prompt_ids(tokenizer, "ROMEO: but").tolist() == prompt[1:].tolist()

    # a folder's tokenizer.json that truncates (at 512, often) does not cut the stream
    truncating = tmp_path / "truncating"
    shutil.copytree(tmp / "init", truncating)
    saved = json.loads((truncating / "tokenizer.json").read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (truncating / "tokenizer.json").write_text(json.dumps(saved))
    tokenizer = hf_init.lm_tokenizer(_config(truncating, tmp / "text.txt"), truncating)
    assert hf_init.encode(tokenizer, TEXT).tolist() == stream.tolist()


@pytest.mark.slow(reason="test_runs' resume test, test_fit_wrt's (the same fit and checkpoints)")
def test_resume_equals_the_uninterrupted_run(whole, tmp_path):
    """The run as a process killed after its step-4 checkpoint leaves it, continued by ``--resume`` alone (the
    model rebuilt from the init folder, then the checkpoint restored): every saved array and the logs equal."""
    from train.lm import main

    from .test_llama_training import _assert_same_state

    tmp, _ = whole
    split = tmp_path / "split"
    shutil.copytree(tmp / "whole", split)
    shutil.rmtree(split / "checkpoints" / str(STEPS))
    (split / "sample.txt").unlink()
    assert run_checkpoints.Checkpoints(split, read_only=True).latest() == 4
    assert main(["--out", str(split), "--resume", "--no-progress"]) == 0
    _assert_same_state(tmp / "whole", split)

    def losses(run):
        return [(r["step"], r["split"], r["loss"]) for r in rundir.read_metrics(run)]
    assert losses(tmp / "whole") == losses(split)
    assert (split / "sample.txt").read_text() == (tmp / "whole" / "sample.txt").read_text()


def test_each_refusal_is_one_line_before_anything_is_written(tmp_path, capsys):
    from train.lm import main

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    good = _folder(tmp_path / "good")
    no_tok = _folder(tmp_path / "no_tok", tokenizer=False)
    bert = _folder(tmp_path / "bert", kind="bert")
    multimodal = tmp_path / "gemma3"  # its config is read and refused before any weights: none are needed
    multimodal.mkdir()
    (multimodal / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    run = tmp_path / "run"
    capsys.readouterr()  # what saving the folders printed
    base = ["--preset", "tiny", "--out", str(run), "--text", str(text), "--no-progress"]
    cases = [
        (["--model", "hf", "--init", str(no_tok)], "no tokenizer.json"),
        (["--model", "hf", "--init", str(bert)], "'bert' model, not a causal LM"),
        (["--model", "hf", "--init", str(multimodal)], "multimodal Gemma 3: train its language model from a gemma3_text"),
        (["--init", str(good)], "--init names a pretrained folder for --model hf"),
        (["--model", "hf"], "--model hf needs --init FOLDER"),
        (["--model", "hf", "--init", str(tmp_path / "nowhere")], "no such folder"),
        (["--model", "hf", "--init", str(good), "--context", "65"], "--context 65 is longer than the model takes: 64"),
        (["--model", "hf", "--init", str(good), "--level", "char"], "--level does not apply to --model hf"),
        (["--model", "hf", "--init", str(good), "--kv-heads", "1"], "--kv-heads applies to --model llama only"),
        (["--model", "hf", "--init", str(good), "--export-hf", str(tmp_path / "taken")], "--export-hf"),
        (["--export-hf", str(tmp_path / "new")], "--export-hf writes the fine-tuned HuggingFace model"),
    ]
    for flags, message in cases:
        try:
            status = main(base + flags)
        except SystemExit as exit:  # a wrong flag: exit 2 as argparse's, raised before the run (UsageError)
            status = exit.code
        assert status == 2, flags
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (flags, err)
        assert not run.exists() and not (tmp_path / "new").exists(), flags
    assert (tmp_path / "taken" / "x").read_text() == "x"  # an existing export is not touched without --overwrite

    # a run begun before the init field existed (its run.json without it) still resumes: the resume gets past
    # the comparison of configurations, to the next check
    old = tmp_path / "old"
    old.mkdir()
    saved = {"task": "lm", **dataclasses.asdict(lm.LMConfig.tiny(text=str(text)))}
    (old / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "init"}))
    with pytest.raises(errors.RunError, match="--export-hf writes the fine-tuned"):
        lm.train_and_evaluate(lm.LMConfig.tiny(text=str(text)), old, resume=True, export_hf=tmp_path / "new")


def test_gpt2_folder_exports_and_the_default_context(tmp_path):
    """A GPT-2 folder (tied head, Conv1D layout) goes back out as transformers' GPT2LMHeadModel with the same
    logits; without --context a run takes the preset's 64 cut to the model's 48 positions. (Its training is
    the llama run's: the same loop on the model from_pretrained gives.)"""
    from flax_transformer.interop import hf
    from flax_transformer.training import hf_init

    folder = _folder(tmp_path / "gpt2", kind="gpt2", n_positions=48)
    config = lm.presets("hf")["tiny"](init=str(folder))
    assert config.context == 64 and hf_init.default_context(config).context == 48
    with pytest.raises(errors.RunError, match="--context 64 is longer than the model takes: 48 positions"):
        hf_init.lm_tokenizer(config, folder)
    generation = {**json.loads((folder / "generation_config.json").read_text()), "eos_token_id": [2, 0],
                  "max_new_tokens": 7}  # the folder's own end ids and defaults: transformers' generate reads them
    (folder / "generation_config.json").write_text(json.dumps(generation))
    model = hf.from_pretrained(folder)
    report = hf_init.export_lm(model, tmp_path / "export", folder=folder, text=TEXT, length=48)
    assert report["same_ids"] and not any(report["loading_info"].values()) and report["max_abs_diff"] < 1e-5
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["model_type"] == "gpt2" and written["eos_token_id"] == 2
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text()) == generation


@pytest.mark.parametrize("kind", list(GEMMAS))
@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state (the same loop on an "
                  "HF folder), test_folder_imports (Gemma folders), test_llama's Gemma gradients (about 70 s per case)")
def test_gemma_folder_trains_resumes_and_exports(kind, tmp_path):
    """Two steps on a Gemma 2 / Gemma 3 folder (contexts of 16 against a 4-key window) with --export-hf: the loss
    falls, transformers loads the export as the folder's class with nothing missing and the run's logits; the run
    resumed from its step-1 checkpoint ends in the same state bit for bit."""
    from train.lm import main

    from .test_llama_training import _assert_same_state

    (tmp_path / "text.txt").write_text(TEXT)
    folder = _folder(tmp_path / "init", kind=kind)
    config = _config(folder, tmp_path / "text.txt", steps=2, eval_every=2, checkpoint_every=1, context=16,
                     eval_batches=1, sample_tokens=1, lr=1e-2)
    metrics = lm.train_and_evaluate(config, tmp_path / "whole", progress=False, export_hf=tmp_path / "export")
    assert metrics["step"] == 2 and metrics["val_loss"] < metrics["init_val_loss"]
    check = metrics["export_check"]
    assert check["same_ids"] and not any(check["loading_info"].values()) and check["max_abs_diff"] <= check["tolerance"]
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["model_type"] == kind and written["layer_types"] == ["sliding_attention", "full_attention"]

    split = tmp_path / "split"
    shutil.copytree(tmp_path / "whole", split)
    shutil.rmtree(split / "checkpoints" / "2")
    (split / "sample.txt").unlink()
    assert main(["--out", str(split), "--resume", "--no-progress"]) == 0
    _assert_same_state(tmp_path / "whole", split)
