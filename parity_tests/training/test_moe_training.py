"""Training a mixture of experts: ``train.lm --model hf --init MOE_FOLDER`` and ``--model llama --experts E``.

The objective is transformers' ``outputs.loss`` with ``output_router_logits=True``: the cross-entropy
plus ``router_aux_loss_coef`` times the load-balancing loss. The train step's loss, cross-entropy and
load-balancing loss equal transformers' on the same folder and batch within 1e-5 (one default kind,
Qwen2-MoE: a shared expert, a dense layer after a sparse one; the three others are slow), and the step
continues bit for bit through a torch training checkpoint. A tiny Qwen2-MoE folder (BPE tokenizer of
``test_lm_pretrained``) fine-tunes with ``--export-hf``: the loss falls, ``aux_loss`` is logged, the
experts and routers train, and transformers loads the export. The ``--experts`` preset keeps the dense
llama's active parameters; its bad flags are one line before anything is made.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf, porting
from flax_transformer.training import lm
from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.step import make_steps
from flax_transformer.training.torch_state.to_jax import import_torch_state

from .test_lm_pretrained import TEXT, _tokenizer

transformers = pytest.importorskip("transformers")

STEPS = 8
COEF = 0.3  # far above transformers' 0.001: a load-balancing loss left out or miscounted shows in the total
KINDS = {
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                         mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=5,
                                         num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=4, num_experts_per_tok=3, clip_qkv=3.0)),
    "gpt_oss": ("GptOssConfig", dict(  # sliding then full, biases, sinks (transformers' defaults), YaRN x4 of 16
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=16, truncate=False))),
}
SLOW = ("the kept case covers the others: Qwen2-MoE (a shared expert, a dense layer); the forwards of all four "
        "are test_moe_generate's")


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _folder(path, kind):
    """A random tiny HF folder of ``kind`` (two layers of width 32) with ``test_lm_pretrained``'s tokenizer."""
    fast = _tokenizer()
    config_class, switches = KINDS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, router_aux_loss_coef=COEF, **switches)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> its folder, made on first use."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = _folder(tmp_path_factory.mktemp(kind), kind)
        return made[kind]
    return get


# ----------------------------------------------------------------------------- the train step


def _batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    window = rng.integers(3, vocab, size=(2, 17))
    return {"ids": jnp.asarray(window[:, :-1], jnp.int32), "labels": jnp.asarray(window[:, 1:], jnp.int32)}


