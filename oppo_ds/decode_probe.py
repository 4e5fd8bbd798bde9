"""Where a decoded token's time goes: the model's forward, the host-device syncs, the sampling.

    python -m oppo_ds.decode_probe --arch qwen2.5-0.5b --batch 32 --tokens 64 --dtype bf16

On the first GPU run (an H200, 2026-11-26, docs/benchmarks.md) the actor decoded at about
36 ms a token for a 2-layer tiny model and 38 ms for Qwen2.5-0.5B shapes, with the GPU's
multiprocessors about 10% busy: a cost per token that does not grow with the model, which a
forward pass cannot explain. This probe times, on one actor built from config with random
weights, each piece of a decode step alone, so one short run on a GPU says which it is. On the
second (an H100, 2026-11-26) it said: not the host waits (a sync 0.02 ms, a copy 0.02 ms,
decoding in blocks no faster), but the forward itself, 15.7 ms a token for Qwen2.5-0.5B at
batch 32 (the host's launches, not the GPU's work); the trainer still took 37-48 ms a token
there, which ``--trainer`` (below) is for. The pieces:

- ``forward``: the model's forward with its KV cache and a greedy next token chosen on the
  device, no host sync until the end (launch and compute alone);
- ``forward + sync``: the same with one ``synchronize`` per token (what any loop that asks
  the host whether a row ended pays);
- ``decode (cpu generator)``: ``decode_steps`` as the trainer runs it, sampling with a CPU
  ``torch.Generator`` (its state is in the checkpoints): on a GPU one host-to-device copy of
  the uniforms per token, beside the end-of-row check;
- ``decode (device generator)``: ``decode_steps`` sampling with a generator on the logits'
  device (no copy);
- ``decode (in blocks)``: ``decode_steps`` with ``generation.sync_every`` = ``--sync-every``
  (16), the trainer's CPU generator: one host check of ended rows and one copy of uniforms
  a block instead of a token (no row ends in the probe, so no forward is wasted);
- ``decode, left-padded``: ``decode (cpu generator)`` on prompts of random lengths padded on
  the left, as the trainer's are (an attention mask with zeros: attention kernels that take
  a mask, where full prompts take the causal ones);
- ``decode, left-padded, new shapes``: the same, each run at a batch size not decoded
  before in the process (``new_shape_batches``): the pieces above pay any cost per new shape
  (an attention backend's plan, say) in their warm-up run, a rollout pays it whenever its
  batch shrinks or its prompts change width; ``decode, new shapes, no cuDNN attention`` the
  same with torch's cuDNN attention backend left out (cuDNN plans each shape it sees);
- ``decode, rows ending``: ``decode, left-padded`` with each row ending at a length drawn
  anew each run, so the batch shrinks through the decode at other points each time (a
  rollout's shapes); ``decode, static cache, rows ending`` the same with
  ``generation.static_cache`` (one shape for every forward: the ended rows stay in the
  batch), and on a GPU ``decode, static cache + CUDA graph, rows ending`` with
  ``generation.cuda_graph`` too (the forward replayed as one graph); ms per forward;
- ``launch``: one one-element kernel queued without a wait (what each of a forward's
  kernels costs the host to start);
- ``sync``, ``d2h item``, ``h2d copy`` and ``h2d pinned``: one ``synchronize`` after a
  one-element kernel; one ``bool(t.any())`` of a (batch,) tensor (the end-of-row check: a
  kernel, a copy to pageable host memory and the wait); one copy of ``batch`` float64
  uniforms from pageable host memory (the sampler's), and the same from pinned memory with
  ``non_blocking`` and a wait, each on its own.

With ``--trainer KEY=VALUE ...`` it also builds a ``PPOTrainer`` from those overrides and
times its own decode: its actor on the probe's prompts, ``PPOTrainer.generate`` on its
workload's prompts (split into a cost per token and a fixed cost per call; with its rows
ending one after another, as a rollout's do; at new batch sizes), and its first call after a
PPO step (``probe_trainer``).

Figures are milliseconds per decode step (one token for every row), medians of ``--repeat``
timed runs after one warm-up. On a CPU the syncs cost nothing and the probe shows only
the loop's own overhead beside the forward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from .kv_cache import cache_kwargs, output_cache
from .models import FROM_CONFIG_ARCHS, TINY_ARCHS, build_causal_lm
from .rollout.generate import SamplingParams, cudnn_attention, decode_steps, start_decode

TINY_VOCAB = 512  # the tiny architectures' vocabulary here (the real shapes keep their own)
# timed per decode step; the other pieces are timed per call
DECODE_PIECES = ("forward", "forward + sync", "decode (cpu generator)", "decode (device generator)",
                 "decode (in blocks)", "decode, left-padded", "decode, left-padded, new shapes",
                 "decode, new shapes, no cuDNN attention", "decode, rows ending",
                 "decode, static cache, rows ending")
# on a CUDA device only
GRAPH_PIECE = "decode, static cache + CUDA graph, rows ending"


def _sync_fn(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _median_ms(fn: Callable[[], int], sync: Callable[[], None], repeat: int) -> float:
    """Median over ``repeat`` runs of fn's wall time per unit it returns (ms), after a warm-up."""
    fn()
    sync()
    per_unit = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        units = fn()
        sync()
        per_unit.append((time.perf_counter() - start) * 1e3 / max(units, 1))
    return statistics.median(per_unit)


