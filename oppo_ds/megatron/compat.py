"""The fixes megatron-core needs to run on a CPU, in one place.

megatron-core is written for CUDA: a few functions that every forward reaches allocate on
``torch.cuda.current_device()`` or swap CUDA RNG states, and fail on a machine without a GPU
(FACTS.md, "megatron-core on CPU"). :func:`apply_cpu_compat` replaces exactly those
functions, and only when all of these hold:

* CUDA is not available (on a GPU nothing is touched);
* the installed function still does the CUDA-only thing (its source mentions ``torch.cuda``),
  so a megatron-core that fixed it upstream is left alone;
* its signature is the one the replacement was written against (``PATCHES[...].signature``);
  a changed signature raises instead of patching blindly (``tests/test_megatron_compat.py``
  fails first).

Applying twice is a no-op (each replacement is marked). Written against megatron-core 0.16.1.

The replacements:

``GlobalMemoryBuffer.get_tensor``
    allocates its scratch buffer on the CPU instead of the current CUDA device.
``CudaRNGStatesTracker.fork``
    a plain context manager: the CUDA RNG it would swap does not exist. Only dropout inside
    tensor-parallel regions reads it, and oppo-ds runs with dropout off (PPO ratios compare
    two forwards of the same weights).
``model_parallel_cuda_manual_seed``
    registers the tracker's named states (so ``fork(name)`` checks still pass) from CPU
    generators seeded as megatron seeds them, without touching the global CPU RNG.
``RotaryEmbedding.get_emb``
    keeps ``inv_freq`` where it is instead of moving it to ``torch.cuda.current_device()``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import operator
from dataclasses import dataclass
from typing import Callable

import torch

_MARK = "_oppo_cpu_compat"


@dataclass(frozen=True)
class Patch:
    module: str        # where the function lives
    owner: str         # class name, or "" for a module-level function
    name: str          # attribute name
    signature: str     # str(inspect.signature(original)) the replacement was written for
    replacement: Callable

    def target(self):
        mod = importlib.import_module(self.module)
        return getattr(mod, self.owner) if self.owner else mod

    def original(self):
        return inspect.unwrap(getattr(self.target(), self.name)) \
            if not self.applied() else getattr(self.target(), self.name).__wrapped__

    def applied(self) -> bool:
        return getattr(getattr(self.target(), self.name), _MARK, False)

    def needed(self) -> bool:
        """The installed function still refers to CUDA (a fixed upstream needs no patch)."""
        try:
            source = inspect.getsource(self.original())
        except (OSError, TypeError):
            return True
        return "torch.cuda" in source or "_get_cuda_rng_state" in source \
            or "_set_cuda_rng_state" in source


def _get_tensor_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required = functools.reduce(operator.mul, tensor_shape, 1)
    held = self.buffer.get((name, dtype))
    if held is None or held.numel() < required:
        with (mem_alloc_context or contextlib.nullcontext)():
            held = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
    return held[:required].view(*tensor_shape)


@contextlib.contextmanager
def _fork_cpu(self, name="model-parallel-rng"):
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    yield


def _manual_seed_cpu(seed, te_rng_tracker=False, inference_rng_tracker=False,
                     use_cudagraphable_rng=False, tp_rank=None, ep_rank=None, etp_rank=None,
                     force_reset_rng=False):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    mrandom.initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                                   force_reset=force_reset_rng)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    # the same seeds megatron derives (data parallel, tensor parallel, expert), as CPU states
    seeds = {"data-parallel-rng": seed, "model-parallel-rng": seed + 2718 + tp_rank,
             "expert-parallel-rng": seed + 1024 + 100 * ep_rank + etp_rank}
    tracker.set_states({name: torch.Generator().manual_seed(s).get_state()
                        for name, s in seeds.items()})
    tracker.seeds_ = set(seeds.values())


def _get_emb_cpu(self, max_seq_len, offset=0):
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (S, D/2), on inv_freq's device
    if self.rotary_interleaved:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)        # f0 f0 f1 f1 ...
    else:
        emb = torch.cat((freqs, freqs), dim=-1)                # f0 f1 ... f0 f1 ...
    return emb[:, None, None, :]


PATCHES = (
    Patch("megatron.core.utils", "GlobalMemoryBuffer", "get_tensor",
          "(self, tensor_shape, dtype, name, mem_alloc_context: Optional[Callable] = None)",
          _get_tensor_cpu),
    Patch("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", "fork",
          "(self, name='model-parallel-rng')", _fork_cpu),
    Patch("megatron.core.tensor_parallel.random", "", "model_parallel_cuda_manual_seed",
          "(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False, "
          "use_cudagraphable_rng: bool = False, tp_rank: Optional[int] = None, "
          "ep_rank: Optional[int] = None, etp_rank: Optional[int] = None, "
          "force_reset_rng: bool = False)", _manual_seed_cpu),
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding",
          "get_emb", "(self, max_seq_len: 'int', offset: 'int' = 0) -> 'Tensor'",
          _get_emb_cpu),
)
# modules that import model_parallel_cuda_manual_seed by name
_REEXPORTS = ("megatron.core.tensor_parallel",)


def signature_of(patch: Patch) -> str:
    """The installed original's signature, as ``str(inspect.signature(...))``."""
    return str(inspect.signature(patch.original()))


def apply_cpu_compat(*, force: bool = False) -> list[str]:
    """Patch what megatron-core needs on a CPU; returns the names patched by this call.

    No-op with CUDA available (unless ``force``, for tests), for functions already patched
    and for functions that no longer use CUDA. Raises ``RuntimeError`` when a function to
    patch has another signature than the one its replacement was written for.
    """
    if torch.cuda.is_available() and not force:
        return []
    done = []
    for patch in PATCHES:
        if patch.applied() or not patch.needed():
            continue
        found = signature_of(patch)
        if found != patch.signature:
            raise RuntimeError(
                f"megatron-core changed {patch.module}.{patch.owner or ''}{'.' if patch.owner else ''}"
                f"{patch.name}: signature {found}, oppo_ds.megatron.compat was written for "
                f"{patch.signature}; review the CPU replacement before running on CPU")
        original = getattr(patch.target(), patch.name)
        replacement = functools.wraps(original)(patch.replacement)
        setattr(replacement, _MARK, True)
        setattr(patch.target(), patch.name, replacement)
        if not patch.owner:
            for module in _REEXPORTS:
                mod = importlib.import_module(module)
                if getattr(mod, patch.name, None) is original:
                    setattr(mod, patch.name, replacement)
        done.append(f"{patch.owner + '.' if patch.owner else ''}{patch.name}")
    return done
