"""Passing and reading a KV cache at the boundary with Hugging Face models, whatever the
transformers version.

transformers 5.24 renamed the forward argument ``past_key_values`` to ``cache``, and the
output field with it; the old names still work but warn at every call, and are to be removed
in 5.40. Our own models (``ValueHeadModel``, the Megatron wrappers, DeepSpeed-Chat's reward
model seen through ``ValueView``) keep ``past_key_values``. Every cached forward of a model
that may be a Hugging Face one goes through these two functions.
"""
from __future__ import annotations

import inspect

_ARG: dict[type, str] = {}


def installed_name() -> str:
    """The name the installed transformers' models take and return their cache by."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` under the name ``model``'s forward takes its cache by: the one its
    signature names, else (a wrapper that passes ``**kwargs`` on) the installed transformers'
    (a DeepSpeed engine is looked through to the module it wraps)."""
    target = getattr(model, "module", model)
    kind = type(target)
    name = _ARG.get(kind)
    if name is None:
        try:
            params = inspect.signature(getattr(target, "forward", target)).parameters
        except (TypeError, ValueError):  # a builtin or C callable
            params = {}
        named = [n for n in ("cache", "past_key_values") if n in params]
        name = named[0] if len(named) == 1 else installed_name()
        _ARG[kind] = name
    return {name: cache}


def output_cache(out):
    """The cache a cached forward returned: ``out.cache`` for transformers >= 5.24 outputs,
    else ``out.past_key_values``."""
    fields = getattr(out, "__dataclass_fields__", None)
    if fields is not None and "cache" in fields:
        return out.cache
    return out.past_key_values
