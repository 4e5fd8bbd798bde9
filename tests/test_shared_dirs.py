"""Tier 1: the start-up check that every rank sees logging.output_dir and workload.cache_dir as
one directory (oppo_ds/shared_dirs.py), with two real processes over gloo. A node-local disk is
made for real: rank 1 runs in a mount namespace of its own with a private tmpfs over the
directory (needs root, like the Slurm cluster tests). The same check between two Slurm nodes:
tests/test_slurm.py::test_two_nodes_an_output_dir_on_a_node_local_disk_stops_the_job."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from oppo_ds.engines.deepspeed_engine import find_free_port

RANK = """\
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from oppo_ds.config_types import ConfigError
from oppo_ds.shared_dirs import check_shared_dirs
rank, port, dirs = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
try:
    check_shared_dirs(dirs, settle_s=0.5)
    print(json.dumps({"ok": True}))
except ConfigError as err:
    print(json.dumps({"ok": False, "key": err.key, "detail": err.detail}))
dist.destroy_process_group()
"""

# rank 1 on a "node" whose $0 is a disk of its own: a private mount namespace, a tmpfs there
PRIVATE = 'mount -t tmpfs tmpfs "$0" && exec "$@"'


def _two_ranks(dirs: dict, private: str | None = None, cwd1: str | None = None) -> list[dict]:
    """Each rank's outcome of check_shared_dirs(dirs); rank 1 with ``private`` (a folder) on
    a disk of its own, in working directory ``cwd1``."""
    port = str(find_free_port())
    procs = []
    try:
        for rank in (0, 1):
            cmd = [sys.executable, "-c", RANK, str(rank), port, json.dumps(dirs)]
            if rank == 1 and private is not None:
                cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE,
                       private, *cmd]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, cwd=cwd1 if rank == 1 else None))
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:  # a rank left waiting for the other would wait for gloo's timeout
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _private_mount_works(tmp_path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE,
                           str(probe), "true"], capture_output=True).returncode == 0


def test_one_directory_for_both_ranks_passes_and_leaves_nothing(tmp_path):
    dirs = {"logging.output_dir": str(tmp_path / "run"), "workload.cache_dir": str(tmp_path / "c")}
    assert _two_ranks(dirs) == [{"ok": True}, {"ok": True}]
    # created as the run would, and the marks removed
    assert os.listdir(tmp_path / "run") == [] and os.listdir(tmp_path / "c") == []


def test_a_directory_on_a_node_local_disk_stops_every_rank_naming_the_key(tmp_path):
    if not _private_mount_works(tmp_path):
        pytest.skip("a private mount (the node-local disk) needs root, unshare and mount rights")
    run, cache = tmp_path / "run", tmp_path / "cache"
    run.mkdir()
    dirs = {"workload.cache_dir": str(cache), "logging.output_dir": str(run)}
    results = _two_ranks(dirs, private=str(run))
    assert results[0] == results[1]  # both ranks stop, with the same error
    assert results[0]["key"] == "logging.output_dir"  # the shared cache passes
    detail = results[0]["detail"]
    assert f"{run} is not one directory for every rank: rank 1 (" in detail
    assert "rank 0 (" in detail and "checkpoint" in detail
    assert "filesystem all nodes share" in detail
    assert os.listdir(run) == []  # rank 0's mark removed again


def test_a_directory_rank_0_cannot_create_stops_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    dirs = {"logging.output_dir": str(blocker / "run")}
    results = _two_ranks(dirs)
    assert results[0] == results[1]
    assert results[0]["key"] == "logging.output_dir"
    assert results[0]["detail"].startswith(f"{blocker / 'run'} cannot be written by rank 0 (")


def test_a_directory_only_rank_1_cannot_create_stops_every_rank(tmp_path, monkeypatch):
    """Rank 1 alone fails to create the folder (here a file stands where its relative path
    leads): rank 0, which could, stops too, with rank 1's error."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
    (tmp_path / "b" / "x").write_text("")
    monkeypatch.chdir(tmp_path / "a")
    results = _two_ranks({"workload.cache_dir": "x/cache"}, cwd1=str(tmp_path / "b"))
    assert results[0] == results[1]
    assert results[0]["key"] == "workload.cache_dir"
    assert results[0]["detail"].startswith(
        f"{tmp_path / 'b' / 'x' / 'cache'} cannot be written by rank 1 (")
    assert "Not a directory" in results[0]["detail"]


def test_a_relative_path_in_another_working_directory_is_named_with_both_places(tmp_path,
                                                                               monkeypatch):
    """A rank started elsewhere resolves a relative output_dir to another folder: the error
    says where each rank took it to be."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")  # rank 0's working directory
    results = _two_ranks({"logging.output_dir": "runs/x"}, cwd1=str(tmp_path / "b"))
    assert results[0] == results[1]
    assert results[0]["detail"].startswith(
        f"{tmp_path / 'a' / 'runs' / 'x'} is not one directory for every rank: rank 1 (")
    assert f", where it is {tmp_path / 'b' / 'runs' / 'x'}) cannot see" in results[0]["detail"]


def test_one_process_checks_nothing(tmp_path):
    from oppo_ds.shared_dirs import check_shared_dirs

    check_shared_dirs({"logging.output_dir": str(tmp_path / "run")})
    assert not (tmp_path / "run").exists()  # no group: nothing written, nothing created


SMALL_WORKLOAD = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
                  "generation.max_new_tokens=24"]


def test_a_rank_that_finds_no_prepared_workload_says_the_folder_is_not_shared(tmp_path,
                                                                            cache_dir):
    """A rank other than 0 reads the built-in workload rank 0 prepared (the stage placement's
    scorer rank too, outside the actor ranks' check above): where the folder holds none, it
    stops naming workload.cache_dir instead of preparing its own, which could differ; where
    rank 0 prepared it (the shared fixture's folder), it reads it."""
    from oppo_ds.config import ConfigError, load_config
    from oppo_ds.sources import resolve_sources

    empty = tmp_path / "node-local-cache"
    with pytest.raises(ConfigError) as err:
        resolve_sources(load_config(None, SMALL_WORKLOAD + [f"workload.cache_dir={empty}"]),
                        rank=2)
    assert err.value.key == "workload.cache_dir"
    assert err.value.detail.startswith("rank 2 (") and f"cannot find {empty}/" in err.value.detail
    assert "not shared with rank 0's node" in err.value.detail
    assert not empty.exists() or not any(empty.iterdir())  # nothing prepared by this rank
    resolve_sources(load_config(None, SMALL_WORKLOAD + [f"workload.cache_dir={cache_dir}"]), rank=0)
    src = resolve_sources(load_config(None, SMALL_WORKLOAD + [f"workload.cache_dir={cache_dir}"]),
                          rank=2)
    assert src.actor.startswith(str(cache_dir)) and os.path.isdir(src.actor)
