"""Tier 1: model.reward_function, loading a function by module or file and calling it on
decoded responses (oppo_ds/reward_fn.py); the built-in task's rule as one."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from _builders import single_process_env, tiny_run_overrides

from oppo_ds import workload as wl
from oppo_ds.config import ConfigError
from oppo_ds.reward_fn import (RewardFunction, RewardFunctionError, RewardFunctions,
                               load_reward_function)


def test_a_function_is_loaded_from_a_module_or_a_file(tmp_path):
    assert load_reward_function("oppo_ds.workload:gold_reward") is wl.gold_reward
    path = tmp_path / "my_rewards.py"
    path.write_text("def exact(prompts, completions, answer, **_):\n"
                    "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    fn = load_reward_function(f"{path}:exact")
    assert fn(prompts=["p", "q"], completions=[" 4", "5"], answer=["4", "4"]) == [1.0, 0.0]


@pytest.mark.parametrize("spec, words", [
    ("oppo_ds.workload", "name a function as package.module:function or path/to/file.py:function"),
    (":gold_reward", "name a function as"),
    ("oppo_ds.no_such_module:f", "cannot import oppo_ds.no_such_module"),
    ("oppo_ds.workload:no_such_name", "oppo_ds.workload has no 'no_such_name'"),
    ("oppo_ds.workload:LETTERS", "LETTERS is a tuple, not a function"),
    ("/no/such/rewards.py:f", "/no/such/rewards.py: no such file"),
])
def test_a_function_that_cannot_be_found_names_the_key(spec, words):
    with pytest.raises(ConfigError, match=r"^model\.reward_function: ") as err:
        load_reward_function(spec)
    assert words in str(err.value)


def test_a_file_that_fails_to_load_names_the_file_and_the_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_package_here\n")
    with pytest.raises(ConfigError, match=r"broken.py: loading it failed: ModuleNotFoundError"):
        load_reward_function(f"{path}:f")


def test_a_module_that_fails_to_import_is_told_from_a_name_not_found(tmp_path, monkeypatch):
    """The module form let a SyntaxError through as a traceback, and said of a module that
    imports a package not installed "cannot import myrew (No module named 'xyz'); a file is
    named by a path ending in .py", blaming the spelling: now the file and line of the
    syntax error, and the dependency that is missing."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "oppo_test_rew_syntax.py").write_text("def f(prompts, completions):\n"
                                                      "    return [1.0 for c in completions\n")
    (tmp_path / "oppo_test_rew_dep.py").write_text("import oppo_no_such_dependency\n")
    (tmp_path / "oppo_test_rew_raises.py").write_text("raise RuntimeError('no API key')\n")
    with pytest.raises(ConfigError) as err:
        load_reward_function("oppo_test_rew_syntax:f")
    assert str(err.value) == (
        f"model.reward_function: 'oppo_test_rew_syntax:f': importing oppo_test_rew_syntax "
        f"failed: {tmp_path / 'oppo_test_rew_syntax.py'}:2: SyntaxError: '[' was never closed")
    with pytest.raises(ConfigError) as err:
        load_reward_function("oppo_test_rew_dep:f")
    assert str(err.value) == (
        "model.reward_function: 'oppo_test_rew_dep:f': oppo_test_rew_dep was found, but its "
        "import of oppo_no_such_dependency failed (No module named 'oppo_no_such_dependency'): "
        "a dependency of it is not installed in this environment")
    with pytest.raises(ConfigError, match=r"'oppo_test_rew_raises:f': importing "
                                          r"oppo_test_rew_raises failed: RuntimeError: no API key"):
        load_reward_function("oppo_test_rew_raises:f")
    with pytest.raises(ConfigError, match=r"cannot import oppo_test_rew_nope \(No module named "
                                          r"'oppo_test_rew_nope'\); a file is named by a path"):
        load_reward_function("oppo_test_rew_nope:f")


def test_the_rows_fields_arrive_as_columns():
    """Every other field of the prompt rows is a keyword holding one value per response, None
    where a row lacks the field (TRL passes a data set's columns so); the scores come back as
    float32, numbers of any kind (a bool, a 0-dim tensor) taken as they are."""
    seen = {}

    def fn(prompts, completions, **fields):
        seen.update(prompts=prompts, completions=completions, **fields)
        return [True, torch.tensor(0.5), 2]
    reward = RewardFunction("oppo_ds.workload:gold_reward")
    reward.fn = fn
    scores = reward(["p1", [{"role": "user", "content": "p2"}], "p3"], ["a", "b", "c"],
                    [{"answer": "x", "level": 1}, {"answer": "y"}, {}])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.5, 2.0]
    assert seen["prompts"][1] == [{"role": "user", "content": "p2"}]
    assert seen["answer"] == ["x", "y", None] and seen["level"] == [1, None, None]


