"""Shared fixtures, and the order of the test files. The two autouse fixtures destroy the
DeepSpeed engines a test (or a module's fixtures) started and left open; every other fixture
is asked for by name."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch


# Seconds each test file took in a whole run (setup, call and teardown of its tests), written
# by `--file-seconds`; refresh it after adding a slow file: `make test TEST_ARGS="--file-seconds
# tests/file_seconds.json"`.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_addoption(parser):
    parser.addoption("--file-seconds", metavar="PATH", default=None,
                     help="write each test file's seconds in this run to PATH (JSON), the "
                          "table the files are ordered by (tests/file_seconds.json)")


def pytest_configure(config):
    path = config.getoption("--file-seconds")
    if path and not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(_FileSeconds(path), "oppo-file-seconds")


def pytest_collection_modifyitems(config, items):
    """The test files longest first, by ``FILE_SECONDS``; a file's tests keep their order.
    `make test` has pytest-xdist hand whole files to its workers in this order
    (``--dist loadfile --no-loadscope-reorder``), each taking the next file as it runs short,
    so the long files start early and short ones fill the end. xdist's own order, most tests
    first, put files of few long tests late (test_distributed.py, 9 minutes, 35th of 51):
    replaying the 2026-11-29 run's test times through xdist's hand-out, its two workers end
    at 41.5 and 44.6 min in that order, both at 43.1 in this one. Files not in the table
    (new ones) go first."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    unknown = max(seconds.values(), default=0.0) + 1.0
    items.sort(key=lambda item: -seconds.get(item.path.name, unknown))  # stable


class _FileSeconds:
    """Sums each test file's report durations (setup, call, teardown) and writes them at the
    end of a session whose tests all passed, longest first, in one rename (a torn table
    would stop every worker's collection). Counts what ran: a run of some tests gives a
    partial table."""

    def __init__(self, path: str):
        self.path, self.seconds = Path(path), {}

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus != 0:
            return
        table = {k: round(v, 1) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(part, self.path)


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
