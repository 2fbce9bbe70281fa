"""The package's layers, read from the source: no import circle (imports inside functions count),
and every import runs one way, down the layers the folder tree names.

    models  <-  interop  <-  verification  <-  training  <-  cli  <-  flax_transformer/__init__, __main__

``torch_reference`` stands beside ``models`` (it may read the pure-Python ``models.configs``,
``models.llama_config``, ``models.mla_config``, ``models.rope`` and the pure-Python shared modules in ``PURE_PYTHON``, nothing else of flax_transformer); ``train/`` is above everything.
Self-contained (no tool outside the repository), so it runs wherever the tests run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flax_transformer", "torch_reference", "train")
# rank of each layer: a module may import its own layer and lower ranks only
LAYERS = {"flax_transformer.models": 0, "flax_transformer.interop": 1, "flax_transformer.verification": 2,
          "flax_transformer.training": 3, "flax_transformer.cli": 4, "flax_transformer": 5, "train": 6}
# torch_reference may read only these pure-Python modules of flax_transformer
PURE_PYTHON = ("configs", "llama_config", "mla_config", "rope", "arg_checks", "constructor_records", "input_specs", "state_dict_errors",
               "shape_logging", "generation_args")
TORCH_REFERENCE_MAY_IMPORT = {*(f"flax_transformer.models.{name}" for name in PURE_PYTHON), "flax_transformer",
                              "flax_transformer.models"}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """{imported project module: line} of every import in the file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
    return found


def _graph():
    modules = _modules()
    known = set(modules)
    return modules, {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(name: str) -> str | None:
    for layer in sorted(LAYERS, key=len, reverse=True):
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def _circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)  # noqa: E702
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1  # noqa: E702
                    stack.append(child); on.add(child)  # noqa: E702
                    work.append((child, iter(edges[child])))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop(); on.discard(w); component.append(w)  # noqa: E702
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles():
    modules, edges = _graph()
    circles = _circles(edges)
    lines = [f"{a} ({modules[a].relative_to(ROOT)}:{edges[a][b]}) imports {b}"
             for circle in circles for a in circle for b in edges[a] if b in circle]
    assert not circles, "import circles:\n" + "\n".join(lines)


def test_imports_run_down_the_layers():
    modules, edges = _graph()
    wrong = []
    for name, targets in edges.items():
        path = modules[name].relative_to(ROOT)
        for target, line in targets.items():
            if name.startswith("torch_reference"):
                if target.startswith("flax_transformer") and target not in TORCH_REFERENCE_MAY_IMPORT:
                    wrong.append(f"{path}:{line}: torch_reference imports {target}")
                continue
            here, there = _layer(name), _layer(target)
            if here is None or there is None:
                continue
            if LAYERS[there] > LAYERS[here]:
                wrong.append(f"{path}:{line}: {here} imports {target}, a layer above it")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_every_module_sits_in_a_layer():
    """No module at the top of flax_transformer but the package's own ``__init__``/``__main__``:
    the folder a file is in says its layer."""
    loose = [str(p.relative_to(ROOT)) for p in (ROOT / "flax_transformer").glob("*.py")
             if p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules outside the layer folders: {loose}"


@pytest.mark.parametrize("source, message", [
    ("from flax_transformer.training import loop\n", "a layer above it"),
    ("def f():\n    from flax_transformer.verification import certificate\n", "a layer above it"),
])
def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch, source, message):
    """The check itself can fail: an interop module that reaches up (even lazily) is reported."""
    modules, edges = _graph()
    name = "flax_transformer.interop.files"
    path = tmp_path / "files.py"
    path.write_text(source)
    edges[name] = _imports(name, path, set(modules))
    here = _layer(name)
    found = [t for t in edges[name] if LAYERS[_layer(t)] > LAYERS[here]]
    assert found, message


def test_the_circle_check_catches_a_circle():
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b": 1}, "b": {}}) == []
