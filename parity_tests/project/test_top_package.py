"""The top package holds no names: everything is imported by its full path, and the old short names say where they went."""

import importlib
import re

import pytest

import flax_transformer


def test_full_paths_import():
    import flax_transformer.interop.porting
    from flax_transformer.models.attention import set_attention
    from flax_transformer.models.former import CTransformer

    assert flax_transformer.interop.porting.torch_to_flax
    assert CTransformer.__module__ == "flax_transformer.models.former"
    assert set_attention.__module__ == "flax_transformer.models.attention"


@pytest.mark.parametrize("name", sorted(flax_transformer._MOVED))
def test_an_old_short_name_names_its_full_path(name):
    target = flax_transformer._MOVED[name]
    message = re.escape(f"flax_transformer.{name} is {target}: import it from there")
    with pytest.raises(AttributeError, match=message):
        getattr(flax_transformer, name)
    with pytest.raises(ModuleNotFoundError, match=message):
        exec(f"from flax_transformer import {name}", {})
    with pytest.raises(ModuleNotFoundError, match=message):
        importlib.import_module(f"flax_transformer.{name}")
    # and the path it names is real
    try:
        importlib.import_module(target)
    except ModuleNotFoundError:
        module, _, attribute = target.rpartition(".")
        assert hasattr(importlib.import_module(module), attribute), target


def test_other_names_are_not_found_as_usual():
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        flax_transformer.nothing_here  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="No module named 'flax_transformer.nothing_here'"):
        importlib.import_module("flax_transformer.nothing_here")


def test_the_package_defines_no_names():
    public = {name for name in vars(flax_transformer) if not name.startswith("_")}
    layers = {"models", "interop", "verification", "training", "cli"}
    assert public <= layers, public - layers


@pytest.mark.parametrize("package", ["flax_transformer.models", "flax_transformer.training",
                                     "flax_transformer.training.torch_state"])
def test_layer_packages_define_no_names(package):
    """Their names are imported from the modules that define them, not from the package (one path per name)."""
    module = importlib.import_module(package)
    names = {name for name, value in vars(module).items()
             if not name.startswith("_") and getattr(value, "__name__", "").rpartition(".")[0] != package}
    assert not names, names
