"""Where a run's models, tokenizer and prompts come from (``builtin`` resolved to the prepared
workload), and whether they fit together, checked on every rank before any engine loads:
every model reads the actor's token ids, a prompt and a response fit every model's
positions, and the ids that end a response.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from . import workload as wl
from .config import Config, ConfigError
from .shared_dirs import SHARE_IT
from .checkpoint_files import checkpoint_config, quantized_problem
from .models import (FROM_CONFIG_ARCHS, NO_HEAD, CheckpointFileError, TokenizerFileError,
                     has_value_head, load_tokenizer, position_limit, response_end_ids,
                     source_problem, tokenizer_mismatch)

logger = logging.getLogger(__name__)

MODEL_KEYS = ("actor", "reference", "reward", "critic")


@dataclass
class Sources:
    """Where each model, the tokenizer and the prompts come from, after resolving `builtin`."""
    actor: str
    reference: str
    reward: str
    critic: str
    tokenizer: Optional[str]
    prompts: str | list[str]
    builtin_prompts: bool
    oracle: bool = False  # workload.kind length_oracle: models from config, random weights
    # False with model.reward_function: no reward model is built (``reward`` is then only
    # where the critic starts, checked under model.critic)
    reward_model: bool = True

    @property
    def models(self) -> dict[str, str]:
        """Each built model's source under its ``model.`` key, in ``MODEL_KEYS`` order."""
        return {key: getattr(self, key) for key in MODEL_KEYS
                if (key != "reward" or self.reward_model) and getattr(self, key) is not None}


def uses_builtin_workload(cfg: Config) -> bool:
    """Whether the run reads the prepared built-in workload (in ``workload.cache_dir``): some
    model or the prompts are ``builtin`` (under the length oracle nothing is prepared)."""
    m = cfg.model
    if cfg.workload.kind == "length_oracle":
        return False
    # model.reward is read where the reward model scores, or where the critic starts from it
    reward_read = m.uses_reward_model or (cfg.ppo.uses_critic and m.critic is None)
    return "builtin" in (m.actor, m.critic, m.reference, cfg.data.prompts) or \
        (reward_read and m.reward == "builtin")


def resolve_sources(cfg: Config, rank: int, *, prepare: bool = True) -> Sources:
    """Replace `builtin` by the prepared workload's directories (rank 0 prepares, the others
    wait), and fill the defaults: reference = actor, critic = reward. ``prepare=False`` leaves
    the built-in workload alone: its models and prompts come back as None and its tokenizer
    as built (``run_tokenizer``; the prepared one is that tokenizer, saved). That is enough to
    read and encode the user's prompts, as the DeepSpeed-Chat flags' epoch count does in every
    process before the ranks join."""
    m, d = cfg.model, cfg.data
    if cfg.workload.kind == "length_oracle":
        # nothing to prepare: `builtin` models are the architecture built from config
        def arch(value: Optional[str], fallback: Optional[str]) -> str:
            value = fallback if value is None else value
            return m.builtin_arch if value in (None, "builtin") else value
        return Sources(actor=arch(m.actor, "builtin"), reference=arch(m.reference, m.actor),
                       reward=arch(m.reward, "builtin"), critic=arch(m.critic, m.reward),
                       tokenizer=m.tokenizer, prompts=d.prompts, builtin_prompts=False, oracle=True)
    prepared = None
    if prepare and uses_builtin_workload(cfg):
        from .prepare import prepare_builtin

        w = cfg.workload
        kwargs = dict(arch=m.builtin_arch, seed=cfg.seed, num_prompts=w.num_prompts,
                      sft_steps=w.sft_steps, reward_steps=w.reward_steps, median_len=w.median_len,
                      tail_sigma=w.tail_sigma, max_new_tokens=cfg.generation.max_new_tokens)
        if rank == 0:
            prepared = prepare_builtin(w.cache_dir, **kwargs)
        if dist.is_initialized():
            dist.barrier()
        if rank != 0:  # now a cache hit, unless this rank's node does not share the folder
            try:
                prepared = prepare_builtin(w.cache_dir, build=False, **kwargs)
            except FileNotFoundError as err:
                raise ConfigError("workload.cache_dir", (
                    f"rank {rank} ({socket.gethostname()}) cannot find {err}, the built-in "
                    f"workload rank 0 prepared: the folder is not shared with rank 0's node: "
                    f"{SHARE_IT}")) from None

    def pick(value: Optional[str], fallback: str, builtin_path: Optional[str] = None) -> str:
        value = fallback if value is None else value
        return builtin_path if value == "builtin" else value

    actor = pick(m.actor, "builtin", prepared and prepared.actor)
    reward = pick(m.reward, "builtin", prepared and prepared.reward)
    tokenizer = m.tokenizer
    if tokenizer is None:
        tokenizer = actor if actor and os.path.isdir(actor) else \
            (prepared.tokenizer if prepared else None)
    return Sources(actor=actor,
                   reference=pick(m.reference, m.actor, prepared and prepared.actor),
                   reward=reward,
                   critic=pick(m.critic, m.reward, prepared and prepared.reward),
                   tokenizer=tokenizer,
                   prompts=pick(d.prompts, "builtin", prepared and prepared.prompts),
                   builtin_prompts=d.prompts == "builtin",
                   reward_model=m.uses_reward_model)


