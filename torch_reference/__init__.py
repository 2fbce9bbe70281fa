"""PyTorch reference implementations of the notebooks' architectures.

One module per family: ``former`` (notebooks 000/004) and ``encoder`` (notebook 001).
Names and state_dict keys are the notebooks'. This package never imports JAX.
"""
