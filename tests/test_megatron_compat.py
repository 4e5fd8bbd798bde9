"""Tier 0: the CPU compatibility patches of megatron-core (oppo_ds/megatron/compat.py).

The signature test fails when a megatron-core upgrade changes a function we replace: the
replacement must then be reviewed against the new code before it is used again."""
from __future__ import annotations

import inspect

import pytest
import torch

import megatron.core  # noqa: E402,F401  the test extra installs it: missing is a failure, not a skip

from oppo_ds.megatron import compat  # noqa: E402


@pytest.mark.parametrize("patch", compat.PATCHES, ids=lambda p: f"{p.owner}.{p.name}")
def test_patched_functions_keep_their_signature(patch):
    assert compat.signature_of(patch) == patch.signature
    # the replacement takes every argument the original takes
    replacement = inspect.signature(patch.replacement)
    original = inspect.signature(patch.original())
    assert list(replacement.parameters) == list(original.parameters)


def test_apply_is_idempotent_and_only_where_needed():
    first = compat.apply_cpu_compat()
    if not torch.cuda.is_available():
        assert all(p.applied() for p in compat.PATCHES if p.needed())
    assert compat.apply_cpu_compat() == []          # a second call changes nothing
    for patch in compat.PATCHES:                    # the original stays reachable
        assert not getattr(patch.original(), "_oppo_cpu_compat", False)
        assert patch.needed()  # megatron-core 0.16.1 still needs every one of them
    assert isinstance(first, list)


def test_cpu_replacements_work():
    compat.apply_cpu_compat()
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer()
    t = buf.get_tensor((2, 3), torch.float32, "x")
    assert t.shape == (2, 3) and t.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        return
    mrandom.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    state = torch.get_rng_state()
    with mrandom.get_cuda_rng_tracker().fork():
        pass
    assert torch.equal(state, torch.get_rng_state())  # the global CPU RNG is left alone
    with pytest.raises(Exception, match="not added"):
        with mrandom.get_cuda_rng_tracker().fork("no-such-state"):
            pass


def test_a_changed_signature_refuses_to_patch(monkeypatch):
    patch = compat.PATCHES[0]
    changed = compat.Patch(patch.module, patch.owner, patch.name, "(self, something_else)",
                           patch.replacement)
    monkeypatch.setattr(compat, "PATCHES", (changed,))
    monkeypatch.setattr(changed.target(), patch.name, patch.original())  # as if unpatched
    if torch.cuda.is_available():
        assert compat.apply_cpu_compat() == []
        return
    with pytest.raises(RuntimeError, match="signature"):
        compat.apply_cpu_compat()
