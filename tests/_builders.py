"""Small builders shared by the decoding and streaming tests (imported by test modules and
by the processes that test_stage spawns)."""
import torch


def left_padded_prompts(lens, vocab: int, pad: int, seed: int = 1):
    """Random prompts of the given lengths, left-padded: (B, max len) ids and mask; token ids
    start at 3 so they never collide with pad/bos/eos."""
    width = max(lens)
    ids = torch.full((len(lens), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lens):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def sharpen(model, seed: int, scale: float = 0.3):
    """Random weights far from the default init (std 0.02), whose outputs barely depend on
    the context: a wrong position or mask then changes the scores by ~0.1-1, not ~1e-6.
    Value heads are drawn with std 1/sqrt(hidden), so values are of order 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = p.shape[-1] ** -0.5 if name.startswith("value_head") else scale
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def random_lm(arch: str, vocab: int, seed: int, scale: float = 0.5):
    """A tiny causal LM with weights far from the init scale, so that its greedy tokens (and
    where rows hit EOS) vary with the context: at the default std 0.02 a random model repeats
    one token, which would hide where rows end."""
    from oppo_ds.models import build_causal_lm

    model = build_causal_lm(arch, vocab_size=vocab, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def tiny_reward_dir(root) -> str:
    """A tiny-llama reward model with a random (non-zero) head over the built-in tokenizer,
    saved under ``root/reward``: PPO runs on tiny models then have advantages to learn from
    (a fresh value head is zero, so a tiny-* reward scores everything 0)."""
    import os

    from oppo_ds import workload as wl
    from oppo_ds.models import build_value_model

    path = os.path.join(str(root), "reward")
    if not os.path.exists(path):
        model = build_value_model("tiny-llama", vocab_size=len(wl.build_tokenizer()), seed=0)
        torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(0))
        model.save_pretrained(path)
    return path


def prompt_file(root, n: int = 16) -> str:
    """A .jsonl of ``n`` short prompts under ``root``."""
    import json
    import os

    path = os.path.join(str(root), "prompts.jsonl")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.writelines(json.dumps({"prompt": f"q {i} a"}) + "\n" for i in range(n))
    return path


# a launcher's rendezvous variables that earlier tests of this process may have left behind:
# a single `oppo-train` must not take them for its own (DeepSpeed then tries MPI discovery)
LAUNCHER_VARS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "LOCAL_WORLD_SIZE"})


def single_process_env() -> dict:
    """This process's environment for an ``oppo-train`` subprocess of its own: no launcher
    variables, one OpenMP thread."""
    import os

    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, "OMP_NUM_THREADS": "1"}


def tiny_run_overrides(root, steps: int) -> list[str]:
    """Config overrides of a seconds-long PPO run on tiny models (no workload preparation)."""
    return [f"steps={steps}", "model.actor=tiny-llama", "model.reward=" + tiny_reward_dir(root),
            "data.prompts=" + prompt_file(root), "ppo.batch_size=4", "ppo.mini_batch_size=4",
            "ppo.micro_batch_size=2", "generation.max_new_tokens=6", "logging.progress=false",
            "logging.log_every=0", f"logging.output_dir={root}/run"]


def spawn_gloo(target, world: int, *args, join_s: float, group_timeout_s: float = 90) -> list:
    """Run ``target(rank, world, out, *args)`` in ``world`` fresh processes joined in a gloo
    group (``group_timeout_s`` per collective); returns what they put on ``out``; a failure
    in any process fails the test with its traceback (``spawn_and_collect``)."""
    return spawn_and_collect(
        _gloo_guarded,
        lambda rank, port, out: (target, rank, world, port, out, group_timeout_s, *args),
        world, join_s)


def _gloo_guarded(target, rank, world, port, out, group_timeout_s, *args):
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=group_timeout_s))
        target(rank, world, out, *args)
        dist.destroy_process_group()
    except BaseException:
        out.put(("crash", rank, traceback.format_exc()))
        raise
    _exit_without_finalizing(out)


def _exit_without_finalizing(out) -> None:
    """End a worker that finished: what it put on ``out`` is flushed to the pipe, then the
    process exits 0 through ``oppo-train``'s own ``exit_process`` (no Python finalization): a
    group megatron-core or DeepSpeed still holds can otherwise abort the finished process
    (SIGABRT, "terminate called without an active exception")."""
    from oppo_ds.cli.train import exit_process

    out.close()
    out.join_thread()
    exit_process(0)


def spawn_stage(target, actors: int, *args, join_s: float, tp: int = 1,
                link_timeout_s: float = 60) -> list:
    """The stage placement's processes, as the trainer lays them out: ``actors`` actor ranks
    in a gloo world of their own and one scorer process in none, linked by the trainer's own
    ``StageLayout.open_links`` (standalone two-rank groups through the actor world's store).
    Runs ``target(rank, layout, links, out, *args)`` in each; returns what they put on
    ``out`` (``spawn_and_collect``). ``tp``: ranks per model replica (one sender each)."""
    return spawn_and_collect(
        _stage_guarded,
        lambda rank, port, out: (target, rank, actors, tp, port, out, link_timeout_s, *args),
        actors + 1, join_s)


def _stage_guarded(target, rank, actors, tp, port, out, link_timeout_s, *args):
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from oppo_ds.rollout.stage_layout import StageLayout, replica_senders

    torch.set_num_threads(1)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = timedelta(seconds=link_timeout_s)
        layout = StageLayout(rank, actors + 1, replica_senders(actors, tp))
        if not layout.is_scorer:
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=actors,
                                    timeout=timeout)
        links = layout.open_links("gloo", timeout)
        target(rank, layout, links, out, *args)
        for link in links.values():
            link.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        out.put(("crash", rank, traceback.format_exc()))
        raise
    _exit_without_finalizing(out)


def spawn_and_collect(target, args_of_rank, world: int, join_s: float) -> list:
    """Run ``target(*args_of_rank(rank, port, out))`` in ``world`` fresh (spawned) processes
    and return what they put on the queue ``out``. A process that puts ``("crash", rank,
    traceback)`` fails the test with that traceback; one still running after ``join_s``
    seconds is killed and fails it too; so does a non-zero exit code."""
    import multiprocessing as mp
    import queue

    from oppo_ds.engines.deepspeed_engine import find_free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=target, args=args_of_rank(rank, port, out), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(join_s)
        hung = [p.pid for p in procs if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    messages = []
    while True:
        try:
            messages.append(out.get(timeout=1))
        except queue.Empty:
            break
    crashes = [m for m in messages if m[0] == "crash"]
    assert not crashes, crashes[0][2]
    assert not hung, f"processes {hung} did not exit; messages: {messages}"
    assert [p.exitcode for p in procs] == [0] * world, messages
    return messages


def assert_trained_once(trainer_state_file, batch_size: int, steps: int) -> None:
    """A pool checkpoint's ledger balances, ``steps`` batches were trained with no prompt
    twice (runs shorter than an epoch), and every prompt drawn was trained or waits in it."""
    from oppo_ds.rollout.pool import RolloutPool

    state = torch.load(trainer_state_file, weights_only=False)
    pool = RolloutPool(batch_size=batch_size, max_defer_steps=2)
    pool.load_state_dict(state["pool"])
    pool.check()
    trained = pool.ledger.trained
    assert sum(trained.values()) == steps * batch_size and set(trained.values()) == {1}
    assert set(pool.ledger.drawn) == set(trained) | {e.key for e in pool.entries}


def rank_process(rank: int, world: int, port: int, args):
    """One rank of an ``oppo-train`` run started without a launcher (a test that signals
    one rank needs each rank's pid), its output in its ``stdout``."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "oppo_ds.train", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def signal_after_steps(procs, metrics, steps: int, signalled, timeout_s: float = 300) -> list[str]:
    """Once ``metrics`` (a run's metrics.jsonl) has ``steps`` lines, send SIGUSR1 to the
    processes at the indices ``signalled``; returns every process's output once all ended
    (each killed if it is still running after 120 s more)."""
    import signal
    import time

    try:
        deadline = time.time() + timeout_s
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
            assert all(p.poll() is None for p in procs), procs[0].stdout.read()[-3000:]
            assert time.time() < deadline, "no steps logged"
            time.sleep(0.05)
        for i in signalled:
            procs[i].send_signal(signal.SIGUSR1)
        return [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None


class LikeAGpuGenerator(torch.Generator):
    """A CPU generator that reports device ``cuda``: ``decode_steps`` per token then samples
    as it does on a GPU with the trainer's CPU generator (one ``torch.rand`` of the running
    rows a token, ``inverse_cdf_sample``), the path that decoding in blocks
    (``generation.sync_every``) must match. A stand-in because this machine has no GPU; the
    draws are the CPU generator's own."""

    @property
    def device(self):
        return torch.device("cuda")


def assert_same_decode(state, produced: int, ref_state, ref_produced: int, atol: float) -> None:
    """Two decodes (``DecodeState`` and tokens counted) sampled the same: tokens, lengths,
    finished rows, finish order and count equal; log-probs within ``atol`` (the same
    forwards over other shapes sum in another order)."""
    import torch

    assert torch.equal(state.tokens, ref_state.tokens)
    assert torch.equal(state.lengths, ref_state.lengths)
    assert torch.equal(state.finished, ref_state.finished)
    assert state.finish_order == ref_state.finish_order
    assert produced == ref_produced
    torch.testing.assert_close(state.logprobs, ref_state.logprobs, atol=atol, rtol=0)
    torch.testing.assert_close(state.actor_logprobs, ref_state.actor_logprobs, atol=atol, rtol=0)


def record_static_buffers(monkeypatch) -> list:
    """(rows decoded, buffers) of every ``StaticDecode.get`` from now on, the buffers kept
    between decodes as with a CUDA graph (``_KEEP_WITHOUT_GRAPH``): what a GPU's captures
    follow, checked on a CPU."""
    from oppo_ds.rollout import static_decode
    from oppo_ds.rollout.static_decode import StaticDecode

    used = []
    get = StaticDecode.get.__func__

    def recording(cls, model, batch, *args, **kw):
        buffers = get(cls, model, batch, *args, **kw)
        used.append((batch, buffers))
        return buffers

    monkeypatch.setattr(StaticDecode, "get", classmethod(recording))
    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)
    return used
