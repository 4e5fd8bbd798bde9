"""DAPO's dynamic sampling (ppo.filter_groups): whole PPO runs on the built-in prompts with a
reward function that gives every response of some prompts the same score. The prompts drawn
are accounted for exactly: each is trained on, dropped by the rule, or (with several ranks) a
rank's surplus; a resumed run continues exactly."""
from __future__ import annotations

import json

import pytest
import torch

from oppo_ds.config import ConfigError, load_config
from oppo_ds.experience import Experience, concat_experiences
from oppo_ds.filter_rounds import FilterRounds, _Rounds, informative_groups
from oppo_ds.telemetry import read_history

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=16", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=8", "logging.progress=false", "logging.log_every=0",
         "data.samples_per_prompt=4", "ppo.advantage_estimator=group_norm",
         "checkpoint.export_hf=false", "ppo.filter_groups=true"]
N = 4  # responses per prompt

# every response to a prompt of an even number of words scores 0 (a group with nothing to
# learn from); the others score their length in characters, which differs between responses
RULE = '''
def parity(prompts, completions, **fields):
    return [0.0 if len(p.split()) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]


def nothing(prompts, completions, **fields):
    return [0.0 for _ in prompts]
'''


def uniform_prompt(text: str) -> bool:
    return len(text.split()) % 2 == 0


@pytest.fixture(scope="module")
def rule(tmp_path_factory):
    path = tmp_path_factory.mktemp("rule") / "rule.py"
    path.write_text(RULE)
    return str(path)


def trainer_for(cache_dir, out_dir, *overrides):
    from oppo_ds.trainer import PPOTrainer

    return PPOTrainer(load_config(None, SMALL + [f"workload.cache_dir={cache_dir}",
                                                 f"logging.output_dir={out_dir}", *overrides]))


def recorded(trainer):
    """Each step's trained batch (keys, scores, groups) and every prompt drawn, in order."""
    batches, drawn = [], []
    update, take = trainer.update, trainer.stream.take

    def record_update(exp):
        batches.append((list(exp.prompt_keys), exp.scores.clone(), exp.groups.clone()))
        return update(exp)

    def record_take(n):
        prompts = take(n)
        drawn.extend(p.id for p in prompts)
        return prompts
    trainer.update, trainer.stream.take = record_update, record_take
    return batches, drawn


def filtered_run(cache_dir, out_dir, *overrides):
    """A trained run with SMALL's filter and ``overrides``: (trainer, each step's trained
    batch, every prompt drawn, the metrics by step, each drawn prompt's text)."""
    trainer = trainer_for(cache_dir, out_dir, *overrides)
    batches, drawn = recorded(trainer)
    trainer.train()
    rows = read_history(str(out_dir / "metrics.jsonl"))
    return trainer, batches, drawn, rows, {pid: trainer.prompt_rows[pid][0] for pid in drawn}


def check_every_rounds_streaming(out_dir, rows) -> None:
    """A step's stream/ metrics and trace cover each of its filter rounds' rollouts: one
    actor prefill per round in the trace, every rollout event inside a generate phase (the
    rollout's own clock placed on the step's), the chunks in the metric those of the trace
    (a later round that finds its rows finished in the pool decodes nothing)."""
    prefills = []
    for m in rows:
        trace = json.loads((out_dir / "traces" / f"step{m['step']}.json").read_text())
        lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e.get("name") == "thread_name"}
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        generate = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "generate"]
        rollout = [e for e in spans if lanes[e["tid"]] != "phases"]
        actor = [e["name"] for e in rollout if lanes[e["tid"]] == "actor"]
        prefills.append(actor.count("prefill"))
        assert 1 <= prefills[-1] <= len(generate) == m["filter/rounds"], m["step"]
        assert len(actor) - prefills[-1] == m["stream/chunks"]
        for e in rollout:  # microseconds, rounded in the file
            assert any(a - 1 <= e["ts"] and e["ts"] + e["dur"] <= b + 1 for a, b in generate), e
    assert max(prefills) >= 2  # a later round's rollout streamed, and is in its step's figures


