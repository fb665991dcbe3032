"""Models of fine-tuning as users run it, for the tests.

``FineTune``: a frozen base with a trainable adapter, a parameter forward never uses, and a
branch taken only when the piece of the batch a rank sees says so (so some ranks take it and
others do not). ``lora_llama``: PEFT LoRA on a Hugging Face Llama causal LM built from a small
config (no weights from a hub); ``lora_tied_llama`` and ``lora_gpt2`` the same over models whose
input and output embeddings are one parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, FEATURES, OUTPUTS = 16, 8, 4


class Block(nn.Module):
    """The trainable part: an adapter, and a branch used only when ``take`` is set."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.adapter = nn.Linear(width, width)
        self.branch = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, take: bool) -> torch.Tensor:
        h = h + self.adapter(h)
        if take:
            h = h + self.branch(torch.tanh(h))
        return h


class FineTune(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.base.requires_grad_(False)
        self.block = Block()
        self.unused = nn.Parameter(torch.randn(WIDTH))  # registered, never used by forward
        self.head = nn.Linear(WIDTH, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        take = bool(x[:, 0].mean() > 0)  # decided by the samples this rank (or micro-batch) holds
        return self.head(self.block(self.base(x), take))


def finetune_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(module(x), y)


def finetune_batches(steps: int = 4, n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose first feature is +1 on a leading block of samples and -1 on the rest, the
    block's length changing per step: the leading ranks' pieces take the branch, the trailing
    ones do not, and the whole batch takes it on some steps only."""
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps):
        x = torch.randn(n, FEATURES, generator=g)
        lead = (7, 3, n, 0, 9, 5)[step % 6]
        x[:, 0] = torch.where(torch.arange(n) < lead, 1.0, -1.0)
        out.append((x, torch.randn(n, OUTPUTS, generator=g)))
    return out


VOCAB, SEQ = 64, 12


def lora_llama(tie_word_embeddings: bool = False) -> nn.Module:
    """A two-layer Llama causal LM from a small config with LoRA adapters on q_proj and v_proj
    (peft freezes everything else)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                         use_cache=False, tie_word_embeddings=tie_word_embeddings)
    model = LlamaForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def lora_tied_llama() -> nn.Module:
    """``lora_llama`` with ``lm_head.weight`` the embedding's (``tie_word_embeddings=True``)."""
    return lora_llama(tie_word_embeddings=True)


def gpt2_lm() -> nn.Module:
    """A two-layer GPT-2 causal LM from a small config (``lm_head`` tied to ``wte``, dropout off)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
                                      use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def lora_gpt2() -> nn.Module:
    """A two-layer GPT-2 (``lm_head`` tied to ``wte``, dropout off so that ranks and the reference
    compute the same) with LoRA adapters on the fused attention projection ``c_attn``."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    # GPT-2's Conv1D stores (in, out): fan_in_fan_out says so to peft.
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                                            fan_in_fan_out=True))


def causal_lm_loss(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return module(input_ids=tokens, labels=tokens).loss


def token_batches(steps: int = 3, n: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n, SEQ), generator=g) for _ in range(steps)]


def padded_token_batches(steps: int = 3, n: int = 9, seed: int = 17) -> list[dict[str, torch.Tensor]]:
    """Right-padded sequences of random lengths (2..SEQ): ``labels`` are -100 where padded, so a
    rank's mean over its own tokens is not the global token mean."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (n,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return out


def llama() -> nn.Module:
    """A two-layer Llama causal LM from a small config (every parameter trains)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                        use_cache=False, tie_word_embeddings=False))


def token_sum_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair form: next-token cross-entropy summed over the labelled tokens, and their count."""
    logits = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (labels != -100).sum()


def token_mean_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The single-process reference: the same sum over the whole batch divided by its count."""
    total, count = token_sum_loss(module, batch)
    return total / count


def compiled_by_hand(model_fn: Callable[[], nn.Module], block: str) -> Callable[[], nn.Module]:
    """The reference for ``ZeroConfig(compile=...)``: ``model_fn()`` with each ``block``'s
    forward compiled, as a user would compile it in one process."""
    def build() -> nn.Module:
        module = model_fn()
        for sub in module.modules():
            if type(sub).__name__ == block:
                sub.forward = torch.compile(sub.forward)  # type: ignore[method-assign]
        return module
    return build