def read_rows(cfg: Config, prompts: str | list[str]):
    """The prompt rows of ``prompts`` (a path or several) as ``cfg.data`` says to read them:
    the first ``data.max_samples`` of them where that is set."""
    from .datafiles import read_prompt_rows

    d = cfg.data
    source_format = None
    if d.deepspeed_chat_formats:
        from .integrations.dschat_data import dschat_format as source_format
    rows = read_prompt_rows(prompts, prompt_key=d.prompt_key, split=d.split,
                            phase_split=d.phase_split,
                            phase_seed=cfg.seed if d.phase_split_seed is None else d.phase_split_seed,
                            source_format=source_format)
    return rows[:d.max_samples] if d.max_samples else rows


def load_prompts(cfg: Config, src: Sources, tokenizer, *, log: bool):
    """The run's prompts, encoded, and the rows they came from: the length oracle's prompts
    (``None`` for the rows) when its built-in prompts are used, else ``src.prompts`` read by
    ``read_rows`` and put through ``encode_rows``. The trainer, the TRL peer and the
    DeepSpeed-Chat flags' epoch count read their prompts through it, so all see the same ones."""
    if src.oracle and src.prompts == "builtin":
        return wl.run_oracle_prompts(cfg, len(tokenizer)), None
    rows = read_rows(cfg, src.prompts)
    return encode_rows(cfg, rows, tokenizer, prompts_label(src.prompts), log=log).prompts, rows


def encode_rows(cfg: Config, rows, tokenizer, label: str, *, log: bool):
    """``rows`` encoded as every prompt of a run is (``data.chat_template``,
    ``data.input_template``, ``generation.max_prompt_len``, ``data.overlong``); with ``log``
    the prompts truncated, skipped and continuing an assistant message are counted in the log
    under ``label``."""
    from .data import encode_prompts

    d, g = cfg.data, cfg.generation
    encoded = encode_prompts(rows, tokenizer, g.max_prompt_len, overlong=d.overlong,
                             chat_template=chat_template_mode(cfg), input_template=d.input_template)
    if log and (encoded.n_truncated or encoded.n_skipped):
        logger.warning("%s: %d prompts truncated, %d skipped (over %d tokens)", label,
                       encoded.n_truncated, encoded.n_skipped, g.max_prompt_len)
    if log and encoded.n_continued:
        logger.info("%s: %d prompts end with an assistant message; their responses continue it "
                    "(no end of turn after it, as TRL does)", label, encoded.n_continued)
    return encoded


def chat_template_mode(cfg: Config) -> str:
    """``data.chat_template`` as the prompts are encoded: ``auto`` is ``off`` under
    ``data.deepspeed_chat_formats`` (set in YAML or by oppo-train's --data_path alike), whose
    prompts carry their own format (" Human: ... Assistant:") and which DeepSpeed-Chat
    tokenizes as they are: a chat template would wrap them in a second one. ``on`` applies
    the template all the same."""
    d = cfg.data
    return "off" if d.chat_template == "auto" and d.deepspeed_chat_formats else d.chat_template


