"""Training DeepSeek-V3: ``train.lm --model hf --init DEEPSEEK_FOLDER`` and its torch training state.

The router's ``e_score_correction_bias`` is a torch *buffer* (transformers' and torch_reference's
``DeepseekV3TopkRouter``): no optimizer holds it, and transformers' training never changes it (DeepSeek
moves it by a rule outside the gradient, which neither library runs). Here it is an ``nnx.Param`` that only
chooses experts (``stop_gradient``): its gradient is zero, so Adam's moments of it stay zero and, being 1-D,
``decay_mask`` does not decay it: it stays unchanged bit for bit through training. A torch training
checkpoint carries it in "model" and never in the optimizer; the import gives it zero moments; the export
refuses one whose moments are not zero (it would have trained, and torch's Adam could not continue it).

Default run: the torch state both ways on a model built in memory (no train step compiled). Slow: the
train step's loss = transformers' within 1e-5, a torch step continuing it through the file, and a
fine-tune of a tiny folder with --export-hf and a resume, bit for bit.
"""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf, porting, targets
from flax_transformer.models.llama import LlamaForCausalLM
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.training import lm
from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.torch_state.checks import TorchStateError
from flax_transformer.training.torch_state.to_jax import import_torch_state, torch_optimizer
from flax_transformer.training.torch_state.to_torch import torch_training_state

from .test_lm_pretrained import TEXT, _tokenizer

transformers = pytest.importorskip("transformers")

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # layer 0 is dense (first_k_dense_replace=1)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, decay="cosine", total_steps=4, weight_decay=0.1, clip_norm=1.0)
SWITCHES = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4,
                qk_nope_head_dim=6, v_head_dim=5, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _config(vocab=40):
    return transformers.DeepseekV3Config(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **SWITCHES)


def _bias(model):
    return np.asarray(model.model.layers[1].mlp.gate.e_score_correction_bias[...])


def _random_model(config, rng):
    """The Flax model of ``config`` with random weights (the bias too), built abstractly and filled: no init."""
    model = targets.build_unfilled(LlamaForCausalLM, {"config": config})
    nnx.update(model, jax.tree.map(lambda leaf: jnp.asarray(0.1 * rng.standard_normal(leaf.shape), leaf.dtype),
                                   nnx.as_pure(nnx.state(model, nnx.Param))))
    return model


