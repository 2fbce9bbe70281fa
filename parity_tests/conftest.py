"""Shared settings and helpers for the parity tests.

fp32 parity is checked with full-precision matmuls, and with JAX's strict dtype
promotion so that an accidental float64/bool promotion in the library shows up here.
"""

import atexit
import os
import shutil
import tempfile

# One persistent XLA compilation cache for the whole run, set before jax is imported: the xdist
# workers and every subprocess a test starts (the CLI, the trainers) inherit it, so a program one
# of them compiled (the same tiny model, the same step) is loaded by the others instead of
# compiled again. It lives in a temporary folder that the process that made it removes at exit:
# each run starts cold, as CI does. max_size turns on jax's file lock, so concurrent writers and
# readers of one entry never see it half written. Set JAX_COMPILATION_CACHE_DIR to choose another.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="ft-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ |= {"JAX_COMPILATION_CACHE_DIR": _cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)}

# torch on one thread in the tests (and the processes they start): the two xdist workers share two
# cores, so torch's default of a thread per core would have four threads contend for two. Measured
# on test_hf + test_encoder: 173 -> 147 CPU s, 265 -> 221 s wall. The benchmarks keep the defaults.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_dtype_promotion", "strict")
torch.use_deterministic_algorithms(True)

TOL = 1e-5  # fp32, matmul precision "highest": a larger error is a bug, not noise

# The heaviest tests, left out of the default run (pyproject's addopts: -m "not slow"), which is
# CI's, so that the suite stays within about 15 minutes on 2 idle cores (issue 21). Each is an
# end-to-end variant, or a second model, of something a lighter test of the default run checks
# (named here). `python -m pytest parity_tests -q -n 2 -m slow` runs these alone, and
# `-m "slow or not slow"` runs everything. A name here that no longer exists fails the run.
SLOW = {
    "test_runs.py::test_bucket_padding_does_not_change_the_classifier_output":
        "test_guards_training's filler-row tests: padding changes no loss, metric or gradient",
    "test_runs.py::test_classify_tiny_on_the_real_imdb": "test_classify_tiny_end_to_end_then_predict_and_export, fake data",
    "test_runs.py::test_classify_encoder_model": "test_guards_training[encoder-*], test_encoder",
    "test_runs.py::test_lm_former_at_word_level": "test_lm_tiny_end_to_end",
    "test_finetune.py::test_minilm_fine_tune_end_to_end_and_the_export_in_transformers":
        "test_hf's MiniLM parity, test_finetune's other cases",
    "test_finetune.py::test_frozen_encoder_caches_features_trains_the_head_and_resumes":
        "test_runs' resume tests",
    "test_finetune.py::test_fine_tune_resume_equals_an_uninterrupted_run": "test_runs' resume tests",
    "test_finetune.py::test_classifier_from_pretrained_reads_its_own_export_and_a_wrong_head":
        "test_hf_more::test_sequence_classifier_heads",
    "test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[former-CTransformer(max)]":
        "the same bound on CTransformer(mean)",
    "test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[former-GTransformer]":
        "the same bound on CTransformer(mean)",
    "test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[classic-Transformer]":
        "the same bound on the classic TransformerEncoder",
    "test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[gpt-GPT2LMHeadModel]":
        "the same bound on GPTTransformer",
    "test_hf.py::test_gpt2_from_transformers_and_back[True]": "test_gpt2_from_transformers_and_back[False]",
    "test_hf.py::test_pytorch_bin_sharded_index_and_bf16": "test_hf_more::test_encoder_folder_both_ways (sharded)",
    "test_hf_more.py::test_bf16_export_and_import": "test_llama_hf's bf16 shards, test_porting's bf16 cases",
    "test_hf_more.py::test_sharded_save_streams_and_transformers_loads":
        "test_hf_more::test_encoder_folder_both_ways[distilbert-True], test_sharded",
    "test_generate.py::test_a_row_in_a_ragged_batch_equals_the_row_alone[former]":
        "test_generate_hf's and test_llama_generate's ragged batches",
    "test_generate.py::test_a_row_in_a_ragged_batch_equals_the_row_alone[gpt]":
        "test_generate_hf's and test_llama_generate's ragged batches",
    "test_former.py::test_random_configurations": "test_former's parametrised parity tests (every attention, scale, pooling)",
    "test_encoder.py::test_random_configurations": "test_encoder's parametrised parity tests",
    "test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[llama-LlamaForCausalLM(tied, Gemma)]":
        "the same bound on the untied GQA llama",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a heavy test left out of the default run (conftest.SLOW says which "
                                       "lighter test covers it); -m slow runs them")


def pytest_collection_modifyitems(config, items):
    names = {item.nodeid.rpartition("parity_tests/")[2]: item for item in items}
    modules = {name.partition("::")[0]: item.module for name, item in names.items() if hasattr(item, "module")}
    stale = [name for name in SLOW if name.partition("::")[0] in modules  # a file collected, even in part
             and not hasattr(modules[name.partition("::")[0]], name.partition("::")[2].partition("[")[0])]
    if stale:
        raise pytest.UsageError(f"conftest.SLOW names tests that do not exist: {stale}")
    for name, item in names.items():
        if name in SLOW:
            item.add_marker(pytest.mark.slow)


def assert_both_directions(torch_module, args, kwargs=None, *, seed=0, tol=TOL, eager_too=False):
    """torch->Flax and Flax->torch parity under jit, and also eagerly if asked.

    Eager Flax runs op by op (each op compiled for its shapes), so it costs more than
    jit on small inputs; the tests ask for it where masks are hardest and at model level.
    """
    from flax_transformer.verification import verify

    for use_jit in (True, False) if eager_too else (True,):
        results = verify.both_directions(torch_module, args, kwargs, seed=seed, use_jit=use_jit, reports=True, tol=tol)
        for direction, report in results:
            # the whole verdict: abs error, NaN/inf (never agreement), the float64 budget
            assert report.passed, f"{direction} (jit={use_jit}):\n{report}"


def assert_parameter_gradients_match(torch_model, args, rng):
    """d<model(*args), W>/d(every parameter) agrees between torch and the ported Flax model.

    W is a fixed random tensor of the output's shape (``verify.compare(..., grads=True)``).
    Tolerance: TOL relative to the gradient's scale (max(1, max |g|)); and every gradient (and
    the outputs) within the float64 budget, with no NaN or inf.
    """
    from flax_transformer.interop import porting
    from flax_transformer.verification import verify

    torch_model.eval()
    report = verify.compare(torch_model, porting.torch_to_flax(torch_model), tuple(args), grads=True, tol=TOL,
                            seed=int(rng.integers(1 << 30)))
    assert report.grad_finite and report.grad_err <= TOL, \
        f"{report.worst_grad_key}: grad max abs err {report.grad_err:.3g} relative to its scale"
    assert report.passed, str(report)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