def prompts_label(prompts: str | list[str]) -> str:
    """A prompt source or several, for a message."""
    return prompts if isinstance(prompts, str) else " + ".join(prompts)


def oracle_vocab(arch: str) -> int:
    """The vocabulary of the length oracle's models: a real shape's own, or a fixed size for
    the tiny architectures."""
    from .models import SHAPES

    return SHAPES[arch][5] if arch in SHAPES else wl.ORACLE_TINY_VOCAB


def check_paths(cfg: Config, src: Sources) -> None:
    """Each model source is a checkpoint directory of a causal LM transformers has, or an
    architecture built from config, and the reward checkpoint has a scalar head (under
    system.backend megatron, unquantized weights):
    ``ConfigError`` naming the key otherwise, before the tokenizer is chosen (a missing actor
    directory would otherwise fall back to the built-in tokenizer and fail on the prompts) or
    any model is built."""
    problems: dict[str, Optional[str]] = {}  # by source: the actor's is often the reference's
    for key, source in src.models.items():
        if source not in problems:
            problems[source] = source_problem(source, trust_remote_code=cfg.model.trust_remote_code)
        if problems[source]:
            raise ConfigError(f"model.{key}", problems[source])
        if cfg.system.backend == "megatron" and source not in FROM_CONFIG_ARCHS:
            problem = quantized_problem(source)
            if problem:
                raise ConfigError(f"model.{key}", problem)
    if src.reward_model and src.reward not in FROM_CONFIG_ARCHS:
        try:
            head = has_value_head(src.reward)
        except ValueError as err:  # a pickled weights file cut short (safetensors ones are
            raise ConfigError("model.reward", str(err)) from err  # seen by source_problem)
        if not head:
            raise ConfigError("model.reward", f"{src.reward}: {NO_HEAD}")