@pytest.mark.parametrize("returned, words", [
    ([1.0], "returned 1 scores for 2 responses"),
    (3.0, "returned a float, not a sequence of 2 scores"),
    ([1.0, math.nan], "scored response 1 nan: every score must be a finite number"),
    ([1.0, "1"], "scored response 1 '1'"),
    ([None, 1.0], "scored response 0 None"),
])
def test_what_is_not_one_finite_number_per_response_stops_the_run(returned, words):
    reward = RewardFunction("oppo_ds.workload:gold_reward")
    reward.fn = lambda prompts, completions: returned
    with pytest.raises(RewardFunctionError, match="model.reward_function oppo_ds.workload:gold_reward") as err:
        reward(["p", "q"], ["a b", "c"], [{}, {}])
    assert words in str(err.value)


def test_an_async_function_is_awaited(tmp_path):
    """TRL takes ``async def`` reward functions (a call to a verifier service); calling one
    gives a coroutine, which was refused as "not a sequence of scores". Every call runs on
    one event loop, so what the function opened on the loop at its first call (a client's
    connection pool) still works at the next; a loop per call was closed under it."""
    path = tmp_path / "remote.py"
    path.write_text("import asyncio\n"
                    "LOOPS = []\n"
                    "GRAD = []\n"
                    "async def judge(prompts, completions, **_):\n"
                    "    import torch\n"
                    "    LOOPS.append(asyncio.get_running_loop())\n"
                    "    GRAD.append(torch.is_grad_enabled())\n"
                    "    assert not LOOPS[0].is_closed()\n"
                    "    await asyncio.sleep(0)\n"
                    "    return [float(len(c)) for c in completions]\n")
    reward = RewardFunction(f"{path}:judge")
    for _ in range(2):
        with torch.no_grad():  # as the trainer scores: the function's thread has it too
            assert reward(["p", "q"], ["ab", "c"], [{}, {}]).tolist() == [2.0, 1.0]
    module = sys.modules[reward.fn.__module__]
    assert len(module.LOOPS) == 2 and module.LOOPS[0] is module.LOOPS[1]
    assert module.GRAD == [False, False]


def test_async_functions_of_a_list_run_together(tmp_path):
    """Of several functions, the async ones are awaited together, as TRL gathers them: here
    the first waits for what the second does, which one after the other would never see
    (it would time out). Functions of one file share its module, as those of an importable
    module do (each loaded the file afresh: two events). An error in one names it."""
    path = tmp_path / "pair.py"
    path.write_text("import asyncio\n"
                    "SEEN = asyncio.Event()\n"
                    "async def waits(completions, **_):\n"
                    "    await asyncio.wait_for(SEEN.wait(), 10)\n"
                    "    return [1.0 for _ in completions]\n"
                    "async def tells(completions, **_):\n"
                    "    SEEN.set()\n"
                    "    return [2.0 for _ in completions]\n"
                    "def plain(completions, **_):\n"
                    "    return [4.0 for _ in completions]\n"
                    "async def fails(completions, **_):\n"
                    "    raise KeyError('gone')\n")
    reward = RewardFunctions([f"{path}:waits", f"{path}:plain", f"{path}:tells"])
    assert reward(["p"], ["a"], [{}]).tolist() == [7.0]
    with pytest.raises(RewardFunctionError, match=f"{path}:fails raised KeyError: 'gone'") as err:
        RewardFunctions([f"{path}:plain", f"{path}:fails"])(["p"], ["a"], [{}])
    assert isinstance(err.value.__cause__, KeyError)  # its frames, as oppo-train prints them
    # a sync function failing after an async one: that one's coroutine is closed, not left
    # never awaited
    broken = tmp_path / "broken.py"
    broken.write_text("def f(completions, **_):\n    raise ValueError('no')\n")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be one
        with pytest.raises(RewardFunctionError, match="raised ValueError: no"):
            RewardFunctions([f"{path}:tells", f"{broken}:f"])(["p"], ["a"], [{}])
        import gc
        gc.collect()