def checked_batch(keys, scores, groups, m, text) -> list[str]:
    """A trained batch's prompts, after checking it: whole prompts, each once, responses
    #0..#3 in order; the prompts whose scores differ first, then (only when the rounds ran
    out) dropped ones, whose prompts are the rule's uniform ones."""
    assert len(keys) == 16 and groups.tolist() == [i // N for i in range(16)]
    prompts = [k.split("#")[0] for k in keys[::N]]
    assert keys == [f"{p}#{k}" for p in prompts for k in range(N)]
    assert len(set(prompts)) == len(prompts)
    by_group = scores.view(-1, N)
    differs = (by_group.max(1).values != by_group.min(1).values).tolist()
    fallback = m["filter/fallback_groups"]
    assert differs == [True] * (4 - fallback) + [False] * fallback
    assert [uniform_prompt(text[p]) for p in prompts] == [not d for d in differs]
    return prompts


def test_a_surplus_is_carried_only_while_the_rows_due_next_step_fit_the_batch():
    """A rank's surplus comes on top of the Delta its pool carries: with B one prompt of 4
    rows, Delta one prompt and max_defer_steps 1, every row left in the pool is due next
    step, so a surplus group put back made 8 rows due for a batch of 4 and one group was
    deferred twice (two ranks, audit run). Such a surplus is dropped (in the ledger); one
    that will not be due next step is carried."""
    from types import SimpleNamespace

    from oppo_ds.rollout.pool import RolloutPool

    def pool_with(max_defer_steps):
        pool = RolloutPool(batch_size=4, max_defer_steps=max_defer_steps, group_size=4)
        prompts = [SimpleNamespace(id=f"p{g}#{k}", input_ids=[5, 6]) for g in range(3)
                   for k in range(4)]
        pool.top_up(prompts, 12)
        for e in pool.entries:
            e.finished, e.finished_at = True, (1, e.uid)
        return pool

    for max_defer_steps, carried in ((1, False), (2, True)):
        pool = pool_with(max_defer_steps)
        taken = pool.take(8, defer=False)  # two prompts taken, one left (Delta)
        trainer, state = SimpleNamespace(pool=pool), _Rounds(wanted=1, drawn=2)
        # the second prompt is this rank's surplus
        FilterRounds._carry_surplus(trainer, state, [taken[4:]])
        in_pool = [e.key for e in pool.entries]
        assert (taken[4].key in in_pool) == carried
        assert state.surplus_dropped == (0 if carried else 1)
        assert state.returned == ({taken[4].uid} if carried else set())
        pool.check()  # the ledger balances either way (the dropped counted as dropped)
        assert pool.ledger.dropped[taken[4].key] == (0 if carried else 1)


def test_dropped_prompts_are_replaced_and_every_drawn_prompt_is_accounted_for(cache_dir, rule, tmp_path):
    trainer, batches, drawn, rows, text = filtered_run(
        cache_dir, tmp_path / "run", "steps=4", f"model.reward_function={rule}:parity")
    trained, kept = [], []
    for (keys, scores, groups), m in zip(batches, rows):
        prompts = checked_batch(keys, scores, groups, m, text)
        fallback = m["filter/fallback_groups"]
        assert 1 <= m["filter/rounds"] <= 4 and m["filter/surplus_groups"] == 0
        assert m["filter/prompts_drawn"] == 4 + m["filter/dropped_groups"]
        trained += prompts
        kept += prompts[:4 - fallback]
    # every prompt drawn is trained on once or dropped by the rule; the kept ones in the order
    # drawn (those that fill in when the rounds run out come after them)
    assert len(drawn) == len(set(drawn)) == trainer.stream.prompts_seen
    dropped = [p for p in drawn if p not in trained]
    assert all(uniform_prompt(text[p]) for p in dropped)
    assert len(dropped) == sum(m["filter/dropped_groups"] for m in rows)
    assert [p for p in drawn if p in set(kept)] == kept
    # the rule did drop prompts and replace them with rounds of their own
    assert sum(m["filter/dropped_groups"] for m in rows) >= 4 and max(m["filter/rounds"] for m in rows) >= 2


def test_when_the_rounds_run_out_dropped_prompts_fill_the_batch(cache_dir, rule, tmp_path):
    _, batches, drawn, rows, _ = filtered_run(cache_dir, tmp_path / "run", "steps=2",
                                              f"model.reward_function={rule}:nothing",
                                              "ppo.filter_groups_max_rounds=2")
    for m in rows:  # 4 prompts a step; each round draws 4 more, all scoring 0
        assert (m["filter/rounds"], m["filter/fallback_groups"], m["filter/dropped_groups"]) == (2, 4, 4)
    # the batch is the first round's prompts, the second round's dropped
    assert [k.split("#")[0] for k in batches[0][0][::N]] == drawn[:4]
    assert len(drawn) == 16 and all(m["samples"] == 16 for m in rows)


def test_filter_groups_resumes_exactly(cache_dir, rule, tmp_path):
    """A run stopped after its step-2 checkpoint and resumed draws the same prompts, drops the
    same ones and logs the uninterrupted run's metrics (1e-6: CPU, fp32, fixed seeds)."""
    over = ("steps=4", "checkpoint.every=2", f"model.reward_function={rule}:parity")
    trainer_for(cache_dir, tmp_path / "full", *over).train()
    cut = trainer_for(cache_dir, tmp_path / "cut", *over[1:], "steps=2")
    cut.train()
    trainer_for(cache_dir, tmp_path / "cut", *over).train()
    a, b = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("full", "cut"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        for key in ("filter/rounds", "filter/dropped_groups", "filter/fallback_groups"):
            assert x[key] == y[key], key
        for key in ("reward/mean", "loss/policy", "kl/mean", "response/len_mean"):
            assert y[key] == pytest.approx(x[key], abs=1e-6), key


@pytest.mark.parametrize("streaming", [False, True], ids=["inter", "oppo"])
def test_with_the_pool_later_rounds_take_from_it_and_its_ledger_counts_the_drops(
        cache_dir, rule, tmp_path, streaming):
    """ppo.filter_groups with overcommitment (and streaming: full OPPO): a later round is one
    more take from the rollout pool. Every batch holds whole prompts, those whose scores
    differ first; the pool's ledger shows every prompt drawn trained once, dropped by the rule
    (each one a prompt of uniform scores) or still in the pool; the prompts drawn from the data
    are each drawn once."""
    trainer, batches, drawn, rows, text = filtered_run(
        cache_dir, tmp_path / "run", "steps=5", "oppo.overcommit=8",
        f"model.reward_function={rule}:parity",
        *(["oppo.streaming=true", "oppo.chunk_size=4", "logging.trace_every=1"]
          if streaming else []))
    if streaming:
        check_every_rounds_streaming(tmp_path / "run", rows)
    trained = []
    for (keys, scores, groups), m in zip(batches, rows):
        prompts = checked_batch(keys, scores, groups, m, text)
        assert m["filter/surplus_groups"] == 0  # one rank: it never takes more than it lacks
        assert m["filter/prompts_drawn"] == 4 + m["filter/dropped_groups"]
        trained += prompts
    assert len(drawn) == len(set(drawn))  # the data's prompts, each drawn into the pool once
    ledger = trainer.pool.ledger
    trainer.pool.check()  # drawn == trained + dropped + in flight, per row
    in_pool = {e.key.split("#")[0] for e in trainer.pool.entries}
    for p in drawn:
        rows_of = [f"{p}#{k}" for k in range(N)]
        t, d = (sum(c[r] for r in rows_of) for c in (ledger.trained, ledger.dropped))
        assert (t, d) in ((N, 0), (0, N), (0, 0)), p
        assert (t == N) == (p in trained)
        if d:
            assert uniform_prompt(text[p]), p
        if (t, d) == (0, 0):
            assert p in in_pool, p
    assert sum(ledger.dropped.values()) == N * sum(m["filter/dropped_groups"] for m in rows) > 0
    assert max(m["filter/rounds"] for m in rows) >= 2


@pytest.mark.parametrize("overcommit", [0, 8], ids=["rounds", "pool"])
def test_oversampled_rounds_account_for_their_surplus(cache_dir, rule, tmp_path, overcommit):
    """ppo.filter_groups_oversample 2: a later round generates twice the prompts the batch
    lacks. Its informative extra ones are the surplus: with the pool they go back to it and
    are trained in a later step (the ledger: every prompt trained once, dropped or in the
    pool); without, they are drawn and not trained (drawn = trained + dropped + surplus)."""
    trainer, batches, drawn, rows, text = filtered_run(
        cache_dir, tmp_path / "run", "steps=4", f"oppo.overcommit={overcommit}",
        "ppo.filter_groups_oversample=2", f"model.reward_function={rule}:parity")
    trained = []
    for (keys, scores, groups), m in zip(batches, rows):
        prompts = checked_batch(keys, scores, groups, m, text)
        assert m["filter/prompts_drawn"] == (4 + m["filter/dropped_groups"]
                                             + m["filter/surplus_groups"])
        trained += prompts
    assert sum(m["filter/surplus_groups"] for m in rows) > 0
    assert len(trained) == len(set(trained))  # a surplus prompt is trained once at most
    if overcommit:
        trainer.pool.check()
        in_pool = {e.key.split("#")[0] for e in trainer.pool.entries}
        dropped = {k.split("#")[0] for k, c in trainer.pool.ledger.dropped.items() if c}
        assert set(drawn) == set(trained) | dropped | in_pool
        assert all(uniform_prompt(text[p]) for p in dropped)
    else:
        surplus = sum(m["filter/surplus_groups"] for m in rows)
        dropped = sum(m["filter/dropped_groups"] for m in rows)
        assert len(drawn) == len(trained) + dropped + surplus


def test_oversampled_rounds_decode_in_one_set_of_static_buffers(cache_dir, rule, tmp_path,
                                                                monkeypatch):
    """With ``generation.static_cache`` (its buffers kept between rollouts here as a CUDA
    graph keeps them), a run whose later rounds oversample twice, up to 2B + Delta rows, builds
    its buffers once for that widest rollout (``Config.widest_rollout``), and every rollout,
    first round or later, pads into them: on a GPU one capture. Before, the buffers were B +
    Delta rows wide and the first wide round took a second set."""
    from _builders import record_static_buffers

    used = record_static_buffers(monkeypatch)
    trainer, batches, _, rows, text = filtered_run(
        cache_dir, tmp_path / "run", "steps=3", "oppo.overcommit=8", "generation.static_cache=true",
        "ppo.filter_groups_oversample=2", f"model.reward_function={rule}:parity")
    for (keys, scores, groups), m in zip(batches, rows):
        checked_batch(keys, scores, groups, m, text)
    assert max(m["filter/rounds"] for m in rows) > 1  # later rounds ran
    widest = trainer.cfg.widest_rollout
    assert widest == 2 * 16 + 8
    assert len(used) > len(rows) and len({batch for batch, _ in used}) > 1
    assert {buffers.batch for _, buffers in used} == {widest}
    assert len({id(buffers) for _, buffers in used}) == 1


def test_filter_groups_with_the_pool_resumes_exactly(cache_dir, rule, tmp_path):
    """Stopped after its step-2 checkpoint (the pool, with the surplus and the ledger's drops,
    in it) and resumed: the uninterrupted run's metrics (1e-6)."""
    over = ("steps=4", "checkpoint.every=2", f"model.reward_function={rule}:parity",
            "oppo.overcommit=8")
    trainer_for(cache_dir, tmp_path / "full", *over).train()
    trainer_for(cache_dir, tmp_path / "cut", *over[1:], "steps=2").train()
    trainer_for(cache_dir, tmp_path / "cut", *over).train()
    a, b = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("full", "cut"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        for key in ("filter/rounds", "filter/dropped_groups", "filter/fallback_groups",
                    "pool/deferrals", "response/lengths"):
            assert x[key] == y[key], key
        for key in ("reward/mean", "loss/policy", "kl/mean", "response/len_mean"):
            assert y[key] == pytest.approx(x[key], abs=1e-6), key


def test_the_informative_rules_by_hand():
    """DAPO's rule (scores not all equal) and OpenRLHF's (low < mean < high, both excluded),
    on 4 prompts of 3 responses each."""
    scores = torch.tensor([0., 0., 0.,  1., 1., 0.,  1., 1., 1.,  .5, .5, .5])
    assert informative_groups(scores, 3) == [False, True, False, False]
    # the means are 0, 2/3, 1, 0.5
    assert informative_groups(scores, 3, [0, 1]) == [False, True, False, True]
    assert informative_groups(scores, 3, [0.5, 1]) == [False, True, False, False]  # 0.5 excluded
    assert informative_groups(scores, 3, [0.7, 1.5]) == [False, False, True, False]
    # for 0/1 scores the range (0, 1) is DAPO's rule
    binary = torch.tensor([float(b) for b in "0000" "0100" "1111" "1011" "0110"])
    assert informative_groups(binary, 4, [0, 1]) == informative_groups(binary, 4)
    assert informative_groups(binary, 4, [0.3, 0.9]) == [False, False, False, True, True]
    # a non-finite score is kept under either rule: the step's finite check then stops the run
    broken = torch.tensor([0., float("nan"), 1., 1.,  float("inf"), float("inf")])
    assert informative_groups(broken, 2) == [True, False, True]
    assert informative_groups(broken, 2, [0, 0.9]) == [True, False, True]


@pytest.mark.parametrize("low", [-1.0, 0.5], ids=["keeps-all", "drops-zero-means"])
def test_the_reward_range_rule_keeps_the_prompts_whose_mean_is_inside(cache_dir, rule, tmp_path, low):
    """ppo.filter_groups_reward_range [low, 1e9] with the parity rule (even-word prompts score
    0 each, the others their responses' lengths). low -1: every prompt is inside, although
    DAPO's rule would drop the even-word ones: one round a step, nothing dropped. low 0.5: the
    even-word prompts (mean 0) are dropped and replaced; every kept prompt's mean is inside,
    every fallback one's outside; each prompt drawn is trained or dropped."""
    _, batches, drawn, rows, text = filtered_run(
        cache_dir, tmp_path / "run", "steps=3", f"model.reward_function={rule}:parity",
        f"ppo.filter_groups_reward_range=[{low},1e9]")
    trained, kept = [], []
    for (keys, scores, groups), m in zip(batches, rows):
        means = scores.view(-1, N).double().mean(1).tolist()
        inside = 4 - m["filter/fallback_groups"]
        assert all(x > low for x in means[:inside]) and all(x <= low for x in means[inside:])
        trained += [k.split("#")[0] for k in keys[::N]]
        kept += trained[-4:][:inside]
    assert len(trained) == len(set(trained))
    assert len(drawn) == len(trained) + sum(m["filter/dropped_groups"] for m in rows)
    if low < 0:
        assert all(m["filter/rounds"] == 1 and m["filter/dropped_groups"] == 0 for m in rows)
        assert any(uniform_prompt(text[p]) for p in trained)
    else:
        assert kept and not any(uniform_prompt(text[p]) for p in kept)
        assert sum(m["filter/dropped_groups"] for m in rows) > 0


@pytest.mark.parametrize("extra, key, match", [
    (["ppo.advantage_estimator=gae", "data.samples_per_prompt=1"], "ppo.filter_groups", "needs a group baseline"),
    (["ppo.filter_groups_max_rounds=0"], "ppo.filter_groups_max_rounds", "must be >= 1"),
    (["ppo.filter_groups_oversample=0.5"], "ppo.filter_groups_oversample", "must be >= 1"),
    (["ppo.filter_groups_reward_range=[1,0]"], "ppo.filter_groups_reward_range", "low < high"),
    (["ppo.filter_groups_reward_range=[0]"], "ppo.filter_groups_reward_range", r"\[low, high\]"),
    (["ppo.filter_groups=false", "ppo.filter_groups_reward_range=[0,1]"],
     "ppo.filter_groups_reward_range", "set ppo.filter_groups: true"),
])
def test_filter_groups_refuses_what_it_cannot_do(extra, key, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(None, SMALL + extra)
    assert err.value.key == key


def _part(rows: int, prompt_w: int, response_w: int, fill: float) -> Experience:
    full = lambda w: torch.full((rows, w), fill)
    return Experience(prompt_keys=[f"p{fill}#{i}" for i in range(rows)],
                      prompt_ids=torch.full((rows, prompt_w), 7), prompt_mask=torch.ones(rows, prompt_w, dtype=torch.long),
                      response_ids=torch.full((rows, response_w), 9), response_mask=full(response_w).clamp(max=1),
                      behaviour_logprobs=full(response_w), old_logprobs=full(response_w),
                      ref_logprobs=full(response_w), old_values=full(response_w),
                      scores=torch.full((rows,), fill), gold=None)


def test_concat_experiences_pads_prompts_left_and_responses_right():
    out = concat_experiences([_part(2, 3, 5, 1.0), _part(1, 4, 2, 2.0)], pad_id=0)
    assert out.prompt_keys == ["p1.0#0", "p1.0#1", "p2.0#0"] and out.gold is None
    assert out.prompt_ids.tolist()[0] == [0, 7, 7, 7] and out.prompt_mask.tolist()[0] == [0, 1, 1, 1]
    assert out.prompt_ids.tolist()[2] == [7, 7, 7, 7]
    assert out.response_ids.tolist()[2] == [9, 9, 0, 0, 0]
    assert out.response_mask.tolist()[2] == [1, 1, 0, 0, 0]
    assert out.old_values.tolist()[2] == [2.0, 2.0, 0.0, 0.0, 0.0]
    assert out.scores.tolist() == [1.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="groups is set"):
        concat_experiences([_part(1, 1, 1, 0.0), Experience(**{**vars(_part(1, 1, 1, 0.0)),
                                                              "groups": torch.zeros(1)})], pad_id=0)
