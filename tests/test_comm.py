"""Tier 1: the host-side collectives (oppo_ds/comm.py) with two real processes over gloo;
the NCCL placement rule with the backend's name and the CUDA device faked (no GPU here)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oppo_ds import comm
from oppo_ds.engines.deepspeed_engine import find_free_port


def _ranks(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        t = torch.tensor([1.0 + rank, 5.0 - rank], dtype=torch.float64)
        summed = comm.all_reduce(t)
        smallest = comm.all_reduce(t, op=dist.ReduceOp.MIN)
        counts = comm.all_reduce_ints([rank, 3 * rank], op=dist.ReduceOp.MAX)
        out.put((rank, summed.tolist(), smallest.tolist(), counts, t.tolist(),
                 str(comm.comm_device()), comm.active()))
    finally:
        dist.destroy_process_group()


def test_all_reduce_over_two_gloo_ranks():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_ranks, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, (summed, smallest, counts, original, device, active) in results.items():
        assert summed == [3.0, 9.0]
        assert smallest == [1.0, 4.0]
        assert counts == [1, 3]
        assert original == [1.0 + rank, 5.0 - rank]  # the input is left as it was
        assert device == "cpu" and active


def test_free_ports_lie_below_the_ephemeral_range():
    """``find_free_port`` draws below the kernel's range for outgoing connections, where no
    client socket is given the port before the rendezvous server binds it (a client may
    otherwise connect to itself: "Connection reset by peer", with which a launch's
    rendezvous failed in a CI run of two pytest workers); the ports differ from draw to draw
    and can be bound."""
    import socket

    from oppo_ds.engines.deepspeed_engine import _ephemeral_port_floor

    low = _ephemeral_port_floor()
    ports = [find_free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 10
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_one_process_without_a_group_returns_the_input():
    t = torch.tensor([2.0])
    assert comm.all_reduce(t) is t
    assert comm.all_reduce_ints([4, 5]) == [4, 5]
    assert comm.comm_device() == torch.device("cpu")
    assert comm.set_local_cuda_device() == torch.device("cpu")  # no CUDA here


def test_nccl_groups_get_cuda_tensors(monkeypatch):
    """NCCL takes CUDA tensors only ("No backend type associated with device type cpu"):
    the device comes from the group's backend. No GPU here, so the backend's name and the
    current CUDA device are faked; what is tested is the rule."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert comm.comm_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert comm.comm_device() == torch.device("cpu")


@pytest.mark.parametrize("local_rank,visible,expected", [("5", 8, 5), ("5", 1, 0), ("3", 2, 1)])
def test_local_rank_picks_the_gpu_among_those_visible(monkeypatch, local_rank, visible, expected):
    """The launcher's LOCAL_RANK modulo the GPUs this process sees (Slurm's --gpus-per-task
    shows each task one GPU whatever its local rank). CUDA faked: no GPU here."""
    chosen = []
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    assert comm.set_local_cuda_device() == torch.device("cuda", expected)
    assert chosen == [expected]


def test_a_process_that_sees_fewer_gpus_than_its_local_rank_is_told_the_launch_to_use(
        monkeypatch):
    """Under ``srun --gpus-per-task`` each task sees one GPU whatever its local rank, and
    ``deepspeed.initialize`` (or the stage's scorer rank) failed on GPU LOCAL_RANK with CUDA's
    "invalid device ordinal". No GPU here: torch.cuda's two answers are set as such a task's
    would be (a mock around what cannot exist on this machine); the check reads nothing else
    of CUDA."""
    from oppo_ds.comm import check_local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"^rank 7 \(.*\) has LOCAL_RANK=3 but sees 1 GPU\(s\) "
                                           r"\(CUDA_VISIBLE_DEVICES=3\): each process") as err:
        check_local_device()
    assert "request --gpus-per-node, not --gpus-per-task" in str(err.value)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU: no GPU is taken
    check_local_device()
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first task of the node: GPU 0 is there
    check_local_device()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # --gpus-per-node=8
    monkeypatch.setenv("LOCAL_RANK", "7")
    check_local_device()