def test_an_error_in_the_function_names_it_and_the_fields_it_was_given():
    def fn(prompts, completions, answer):
        raise KeyError("solution")
    reward = RewardFunction("oppo_ds.workload:gold_reward")
    reward.fn = fn
    with pytest.raises(RewardFunctionError, match=r"oppo_ds.workload:gold_reward raised KeyError: "
                                                  r"'solution' \(scoring 1 responses; their fields: "
                                                  r"answer\)") as err:
        reward(["p"], ["a"], [{"answer": "4"}])
    assert isinstance(err.value.__cause__, KeyError)


def test_a_field_the_function_names_and_no_row_has_arrives_as_nones(tmp_path):
    """``def f(prompts, completions, answer, **_)`` on prompts none of which has an answer
    (an evaluation set without them) was called without ``answer``: a TypeError. It gets one
    None per response, as for a row that lacks the field; a named argument with a default
    keeps its default."""
    path = tmp_path / "rewards.py"
    path.write_text("def f(prompts, completions, answer, level=7, **_):\n"
                    "    return [len(a or '') + level for a in answer]\n")
    reward = RewardFunction(f"{path}:f")
    assert reward(["p", "q"], ["a", "b"], [{}, {}]).tolist() == [7.0, 7.0]
    assert reward(["p", "q"], ["a", "b"], [{"answer": "xy"}, {}]).tolist() == [9.0, 7.0]


