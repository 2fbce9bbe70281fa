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
# Only programs that took 0.5 s or more to compile are written: writing every eager op's tiny
# program cost more than compiling it again (test_gpt + test_inputs: 80 -> 67 s; the CLI and
# training tests, which share big programs across processes, the same at 0, 0.1 and 0.5).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="ft-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ |= {"JAX_COMPILATION_CACHE_DIR": _cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
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
    "training/test_runs.py::test_bucket_padding_does_not_change_the_classifier_output":
        "test_guards_training's filler-row tests: padding changes no loss, metric or gradient",
    "training/test_runs.py::test_classify_tiny_on_the_real_imdb": "test_classify_tiny_end_to_end_then_predict_and_export, fake data",
    "training/test_runs.py::test_classify_encoder_model": "test_guards_training[encoder-*], test_encoder",
    "training/test_runs.py::test_lm_former_at_word_level": "test_lm_tiny_end_to_end",
    "training/test_finetune.py::test_minilm_fine_tune_end_to_end_and_the_export_in_transformers":
        "test_hf's MiniLM parity, test_finetune's other cases",
    "training/test_finetune.py::test_frozen_encoder_caches_features_trains_the_head_and_resumes":
        "test_runs' resume tests",
    "training/test_finetune.py::test_fine_tune_resume_equals_an_uninterrupted_run": "test_runs' resume tests",
    "training/test_finetune.py::test_classifier_from_pretrained_reads_its_own_export_and_a_wrong_head":
        "test_hf_more::test_sequence_classifier_heads",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[former-CTransformer(max)]":
        "the same bound on CTransformer(mean)",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[former-GTransformer]":
        "the same bound on CTransformer(mean)",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[classic-Transformer]":
        "the same bound on the classic TransformerEncoder",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[gpt-GPT2LMHeadModel]":
        "the same bound on GPTTransformer",
    "interop/test_hf.py::test_gpt2_from_transformers_and_back[True]": "test_gpt2_from_transformers_and_back[False]",
    "interop/test_hf.py::test_pytorch_bin_sharded_index_and_bf16": "test_hf_more::test_encoder_folder_both_ways (sharded)",
    "interop/test_hf_encoder_folders.py::test_bf16_export_and_import": "test_llama_hf's bf16 shards, test_porting's bf16 cases",
    "interop/test_hf_encoder_folders.py::test_sharded_save_streams_and_transformers_loads":
        "test_hf_more::test_encoder_folder_both_ways[distilbert-True], test_sharded",
    "models/test_generate.py::test_a_row_in_a_ragged_batch_equals_the_row_alone[former]":
        "test_generate_hf's and test_llama_generate's ragged batches",
    "models/test_generate.py::test_a_row_in_a_ragged_batch_equals_the_row_alone[gpt]":
        "test_generate_hf's and test_llama_generate's ragged batches",
    "models/test_former.py::test_random_configurations": "test_former's parametrised parity tests (every attention, scale, pooling)",
    "models/test_encoder.py::test_random_configurations": "test_encoder's parametrised parity tests",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[llama-LlamaForCausalLM(tied, Gemma)]":
        "the same bound on the untied GQA llama",
    # added at stop 28, when CI took 3015 s (the default run, 1064 tests): each the heaviest case of
    # its kind, with the lighter one that stays named
    "project/test_docs.py::test_python_blocks_run[docs/porting.md]": "test_porting, test_hf, test_cli's port tests run the same calls",
    "project/test_docs.py::test_python_blocks_run[docs/verification.md]": "test_verdicts, test_bisect, test_certificate",
    "project/test_docs.py::test_python_blocks_run[docs/generation.md]": "test_generate, test_generate_hf",
    "project/test_docs.py::test_python_blocks_run[docs/training.md]": "test_runs, test_torch_state",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[former-CTransformer(mean)]":
        "the same bound on the encoder and gpt models",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[llama-LlamaForCausalLM(untied, GQA, llama3 RoPE)]":
        "test_llama_hf's bf16 folders, the same bound on gpt",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[encoder-TransformerEncoder]":
        "the same bound on TransformerForSequenceClassification",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[classic-TransformerEncoder]":
        "the same bound on the encoder family's TransformerEncoder(BERT)",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[encoder-TransformerForSequenceClassification(BERT)]":
        "the same bound on TransformerForSequenceClassification",
    "models/test_mixed_precision.py::test_bf16_compute_stays_within_the_bound[encoder-TransformerForSequenceClassification(BERT, mean)]":
        "the same bound on TransformerForSequenceClassification",
    "training/test_runs.py::test_classify_tiny_end_to_end_then_predict_and_export":
        "test_lm_tiny_end_to_end and test_seq2seq_tiny_end_to_end (the same CLI and loop), test_guards_training's "
        "classify steps, test_certificate's exports",
    "cli/test_commands.py::test_attention_map_png_and_html": "test_text_length's attention-map run",
    "training/test_runs.py::test_sharded_run_on_8_host_devices_equals_one_device": "test_sharded",
    "training/test_runs.py::test_two_processes_equal_one_process": "test_sharded",
    "models/test_encoder.py::test_notebook_001_classifier_checkpoint":
        "test_encoder's parity tests; notebooks 000 and 002's checkpoint tests",
    "training/test_llama_training.py::test_the_torch_export_gives_the_same_logits": "test_torch_state's exports",
    "training/test_llama_training.py::test_resume_equals_the_uninterrupted_run": "test_runs' resume test",
    "verification/test_llama_bisect.py::test_rope_half_split_applied_to_meta_interleaved_q_k_weights":
        "test_llama_meta's permutation tests",
    "interop/test_hf_encoder_folders.py::test_classify_fine_tunes_a_roberta_folder_and_exports_it":
        "test_hf_more::test_sequence_classifier_heads[roberta], test_finetune's cases",
    "interop/test_hf_encoder_folders.py::test_encoder_folder_both_ways[roberta-False]": "test_sequence_classifier_heads[roberta]",
    "interop/test_hf_encoder_folders.py::test_sequence_classifier_heads[distilbert]": "test_encoder_folder_both_ways[distilbert-True]",
    "cli/test_commands.py::test_verify_grads_covers_every_full_model":
        "test_*::test_parameter_gradients, test_llama::test_forward_and_gradients",
    "models/test_encoder.py::test_jit_matches_eager": "test_former::test_jit_matches_eager, test_gpt's eager model rows",
    "training/test_torch_state.py::test_entry_point_continues_an_exported_run_exactly_as_resume":
        "test_trajectory_continues_across_frameworks",
    "interop/test_porting.py::test_torch_to_flax_dtypes": "test_bf16_weights_load_into_fp32_and_bf16_models",
    "training/test_finetune.py::test_bf16_fine_tune_runs_with_fp32_parameters": "test_torch_state::test_bf16_run_exported_and_imported_continues_bit_for_bit",
    "interop/test_hf.py::test_fresh_flax_gpt2_loads_in_transformers": "test_gpt2_from_transformers_and_back[False]",
    "interop/test_hf_masked_lm.py::test_masked_lm_folders_load[bert-BertForPreTraining]": "the other masked-LM folders",
    "models/test_llama.py::test_rope_against_transformers_at_long_positions[dynamic]": "the llama3, linear, default RoPE",
    "models/test_llama.py::test_forward_and_gradients[linear-mha-biases-gelu]": "test_attention_impl's llama blocks",
    "models/test_llama.py::test_forward_and_gradients[mistral-window-dynamic-mqa]": "test_attention_impl's llama blocks",
    "models/test_llama.py::test_forward_and_gradients[qwen3-qk-norm]": "test_attention_impl's llama blocks",
    "interop/test_writers.py::test_port_on_a_full_disk_keeps_the_old_output[torch]": "the safetensors and orbax cases",
    "models/test_sampling.py::test_generation_with_eos_on_ragged_prompts_matches_torch[top_k=1]":
        "test_generate::test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus",
    "interop/test_hf_encoder_folders.py::test_tf_era_layer_norm_names_load": "test_porting's rename tests, test_survivors' masked-LM folders",
    "models/test_encoder.py::test_returned_attentions_match": "test_text_length's attention map, test_llama_cli's attention maps",
    "interop/test_hf_encoder_folders.py::test_verify_checkpoint_and_port_on_each": "test_hf::test_verify_checkpoint_command_compares_with_transformers",
    "models/test_former.py::test_notebook_000_ctransformer_checkpoint[True]": "test_notebook_000_ctransformer_checkpoint[False]",
    "verification/test_llama_bisect.py::test_q_norm_after_rope_instead_of_before":
        "test_sliding_window_off_by_one, test_gemma_norm_without_plus_one",
    # added at stop 29, when the default run took 1169 s in a fresh clone (991 tests)
    "cli/test_commands.py::test_verify_command_passes_and_covers_every_module_of_a_family":
        "test_classic's parity tests (the same rows in-process), test_cli's other verify commands; the README's "
        "set-up runs `flax-transformer verify` whole",
    "training/test_runs.py::test_unreadable_checkpoint_is_a_clear_error":
        "test_run_faults::test_a_corrupted_checkpoint_is_named_and_resume_falls_back_to_the_one_before",
    "cli/test_commands.py::test_every_whole_model_says_what_it_reads":
        "the verify --checkpoint tests of each family (pairs.example_inputs, drawn from input_spec), test_generate's "
        "per-family greedy tests",
    "training/test_run_faults.py::test_a_full_disk_during_the_first_checkpoint_is_one_line_and_leaves_nothing":
        "test_writers' full-disk cases (the same atomic writes), test_run_faults' corrupted-checkpoint test",
    "training/test_lm_pretrained.py::test_resume_equals_the_uninterrupted_run":
        "test_runs' resume test, test_fit_wrt's (the same fit and checkpoints)",
    "verification/test_bf16_budget.py::test_a_bug_in_a_bf16_model_is_named[window+1]":
        "test_a_bug_in_a_bf16_model_is_named[q-norm-after-rope] (nearer its budget)",
    # added at stop 30, to make room for issue 25's LoRA tests (CI took 1127 s at stop 29)
    "training/test_runs.py::test_ctrl_c_in_a_subprocess_saves_and_exits_cleanly":
        "test_interrupt_and_resume_equals_an_uninterrupted_run (a real SIGINT in-process: the checkpoint, the "
        "resume), test_finetune's SIGINT cases, test_run_faults' killed runs",
    "training/test_runs.py::test_bf16_and_fused_attention_runs":
        "test_torch_state::test_bf16_run_exported_and_imported_continues_bit_for_bit (a bf16 run), "
        "test_attention_impl (the fused attention), test_mixed_precision",
    "training/test_torch_state_values.py::test_verify_fails_on_a_bad_moment_naming_it":
        "test_port_refuses_to_write_a_run_whose_moment_is_inf, test_save_torch_state_refuses_a_bad_moment",
}

