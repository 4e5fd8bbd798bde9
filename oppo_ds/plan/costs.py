"""Devices and the roofline cost of one operation.

An operation (a decode step, a prefill, a training forward+backward) costs

    time = host overhead + max(FLOPs / effective FLOP/s, bytes / effective bandwidth)

Decode reads every weight and the KV cache for one new token per row, so it is bandwidth-
bound; prefill and training multiply many tokens per weight read, so they are compute-bound.
The host overhead is the per-call cost of launching the work (Python, kernel launches): on a
GPU a few microseconds per kernel, on a CPU running a tiny model most of the time.

GPU entries come from data sheets (peak dense bf16 FLOP/s, HBM bandwidth, memory) with
stated efficiency factors and assumed overheads; the ``cpu`` entry is measured: fitted to
the phase timings of ``make bench`` on the development machine (``calibrate.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..config import ConfigError

GIB = 2 ** 30

# Efficiency factors of the GPU entries (assumed, typical of eager PyTorch + DeepSpeed):
# achieved / peak FLOP/s for decode, prefill and training (the training MFU of a ZeRO-3
# RLHF step is rarely above 0.45), and achieved / peak HBM bandwidth.
EFF_DECODE, EFF_PREFILL, EFF_TRAIN, EFF_BW = 0.5, 0.6, 0.45, 0.75
# Host overheads of the GPU entries (assumed): per forward call (sampling, the decode loop's
# Python), per decoder layer per call (~10 kernel launches of ~5 us each), per optimizer step.
CALL_S, LAYER_S, OPTIM_S = 1e-3, 50e-6, 5e-3
TP_ALLREDUCE_S = 10e-6  # latency of one small NVLink all-reduce (2 per layer under TP)


@dataclass(frozen=True)
class Device:
    """What the cost model knows about one accelerator (all rates effective, i.e. already
    multiplied by their efficiency factor)."""
    name: str
    mem_gib: float            # usable device memory
    peak_flops: float         # data-sheet dense bf16 FLOP/s (display only)
    hbm_bw: float             # data-sheet memory bandwidth, bytes/s (display only)
    decode_flops: float       # effective FLOP/s of decode steps
    prefill_flops: float      # effective FLOP/s of prefill / scoring forwards
    train_flops: float        # effective FLOP/s of training forward + backward
    bw: float                 # effective memory bandwidth, bytes/s
    intra_node_bw: float      # per-GPU bandwidth to the other GPUs of its node (NVLink)
    inter_node_bw: float      # per-GPU network bandwidth to other nodes
    host_link_bw: float       # per-GPU bandwidth to CPU memory (PCIe), for offload
    decode_call_s: float = CALL_S     # host overhead of one decode step
    prefill_call_s: float = CALL_S    # host overhead of one scoring / prefill forward
    train_call_s: float = 2 * CALL_S  # host overhead of one forward + backward
    layer_s: float = LAYER_S          # host overhead per decoder layer per call
    optim_s: float = OPTIM_S          # host overhead of one optimizer step
    rollout_setup_s: float = 0.0      # fixed cost of starting a rollout (padding, masks)
    step_other_s: float = 0.0         # per-step work outside the models (advantages, logging)
    cpu_adam_params_s: float = 2e9    # offloaded optimizer: parameters per second per node
    measured: Optional[str] = None    # where the numbers of a measured entry come from

    def op_time(self, flops: float, bytes_: float, kind: str, calls: float = 1.0,
                layers: int = 0) -> float:
        """Roofline time of ``calls`` calls doing ``flops`` and moving ``bytes_`` in all."""
        rate = {"decode": self.decode_flops, "prefill": self.prefill_flops,
                "train": self.train_flops}[kind]
        call = {"decode": self.decode_call_s, "prefill": self.prefill_call_s,
                "train": self.train_call_s}[kind]
        return calls * (call + layers * self.layer_s) + max(flops / rate, bytes_ / self.bw)


def gpu(name: str, peak_tflops: float, hbm_tbs: float, mem_gib: float, nvlink_gbs: float,
        net_gbs: float, pcie_gbs: float) -> Device:
    peak, bw = peak_tflops * 1e12, hbm_tbs * 1e12
    return Device(name, mem_gib, peak, bw, decode_flops=peak * EFF_DECODE,
                  prefill_flops=peak * EFF_PREFILL, train_flops=peak * EFF_TRAIN, bw=bw * EFF_BW,
                  intra_node_bw=nvlink_gbs * 1e9, inter_node_bw=net_gbs * 1e9,
                  host_link_bw=pcie_gbs * 1e9)


# Data-sheet numbers: dense bf16 TFLOP/s (no sparsity), HBM TB/s, usable GiB (what the driver
# reports), NVLink GB/s per direction per GPU, network GB/s per GPU (one 400 Gb/s NIC per GPU
# for H100/H200/B200 nodes, 200 Gb/s for A100 nodes), PCIe GB/s.
GPUS: dict[str, Device] = {d.name: d for d in (
    gpu("H100-80GB", 989, 3.35, 79.6, 450, 50, 55),
    gpu("H100-PCIe", 756, 2.0, 79.6, 300, 50, 55),
    gpu("H200", 989, 4.8, 139.8, 450, 50, 55),
    gpu("B200", 2250, 8.0, 178.4, 900, 50, 55),
    gpu("A100-80GB", 312, 2.039, 79.2, 300, 25, 25),
    gpu("A100-40GB", 312, 1.555, 39.4, 300, 25, 25),
    gpu("L40S", 362, 0.864, 44.4, 32, 25, 25),
    gpu("MI300X", 1307, 5.3, 191.5, 448, 50, 55),
)}

# The development machine (2 cores, 24 GiB), measured: the tiny built-in models are bound by
# per-call overhead, so these are the effective rates and overheads that the fit of
# ``make bench``'s sequential phase timings gave (``oppo-plan --calibrate
# tests/data/bench-cpu-2core/results.json``, the run of 2026-11-22), not peak numbers. A decode
# step cost the same whatever its number of rows (the per-row slope came out at 0): its FLOP/s
# is left unbounded, as is the memory bandwidth, which the fit has no term for.
CPU = Device(
    "cpu", mem_gib=24.0, peak_flops=0.0, hbm_bw=0.0,
    decode_flops=1e18, prefill_flops=3.583e10, train_flops=3.428e10, bw=1e18,
    intra_node_bw=5e9, inter_node_bw=1e9, host_link_bw=2e10,
    decode_call_s=2.010e-3, prefill_call_s=2.651e-3, train_call_s=7.319e-3, layer_s=0.0,
    optim_s=0.0, rollout_setup_s=0.0, step_other_s=5.261e-3, cpu_adam_params_s=2e8,
    measured="fit to tests/data/bench-cpu-2core/results.json (make bench, 2026-11-22, 2-core CPU)")

DEVICES: dict[str, Device] = {**GPUS, "cpu": CPU}


def get_device(name: str) -> Device:
    """A device by name (case-insensitive), or a ConfigError listing the known ones."""
    for key, device in DEVICES.items():
        if key.lower() == name.lower():
            return device
    raise ConfigError("--gpu", f"unknown device {name!r}; known: {', '.join(DEVICES)}")


def with_measured(base: Device, **fields) -> Device:
    """``base`` with measured fields replaced (the calibration's result)."""
    return replace(base, **fields)