def _random_state(optimizer, rng):
    """Random Adam moments (the bias's zero, as training leaves them) at step 1."""

    def draw(path, leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return leaf + 1
        if "e_score_correction_bias" in jax.tree_util.keystr(path):
            return jnp.zeros_like(leaf)
        return jnp.asarray(0.01 * np.abs(rng.standard_normal(leaf.shape)), leaf.dtype)

    state = jax.tree_util.tree_map_with_path(draw, nnx.as_pure(optimizer.opt_state))
    nnx.update(optimizer.opt_state, nnx.state(state))
    optimizer.step[...] = 1


def test_torch_state_carries_the_correction_bias_as_a_buffer_both_ways():
    """The export puts the bias in "model" (which torch_reference's twin loads strictly, buffer included)
    and in no optimizer group; its import gives the bias zero moments and every other tensor back bit for
    bit. A bias whose moments are not zero is refused at the export, a file without it at the import."""
    from torch_reference.llama import LlamaForCausalLM as TorchLlama

    config, rng = LlamaConfig.from_hf(_config()), np.random.default_rng(0)
    model = _random_model(config, rng)
    optimizer = nnx.Optimizer(model, make_optimizer(OPTIM), wrt=nnx.Param)
    _random_state(optimizer, rng)
    assert np.abs(_bias(model)).min() > 0  # random, not transformers' zeros: a bias lost on the way would show
    saved = torch_training_state(model, optimizer, OPTIM)
    np.testing.assert_array_equal(saved["model"][BIAS].numpy(), _bias(model))
    names = [n for group in saved["optimizer"]["param_groups"] for n in group["param_names"]]
    assert BIAS not in names and len(saved["optimizer"]["state"]) == len(names)
    twin = TorchLlama(config)
    assert BIAS in dict(twin.named_buffers()) and BIAS not in dict(twin.named_parameters())
    twin.load_state_dict(saved["model"], strict=True)  # the buffer too: nothing missing, nothing unexpected
    torch_opt, _ = torch_optimizer(twin, OPTIM)
    torch_opt.load_state_dict(saved["optimizer"])

    buffer = io.BytesIO()
    torch.save(saved, buffer)
    again = _random_model(config, rng)
    continued, step = import_torch_state(io.BytesIO(buffer.getvalue()), again, OPTIM)
    assert step == 1
    ours, theirs = porting.state_dict(again), porting.state_dict(model)
    assert ours.keys() == theirs.keys() and BIAS in ours
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    for a, b in zip(jax.tree.leaves(nnx.as_pure(continued.opt_state)), jax.tree.leaves(nnx.as_pure(optimizer.opt_state)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    missing = dict(saved, model={k: v for k, v in saved["model"].items() if k != BIAS})
    with pytest.raises(TorchStateError, match=rf"{BIAS} missing \(a buffer\)"):
        import_torch_state(missing, _random_model(config, rng), OPTIM)
    mu = optimizer.opt_state[1][0].mu  # clip_by_global_norm, then adamw's scale_by_adam
    mu["model"]["layers"][1]["mlp"]["gate"]["e_score_correction_bias"][...] = jnp.full((8,), 1e-3)
    with pytest.raises(TorchStateError, match=rf"{BIAS} is a buffer in torch.*Adam moments here are not zero"):
        torch_training_state(model, optimizer, OPTIM)


# ----------------------------------------------------------------------------- slow: the step and the fine-tune


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random DeepSeek-V3 folder (random correction biases) with test_lm_pretrained's tokenizer."""
    path = tmp_path_factory.mktemp("deepseek") / "hf"
    fast = _tokenizer()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(len(fast)))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0, 0.3)  # large enough to change which experts are chosen
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.mark.slow(reason="test_torch_state_carries_the_correction_bias_as_a_buffer_both_ways and test_moe_training's "
                         "test_train_step_equals_transformers_and_continues_through_torch_state (the same step on "
                         "Qwen2-MoE); about 40 s: a train step's compile and transformers' model")
def test_train_step_equals_transformers_and_a_torch_step_continues_it(folder):
    """The first train step's loss is transformers' ``outputs.loss`` within 1e-5 (no aux loss: DeepSeek-V3's
    transformers adds none), the bias unchanged; through the torch training state the torch_reference twin
    takes the second step with torch's AdamW and LambdaLR, and it equals ours at 1e-5 (weights), the bias
    unchanged in both."""
    from flax_transformer.training.step import make_steps

    from .test_moe_training import _batch

    model = hf.from_pretrained(folder)
    before = _bias(model).copy()
    first, second = _batch(model.config.vocab_size, 0), _batch(model.config.vocab_size, 1)
    model.train()
    optimizer = nnx.Optimizer(model, make_optimizer(OPTIM), wrt=nnx.Param)
    train_step, _ = make_steps(lm.loss_fn)
    metrics = jax.device_get(train_step(model, optimizer, first))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    window = torch.from_numpy(np.concatenate([np.asarray(first["ids"]), np.asarray(first["labels"])[:, -1:]], 1)
                              .astype(np.int64))  # 17 tokens, labels the tokens themselves (shifted inside)
    with torch.no_grad():
        out = theirs(input_ids=window, labels=window, output_router_logits=True)
    assert out.aux_loss is None  # transformers' DeepSeek-V3 adds no load-balancing loss
    assert abs(float(metrics["loss"]) - float(out.loss)) <= 1e-5 and float(metrics["lm_loss"]) == float(metrics["loss"])
    np.testing.assert_array_equal(_bias(model), before)

    from torch_reference.llama import LlamaForCausalLM as TorchLlama

    saved = torch_training_state(model, optimizer, OPTIM)
    twin = TorchLlama(model.config)
    twin.load_state_dict(saved["model"], strict=True)
    twin.train()
    torch_opt, sched = torch_optimizer(twin, OPTIM)
    torch_opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    logits = twin(torch.from_numpy(np.asarray(second["ids"]).astype(np.int64)))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(
        np.asarray(second["labels"]).astype(np.int64)).flatten()).backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), OPTIM.clip_norm)
    torch_opt.step()
    sched.step()
    jax.device_get(train_step(model, optimizer, second))
    ours = porting.state_dict(model)
    stepped = {k: v.detach().numpy() for k, v in twin.state_dict().items()}
    assert max(float(np.abs(ours[k] - stepped[k]).max()) for k in stepped) <= 1e-5
    assert float(np.abs(ours["model.layers.1.mlp.experts.gate_up_proj"] - saved["model"][
        "model.layers.1.mlp.experts.gate_up_proj"].numpy()).max()) > 1e-4  # the second step moved the experts
    np.testing.assert_array_equal(stepped[BIAS], before)
    np.testing.assert_array_equal(_bias(model), before)


