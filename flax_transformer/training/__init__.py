"""The training library: the optax chain, the jitted steps, the data readers and tokenizers,
length-bucketed batches, and the run loop (orbax checkpoints, exact resume, logs, curves).

The tasks (``classify``, ``lm``, ``seq2seq``) are library modules with frozen configs and
presets and a ``train_and_evaluate(config, run_dir)``; ``train/`` holds their thin
command-line entry points.

The modules import one way, each only from the lines above it (and from ``models``,
``interop``, ``verification``; never from ``cli``). Import each by its full path: this ``__init__``
holds no names::

    errors, config_bounds, batching, data, tokenizers, step, malloc   # import nothing of this package
    optim, preflight, distributed                              # the optimizer; memory/output checks; the mesh
    torch_state.checks, torch_state.to_jax                     # torch's optimizer state: checked; continued in JAX
    run_config                                                 # RunConfig, and the task configs' nesting
    rundir                                                     # the run directory: run.json, lock, logs, curves
    run_checkpoints                                            # the run's orbax checkpoints
    loop, torch_state.to_torch                                 # fit; a model and its optimizer as a torch checkpoint
    hf_init, probe                                             # a pretrained HF folder as init, its --export-hf; the linear probe
    lm, seq2seq, parity, torch_state.continuity                # the tasks; optimizer parity; a run across a torch checkpoint
    classify                                                   # the classifier task
    run_loading                                                # a run directory back as a model (the task named in run.json)
    torch_state.run_export                                     # a run directory, by its path, as a torch checkpoint
"""
