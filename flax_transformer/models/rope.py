"""Rotary positions of the llama family: the scaling kinds (``RopeScaling``), the inverse frequencies
and the attention factor that both packages compute from them, once, on the host.

Pure Python and numpy, like ``llama_config``: torch_reference reads it without JAX. A config gives its
RoPE per layer kind (``rope_for``): every layer the same (``rope_theta``, ``rope_scaling``), or, with
``rope_local_base_freq`` (Gemma 3), the sliding layers their own base and no scaling.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from flax_transformer.models.arg_checks import check_positive_float, check_size, shown
from flax_transformer.models.configs import _set

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for contexts longer than the training one.

    rope_type:
        ``"linear"``: every frequency divided by ``factor`` (positions interpolated).
        ``"dynamic"``: NTK scaling; once a call's largest position reaches
            ``max_position_embeddings``, theta grows with it. Computed from each call alone
            (transformers' module also remembers the longest call it has seen).
        ``"llama3"``: Llama 3.1's: wavelengths above ``original_max_position_embeddings /
            low_freq_factor`` divided by ``factor``, below ``.../ high_freq_factor`` kept, and a
            smooth blend between. Its error is zero at position 0 and grows with position.
        ``"yarn"``: YaRN (GPT-OSS, Qwen, DeepSeek): the frequencies that turn fewer than
            ``beta_slow`` times over ``original_max_position_embeddings`` divided by ``factor``,
            those that turn more than ``beta_fast`` times kept, a linear ramp between (its ends
            rounded outwards when ``truncate``); cos and sin are multiplied by the attention
            factor: ``attention_factor``, or ``0.1 ln(factor) + 1``, or with ``mscale`` and
            ``mscale_all_dim`` the ratio of two such terms.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported ({', '.join(ROPE_TYPES[1:])}; "
                             "or rope_scaling=None for plain RoPE)")
        factor = check_positive_float("rope_scaling.factor", self.factor)
        if factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor!r}")
        _set(self, "factor", factor)
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                _set(self, name, check_positive_float(f"rope_scaling.{name}", getattr(self, name)))
            if not self.low_freq_factor < self.high_freq_factor:
                raise ValueError(f"rope_scaling.low_freq_factor ({self.low_freq_factor}) must be below "
                                 f"high_freq_factor ({self.high_freq_factor})")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_scaling of type {self.rope_type!r} needs original_max_position_embeddings")
        if self.original_max_position_embeddings is not None:
            _set(self, "original_max_position_embeddings", check_size(
                "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings))
        if self.rope_type == "yarn":
            for name in ("beta_fast", "beta_slow"):
                _set(self, name, check_positive_float(f"rope_scaling.{name}", getattr(self, name)))
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    _set(self, name, check_positive_float(f"rope_scaling.{name}", getattr(self, name)))
            if not isinstance(self.truncate, bool):
                raise ValueError(f"rope_scaling.truncate must be True or False, got {shown(self.truncate)}")

    @classmethod
    def from_any(cls, value, *, max_position_embeddings: int | None = None) -> RopeScaling | None:
        """From a dict in transformers' form (``rope_type`` or the older ``type``), or None.

        ``{"rope_type": "default"}`` is plain RoPE: None. llama3 and yarn without
        ``original_max_position_embeddings`` take ``max_position_embeddings``, as transformers does;
        yarn's ``beta_fast``/``beta_slow`` given as None or 0 take 32 and 1, as transformers reads them.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"rope_scaling must be None or a dict with 'rope_type', got {shown(value)}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind == "default":
            return None
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope partial_rotary_factor other than 1 is not supported")
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in value.items() if k in known and k != "rope_type"}
        if kind in ("llama3", "yarn") and fields.get("original_max_position_embeddings") is None:
            fields["original_max_position_embeddings"] = max_position_embeddings
        if kind == "yarn":
            if fields.get("factor") is None:  # DeepSeek's: the ratio of the two contexts
                fields["factor"] = max_position_embeddings / fields["original_max_position_embeddings"]
            fields["beta_fast"] = fields.get("beta_fast") or 32.0
            fields["beta_slow"] = fields.get("beta_slow") or 1.0
        return cls(rope_type=kind, **fields)

    def to_dict(self) -> dict:
        """transformers' ``rope_scaling`` dict (``rope_type`` and the older ``type`` both written)."""
        out = {"rope_type": self.rope_type, "type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        if self.rope_type == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            out.update({k: getattr(self, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                        if getattr(self, k) is not None})
        return out


def llama3_scaling(factor: float) -> RopeScaling:
    """Llama 3.1's scaling (8k original context) with ``factor``: the presets' and Meta's files'."""
    return RopeScaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


def rope_for(config, layer_type: str = "full_attention") -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of the layers of ``layer_type``: Gemma 3's sliding layers take
    ``rope_local_base_freq`` unscaled; every other layer ``rope_theta`` and ``rope_scaling``."""
    local = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local is not None:
        return local, None
    return config.rope_theta, config.rope_scaling


def attention_scaling(scaling: RopeScaling | None) -> float:
    """The factor on cos and sin: YaRN's (transformers' ``_compute_yarn_parameters``), else 1."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(get_mscale(scaling.factor, scaling.mscale) / get_mscale(scaling.factor, scaling.mscale_all_dim))
    return get_mscale(scaling.factor)


def rope_inverse_frequencies(config, dtype=np.float32, layer_type: str = "full_attention") -> np.ndarray:
    """RoPE's inverse frequencies (head_dim / 2,) in ``dtype`` for the layers of ``layer_type``,
    computed once on the host and shared by both packages. ``dynamic`` scaling changes them per call
    (the models do that); this is its table below ``max_position_embeddings``.

    transformers' formulas in its order of float32 roundings (its ``scalar / tensor`` is
    ``tensor.reciprocal() * scalar``), with one difference: ``theta ** exponent`` is rounded once
    from float64. torch's vectorised float32 pow is within one ulp of that and differs from it on
    about 1.6% of the entries, and differently on other CPUs (AVX-512, AVX2 and scalar code
    paths); XLA's differs again between its constant folder and its kernels. At position p a
    one-ulp frequency moves the angle by up to p * 2**-24 radians (1e-3 at 16k).
    """
    dim = config.head_dim
    theta, scaling = rope_for(config, layer_type)
    one = dtype(1)
    exponents = np.arange(0, dim, 2).astype(dtype) / dtype(dim)
    powers = (float(dtype(theta)) ** exponents.astype(np.float64)).astype(dtype)
    inv_freq = one / powers
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq
    factor = dtype(scaling.factor)
    if scaling.rope_type == "linear":
        return inv_freq / factor
    if scaling.rope_type == "yarn":
        return _yarn(inv_freq, one / (factor * powers), dim, theta, scaling, dtype)
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend between
    low, high, context = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = context / low, context / high
    wavelen = (one / inv_freq) * dtype(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = ((one / wavelen) * dtype(context) - dtype(low)) / dtype(high - low)
    smoothed = (one - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(dtype)


def _yarn(extrapolation, interpolation, dim: int, theta: float, scaling: RopeScaling, dtype) -> np.ndarray:
    """YaRN's blend of the plain (extrapolated) and divided (interpolated) frequencies, as transformers'
    ``_compute_yarn_parameters``: the correction range in float64, the ramp in ``dtype``."""
    context = scaling.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2).astype(dtype) - dtype(low)) / dtype(high - low), 0, 1).astype(dtype)
    keep = dtype(1) - ramp  # the share of the plain frequency
    return (interpolation * (dtype(1) - keep) + extrapolation * keep).astype(dtype)
