"""Small reference models for examples, tests and benchmarks (importable on every actor)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zero_ray.errors import ConfigError


def mlp(width: int = 1024, depth: int = 8, *, bias: bool = True) -> nn.Sequential:
    """``depth`` x (Linear(width, width), ReLU): the benchmark model of the issues."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers)


def mse_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of ``module(x)`` against ``y`` for a batch ``(x, y)``."""
    x, y = batch
    return F.mse_loss(module(x), y)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A small GPT-2-style decoder."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final norm and an LM head whose
    weight is tied to the token embedding by default (a parameter used twice)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        # Re-initialise after construction, as GPT-2 implementations do (post_init style).
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a batch of token windows ``(B, T+1)``."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def lm_loss_sum(module: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pair form of ``lm_loss``: cross entropy summed over the predicted tokens, and their
    number (the trainer divides by the count over every rank: the exact token mean)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    return total, targets.numel()
