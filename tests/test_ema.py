"""The actor's exponential moving average (``model.actor_ema``): the recursion by hand, the
export of a real run against the weights it averaged, exact resume, and ZeRO-3 partitions over
two gloo ranks."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from oppo_ds.ema import ActorEMA
from test_trainer import run


def test_the_average_by_hand():
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0]]))
    ema = ActorEMA(layer, beta=0.9)
    for w in ([[3.0, 2.0]], [[0.0, -8.0]]):
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(w))
        ema.update(layer)
    # 0.9 * (0.9 * [1, 2] + 0.1 * [3, 2]) + 0.1 * [0, -8] = 0.9 * [1.2, 2.0] + [0, -0.8] = [1.08, 1.0]
    torch.testing.assert_close(ema.tensors[0], torch.tensor([[1.08, 1.0]]))
    with ema.swapped_in(layer):
        torch.testing.assert_close(layer.weight.data, torch.tensor([[1.08, 1.0]]))
    assert torch.equal(layer.weight.data, torch.tensor([[0.0, -8.0]]))  # given back exactly
    other = ActorEMA(torch.nn.Linear(3, 1, bias=False), 0.9)
    with pytest.raises(ValueError, match="other shapes"):
        other.load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        ActorEMA(layer, 1.5)


def _weights(path) -> dict:
    return load_file(os.path.join(str(path), "model.safetensors"))


def test_a_run_exports_the_average_of_its_steps(cache_dir, tmp_path):
    """beta 0.5 over 3 steps, against the actor's weights recorded after each step (1e-6: fp32
    sums); the export leaves the actor's own weights as they were."""
    from oppo_ds.config import load_config
    from oppo_ds.trainer import PPOTrainer
    from test_trainer import SMALL

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}", f"logging.output_dir={tmp_path / 'run'}",
                                     "steps=3", "model.actor_ema=true", "model.actor_ema_beta=0.5"])
    trainer = PPOTrainer(cfg)
    seen = [{k: v.detach().clone() for k, v in trainer.actor.module.state_dict().items()}]
    real_update = trainer.ema.update

    def update(module):
        seen.append({k: v.detach().clone() for k, v in module.state_dict().items()})
        real_update(module)
    trainer.ema.update = update
    trainer.train()
    exported = _weights(tmp_path / "run" / "actor_ema")
    for name, tensor in exported.items():
        want = seen[0][name].float()
        for step in seen[1:]:
            want = 0.5 * want + 0.5 * step[name].float()
        torch.testing.assert_close(tensor.float(), want, atol=1e-6, rtol=1e-6, msg=name)
    assert any(not torch.equal(exported[n], seen[-1][n]) for n in exported)  # not the last weights
    final = {k: v.detach().clone() for k, v in trainer.actor.module.state_dict().items()}
    trainer.export(str(tmp_path / "again"))
    assert all(torch.equal(final[k], v) for k, v in trainer.actor.module.state_dict().items())
    assert os.path.isfile(tmp_path / "run" / "actor_ema" / "generation_config.json")


def test_a_resumed_run_exports_the_same_average(cache_dir, tmp_path):
    every = ("steps=4", "checkpoint.every=2", "model.actor_ema=true", "model.actor_ema_beta=0.7")
    run(cache_dir, tmp_path / "full", *every)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *every, crash_after=3)
    run(cache_dir, tmp_path / "cut", *every)
    a, b = _weights(tmp_path / "full" / "actor_ema"), _weights(tmp_path / "cut" / "actor_ema")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6, msg=name)


def test_two_zero3_ranks_average_their_partitions(tmp_path):
    """beta 1 keeps the starting weights: under ZeRO-3 over two ranks, the exported average is
    the prepared SFT actor exactly (every partition, and the small parameters ZeRO-3 keeps
    whole, swapped in for the export), while the exported actor trained away from it. beta 0
    keeps the last weights: the average is the exported actor exactly (each update read the
    partitions after the optimizer's step)."""
    from test_distributed import launch

    launch(tmp_path / "run", tmp_path / "cache", "steps=2", "system.zero_stage=3",
           "model.actor_ema=true", "model.actor_ema_beta=1.0")
    sft_dir = [d for d in (tmp_path / "cache").iterdir() if d.is_dir() and not d.name.startswith(".")][0]
    sft = _weights(sft_dir / "actor")
    ema, actor = _weights(tmp_path / "run" / "actor_ema"), _weights(tmp_path / "run" / "actor")
    assert ema.keys() == sft.keys()
    for name in sft:
        assert torch.equal(ema[name], sft[name]), name
    assert any(not torch.equal(actor[n], sft[n]) for n in sft)

    launch(tmp_path / "last", tmp_path / "cache", "steps=2", "system.zero_stage=3",
           "model.actor_ema=true", "model.actor_ema_beta=0.0")
    ema, actor = _weights(tmp_path / "last" / "actor_ema"), _weights(tmp_path / "last" / "actor")
    assert ema.keys() == actor.keys() and all(torch.equal(ema[n], actor[n]) for n in actor)
