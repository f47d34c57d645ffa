"""Hugging Face transformers by name, without downloads: a config written here, random weights
(seed 0), random token ids. transformers is an optional extra (`pip install 'vsim[hf]'`).

The step is a language-model loss computed outside the model (so its ops form the `loss` layer,
as for the zoo's own models): GPT-2 and the Llama-style decoder predict the next token (inputs
ids[:, :-1], targets ids[:, 1:]); BERT's masked-LM head is scored on every position against
random targets (no masking: the same tensors and ops at every position). Dropout as each config
has it (GPT-2 and BERT 0.1, Llama none), `use_cache=False`, attention through PyTorch's
scaled_dot_product_attention (`attn_implementation="sdpa"`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

# name -> (description, default sequence length)
HF_MODELS: dict[str, tuple[str, int]] = {
    "gpt2": ("Hugging Face GPT-2 small (124 M): 12 layers, d 768, 12 heads, causal LM", 1024),
    "gpt2-medium": ("Hugging Face GPT-2 medium (355 M): 24 layers, d 1024, 16 heads, causal LM",
                    1024),
    "llama-1b-8l": ("Llama-3.2-1B-shaped decoder cut to 8 of its 16 layers (d 2048, 32 heads, "
                    "8 KV heads, MLP 8192, vocab 128256, tied embedding; 0.75 B parameters), "
                    "causal LM", 1024),
    "gpt2-tiny": ("GPT-2 cut to 2 layers, d 64, 2 heads, vocab 1000 (for tests)", 32),
    "bert-base": ("Hugging Face BERT-base (110 M): 12 layers, d 768, masked-LM head scored on "
                  "every position", 512),
}


def is_hf(name: str) -> bool:
    return name in HF_MODELS


def default_seq(name: str) -> int:
    return HF_MODELS[name][1]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face models need transformers: pip install 'vsim[hf]'") \
            from None
    return transformers


def hf_config(name: str, seq: int) -> Any:
    """The transformers config of `name`, with room for `seq` positions (GPT-2's and BERT's
    learned position tables grow past their published 1024 and 512 when `seq` asks for it)."""
    tf = _transformers()
    if name in ("gpt2", "gpt2-medium"):
        size = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16)}[name]
        return tf.GPT2Config(n_layer=size[0], n_embd=size[1], n_head=size[2],
                             n_positions=max(1024, seq), use_cache=False)
    if name == "gpt2-tiny":
        return tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000,
                             n_positions=max(32, seq), bos_token_id=0, eos_token_id=0,
                             use_cache=False)
    if name == "llama-1b-8l":
        return tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                              num_hidden_layers=8, num_attention_heads=32,
                              num_key_value_heads=8, max_position_embeddings=max(131072, seq),
                              rms_norm_eps=1e-5, tie_word_embeddings=True, use_cache=False)
    if name == "bert-base":
        return tf.BertConfig(max_position_embeddings=max(512, seq), use_cache=False)
    raise ConfigError(f"unknown Hugging Face model {name!r}; known: {', '.join(HF_MODELS)}")


def _from_config(auto: Any, config: Any) -> nn.Module:
    try:
        return auto.from_config(config, attn_implementation="sdpa")  # type: ignore[no-any-return]
    except TypeError:  # transformers before 4.36: sdpa is picked by default when available
        return auto.from_config(config)  # type: ignore[no-any-return]


class LogitsLoss(nn.Module):
    """Cross-entropy of a Hugging Face output's (batch, seq, vocab) logits against (batch, seq)
    token targets."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output[0]
        return self.ce(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build_hf(name: str, batch: int, seq: int | None, device: Any,
             tokens: Callable[[int, int, int, Any], tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[nn.Module, tuple[Any, Any], nn.Module]:
    """(model, (input ids, target ids), loss) for `name` at `batch` x `seq` tokens."""
    seq = default_seq(name) if seq is None else seq
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 2:
        raise ConfigError(f"sequence length must be an integer of at least 2, got {seq!r}")
    tf = _transformers()
    config = hf_config(name, seq)
    auto = tf.AutoModelForMaskedLM if name == "bert-base" else tf.AutoModelForCausalLM
    model = _from_config(auto, config)
    return model, tokens(batch, seq, config.vocab_size, device), LogitsLoss()


@contextlib.contextmanager
def meta_safe() -> Iterator[None]:
    """For synthesis on the meta device: transformers' check for packed sequences (position ids
    that restart inside a row) reads tensor values, which meta tensors have none of; it is
    answered as a real step with these inputs answers it: no packed sequences."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda *_a, **_k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