def _left_padded(vocab: int, rows: int, width: int, gen: torch.Generator, device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of ``rows`` random lengths in [width / 4, width], left-padded with id 0 to
    ``width``, as the trainer's are: (ids, mask) on ``device``."""
    lengths = torch.randint(max(1, width // 4), width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(3, vocab, (rows, width), generator=gen) * mask
    return ids.to(device), mask.to(device)


def new_shape_batches(batch: int, repeat: int, skip: int = 0) -> list[int]:
    """Batch sizes ``batch - 1 - skip``, ``batch - 2 - skip``, ... (``repeat`` + 1 of them,
    the first a warm-up; never below 1): decoding at a batch size the process has not used
    yet gives every forward a shape of its own, so a cost paid once per new shape (an
    attention backend's plan, an allocator's new block) shows, where the probe's other
    pieces pay it in their warm-up run."""
    return [max(1, batch - 1 - skip - i) for i in range(repeat + 1)]


def _cold_ms(run: Callable[[int], int], batches: list[int], sync: Callable[[], None]) -> float:
    """``_median_ms`` of ``run(rows)``, one call per batch size: ``batches[0]`` warms up the
    code (at a shape of its own), the rest are timed."""
    sizes = iter(batches)
    return _median_ms(lambda: run(next(sizes)), sync, len(batches) - 1)


def _params(tokens: int, sync_every: int = 1, static: bool = False,
            graph: bool = False) -> SamplingParams:
    """Sampling that no end id can stop: every row decodes ``tokens`` tokens."""
    return SamplingParams(max_new_tokens=tokens, eos_token_ids=(), pad_token_id=0,
                          temperature=1.0, top_k=0, top_p=1.0, sync_every=sync_every,
                          static_cache=static, cuda_graph=graph)


def _rows_ending(model, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                 gen: torch.Generator) -> Callable[[], int]:
    """A decode whose rows end one after another at lengths drawn anew each run (a length
    target per row, 2 to ``max_new_tokens``), as a rollout's do: the default decode's batch
    shrinks through it, at other points each run. Returns the forwards after the prefill."""
    def run() -> int:
        targets = torch.randint(2, params.max_new_tokens + 1, (ids.shape[0],), generator=gen)
        state = start_decode(model, ids, mask, params, targets=targets)
        decode_steps(model, state, params, gen)
        return int(state.lengths.max()) - 1
    return run


def _decode(model, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
            generator: Optional[torch.Generator]) -> int:
    """``start_decode`` and ``decode_steps`` as the trainer runs them; returns the decode
    steps after the prefill's token (the unit the pieces are timed in)."""
    state = start_decode(model, ids, mask, params)
    return decode_steps(model, state, params, generator) // ids.shape[0] - 1


def probe(arch: str, batch: int, prompt_len: int, tokens: int, dtype: str, device: str,
          repeat: int = 3, seed: int = 0, sync_every: int = 16) -> dict:
    """Time each piece of a decode step; returns the figures (ms) and what was run."""
    dev = torch.device(device)
    # made on the probed device (a real shape's random init on the host took most of a probe)
    model = build_causal_lm(arch, vocab_size=TINY_VOCAB if arch in TINY_ARCHS else None,
                            dtype=dtype, seed=seed, device=dev).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (batch, prompt_len), generator=gen).to(dev)
    mask = torch.ones_like(prompt)
    sync = _sync_fn(dev)
    params = _params(tokens)

    @torch.no_grad()
    def forward_loop(sync_each: bool) -> int:
        out = model(input_ids=prompt, attention_mask=mask, use_cache=True)
        cache, am = output_cache(out), mask
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.full((batch, 1), prompt_len, device=dev)
        for _ in range(tokens - 1):
            am = torch.cat([am, torch.ones(batch, 1, dtype=am.dtype, device=dev)], dim=1)
            out = model(input_ids=nxt, attention_mask=am, position_ids=pos, use_cache=True,
                        **cache_kwargs(model, cache))
            cache, pos = output_cache(out), pos + 1
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            if sync_each:
                sync()
        return tokens - 1

    blocks = _params(tokens, sync_every)

    def decode(generator: Optional[torch.Generator], how: SamplingParams = params
               ) -> Callable[[], int]:
        return lambda: _decode(model, prompt, mask, how, generator)

    device_gen = torch.Generator(dev).manual_seed(seed)
    uniforms = torch.zeros(batch, dtype=torch.float64)
    one = torch.zeros(1, device=dev)

    def one_sync() -> int:
        one.add_(1)
        sync()
        return 1

    def launches() -> int:  # 100 queued kernels; the timer's closing wait drains them
        for _ in range(100):
            one.add_(1)
        return 100

    def one_copy() -> int:
        uniforms.to(dev)
        return 1

    flags = torch.zeros(batch, dtype=torch.bool, device=dev)

    def one_item() -> int:
        bool(flags.any())
        return 1

    pinned = uniforms.pin_memory() if dev.type == "cuda" else uniforms

    def one_pinned_copy() -> int:
        pinned.to(dev, non_blocking=True)
        sync()
        return 1

    padded_ids, padded_mask = _left_padded(vocab, batch, prompt_len, gen, dev)

    def new_shape(no_cudnn: bool) -> Callable[[int], int]:
        def run(rows: int) -> int:
            ids, am = _left_padded(vocab, rows, prompt_len, gen, dev)
            with cudnn_attention(not no_cudnn):
                return _decode(model, ids, am, params, gen)
        return run

    ms = {
        "forward": _median_ms(lambda: forward_loop(False), sync, repeat),
        "forward + sync": _median_ms(lambda: forward_loop(True), sync, repeat),
        "decode (cpu generator)": _median_ms(decode(gen), sync, repeat),
        "decode (device generator)": _median_ms(decode(device_gen), sync, repeat),
        "decode (in blocks)": _median_ms(decode(gen, blocks), sync, repeat),
        "decode, left-padded": _median_ms(
            lambda: _decode(model, padded_ids, padded_mask, params, gen), sync, repeat),
        "decode, left-padded, new shapes": _cold_ms(new_shape(False),
                                                    new_shape_batches(batch, repeat), sync),
        "decode, new shapes, no cuDNN attention": _cold_ms(
            new_shape(True), new_shape_batches(batch, repeat, skip=repeat + 1), sync),
        "decode, rows ending": _median_ms(
            _rows_ending(model, padded_ids, padded_mask, params, gen), sync, repeat),
        "decode, static cache, rows ending": _median_ms(_rows_ending(
            model, padded_ids, padded_mask, _params(tokens, static=True), gen), sync, repeat),
        "launch": _median_ms(launches, sync, repeat),
        "sync": _median_ms(one_sync, sync, repeat * 20),
        "d2h item": _median_ms(one_item, sync, repeat * 20),
        "h2d copy": _median_ms(one_copy, sync, repeat * 20),
        "h2d pinned": _median_ms(one_pinned_copy, sync, repeat * 20),
    }
    errors = {}
    if dev.type == "cuda":  # a capture that fails loses this piece, not the others' figures
        try:
            ms[GRAPH_PIECE] = _median_ms(_rows_ending(
                model, padded_ids, padded_mask, _params(tokens, static=True, graph=True), gen),
                sync, repeat)
        except Exception as err:  # noqa: BLE001 (reported, not hidden)
            errors[GRAPH_PIECE] = f"{type(err).__name__}: {err}"
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"arch": arch, "batch": batch, "prompt_len": prompt_len, "tokens": tokens,
            "dtype": dtype, "device": where, "repeat": repeat, "sync_every": sync_every,
            "torch": torch.__version__,
            "ms_per_token": ms, "errors": errors}


# ms per decode step, beside the probe's own pieces; the fixed cost is ms per call
TRAINER_PIECES = ("trainer's actor, probe prompts", "trainer generate",
                  "trainer generate, per token", "trainer generate, rows ending",
                  "trainer generate, new shapes", "trainer generate, first after a step")
TRAINER_FIXED = "trainer generate, fixed per call"


def trainer_overrides(overrides: list[str], batch: int, tokens: int, seed: int,
                      out_dir: str) -> list[str]:
    """The probe's trainer: the user's overrides, then its batch, length and a run that
    saves nothing."""
    return [*overrides, f"ppo.batch_size={batch}", f"seed={seed}",
            f"generation.max_new_tokens={tokens}", "checkpoint.resume=never",
            "checkpoint.final=false", "checkpoint.export_hf=false", "logging.progress=false",
            "eval.prompts=null", "logging.wandb_project=null", f"logging.output_dir={out_dir}"]


def probe_trainer(overrides: list[str], batch: int, prompt_len: int, tokens: int,
                  repeat: int = 3, seed: int = 0) -> dict:
    """The trainer's own decode: its actor (a DeepSpeed engine's module) on the probe's
    prompts; ``PPOTrainer.generate`` on its workload's prompts (left-padded, every row held to
    ``tokens`` tokens by a length target), as ms per decode step and split into a cost per
    token and a fixed cost per call (from the same call at ``tokens`` and at 1 token); the
    same with the rows ending one after another through the decode (ms per forward: the
    batch shrinks as a rollout's does, which the probe's pieces never do); and the first call
    after each of ``repeat`` PPO steps (a cost that a step leaves to the next
    decode, which a median after a warm-up call would hide).

    On the first H100 run (2026-11-26) the probe's ``decode (cpu generator)`` took 16.9 ms a
    token for Qwen2.5-0.5B at batch 32, while the trainer's sequential steps took 37-48 ms a
    token of their longest response; fitted over the steps, that is about 18 ms a token plus
    about 3 s a step. This says whether the 3 s are in ``generate`` itself, and which of
    model, prompts or the step before puts them there. ``overrides`` build the trainer
    (``workload.kind=length_oracle model.builtin_arch=...``); its run directory is a
    temporary one and nothing is saved."""
    import shutil
    import tempfile

    from .config import load_config
    from .trainer import PPOTrainer

    out_dir = tempfile.mkdtemp(prefix="oppo-probe-")
    cfg = load_config(None, trainer_overrides(overrides, batch, tokens, seed, out_dir))
    trainer = PPOTrainer(cfg)
    dev = trainer.device
    sync = _sync_fn(dev)
    vocab = trainer.actor.module.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (batch, prompt_len), generator=gen).to(dev)
    mask = torch.ones_like(prompt)

    def own_model() -> int:
        with trainer.actor.generation_context() as model:
            return _decode(model, prompt, mask, _params(tokens), gen)

    prompts = [p.input_ids for p in trainer.stream.take(batch)]

    def own_generate(n: int, ending: bool = False) -> Callable[[], int]:
        # ending: row i ends after ceil((i + 1) n / batch) tokens, so the batch shrinks
        # through the decode as a real rollout's does (new shapes, rows leaving the cache)
        targets = (torch.full((batch,), n, dtype=torch.long) if not ending else
                   (torch.arange(1, batch + 1) * n + batch - 1) // batch)

        def run() -> int:
            trainer.generate(prompts, targets)
            return n
        return run

    def new_shape(rows: int) -> int:  # fresh prompts, a batch size not decoded before
        fresh = [p.input_ids for p in trainer.stream.take(rows)]
        trainer.generate(fresh, torch.full((rows,), tokens, dtype=torch.long))
        return tokens

    def first_after_a_step() -> float:
        trainer.step()
        sync()
        start = time.perf_counter()
        units = own_generate(tokens)()
        sync()
        return (time.perf_counter() - start) * 1e3 / units

    try:
        # under the attention backends the trainer's run uses (system.cudnn_attention)
        with cudnn_attention(cfg.system.cudnn_attention):
            whole = _median_ms(own_generate(tokens), sync, repeat)
            one = _median_ms(own_generate(1), sync, repeat)
            per_token = (whole * tokens - one) / (tokens - 1)
            ms = {TRAINER_PIECES[0]: _median_ms(own_model, sync, repeat),
                  TRAINER_PIECES[1]: whole, TRAINER_PIECES[2]: per_token,
                  TRAINER_PIECES[3]: _median_ms(own_generate(tokens, ending=True), sync,
                                                repeat),
                  # batch sizes past those the probe's own new-shape pieces used
                  TRAINER_PIECES[4]: _cold_ms(new_shape, new_shape_batches(
                      batch, repeat, skip=2 * (repeat + 1)), sync),
                  TRAINER_PIECES[5]: statistics.median(first_after_a_step()
                                                       for _ in range(repeat)),
                  TRAINER_FIXED: one - per_token}
    finally:
        trainer.telemetry.close()
        trainer.close()
        shutil.rmtree(out_dir, ignore_errors=True)
    return ms


def format_report(report: dict) -> str:
    lines = [f"{report['arch']} {report['dtype']} on {report['device']}: batch {report['batch']}, "
             f"prompt {report['prompt_len']}, {report['tokens']} tokens, median of "
             f"{report['repeat']} runs, blocks of {report['sync_every']} tokens (ms per decode "
             f"step; sync, launch, d2h and h2d: ms per call)"]
    base = report["ms_per_token"]["forward"]
    for name, value in report["ms_per_token"].items():
        ratio = (f"{value / base:6.2f}x forward"
                 if (name in DECODE_PIECES or name in TRAINER_PIECES or name == GRAPH_PIECE)
                 and base else "")
        lines.append(f"  {name:<38}{value:10.3f}  {ratio}")
    for name, error in report.get("errors", {}).items():
        lines.append(f"  {name:<38}  failed: {error}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oppo_ds.decode_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="qwen2.5-0.5b", choices=FROM_CONFIG_ARCHS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per run (>= 2)")
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sync-every", type=int, default=16,
                        help="generation.sync_every of the 'decode (in blocks)' piece (>= 2)")
    parser.add_argument("--json", metavar="OUT.json", help="also write the figures as JSON")
    parser.add_argument("--trainer", nargs="*", metavar="KEY=VALUE",
                        help="also time the trainer's own decode (a PPOTrainer built from these "
                             "config overrides, e.g. workload.kind=length_oracle "
                             "model.builtin_arch=qwen2.5-0.5b system.dtype=bf16), before and "
                             "after one PPO step")
    args = parser.parse_args(argv)
    if (args.tokens < 2 or args.batch < 1 or args.prompt_len < 1 or args.repeat < 1
            or args.sync_every < 2):
        parser.error("--tokens and --sync-every must be >= 2 and --batch, --prompt-len, "
                     "--repeat >= 1")
    if args.trainer is not None:  # a wrong key fails now, not after the probe's own pieces
        from .config import ConfigError, load_config

        try:
            load_config(None, trainer_overrides(args.trainer, args.batch, args.tokens, 0, "."))
        except ConfigError as err:
            parser.error(f"--trainer: {err}")
    report = probe(args.arch, args.batch, args.prompt_len, args.tokens, args.dtype, args.device,
                   args.repeat, sync_every=args.sync_every)
    if args.trainer is not None:
        report["trainer_overrides"] = list(args.trainer)
        report["ms_per_token"].update(probe_trainer(args.trainer, args.batch, args.prompt_len,
                                                    args.tokens, args.repeat))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
