"""Rule-based rewards: a Python function scores the responses in place of a reward model
(``model.reward_function``), as TRL's ``reward_funcs`` and OpenRLHF's reward-function file do,
for rewards a rule can check (a verifiable answer, a format, a length).

The function is named ``package.module:name`` (importable from the run's Python path) or
``path/to/file.py:name`` (a file, loaded by path). It is called once per batch of finished
responses as

    fn(prompts=[...], completions=[...], **fields) -> a sequence of numbers, one per response

with ``prompts`` the prompts as the data file holds them (a string, or a list of chat
messages), ``completions`` the responses decoded to text (special tokens left out), and one
keyword per other field of the prompts' rows (``answer=[...]``; None where a row has no such
field, for every row when the function names a field no row of the batch has), as TRL
passes a data set's columns. Accept ``**kwargs`` to ignore fields. A score
that is not a finite number stops the run naming the function and the response.

An ``async def`` function is awaited (those of a list together). A list of functions
(``RewardFunctions``) scores with their weighted sum, as TRL's list of ``reward_funcs`` with
``reward_weights``: one of several may return None for a response it does not apply to (0 in
the sum), but each response needs a number from at least one.
"""
from __future__ import annotations

import asyncio
import atexit
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import threading
from numbers import Real
from typing import Any, Callable, Optional, Sequence

import torch

from .config_types import ConfigError

KEY = "model.reward_function"


def load_reward_function(spec: str) -> Callable:
    """The callable ``spec`` names (``module:name`` or ``file.py:name``); ``ConfigError`` naming
    ``model.reward_function`` when it cannot be found or is not callable."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(KEY, f"{spec!r}: name a function as package.module:function or "
                               f"path/to/file.py:function")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigError(KEY, f"{where}: no such file")
        path, info = os.path.abspath(where), os.stat(where)
        module_name = (f"oppo_reward_fn_{os.path.splitext(os.path.basename(where))[0]}_"
                       f"{hashlib.sha1(path.encode()).hexdigest()[:8]}")
        before, stamp = sys.modules.get(module_name), (info.st_mtime_ns, info.st_size,
                                                       info.st_ino)
        # two functions of one file share its module (its state: a client, a cache, an
        # event), as two of one importable module do; a file changed since is loaded again
        module = before
        if getattr(before, "_oppo_loaded_from", None) != stamp:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module  # so that pickling and dataclasses in it work
            try:
                loader.loader.exec_module(module)
            except BaseException as err:  # a half-run file is not kept (nor reused)
                if before is None:
                    sys.modules.pop(module_name, None)
                else:
                    sys.modules[module_name] = before
                if not isinstance(err, Exception):
                    raise
                raise ConfigError(KEY, f"{where}: loading it failed: {type(err).__name__}: "
                                       f"{err}") from err
            module._oppo_loaded_from = stamp
    else:
        module = _imported(spec, where)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(KEY, f"{spec!r}: {where} has no {name!r}")
    if not callable(fn):
        raise ConfigError(KEY, f"{spec!r}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _imported(spec: str, where: str):
    """Module ``where`` of ``spec``, imported; ``ConfigError`` that tells a name not found (a
    spelling, or a file meant) from a module found whose own import fails (a dependency not
    installed, a syntax error: where, file and line)."""
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and missing != where and not where.startswith(missing + "."):
            raise ConfigError(KEY, (
                f"{spec!r}: {where} was found, but its import of {missing} failed ({err}): a "
                f"dependency of it is not installed in this environment")) from None
        raise ConfigError(KEY, f"{spec!r}: cannot import {where} ({err}); a file is named "
                               f"by a path ending in .py") from None
    except SyntaxError as err:  # IndentationError too; of the module or of one it imports
        raise ConfigError(KEY, f"{spec!r}: importing {where} failed: {err.filename}:"
                               f"{err.lineno}: {type(err).__name__}: {err.msg}") from None
    except Exception as err:  # its own code raised as it ran
        raise ConfigError(KEY, f"{spec!r}: importing {where} failed: {type(err).__name__}: "
                               f"{err}") from err


class RewardFunctionError(RuntimeError):
    """A reward function returned something other than one finite number per response."""


def _named_parameters(fn: Callable) -> set[str]:
    """The keyword arguments ``fn`` names without a default (none for a callable whose
    signature Python cannot read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty}


