"""A Hugging Face model config, read without importing ``transformers``, and
the rotary frequencies its ``rope_parameters`` describe.

A config arrives as a ``transformers`` config object, the dict of a
``config.json``, or a path to one; it becomes an ``HFConfig``: attribute
access over the dict, with the defaults ``transformers`` would fill in
for the fields we read. The rotary maths follows
``transformers.modeling_rope_utils`` (5.x) for the types Llama 3 and
DeepSeek-V3 checkpoints use; ``dynamic`` and ``longrope`` change with the
sequence length and are refused rather than approximated.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class HFConfig:
    """Read-only attribute view of a config dict; ``get`` for optional keys."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__["_values"] = dict(values)

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the model config has no field {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("HFConfig is read-only")

    def get(self, name: str, default=None):
        """The field's value; ``default`` where it is absent or null."""
        value = self._values.get(name)
        return default if value is None else value

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


def read_config(
    config, model_type: str, defaults: dict[str, Any], aliases: dict[str, str] | None = None
) -> HFConfig:
    """``config`` (object, dict or path) as an HFConfig, checked to be of
    ``model_type``, with ``defaults`` under the keys it leaves out;
    ``aliases``: the common name -> the model's own (GPT-2's ``n_embd``
    for ``hidden_size``), readable under both."""
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        with open(path) as f:
            config = json.load(f)
    elif not isinstance(config, dict):
        if not hasattr(config, "to_dict"):
            raise TypeError(
                f"expected a transformers config, a config.json dict or a path, got "
                f"{type(config).__name__}"
            )
        config = config.to_dict()
    found = config.get("model_type")
    if found != model_type:
        raise ValueError(
            f"the config is of model_type {found!r}, not {model_type!r}: load it with the "
            "model class of its architecture"
        )
    # A field the config gives as null stays null (``q_lora_rank: null``
    # means no low-rank q, a null ``pad_token_id`` none): dropping it would
    # let ``transformers`` fill in its own default when it reads what we save.
    values = {**defaults, **config}
    for common, own in (aliases or {}).items():
        # The common name, where given, wins (a job's override over a
        # built-in config, as transformers' attribute_map sets the own one).
        if values.get(common) is not None:
            values[own] = values[common]
        elif own in values:
            values[common] = values[own]
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters(values)
    return HFConfig(values)


def rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """The v5 ``rope_parameters`` dict, also from a v4 config's
    ``rope_theta`` and ``rope_scaling`` (which ``transformers`` converts
    the same way)."""
    params = dict(values.get("rope_parameters") or {})
    scaling = values.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", values.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = kind
    if kind not in ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
            "'dynamic' and 'longrope' rescale with the sequence length"
        )
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    return params


def rope_frequencies(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, attention scaling of cos/sin)."""
    base = params["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, params), 1.0
    return _yarn(params, dim)


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths divided by ``factor``, short ones kept, a smooth
    blend between ``original / low_freq_factor`` and ``/ high_freq_factor``."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolation for low frequencies, extrapolation for high ones,
    a linear ramp between the correction dims; cos/sin scaled by mscale."""
    base, factor = p["rope_theta"], p["factor"]
    original = p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention = yarn_mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv, float(attention)


def softmax_scale(params: dict[str, Any], head_dim: int) -> float:
    """1/sqrt(head_dim), times YaRN's mscale(all dims)^2 where the config
    has one (DeepSeek's MLA scales the whole q.k, not only the rotary dims)."""
    scale = head_dim**-0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale
