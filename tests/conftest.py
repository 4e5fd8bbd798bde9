"""Shared fixtures. The two autouse ones destroy the DeepSpeed engines a test (or a module's
fixtures) started and left open; every other fixture is asked for by name."""

import sys

import pytest
import torch


def _open_engines() -> set:
    module = sys.modules.get("oppo_ds.engines.deepspeed_engine")  # never imported for it
    return set(module.open_engines()) if module is not None else set()


def _close(engines: set) -> None:
    if engines:
        sys.modules["oppo_ds.engines.deepspeed_engine"].close_engines(list(engines))


@pytest.fixture(autouse=True)
def close_test_engines():
    """After each test, the DeepSpeed engines it started and did not close. DeepSpeed keeps
    an engine's buffers after its last reference is gone (a ZeRO-3 engine: 1.9 GB of private
    virtual memory, mostly untouched); over the suite they added up to 31 GB, beyond what
    this 23 GiB machine lets a fork account, and a late fork (the Slurm test's munged)
    failed with ENOMEM. Engines of module-scoped fixtures, open before the test, stay."""
    before = _open_engines()
    yield
    _close(_open_engines() - before)


@pytest.fixture(scope="module", autouse=True)
def close_module_engines():
    """At the end of a module, the engines its module-scoped fixtures started."""
    before = _open_engines()
    yield
    _close(_open_engines() - before)


@pytest.fixture(scope="module")
def torch_one_thread():
    """One intra-op thread for tiny-model tests: their ops take microseconds, and with two
    threads on a small shared CPU each op waits on a busy core (milliseconds per op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A built-in workload cache per test module: the first run in the module prepares the
    workload's tiny models there (under the module's own settings), later runs reuse them."""
    return str(tmp_path_factory.mktemp("builtin-cache"))
