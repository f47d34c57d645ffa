"""A user's own model for `vsim record` / the measuring suite, given as MODULE:CALLABLE
(validation.user_models.qwen2_small:build): a Qwen2.5-0.5B-shaped decoder (24 layers, d 896,
14 heads, 2 KV heads, MLP 4864, vocab 151936, tied embedding; random weights, no download),
next-token loss on random ids at sequence 1024. Written as a user would, without vsim's own
Hugging Face helpers: it checks the MODULE:CALLABLE path on a model no fit has seen.
"""

from __future__ import annotations

import torch
from torch import nn

SEQ = 1024


class NextTokenLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, output: object, target: torch.Tensor) -> torch.Tensor:
        logits = output.logits  # type: ignore[attr-defined]
        return self.ce(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], nn.Module]:
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, config.vocab_size, (batch, SEQ + 1))
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), NextTokenLoss()
