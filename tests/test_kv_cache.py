"""Tier 0: the KV cache passes to and from Hugging Face models under the name the installed
transformers uses (``cache`` from 5.24, ``past_key_values`` before; the old name warns in
5.24 and goes in 5.40), and under ``past_key_values`` to our own models."""
import warnings

import pytest
import torch

from _builders import left_padded_prompts, random_lm

from oppo_ds.kv_cache import cache_kwargs, installed_name, output_cache
from oppo_ds.models import ValueHeadModel, build_value_model
from oppo_ds.rollout.generate import SamplingParams, generate
from oppo_ds.rollout.scorer import StreamingScorer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 64
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]


class KwargsWrapper(torch.nn.Module):
    """A wrapper that passes everything on (as PEFT's and our tests' wrappers do)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)


class Engine:
    """Stands in for a DeepSpeed engine: what matters is the module it wraps."""

    def __init__(self, module):
        self.module = module


def test_names_follow_the_signature_then_the_installed_transformers():
    import transformers
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm = random_lm("tiny-llama", VOCAB, seed=0)
    name = installed_name()
    assert name == ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                    else "past_key_values"), transformers.__version__
    assert cache_kwargs(lm, None) == {name: None}
    assert cache_kwargs(Engine(lm), None) == {name: None}
    assert cache_kwargs(KwargsWrapper(lm), None) == {name: None}
    value_model = build_value_model("tiny-llama", vocab_size=VOCAB, seed=0)
    assert isinstance(value_model, ValueHeadModel)
    assert cache_kwargs(value_model, None) == {"past_key_values": None}  # ours keeps the old name


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_and_streamed_scoring_pass_the_cache_without_deprecation(arch):
    """Our decode loop and streaming scorers, on HF models and our value-head models, reach
    the same cache objects they hand over and raise no deprecation warning about them."""
    actor = random_lm(arch, VOCAB, seed=1)
    value_model = build_value_model(arch, vocab_size=VOCAB, seed=0).eval()
    ids, mask = left_padded_prompts([3, 5, 2], VOCAB, pad=0)
    params = SamplingParams(max_new_tokens=6, eos_token_ids=(), pad_token_id=0, temperature=1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        gen = generate(actor, ids, mask, params, torch.Generator().manual_seed(0))
        for model, kind in ((actor, "reference"), (value_model, "reward")):
            scorer = StreamingScorer(model, kind)
            rows = torch.arange(3)
            scorer.begin(ids, mask)
            scorer.consume(rows, gen.response_ids, gen.lengths)
            assert sorted(scorer.finish(rows)) == [0, 1, 2]

        out = actor(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = output_cache(out)
        assert cache is not None and cache.get_seq_length() == ids.shape[1]
        step = value_model(ids, attention_mask=mask, use_cache=True)
        assert output_cache(step) is step.past_key_values is not None