@pytest.mark.slow(reason="test_torch_state_carries_the_correction_bias_as_a_buffer_both_ways and test_moe_training's "
                         "test_gpt_oss_folder_trains_resumes_and_exports (the same run on GPT-OSS's folder); about "
                         "90 s: two runs' compiles")
def test_deepseek_folder_trains_resumes_and_exports(folder, tmp_path):
    """Two steps on a DeepSeek-V3 folder with --export-hf: the loss falls, every kind of weight trains (MLA's
    projections and norms, the router, the routed and shared experts, the dense layer) but the correction
    bias, which is unchanged in the checkpoints and in the export; transformers loads the export (its
    names, nothing missing) with the run's logits; resumed from step 1 through ``train.lm``, bit for bit."""
    import shutil

    from safetensors.numpy import load_file

    from train.lm import main

    from .test_llama_training import _assert_same_state, _saved_state

    (tmp_path / "text.txt").write_text(TEXT)
    config = lm.LMConfig.tiny(model="hf", init=str(folder), text=str(tmp_path / "text.txt"), context=16, steps=2,
                              lr=1e-2, eval_every=2, checkpoint_every=1, eval_batches=1, sample_tokens=1)
    metrics = lm.train_and_evaluate(config, tmp_path / "whole", progress=False, export_hf=tmp_path / "export")
    assert metrics["step"] == 2 and metrics["val_loss"] < metrics["init_val_loss"]
    check = metrics["export_check"]
    assert check["same_ids"] and not any(check["loading_info"].values()) and check["max_abs_diff"] <= check["tolerance"]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "deepseek_v3"
    exported, before = load_file(tmp_path / "export" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert exported.keys() == before.keys()
    np.testing.assert_array_equal(exported[BIAS], before[BIAS])
    assert np.abs(before[BIAS]).min() > 0
    experts = [k for k in before if k.startswith("model.layers.1.mlp.experts.")]  # per expert, as transformers saves
    assert max(float(np.abs(exported[k] - before[k]).max()) for k in experts) > 1e-4  # those tokens chose trained
    for key in ("model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                "model.layers.1.self_attn.kv_a_layernorm.weight"):
        assert np.abs(exported[key] - before[key]).max() > 1e-4, f"{key} did not train"
    for step in (1, 2):
        saved = _saved_state(tmp_path / "whole", step)
        found = {k: v for k, v in saved.items() if "e_score_correction_bias" in k}
        params = [v for k, v in found.items() if k.startswith("['model']")]
        moments = [v for k, v in found.items() if k.startswith("['optimizer']")]
        assert len(params) == 1 and np.array_equal(params[0], before[BIAS])
        assert len(moments) == 2 and not any(np.any(m) for m in moments)  # Adam's mu and nu: a zero gradient
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(reference).__name__ == "DeepseekV3ForCausalLM"
    np.testing.assert_array_equal(reference.model.layers[1].mlp.gate.e_score_correction_bias.numpy(), before[BIAS])

    split = tmp_path / "split"
    shutil.copytree(tmp_path / "whole", split)
    shutil.rmtree(split / "checkpoints" / "2")
    (split / "sample.txt").unlink()
    assert main(["--out", str(split), "--resume", "--no-progress"]) == 0
    _assert_same_state(tmp_path / "whole", split)