# Parametrised sweeps: the default run keeps the cases named here (the hardest masks: padding,
# causal+padding, fully masked rows; one model of each family), -m slow runs the others. A case
# named here that no longer exists fails the run, as does a stale SLOW name.
KEEP = {
    "models/test_classic.py::test_blocks_and_model": {"fully-masked-row"},
    "models/test_classic.py::test_multi_head_attention": {"3-2-7-padding", "8-3-5-causal+padding", "1-1-1-fully-masked-row"},
    "models/test_encoder.py::test_models": {"False-padding", "False-fully-masked-row"},
    "models/test_encoder.py::test_multi_head_attention": {"3-2-7-padding", "12-3-5-causal+padding", "1-1-1-fully-masked-row"},
    "models/test_encoder.py::test_bert_classifier_heads": {"cls-padding", "mean-padding"},
    "models/test_encoder.py::test_encoder_layer": {"True-padding", "False-causal+padding", "True-fully-masked-row"},
    "models/test_former.py::test_attention": {"narrow-1-1-1-none", "narrow-3-2-7-causal+padding",
                                       "narrow-3-2-7-fully-masked-row", "wide-1-2-5-padding",
                                       "wide-6-1-3-fully-masked-row"},
    "models/test_former.py::test_gtransformer": {"fully-masked-row"},
    "models/test_former.py::test_input_gradients_with_fully_masked_row": {"wide"},
    "models/test_former.py::test_ctransformer": {"False-none", "False-padding", "True-fully-masked-row"},
    "models/test_former.py::test_block": {"narrow-padding", "narrow-causal+padding", "wide-fully-masked-row"},
    "models/test_attention_impl.py::test_fused_attention_matches_torch": {
        "former-CTransformer(max)", "former-TransformerBlock(wide)", "encoder-TransformerForSequenceClassification(BERT)",
        "encoder-TransformerEncoderLayer(post-LN)", "gpt-GPT2LMHeadModel", "gpt-GPTMHTransformerLayer",
        "classic-DecoderBlock", "llama-LlamaForCausalLM(tied, Gemma)",
        "llama-LlamaDecoderLayer(q/k/v biases, MLP biases, window 3, dynamic RoPE)",
        "llama-LlamaDecoderLayer(MHA, q/k norm, linear RoPE)"},
    "models/test_attention_impl.py::test_attend_custom_backward_equals_autodiff": {"padding+empty-row", "causal",
                                                                           "broadcast-kv", "dropout"},
    "training/test_torch_state.py::test_trajectory_continues_across_frameworks": {"llama"},
    "training/test_optim.py::test_training_trajectories_match_torch_for_every_family": {"gpt", "former"},
    "models/test_generate.py::test_cache_gives_the_same_logits_at_every_step": {"gpt", "gpt2"},
    "models/test_llama_generate.py::test_ragged_batch_with_eos_equals_transformers": {"Qwen3"},
    "models/test_llama_generate.py::test_one_prompt_equals_transformers_in_one_compiled_loop": {"Llama"},
    "verification/test_bisect.py::test_a_correct_port_of_every_family_flags_nothing": {"GPTTransformer",
                                                                         "TransformerForSequenceClassification(BERT)"},
    "models/test_gpt.py::test_layer_and_model": {"left-padding (fully masked rows)", "empty row"},
    "models/test_gpt.py::test_multi_head_attention": {"2-3-7-padding", "8-1-9-empty row", "1-1-1-left-padding (fully masked rows)"},
    "interop/test_porting.py::test_round_trips_are_bit_exact": {"CTransformer", "TransformerBlock",
                                                         "TransformerForSequenceClassification", "MultiHeadAttention",
                                                         "AttentionHead"},
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a heavy test left out of the default run (conftest.SLOW says which "
                                       "lighter test covers it, conftest.KEEP which cases of a sweep stay); "
                                       "-m slow runs them")


def slow_tests(collected: set[str], functions: dict[str, set[str]], slow=None, keep=None) -> set[str]:
    """The collected test ids ("file::test[case]") that SLOW and KEEP mark slow.

    ``functions`` maps each collected file to its test functions. Raises pytest.UsageError naming
    every entry of SLOW or KEEP that matches nothing in a collected file (a renamed test or case),
    so that nothing drops out of, or stays in, the default run silently.
    """
    slow, keep = SLOW if slow is None else slow, KEEP if keep is None else keep
    cases = {}  # each collected function's case ids ("" when it has none)
    for name in collected:
        function, _, case = name.partition("[")
        cases.setdefault(function, set()).add(case.removesuffix("]"))

    def stale(name):  # of a collected file (a file left out of the run is not checked)
        file, _, test = name.partition("::")
        function, _, case = test.partition("[")
        return file in functions and (function not in functions[file]
                                      or bool(case) and f"{file}::{test}" not in collected)

    missing = [name for name in [*slow, *keep] if stale(name)]
    missing += [f"{function}[{case}]" for function, kept in keep.items() if function in cases
                for case in sorted(kept - cases[function])]
    if missing:
        raise pytest.UsageError(f"conftest.SLOW or KEEP names tests that do not exist: {missing}")
    marked = set()
    for name in collected:
        function, _, case = name.partition("[")
        if name in slow or function in slow or (function in keep and case.removesuffix("]") not in keep[function]):
            marked.add(name)
    return marked


def pytest_collection_modifyitems(config, items):
    names = {item.nodeid.rpartition("parity_tests/")[2]: item for item in items}
    functions = {}
    for name, item in names.items():
        if hasattr(item, "module"):
            functions.setdefault(name.partition("::")[0], {n for n in dir(item.module) if n.startswith("test")})
    for name in slow_tests(set(names), functions):
        names[name].add_marker(pytest.mark.slow)


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

    W is a fixed random tensor of the output's shape (``compare.compare(..., grads=True)``).
    Tolerance: TOL relative to the gradient's scale (max(1, max |g|)); and every gradient (and
    the outputs) within the float64 budget, with no NaN or inf.
    """
    from flax_transformer.interop import porting
    from flax_transformer.verification import compare

    torch_model.eval()
    report = compare.compare(torch_model, porting.torch_to_flax(torch_model), tuple(args), grads=True, tol=TOL,
                            seed=int(rng.integers(1 << 30)))
    assert report.grad_finite and report.grad_err <= TOL, \
        f"{report.worst_grad_key}: grad max abs err {report.grad_err:.3g} relative to its scale"
    assert report.passed, str(report)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