def run_tokenizer(cfg: Config, src: Sources):
    """The run's tokenizer: the configured or actor directory's, the length oracle's, or the
    built-in workload's."""
    if src.tokenizer:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.actor"
        try:
            return load_tokenizer(src.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
        except (FileNotFoundError, TokenizerFileError) as err:
            hint = "" if cfg.model.tokenizer else "; set model.tokenizer to a tokenizer directory"
            raise ConfigError(key, f"{err}{hint}") from None
    if src.oracle:
        return wl.build_oracle_tokenizer(oracle_vocab(cfg.model.builtin_arch))
    return wl.build_tokenizer()


def reward_normalization(cfg: Config, src: Sources) -> Optional[tuple[float, float]]:
    """(mean, std) of ``model.reward_normalize``, from the reward checkpoint's config.json
    (OpenRLHF writes a number, or a list of one); None when the setting is off. ``ConfigError``
    naming the key when the checkpoint holds none or a std that is not positive."""
    if not cfg.model.reward_normalize:
        return None
    path = os.path.join(src.reward, "config.json")
    config = checkpoint_config(src.reward) or {}

    def number(key):
        value = config.get(key)
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    mean, std = number("mean"), number("std")
    if mean is None or std is None:
        raise ConfigError("model.reward_normalize", (
            f"true, but {path if os.path.isfile(path) else src.reward} holds no `mean` and `std` "
            "(an OpenRLHF reward model trained with --normalize_reward writes them); set "
            "model.reward_normalize: false"))
    if not std > 0:
        raise ConfigError("model.reward_normalize", f"{path}: std is {std}, it must be > 0")
    return mean, std


def check_prompt_format(cfg: Config, src: Sources, tokenizer) -> None:
    """``ConfigError`` for prompt settings the run's tokenizer cannot follow, before any prompt
    is encoded: ``data.chat_template: on`` without a chat template, ``data.input_template``
    while the tokenizer's chat template is in use."""
    d = cfg.data
    has_template = bool(getattr(tokenizer, "chat_template", None))
    where = src.tokenizer or "the built-in workload's tokenizer"
    mode = chat_template_mode(cfg)
    if mode == "on" and not has_template:
        raise ConfigError("data.chat_template", (
            f"on, but {where} has no chat template; set data.chat_template: auto (prompts as "
            "they are), or model.tokenizer to a tokenizer directory that has one"))
    if d.input_template is not None and has_template and mode != "off":
        raise ConfigError("data.input_template", (
            f"{d.input_template!r} is for tokenizers without a chat template, but {where} has "
            "one and data.chat_template is auto or on; set data.chat_template: off to put the "
            "prompts into the input template instead, or data.input_template: null"))


def check_sources(cfg: Config, src: Sources, tokenizer, *, log: bool) -> None:
    """Raise ``ConfigError`` for models that cannot run together, before any is built:

    * each model checkpoint must read the actor's token ids as they are
      (``models.tokenizer_mismatch``; tokens only one tokenizer has are a warning);
    * a prompt of ``generation.max_prompt_len`` tokens and a response of
      ``generation.max_new_tokens`` must fit every model's positions: past a learned table
      (GPT-2, OPT) a forward fails mid-run; past a rotary model's trained length it only
      degrades, which is a warning.

    ``log``: this rank logs the warnings (rank 0)."""
    sources = src.models
    seen = {os.path.realpath(src.tokenizer)} if src.tokenizer else set()
    for key, path in sources.items():
        where = os.path.realpath(path)
        if not os.path.isdir(path) or where in seen:
            continue
        seen.add(where)
        error, warning = tokenizer_mismatch(path, tokenizer,
                                            trust_remote_code=cfg.model.trust_remote_code)
        if error:
            raise ConfigError(f"model.{key}", f"{path}: {error}; every model must use the "
                                              "actor's tokenizer")
        if warning and log:
            logger.warning("model.%s: %s: %s", key, path, warning)

    g = cfg.generation
    need = g.max_prompt_len + g.max_new_tokens
    checked = set()
    for key, source in sources.items():
        if source in checked:
            continue
        checked.add(source)
        limit = position_limit(source, len(tokenizer))
        if limit is None or limit[0] >= need:
            continue
        positions, name, hard = limit
        text = (f"max_prompt_len {g.max_prompt_len} + max_new_tokens {g.max_new_tokens} = "
                f"{need} positions, but model.{key} ({source}) has {positions} "
                f"({name} in its config)")
        if hard:
            raise ConfigError("generation.max_new_tokens", text + ": its positions are a "
                              "learned table, so a longer sequence cannot be scored; lower "
                              "the two")
        if log:
            logger.warning("generation: %s: positions past it were never trained", text)


def end_ids(cfg: Config, src: Sources, tokenizer, *, log: bool) -> tuple[int, ...]:
    """The ids that end a response (``generation.eos_token_ids``; none under the length
    oracle, where only the target lengths end responses), checked against the tokenizer and
    logged when ``log``."""
    if src.oracle:
        return ()
    wanted = cfg.generation.eos_token_ids
    try:
        ids = response_end_ids(wanted, src.actor, tokenizer)
    except CheckpointFileError as err:  # only `auto` reads the actor's files
        raise ConfigError("model.actor", f"{err} (read for generation.eos_token_ids: auto)"
                          ) from None
    if wanted == "auto":
        origin = "the actor's generation config and the tokenizer's EOS"
    else:
        origin, vocab = "generation.eos_token_ids", len(tokenizer)
        if max(ids) >= vocab:
            raise ConfigError("generation.eos_token_ids",
                              f"{max(ids)} is not a token id of this tokenizer (it has {vocab})")
    if log:
        if ids:
            names = tokenizer.convert_ids_to_tokens(list(ids))
            logger.info("responses end at token ids %s %s (%s)", list(ids), names, origin)
        else:
            logger.warning("no end-of-sequence token: neither the actor's generation config "
                           "nor the tokenizer names one, so every response runs to "
                           "generation.max_new_tokens; set generation.eos_token_ids")
    return ids
