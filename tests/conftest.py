"""Shared fixtures; none is autouse, so other test modules are unaffected."""

import pytest
import torch


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
