"""Planting a porting bug in one Flax module instance, and checking that ``bisect`` names it.

The bisect tests of the llama family (``test_llama_bisect.py``, ``test_gemma_gpt_oss_bisect.py``,
``test_deepseek_bisect.py``) plant each bug after a correct port without editing the library: a changed
attribute or weight, or, with ``patched_call``, a function of the library replaced while one module
instance runs.
"""


def patched_call(module, where, **replacements):
    """Give one module instance its own ``__call__``: the library's, with functions of the Python module
    ``where`` (the one whose code the call runs, e.g. ``flax_transformer.models.llama``) replaced while it
    runs. Python looks a call up on the type and a function's globals at call time, so the other instances
    of the class, and every call after this one returns, run the library as it is."""
    cls = type(module)

    def call(self, *args, **kwargs):
        saved = {name: getattr(where, name) for name in replacements}
        try:
            for name, value in replacements.items():
                setattr(where, name, value)
            return cls.__call__(self, *args, **kwargs)
        finally:
            for name, value in saved.items():
                setattr(where, name, value)

    module.__class__ = type(cls)(f"Broken{cls.__name__}", (cls,), {"__call__": call})


def check_named(report, named: str, grads: bool = True, incomplete=()):
    """``named`` introduced the error and nothing before it (its own submodules aside) diverged; with
    ``grads`` the first wrong gradient is a parameter of ``named`` (a tied tensor: under any key).
    ``named`` may be ``"<model>"``, the model's own computation (then no module diverged, and any
    parameter will do). Nothing went uncompared but what ``incomplete`` allows (``report.incomplete``'s
    entries)."""
    assert report.first_divergent == named, str(report)
    assert set(report.incomplete) <= set(incomplete), str(report)
    if named == "<model>":
        assert all(r.status == "ok" or r.status.startswith("covered") for r in report.rows if r.path), str(report)
    else:
        paths = [r.path for r in report.rows]
        assert report.rows[paths.index(named)].status == "introduced", str(report)
        upstream = [r for r in report.rows[:paths.index(named)] if not r.path.startswith(named + ".")]
        assert all(r.status == "ok" or r.status.startswith("covered") for r in upstream), str(report)
    if grads:
        row = next(g for g in report.grad_rows if g.name == report.first_divergent_grad)
        assert named == "<model>" or any(k.startswith(named + ".") for k in row.keys or (row.name,)), str(report)