_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_THREAD: Optional[threading.Thread] = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for async reward functions, running in a daemon thread of
    its own (started again if that thread ended); stopped and closed at exit."""
    global _LOOP, _LOOP_THREAD
    with _LOOP_LOCK:
        if _LOOP_THREAD is None or not _LOOP_THREAD.is_alive():
            _LOOP = asyncio.new_event_loop()
            _LOOP_THREAD = threading.Thread(target=_LOOP.run_forever, daemon=True,
                                            name="oppo-reward-fn-loop")
            _LOOP_THREAD.start()
            atexit.register(_stop_loop, _LOOP, _LOOP_THREAD)
        return _LOOP


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    if not thread.is_alive():
        loop.close()


def _awaited(awaitables: list) -> list:
    """What each of ``awaitables`` gives, or the exception it raised, run together on the
    process's one event loop (``_event_loop``), as TRL gathers its async reward functions:
    a client an async function opened on its first call (an HTTP session's pool) is bound to
    the loop it ran in, and a loop per call (``asyncio.run``) would be closed under it at
    the second; the caller's own running loop (a notebook's) is not touched. The caller's
    CUDA device and grad mode, which are per thread, go with them."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    grad = torch.is_grad_enabled()

    async def one(awaitable):  # anything it raises is its result, named by its function
        try:
            return await awaitable
        except BaseException as err:  # SystemExit too: it would end the loop's thread
            return err

    async def results():
        if device is not None:
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad):
            return await asyncio.gather(*(one(a) for a in awaitables))
    return asyncio.run_coroutine_threadsafe(results(), _event_loop()).result()


class RewardFunction:
    """One function of ``model.reward_function`` loaded, called on decoded responses: (B,)
    float32 scores. ``allow_none``: a None score (one of several functions that does not
    apply to the response) comes back as NaN. A call is ``start`` (what the function
    returned, an awaitable for an ``async def`` one) and ``finish`` (the scores checked)."""

    def __init__(self, spec: str, allow_none: bool = False):
        self.spec = spec
        self.fn = load_reward_function(spec)
        self.wants = _named_parameters(self.fn)
        self.allow_none = allow_none

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str],
                 fields: Sequence[dict]) -> torch.Tensor:
        call = self.start(prompts, completions, fields)
        if inspect.isawaitable(call[0]):
            call = (_awaited([call[0]])[0], call[1])
        return self.finish(*call, completions)

    def start(self, prompts: Sequence[Any], completions: Sequence[str],
              fields: Sequence[dict]) -> tuple[Any, list[str]]:
        """(what the function returned, the field names it was given)."""
        names = sorted({k for f in fields for k in f} - {"prompts", "completions"})
        # a field the function names but no row of this batch has: None for each row, as
        # for a row that lacks it (``answer`` of prompts without one)
        names += sorted(self.wants - set(names) - {"prompts", "completions"})
        columns = {k: [f.get(k) for f in fields] for k in names}
        try:
            return self.fn(prompts=list(prompts), completions=list(completions),
                           **columns), names
        except Exception as err:  # the user's code: say whose it was, keep its traceback
            raise self._raised(err, completions, names) from err

    def _raised(self, err: BaseException, completions, names) -> "RewardFunctionError":
        return RewardFunctionError(f"{KEY} {self.spec} raised {type(err).__name__}: {err} "
                                   f"(scoring {len(completions)} responses; their fields: "
                                   f"{', '.join(names) or 'none'})")

    def finish(self, scores: Any, names: list[str], completions: Sequence[str]) -> torch.Tensor:
        """The scores the function returned (or the exception its awaitable raised),
        checked: one finite number per response (None allowed with ``allow_none``)."""
        if isinstance(scores, BaseException):
            raise self._raised(scores, completions, names) from scores
        try:
            scores = list(scores)
        except TypeError:
            raise RewardFunctionError(f"{KEY} {self.spec} returned a {type(scores).__name__}, "
                                      f"not a sequence of {len(completions)} scores") from None
        if len(scores) != len(completions):
            raise RewardFunctionError(f"{KEY} {self.spec} returned {len(scores)} scores for "
                                      f"{len(completions)} responses")
        for i, s in enumerate(scores):
            if isinstance(s, torch.Tensor) and s.numel() == 1:
                s = s.item()
            if s is None and self.allow_none:
                scores[i] = math.nan
                continue
            if not isinstance(s, Real) or not math.isfinite(s):
                raise RewardFunctionError(
                    f"{KEY} {self.spec} scored response {i} {s!r}: every score must be a finite "
                    f"number (response: {completions[i][:80]!r})")
            scores[i] = float(s)
        return torch.tensor(scores, dtype=torch.float32)