def _transformers_losses(folder, batch):
    """transformers' (loss, aux_loss) on ``batch``: the window's 17 tokens, the last masked out, labels the
    tokens themselves (shifted inside): the cross-entropy of our 16 positions, the load-balancing loss of
    our 16 tokens (the masked one left out, as its padding)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    window = torch.from_numpy(np.concatenate([np.asarray(batch["ids"]), np.asarray(batch["labels"])[:, -1:]], 1)
                              .astype(np.int64))
    mask = torch.ones_like(window)
    mask[:, -1] = 0
    with torch.no_grad():
        out = reference(input_ids=window, attention_mask=mask, labels=window, output_router_logits=True)
    return float(out.loss), float(out.aux_loss)


OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, decay="cosine", total_steps=4, weight_decay=0.1, clip_norm=1.0)


def _assert_loss_is_transformers(folder, metrics, batch, coef):
    theirs, aux = _transformers_losses(folder, batch)
    assert abs(float(metrics["aux_loss"]) - aux) <= 1e-5, (float(metrics["aux_loss"]), aux)
    assert abs(float(metrics["loss"]) - theirs) <= 1e-5, (float(metrics["loss"]), theirs)
    assert abs(float(metrics["lm_loss"]) + coef * float(metrics["aux_loss"]) - float(metrics["loss"])) <= 1e-6
    assert coef * aux > 0.3  # the load-balancing term weighs: leaving it out would fail by far more than 1e-5


def test_train_step_equals_transformers_and_continues_through_torch_state(folders):
    """Qwen2-MoE (a shared expert, a dense layer after the sparse one). The first train step's loss is
    transformers' ``outputs.loss`` (its ``aux_loss`` and cross-entropy too) within 1e-5. A torch training
    checkpoint written after it (experts (E, 2I, H) and (E, H, I) in torch's layout, their Adam moments
    too), imported into a model whose weights are zeros, trains the second step exactly as the run does:
    loss, weights and moments equal bit for bit. (One compiled step: the second model is read from the
    same folder, so its graph is the first's.)"""
    import io

    from flax_transformer.training.torch_state.to_torch import torch_training_state

    folder = folders("qwen2_moe")
    model = hf.from_pretrained(folder)
    moe, vocab = model.config.moe, model.config.vocab_size
    assert moe.router_aux_loss_coef == COEF  # the folder's coefficient
    first, second = _batch(vocab, 0), _batch(vocab, 1)
    model.train()
    tx = make_optimizer(OPTIM)  # one chain for both: one compiled step
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train_step, _ = make_steps(lm.loss_fn)
    stepped = jax.device_get(train_step(model, optimizer, first))
    _assert_loss_is_transformers(folder, stepped, first, COEF)

    buffer = io.BytesIO()
    torch.save(torch_training_state(model, optimizer, OPTIM), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert saved["step"] == 1 and saved["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        moe.num_experts, 2 * moe.moe_intermediate_size, 32)
    assert "model.layers.1.mlp.gate_proj.weight" in saved["model"]  # the dense layer
    expected = jax.device_get(train_step(model, optimizer, second))
    again = hf.from_pretrained(folder)
    nnx.update(again, jax.tree.map(jnp.zeros_like, nnx.state(again, nnx.Param)))
    again.train()
    continued, step = import_torch_state(io.BytesIO(buffer.getvalue()), again, OPTIM, tx=tx)
    assert step == 1
    got = jax.device_get(train_step(again, continued, second))
    assert float(got["loss"]) == float(expected["loss"]) and float(got["aux_loss"]) == float(expected["aux_loss"])
    ours, theirs = porting.state_dict(again), porting.state_dict(model)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    for a, b in zip(jax.tree.leaves(nnx.as_pure(continued.opt_state)), jax.tree.leaves(nnx.as_pure(optimizer.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state")
def test_train_step_loss_equals_transformers(folders, kind):
    folder = folders(kind)
    model = hf.from_pretrained(folder)
    model.train()  # Mixtral's jitter is 0: the step is deterministic
    optimizer = nnx.Optimizer(model, make_optimizer(OPTIM), wrt=nnx.Param)
    batch = _batch(model.config.vocab_size)
    metrics = jax.device_get(make_steps(lm.loss_fn)[0](model, optimizer, batch))
    _assert_loss_is_transformers(folder, metrics, batch, COEF)


def test_a_dense_model_has_no_load_balancing_term():
    """A dense llama's loss and metrics are as before: the cross-entropy, no aux_loss (traced, not run)."""
    model = nnx.eval_shape(lambda: lm.build_model(lm.LMConfig.tiny(model="llama"), 30))
    batch = _batch(30)
    for loss_fn in (lm.loss_fn, lm.eval_loss_fn):
        loss, metrics = jax.eval_shape(lambda m, f=loss_fn: f(m, batch), model)
        assert loss.shape == () and set(metrics) == {"count"}
    assert lm.moe_of(model) is None


# ----------------------------------------------------------------------------- the fine-tune


@pytest.fixture(scope="module")
def whole(folders, tmp_path_factory):
    """The Qwen2-MoE folder fine-tuned with --export-hf: (tmp folder, init folder, metrics)."""
    tmp = tmp_path_factory.mktemp("moe_ft")
    (tmp / "text.txt").write_text(TEXT)
    config = lm.LMConfig.tiny(model="hf", init=str(folders("qwen2_moe")), text=str(tmp / "text.txt"), context=32,
                              steps=STEPS, lr=3e-3, eval_every=STEPS, checkpoint_every=STEPS, eval_batches=2,
                              sample_tokens=8)
    with jax.numpy_dtype_promotion("standard"):
        metrics = lm.train_and_evaluate(config, tmp / "run", progress=False, export_hf=tmp / "export")
    return tmp, folders("qwen2_moe"), metrics


@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state and "
                         "test_fine_tune_lowers_the_loss_and_exports_a_folder_transformers_loads (a dense folder)")
def test_fine_tune_logs_the_aux_loss_and_exports_a_folder_transformers_loads(whole):
    from safetensors.numpy import load_file

    tmp, init, metrics = whole
    assert metrics["step"] == STEPS and metrics["val_loss"] < metrics["init_val_loss"] - 0.5
    lines = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["split"] == "train"]
    assert train and all({"aux_loss", "lm_loss"} <= set(line) for line in train)
    for line in train:  # the objective; each logged value a mean over the same steps
        assert abs(line["lm_loss"] + COEF * line["aux_loss"] - line["loss"]) <= 1e-5
        assert 1.0 <= line["aux_loss"] <= 4.0  # k = 2 for an even load, E = 4 at worst
    evaluation = [line for line in lines if line["split"] == "eval"][-1]
    assert evaluation["loss"] == evaluation["lm_loss"] == metrics["val_loss"]  # validation: the cross-entropy
    assert metrics["val_aux_loss"] == evaluation["aux_loss"]

    check = metrics["export_check"]  # AutoModelForCausalLM's logits against ours, no missing or unexpected keys
    assert check["same_ids"] and not any(check["loading_info"].values()) and check["max_abs_diff"] <= check["tolerance"]
    exported, before = load_file(tmp / "export" / "model.safetensors"), load_file(init / "model.safetensors")
    assert exported.keys() == before.keys()  # transformers' per-expert names
    for key in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.shared_expert_gate.weight"):
        assert np.abs(exported[key] - before[key]).max() > 1e-4, f"{key} did not train"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp / "export").eval()
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.no_grad():
        out = reference(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.aux_loss is not None and len(out.router_logits) == 1  # one sparse layer, one dense


@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state (the same loop on an "
                  "MoE folder) and test_gpt_oss_moe (GPT-OSS's forward and aux loss); about 90 s: two compiles")
def test_gpt_oss_folder_trains_resumes_and_exports(folders, tmp_path):
    """Two steps on a GPT-OSS folder with --export-hf: the loss falls, ``aux_loss`` and ``lm_loss`` are logged
    (their sum the loss), the experts and the router train, transformers loads the export (its names, with
    nothing missing; its aux loss) with the run's logits; the run resumed from its step-1 checkpoint through
    ``train.lm`` ends in the same state bit for bit."""
    import shutil

    from safetensors.numpy import load_file

    from train.lm import main

    from .test_llama_training import _assert_same_state

    folder = folders("gpt_oss")
    (tmp_path / "text.txt").write_text(TEXT)
    config = lm.LMConfig.tiny(model="hf", init=str(folder), text=str(tmp_path / "text.txt"), context=16, steps=2,
                              lr=1e-2, eval_every=2, checkpoint_every=1, eval_batches=1, sample_tokens=1)
    metrics = lm.train_and_evaluate(config, tmp_path / "whole", progress=False, export_hf=tmp_path / "export")
    assert metrics["step"] == 2 and metrics["val_loss"] < metrics["init_val_loss"]
    train = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in train if line["split"] == "train"]
    assert train and all(abs(line["lm_loss"] + COEF * line["aux_loss"] - line["loss"]) <= 1e-5 for line in train)
    assert all(1.0 <= line["aux_loss"] <= 4.0 for line in train)  # k = 2 for an even load, E = 4 at worst
    check = metrics["export_check"]
    assert check["same_ids"] and not any(check["loading_info"].values()) and check["max_abs_diff"] <= check["tolerance"]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "gpt_oss"
    exported, before = load_file(tmp_path / "export" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert exported.keys() == before.keys()  # transformers' names: fused experts, biases, sinks
    for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj_bias",
                "model.layers.0.mlp.router.weight", "model.layers.1.self_attn.sinks"):
        assert np.abs(exported[key] - before[key]).max() > 1e-4, f"{key} did not train"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.no_grad():
        out = reference(input_ids=ids, labels=ids, output_router_logits=True)
    assert type(reference).__name__ == "GptOssForCausalLM" and out.aux_loss is not None

    split = tmp_path / "split"
    shutil.copytree(tmp_path / "whole", split)
    shutil.rmtree(split / "checkpoints" / "2")
    (split / "sample.txt").unlink()
    assert main(["--out", str(split), "--resume", "--no-progress"]) == 0
    _assert_same_state(tmp_path / "whole", split)


# ----------------------------------------------------------------------------- the --experts preset


def _count(model, keep=lambda path: True) -> int:
    return sum(int(np.prod(v.shape)) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if keep(path))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_experts_preset_has_the_dense_llamas_active_parameters(preset):
    """E experts, k per token, each d_ff / k wide: a token uses the dense model's weights plus the router's."""
    dense_config = lm.presets("llama")[preset]()
    config = lm.presets("llama")[preset](experts=8, experts_per_token=2)
    dense, moe = nnx.eval_shape(lambda: lm.build_model(dense_config, 65)), nnx.eval_shape(
        lambda: lm.build_model(config, 65))
    assert moe.config.moe.num_experts == 8 and moe.config.moe.moe_intermediate_size == config.d_ff // 2
    experts = _count(moe, lambda path: "experts" in path)
    active = _count(moe) - experts + experts * 2 // 8
    router = config.n_layers * 8 * config.d_embed
    assert active == _count(dense) + router
    assert lm.moe_of(moe).router_aux_loss_coef == lm.AUX_LOSS_COEF


@pytest.mark.slow(reason="test_train_step_equals_transformers_and_continues_through_torch_state")
def test_experts_run_through_torch_state_continues_as_resume(tmp_path):
    """``--model llama --experts 4``, exported at step 4 (``export_run``) and started again with
    ``--init-from-torch``, trains steps 5..8 exactly as the uninterrupted run (checkpoints equal bit for bit)."""
    from flax_transformer.training.torch_state.run_export import check_export, export_run

    from .test_llama_training import _assert_same_state

    (tmp_path / "text.txt").write_text(TEXT)

    def config():
        return lm.LMConfig.tiny(model="llama", experts=4, text=str(tmp_path / "text.txt"), steps=STEPS, dropout=0.1,
                                eval_every=4, checkpoint_every=4, sample_tokens=8)
    lm.train_and_evaluate(config(), tmp_path / "whole", progress=False, export_torch_state=tmp_path / "whole.pt")
    export_run(tmp_path / "whole", tmp_path / "at4.pt", step=4)
    assert torch.load(tmp_path / "at4.pt", weights_only=True)["model"]["model.layers.0.mlp.experts.down_proj"].shape == (
        4, 64, 96)
    lm.train_and_evaluate(config(), tmp_path / "again", progress=False, init_from_torch=tmp_path / "at4.pt")
    _assert_same_state(tmp_path / "whole", tmp_path / "again")
    assert check_export(tmp_path / "whole", tmp_path / "whole.pt") == []
