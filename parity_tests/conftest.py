"""Shared settings and helpers for the parity tests.

fp32 parity is checked with full-precision matmuls, and with JAX's strict dtype
promotion so that an accidental float64/bool promotion in the library shows up here.
"""

import atexit
import gc
import os
import shutil
import tempfile

# One persistent XLA compilation cache for the whole run, set before jax is imported: the xdist
# workers and every subprocess a test starts (the CLI, the trainers) inherit it, so a program one
# of them compiled (the same tiny model, the same step) is loaded by the others instead of
# compiled again. It lives in a temporary folder that the process that made it removes at exit:
# each run starts cold, as CI does. max_size turns on jax's file lock, so concurrent writers and
# readers of one entry never see it half written. Set JAX_COMPILATION_CACHE_DIR to choose another
# (.ci/run gives its two runs, the default one and the slow tests, one folder); the other three
# settings apply to it too.
# Only programs that took 0.5 s or more to compile are written: writing every eager op's tiny
# program cost more than compiling it again (test_gpt + test_inputs: 80 -> 67 s; the CLI and
# training tests, which share big programs across processes, the same at 0, 0.1 and 0.5).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="ft-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
for _name, _value in {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                      "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)}.items():
    os.environ.setdefault(_name, _value)

# torch on one thread in the tests (and the processes they start): the two xdist workers share two
# cores, so torch's default of a thread per core would have four threads contend for two. Measured
# on test_hf + test_encoder: 173 -> 147 CPU s, 265 -> 221 s wall. The benchmarks keep the defaults.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from parity_tests import slow_marks  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_dtype_promotion", "strict")
torch.use_deterministic_algorithms(True)

TOL = 1e-5  # fp32, matmul precision "highest": a larger error is a bug, not noise


def pytest_configure(config):
    for name, text in slow_marks.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config, items):
    slow_marks.mark_slow(items)  # the heaviest tests, marked at each test: slow_marks.py says how


def pytest_sessionfinish(session):
    """The run's last full garbage collection, then the heap frozen (``gc.freeze``).

    An xdist worker's heap ends a run with about half a million objects (the compiled programs'
    Python side), and one full collection of it takes 4-5 s on two busy cores. pytest collects
    twice more after this hook, in its ``unconfigure`` and cleanup; by then the worker has said
    it finished, and execnet gives a finished worker 5 s to end before it sends the worker a
    SIGINT. The KeyboardInterrupt landed inside JAX's gc callback (``_xla_gc_callback``), which
    reported it as an unraisable exception: the traceback a green run ended with. Collected here,
    before xdist's own ``pytest_sessionfinish`` (a hookwrapper) reports the worker finished, the
    garbage is still collected and its ``__del__`` errors still reported; frozen, the objects
    that live on to the exit are not traversed again, and the later collections take
    milliseconds.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, JAX's compiled programs and trace caches are dropped (``jax.clear_caches``).

    A worker keeps every program it compiled otherwise: by the end of the slow run each of the two
    held 7-8 GB, and a worker died in its last files (``test_routing``: "node down: Not properly
    terminated") in two runs out of two, on a 24 GB machine. Programs shared across modules are
    compiled again or read from the persistent cache above. Measured on five model test files
    (``/usr/bin/time -f %M python -m pytest parity_tests/models/test_{llama,gpt,moe,encoder,former}.py
    -n 0``): peak memory 2.29 -> 1.50 GB, and no slower (187 -> 134 s, other work running).
    """
    yield
    jax.clear_caches()


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
