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
