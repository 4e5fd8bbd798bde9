"""How this process was launched, from the environment alone (no torch.distributed, no
deepspeed import): Slurm's host lists and the rendezvous variables of an ``srun`` task.
Light on purpose: ``oppo-train`` reads its rank from here before it imports anything heavy
(``--print-config`` must print YAML only)."""
from __future__ import annotations


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list (``SLURM_JOB_NODELIST``) into host names, in order:
    ``"node[01-03,05],gpu7"`` -> ``node01 node02 node03 node05 gpu7``. Ranges keep their
    zero padding; several bracket groups in one name (``r[1-2]-n[1-2]``) multiply out.
    Pure (no ``scontrol``): the rank that derives MASTER_ADDR needs no Slurm binaries."""
    hosts: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(hostlist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            name = hostlist[start:i].strip()
            if name:
                hosts.extend(_expand_host(name))
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in Slurm host list {hostlist!r}")
    return hosts


def _expand_host(name: str) -> list[str]:
    if "[" not in name:
        return [name]
    head, _, rest = name.partition("[")
    inner, _, tail = rest.partition("]")
    values = []
    for part in inner.split(","):
        low, _, high = part.partition("-")
        if not high:
            values.append(low)
            continue
        width = len(low)  # "01-10" keeps two digits
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return [head + value + more for value in values for more in _expand_host(tail)]


def slurm_rendezvous(env: dict[str, str]) -> dict[str, str] | None:
    """The torch.distributed rendezvous variables of a task started by ``srun``, derived from
    Slurm's own, or None when ``env`` is not an srun task (no ``SLURM_PROCID``) or a launcher
    already set ``RANK``/``WORLD_SIZE`` (``deepspeed``/``torchrun`` inside an allocation).

    Only srun sets the step variables (SLURM_STEP_NUM_TASKS): the batch script itself also
    has SLURM_PROCID=0 and SLURM_NTASKS, and a ``python`` started there directly is a single
    process, not rank 0 of a group that would wait for the others.

    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS, LOCAL_RANK = SLURM_LOCALID,
    MASTER_ADDR = the first host of the step's node list (SLURM_STEP_NODELIST, else
    SLURM_JOB_NODELIST / SLURM_NODELIST; task 0 runs there with srun's default block
    distribution), MASTER_PORT = from ``env`` if set, else 10000 + SLURM_JOB_ID mod 20000:
    every task computes the same port with no communication, below Linux's ephemeral range
    (32768+). MASTER_ADDR and MASTER_PORT already in ``env`` are kept (a chosen interface or
    port); LOCAL_RANK is the task's own (one exported by the submitting shell would put every
    task of a node on its first GPU)."""
    if "SLURM_PROCID" not in env or "RANK" in env or "WORLD_SIZE" in env:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST"))
    if not tasks or not nodelist:
        return None
    derived = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": tasks,
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": expand_hostlist(nodelist)[0],
        "MASTER_PORT": str(10000 + int(env.get("SLURM_JOB_ID", "0")) % 20000),
    }
    return {key: env.get(key, value) if key.startswith("MASTER_") else value
            for key, value in derived.items()}