def test_an_error_in_the_function_ends_oppo_train_with_its_frames_and_one_line(tmp_path):
    """The user's function failing in a run: its own frames (where in their file), then one
    line naming the key and the function, exit 1; not the trainer's traceback around it."""
    path = tmp_path / "rewards.py"
    path.write_text("def f(prompts, completions, **_):\n    return [1 / 0 for c in completions]\n")
    proc = subprocess.run([sys.executable, "-m", "oppo_ds.train",
                           *tiny_run_overrides(tmp_path, 1), f"model.reward_function={path}:f",
                           "ppo.advantage_estimator=rloo", "data.samples_per_prompt=2"],
                          env=single_process_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("oppo-train: error: rank 0: model.reward_function "
                                f"{path}:f raised ZeroDivisionError: division by zero")
    assert f'File "{path}", line 2, in <listcomp>' in proc.stderr or \
        f'File "{path}", line 2, in f' in proc.stderr
    assert "trainer.py" not in proc.stderr  # none of our frames around it


def _functions_file(tmp_path):
    """Two rules as TRL's reward_funcs write them: one on the answer, which does not apply
    (None) to a row without one, and one on the format."""
    path = tmp_path / "rules.py"
    path.write_text(
        "def correct(prompts, completions, answer, **_):\n"
        "    return [None if a is None else float(c.strip() == a)"
        " for c, a in zip(completions, answer)]\n"
        "def short(prompts, completions, **_):\n"
        "    return [1.0 if len(c) <= 2 else -1.0 for c in completions]\n")
    return path


def test_several_functions_score_with_their_weighted_sum(tmp_path):
    """TRL's reward_funcs with reward_weights: the score is each function's times its weight,
    summed; a None (the function does not apply) counts 0. Each function's scores are counted
    for its mean only when the call is recorded (training, not evaluation)."""
    path = _functions_file(tmp_path)
    reward = RewardFunctions([f"{path}:correct", f"{path}:short"], [2.0, 0.5])
    rows = [{"answer": "4"}, {"answer": "4"}, {}]
    scores = reward(["p", "q", "r"], ["4", "five", "ok"], rows)
    # by hand: 2 * 1 + 0.5 * 1, 2 * 0 + 0.5 * -1, (None) + 0.5 * 1
    assert scores.dtype == torch.float32 and scores.tolist() == [2.5, -0.5, 0.5]
    assert reward.names == ["correct", "short"] and not reward.totals.any()
    reward(["p", "q", "r"], ["4", "five", "ok"], rows, record=True)
    reward(["p"], ["4"], [{"answer": "5"}], record=True)
    assert reward.take_totals().tolist() == [[1.0, 3.0], [2.0, 4.0]]  # (sum, count) each
    assert not reward.totals.any()  # taken: the next step counts afresh
    # no weights: 1 each; one function alone gives its own scores
    assert RewardFunctions([f"{path}:correct", f"{path}:short"])(
        ["p"], ["4"], [{"answer": "4"}]).tolist() == [2.0]
    assert RewardFunctions([f"{path}:short"], [3.0])(["p"], ["abc"], [{}]).tolist() == [-3.0]
    # two functions of one name are told apart by their place
    assert RewardFunctions([f"{path}:short", f"{path}:short"]).names == ["0_short", "1_short"]


def test_a_response_no_function_scores_stops_the_run(tmp_path):
    """Every function returned None for a response: nothing says what it is worth (TRL warns
    and trains on 0). One function alone may not return None at all."""
    path = _functions_file(tmp_path)
    reward = RewardFunctions([f"{path}:correct", f"{path}:correct"])
    with pytest.raises(RewardFunctionError) as err:
        reward(["p", "q"], ["4", "x"], [{"answer": "4"}, {}])
    assert str(err.value) == (
        f"model.reward_function: none of {path}:correct, {path}:correct scored response 1 (each "
        "returned None; 1 such of 2): every response needs a number from at least one function "
        "(response: 'x')")
    with pytest.raises(RewardFunctionError, match="scored response 0 None: every score must be"):
        RewardFunctions([f"{path}:correct"])(["p"], ["4"], [{}])


@pytest.mark.parametrize("overrides, key, words", [
    (["model.reward_function=[]"], "model.reward_function", "is an empty list"),
    (["model.reward_weights=[1.0]"], "model.reward_weights",
     "model.reward_function, which is null"),
    (["model.reward_function=[a:f,b:g]", "model.reward_weights=[1.0]"], "model.reward_weights",
     "has 1 weight(s) for the 2 function(s) of model.reward_function: one each"),
    (["model.reward_function=a:f", "model.reward_weights=[.nan]"], "model.reward_weights",
     "(finite: not inf or nan)"),  # the type check's
])
def test_weights_that_do_not_fit_the_functions_name_the_key(overrides, key, words):
    from oppo_ds.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(f"{key}: ") and words in str(err.value)


def test_a_run_logs_each_functions_mean(tmp_path):
    """A run scoring with two functions and their weights: each function's mean is logged
    per step, and the reward the run trains on is their weighted sum (every row scored by
    both here, and every scored row trained on: no pool, no filter)."""
    from oppo_ds.telemetry import read_history
    from oppo_ds.trainer import PPOTrainer
    from oppo_ds.config import load_config

    path = tmp_path / "rules.py"
    path.write_text("def length(completions, **_):\n    return [len(c) / 10 for c in completions]\n"
                    "def vowels(completions, **_):\n"
                    "    return [sum(ch in 'aeiou' for ch in c) for c in completions]\n")
    cfg = load_config(None, [*tiny_run_overrides(tmp_path, 2), "logging.tensorboard=false",
                             f"model.reward_function=[{path}:length,{path}:vowels]",
                             "model.reward_weights=[1.0,-0.5]", "ppo.advantage_estimator=rloo",
                             "data.samples_per_prompt=2"])
    PPOTrainer(cfg).train()
    history = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    assert len(history) == 2
    for r in history:
        assert r["reward/mean"] == pytest.approx(
            r["reward_fn/length/mean"] - 0.5 * r["reward_fn/vowels/mean"], abs=1e-5)
    assert any(r["reward_fn/length/mean"] > 0 for r in history)


def test_gold_reward_is_the_hidden_rule():
    """The built-in task's rule as a reward function: each completion's gold score for the task
    its prompt names (by hand: the mean of the mood's letter values), -1 where the prompt names
    none or the completion has no letter."""
    v = wl.LETTER_VALUE["warm"]
    got = wl.gold_reward(["warm q c ->", "warm q c ->", "no task here"], ["a b", "<eos>", "a"])
    assert got[0] == pytest.approx((v["a"] + v["b"]) / 2)
    assert got[1:] == [-1.0, -1.0]


def test_a_resume_takes_one_function_as_the_list_of_it():
    """`model.reward_function: f` and `[f]` reward alike: a resume from one to the other is
    no change of objective to name."""
    from oppo_ds.resume import _compared

    assert _compared("model.reward_function", "a.py:f") == \
        _compared("model.reward_function", ["a.py:f"]) != _compared("model.reward_function", None)
    assert _compared("ppo.kl_coef", 0.1) == 0.1
