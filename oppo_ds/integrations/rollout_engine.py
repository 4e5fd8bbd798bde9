"""OPPO's chunked decoder behind DeepSpeed's own rollout interface.

DeepSpeed 0.19.8 ships ``deepspeed.runtime.rollout``: a trainer asks a ``RolloutEngine`` to
``generate(RolloutRequest, SamplingConfig) -> RolloutBatch`` (left-padded prompts in; prompt +
response, right-padded, with its attention mask and where each response starts, out).
``OppoRolloutEngine`` implements it on ``rollout.streaming.stream_generate``: the actor decodes
in chunks of ``chunk_size`` tokens and every chunk streams into the scorers given (reward,
reference, critic), so the batch comes back already scored. The interface has no place for
scores, so they are kept beside it: ``last_scores`` (and ``generate_with_scores`` returns
both): ``reward`` (B',) float32, ``reference`` / ``critic`` (B', T_r) float32 over the response
columns (``input_ids[:, response_start:]``), 0 past each response's end.

Semantics as in DeepSpeed's ``HybridEngineRollout``: ``n_samples_per_prompt`` repeats each
prompt that many times (rows of a prompt adjacent), ``temperature <= 0`` is greedy,
``top_k <= 0`` is off; a response ends at the tokenizer's EOS (kept, mask 1) and is padded
with the pad id after it (mask 0); a pad token the model samples inside a response is masked
too (the streaming scorers did attend to it: a model that never emits its pad token, as
trained ones do not, gives scores equal to a whole-sequence forward under this mask).
Continuous batching (``continuous_batch_size``) is refused:
the chunked decoder already drops finished rows from its batch.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from deepspeed.runtime.rollout.base import (RolloutBatch, RolloutEngine, RolloutRequest,
                                            SamplingConfig)

from ..rollout.generate import SamplingParams, cudnn_attention
from ..rollout.scorer import StreamingScorer
from ..rollout.streaming import StreamTiming, stream_generate
from .deepspeed_chat import ValueView, _host_timed, _unwrap, _zero_stage


class OppoRolloutEngine(RolloutEngine):
    """``RolloutEngine`` on OPPO's chunked decoder with streaming scorers.

    actor: the policy (a DeepSpeed engine or an HF causal LM); tokenizer: its tokenizer
    (``pad_token_id``, else ``eos_token_id``, pads; ``eos_token_id`` ends responses).
    reward / reference / critic (optional): scorers fed chunk by chunk: value-head models
    (``oppo_ds.models.ValueHeadModel``, or DeepSpeed-Chat's ``RewardModel``) and a causal LM.
    chunk_size: tokens decoded between hand-overs; placement: ``inline`` or ``colocated``;
    static_cache, cuda_graph: the actor's decode at one shape, replayed as a CUDA graph
    (``generation.static_cache``, ``generation.cuda_graph``); cudnn_attention: let the
    rollout's attention use torch's cuDNN backend (``system.cudnn_attention``).
    """

    name = "oppo"

    def __init__(self, actor, tokenizer, *, reward=None, reference=None, critic=None,
                 chunk_size: int = 16, placement: str = "inline", seed: int = 0,
                 static_cache: bool = False, cuda_graph: bool = False,
                 cudnn_attention: bool = False):
        self.actor, self.tokenizer = actor, tokenizer
        self.static_cache, self.cuda_graph = static_cache, cuda_graph
        self.cudnn_attention = cudnn_attention
        self.models = {kind: model for kind, model in
                       (("reward", reward), ("reference", reference), ("critic", critic))
                       if model is not None}
        # DeepSpeed engines given here stop synchronizing the device before every forward
        self.host_timed = _host_timed(actor=actor, **self.models)
        self.chunk_size, self.placement = chunk_size, placement
        self.generator = torch.Generator().manual_seed(seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer must define pad_token_id or eos_token_id")
        self.last_scores: dict[str, torch.Tensor] = {}
        self.last_timing: Optional[StreamTiming] = None
        self.weights_step: Optional[int] = None

    def _scorer(self, kind: str, temperature: float) -> StreamingScorer:
        model = _unwrap(self.models[kind])
        if kind != "reference" and hasattr(model, "rwtransformer"):
            model = ValueView(model)  # DeepSpeed-Chat's RewardModel
        return StreamingScorer(model, kind, temperature=temperature)

    def _params(self, sampling: SamplingConfig) -> SamplingParams:
        if sampling.continuous_batch_size is not None:
            raise NotImplementedError("SamplingConfig.continuous_batch_size: the OPPO rollout "
                                      "engine drops finished rows by itself; leave it None")
        if sampling.n_samples_per_prompt < 1 or sampling.max_new_tokens < 1:
            raise ValueError(f"n_samples_per_prompt and max_new_tokens must be >= 1, got "
                             f"{sampling.n_samples_per_prompt} and {sampling.max_new_tokens}")
        if not 0 < sampling.top_p <= 1:  # at 0 every token, the likeliest too, would be cut
            raise ValueError(f"SamplingConfig.top_p must lie in (0, 1], got {sampling.top_p}")
        eos = self.tokenizer.eos_token_id
        return SamplingParams(max_new_tokens=sampling.max_new_tokens,
                              eos_token_ids=() if eos is None else (eos,),
                              pad_token_id=self.pad_id,
                              temperature=max(float(sampling.temperature), 0.0),
                              top_k=max(int(sampling.top_k), 0), top_p=float(sampling.top_p),
                              static_cache=self.static_cache, cuda_graph=self.cuda_graph)

    @torch.no_grad()
    def generate_with_scores(self, request: RolloutRequest, sampling: SamplingConfig):
        """(RolloutBatch, {kind: scores}) (see the module docstring)."""
        params = self._params(sampling)
        n = sampling.n_samples_per_prompt
        prompt_ids = request.prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        actor = _unwrap(self.actor)
        was_training = actor.training
        actor.eval()
        try:
            scorers = [self._scorer(kind, params.temperature if params.temperature > 0 else 1.0)
                       for kind in self.models]
            with self._gathered(), cudnn_attention(self.cudnn_attention):
                gen, scores, timing = stream_generate(actor, scorers, prompt_ids, prompt_mask,
                                                      params, self.generator, self.chunk_size,
                                                      placement=self.placement)
        finally:
            actor.train(was_training)
        prompt_len = prompt_ids.shape[1]
        response = gen.response_ids
        # as HybridEngineRollout: a generated pad token is masked unless it is the EOS
        eos = self.tokenizer.eos_token_id
        response_mask = gen.response_mask.bool() & ((response != self.pad_id) | (response == eos))
        batch = RolloutBatch(
            input_ids=torch.cat([prompt_ids, response], dim=1),
            attention_mask=torch.cat([prompt_mask.long(), response_mask.long()], dim=1),
            response_start_idx=torch.full((prompt_ids.shape[0],), prompt_len, dtype=torch.long,
                                          device=prompt_ids.device))
        self.last_scores, self.last_timing = scores, timing
        return batch, scores

    def _gathered(self):
        """The ZeRO-3 engines given (actor, scorers) whole on every rank for the call, their
        forwards free of collectives (``gathered_without_hooks``; every rank enters it). Each
        rank's responses end at their own tokens, so ranks make different numbers of forwards:
        ZeRO-3's per-forward all-gathers would not pair up (DeepSpeed's HybridEngineRollout
        decodes without EOS for this; here a rank stops where its rows end)."""
        engines = [self.actor, *self.models.values()]
        zero3 = list({id(m): m for m in engines if _zero_stage(m) == 3}.values())
        if not zero3:
            return contextlib.nullcontext()
        from ..engines.deepspeed_engine import gathered_without_hooks

        return gathered_without_hooks(zero3)

    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        return self.generate_with_scores(request, sampling)[0]

    def sync_weights(self, step: int) -> None:
        """Nothing to push: the engine decodes with the training module's own weights (the
        scorers' reference and reward are frozen; the critic is read as it is)."""
        self.weights_step = step
