"""A tiny byte-level decoder-only transformer (pre-norm GPT blocks), built from config."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BOS", "IGNORE", "TinyConfig", "TinyLM", "VOCAB", "load_checkpoint", "save_checkpoint"]

VOCAB = 257   # 256 byte values + BOS
BOS = 256
IGNORE = -100  # label of a padded / invalid target position


@dataclass(kw_only=True, slots=True)
class TinyConfig:
    vocab: int = VOCAB
    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError("d_model must be divisible by n_head")


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> float:
        """6·N + 12·L·d·T: dense-transformer training FLOPs per token (PaLM, Appendix B)."""
        n = sum(p.numel() for p in self.parameters())
        c = self.cfg
        return 6.0 * n + 12.0 * c.n_layer * c.d_model * c.seq_len


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ over valid targets of the token NLL (nats); padded targets are IGNORE."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def save_checkpoint(model: TinyLM, path: Path,
                    ema: dict[str, torch.Tensor] | nn.Module | None = None) -> None:
    """Save config and weights; ``ema`` (a running average of the weights, as a state dict
    or a module of the same architecture) is stored beside them under the key "ema"."""
    blob = {"config": asdict(model.cfg), "model": model.state_dict()}
    if ema is not None:
        blob["ema"] = ema.state_dict() if isinstance(ema, nn.Module) else dict(ema)
    torch.save(blob, path)


def load_checkpoint(path: str | Path, *, ema: bool = False) -> TinyLM | None:
    """Model factory for the evaluator: ``probewire.deploy.demo.model:load_checkpoint``.

    ``ema=True`` loads the averaged weights instead, or returns None when the checkpoint
    carries none (checkpoints written before the "ema" key existed load unchanged).
    """
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if ema and "ema" not in blob:
        return None
    model = TinyLM(TinyConfig(**blob["config"]))
    model.load_state_dict(blob["ema" if ema else "model"])
    return model.eval()