class RewardFunctions:
    """``model.reward_function``'s functions and ``model.reward_weights``: (B,) float32
    scores, each the weighted sum of the functions' scores, as TRL sums its reward_funcs. Of
    several functions one may return None for a response (it does not apply there), which
    counts 0; a response that none of them scores stops the run. ``totals`` holds each
    function's (sum, count) of the scores it gave since ``take_totals``, for its mean."""

    def __init__(self, specs: Sequence[str], weights: Optional[Sequence[float]] = None):
        several = len(specs) > 1
        self.terms = [RewardFunction(spec, allow_none=several) for spec in specs]
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(specs)
        names = [spec.rpartition(":")[2] for spec in specs]
        # by function name, as TRL logs them; by position where two share a name
        self.names = names if len(set(names)) == len(names) else \
            [f"{i}_{name}" for i, name in enumerate(names)]
        self.totals = torch.zeros(len(specs), 2, dtype=torch.float64)

    @property
    def spec(self) -> str:
        return ", ".join(term.spec for term in self.terms)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str],
                 fields: Sequence[dict], *, record: bool = False) -> torch.Tensor:
        """The responses' scores; ``record``: add each function's to ``totals``."""
        calls = []
        try:
            for term in self.terms:
                calls.append(term.start(prompts, completions, fields))
        except BaseException:  # the coroutines of the functions before it never run
            for result, _ in calls:
                if inspect.iscoroutine(result):
                    result.close()
            raise
        waiting = [i for i, (result, _) in enumerate(calls) if inspect.isawaitable(result)]
        for i, result in zip(waiting, _awaited([calls[i][0] for i in waiting]) if waiting
                             else ()):  # async functions run together, as TRL runs them
            calls[i] = (result, calls[i][1])
        parts = torch.stack([term.finish(*call, completions)
                             for term, call in zip(self.terms, calls)], 1)
        scored = ~parts.isnan()
        if record:
            self.totals[:, 0] += parts.nan_to_num(0.0).sum(0).double()
            self.totals[:, 1] += scored.sum(0).double()
        none = (~scored.any(1)).nonzero().flatten().tolist()
        if none:
            i = none[0]
            raise RewardFunctionError(
                f"{KEY}: none of {self.spec} scored response {i} (each returned None; "
                f"{len(none)} such of {len(completions)}): every response needs a number "
                f"from at least one function (response: {completions[i][:80]!r})")
        weights = torch.tensor(self.weights, dtype=torch.float32)
        return (parts.nan_to_num(0.0) * weights).sum(1)

    def take_totals(self) -> torch.Tensor:
        """``totals`` (a (functions, 2) tensor of sums and counts), reset to zero."""
        out, self.totals = self.totals, torch.zeros_like(self.totals)
        return out
