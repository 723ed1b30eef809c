"""A tiny byte-level decoder-only transformer (pre-norm GPT blocks), built from config.

The default ``TinyConfig()`` is the plain dense model. Optional structures, each behind a
config flag whose default leaves the model (parameters, initialisation, outputs) unchanged,
give the model-structure probes something to measure:

* ``n_experts > 0``: every feed-forward is a mixture of experts with a learned top-k
  router (``blocks.N.mlp.router``; its ``expert_bias`` buffer shifts selection only) and
  experts ``blocks.N.mlp.experts.E``. Balancing, in training mode, from each forward's load
  (padding positions included: they cost expert compute): ``aux_loss_weight`` attaches a
  Switch-style load-balancing loss to the backward (the loop adds nothing), ``balance_rate``
  moves the selection bias auxiliary-loss-free style. Without either, the tiny router
  collapses onto one expert within ~20 steps.
* ``gated_branches``: each residual branch ends in a learned per-channel gate
  σ(g/T) (``blocks.N.{attn,mlp}.branch_gate``).
* ``attn_gate``: gated attention, sigmoid gate scores on the attention core output
  (``blocks.N.attn.gate_score``) before the output projection.
* ``media_tiles > 0``: a media path. Each row carries up to ``media_tiles`` procedurally
  rendered images; a small patch encoder (``encoder``) and a projector (``projector``)
  turn them into media tokens that are prepended to the byte sequence. Absent images
  are masked out of attention. The logits cover the text positions only, so
  ``model(tokens)`` and ``model(tokens, media=...)`` both return ``[B, T, V]``.
* ``mtp_depth > 0``: multi-token prediction heads ``mtp.K`` (depth K+1 predicts the
  token K+1 places after the main head's target), trained through ``return_mtp=True``.

``TinyConfig.preset(name)`` names the combinations: tiny, moe, media, full.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BOS",
    "IGNORE",
    "PRESETS",
    "TinyConfig",
    "TinyLM",
    "VOCAB",
    "flops_per_token",
    "load_checkpoint",
    "mtp_targets",
    "save_checkpoint",
]

VOCAB = 257  # 256 byte values + BOS
BOS = 256
IGNORE = -100  # label of a padded / invalid target position

PRESETS = ("tiny", "moe", "media", "full")


@dataclass(kw_only=True, slots=True)
class TinyConfig:
    vocab: int = VOCAB
    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_experts: int = 0
    """0: dense feed-forward; E > 0: mixture of E experts per block."""
    top_k: int = 2
    """Experts per token (with ``n_experts``)."""
    balance_rate: float = 0.0
    """Auxiliary-loss-free balancing: in training mode each MoE forward moves every expert's
    selection bias by ±rate toward the mean load (0: off)."""
    aux_loss_weight: float = 0.0
    """Switch-style load-balancing loss α·E·Σ_i f_i·P_i, attached to the MoE output's
    backward so the training loop needs no change (0: off; the presets use 0.01)."""
    gated_branches: bool = False
    gate_temperature: float = 1.0
    gate_init: float = 3.0
    """Initial gate logit g: σ(3) ≈ 0.95, gates start open."""
    attn_gate: bool = False
    media_tiles: int = 0
    """0: text only; N > 0: up to N images per row, each ``(image_size/patch)²`` tokens."""
    image_size: int = 16
    patch: int = 8
    encoder_dim: int = 32
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError("d_model must be divisible by n_head")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k < self.n_experts):
            raise ValueError("n_experts must be >= 0 and 1 <= top_k < n_experts")
        if self.balance_rate < 0 or self.aux_loss_weight < 0:
            raise ValueError("balance_rate and aux_loss_weight must be >= 0")
        if self.gate_temperature <= 0:
            raise ValueError("gate_temperature must be > 0")
        if self.media_tiles < 0 or self.mtp_depth < 0:
            raise ValueError("media_tiles and mtp_depth must be >= 0")
        if self.media_tiles and (self.image_size < 16 or self.image_size % self.patch):
            raise ValueError("image_size must be >= 16 and divisible by patch")

    @property
    def media_tokens_per_image(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def media_slots(self) -> int:
        """Media token positions prepended to every row when media is given."""
        return self.media_tiles * self.media_tokens_per_image

    @classmethod
    def preset(cls, name: str, **overrides: object) -> TinyConfig:
        """tiny: the dense model; moe: 8 experts, top-2, bias balancing; media: 2 images per
        row; full: all of them plus gated branches, gated attention and one MTP head."""
        presets: dict[str, dict[str, object]] = {
            "tiny": {},
            "moe": {"n_experts": 8, "top_k": 2, "aux_loss_weight": 0.01, "balance_rate": 0.05},
            "media": {"media_tiles": 2},
            "full": {
                "n_experts": 8,
                "top_k": 2,
                "aux_loss_weight": 0.01,
                "balance_rate": 0.05,
                "media_tiles": 2,
                "gated_branches": True,
                "attn_gate": True,
                "mtp_depth": 1,
            },
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**presets[name], **overrides})


class BranchGate(nn.Module):
    """y = x · σ(g/T) per channel: a learned residual-branch gate (seeds 001 §8)."""

    def __init__(self, d: int, temperature: float, init: float) -> None:
        super().__init__()
        self.temperature = temperature
        self.logit = nn.Parameter(torch.full((d,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.logit / self.temperature)


class GateScore(nn.Module):
    """Gated attention: elementwise sigmoid scores σ(x W_g) on the attention core output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        if cfg.attn_gate:
            self.gate_score = GateScore(cfg.d_model)
        if cfg.gated_branches:
            self.branch_gate = BranchGate(cfg.d_model, cfg.gate_temperature, cfg.gate_init)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        y = y.transpose(1, 2).reshape(b, t, d)
        if hasattr(self, "gate_score"):
            y = y * self.gate_score(x)
        y = self.proj(y)
        return self.branch_gate(y) if hasattr(self, "branch_gate") else y


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig, gated: bool | None = None) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)
        if cfg.gated_branches if gated is None else gated:
            self.branch_gate = BranchGate(cfg.d_model, cfg.gate_temperature, cfg.gate_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(F.gelu(self.up(x)))
        return self.branch_gate(y) if hasattr(self, "branch_gate") else y


class Router(nn.Module):
    """Learned top-k router. Returns (logits [N, E], weights [N, k], expert ids [N, k]).

    Selection ranks ``logits + expert_bias``; the weights are the softmax of the chosen
    experts' logits (the bias shifts which experts are chosen, not how they are mixed)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        ids = (logits.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        return logits, torch.softmax(logits.gather(-1, ids), dim=-1), ids


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``y``; in backward, ``aux`` receives gradient 1, so its gradient joins the
    loss's without the loop adding it (Megatron's MoEAuxLossAutoScaler pattern)."""

    @staticmethod
    def forward(ctx, y, aux):  # type: ignore[override]
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


class MoE(nn.Module):
    """Top-k mixture of dense-MLP experts (every expert runs on the tokens routed to it)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.balance_rate = cfg.balance_rate
        self.aux_loss_weight = cfg.aux_loss_weight
        self.router = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg, gated=False) for _ in range(cfg.n_experts))
        if cfg.gated_branches:
            self.branch_gate = BranchGate(cfg.d_model, cfg.gate_temperature, cfg.gate_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, ids = self.router(flat)
        n_experts = len(self.experts)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        if self.training and (self.balance_rate > 0 or self.aux_loss_weight > 0):
            # every position counts: padding costs expert compute too
            load = torch.bincount(ids.reshape(-1), minlength=n_experts).float()
            if self.balance_rate > 0:
                with torch.no_grad():
                    self.router.expert_bias += self.balance_rate * torch.sign(load.mean() - load)
            if self.aux_loss_weight > 0 and out.requires_grad:
                share = load / load.sum()  # f_i (no gradient)
                prob = torch.softmax(logits.float(), dim=-1).mean(0)  # P_i
                aux = self.aux_loss_weight * n_experts * (share * prob).sum()
                out = _AttachAuxLoss.apply(out, aux)
        y = out.view_as(x)
        return self.branch_gate(y) if hasattr(self, "branch_gate") else y


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), attn_mask)
        return x + self.mlp(self.ln_mlp(x))


class MediaEncoder(nn.Module):
    """Images [B, N, S, S] -> patch features [B, N·P, encoder_dim] (P patches per image)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.patch = cfg.patch
        self.embed = nn.Linear(cfg.patch * cfg.patch, cfg.encoder_dim)
        self.mix = nn.Linear(cfg.encoder_dim, cfg.encoder_dim)
        self.norm = nn.LayerNorm(cfg.encoder_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, n, s, _ = images.shape
        p = self.patch
        patches = images.reshape(b, n, s // p, p, s // p, p).permute(0, 1, 2, 4, 3, 5)
        h = F.gelu(self.embed(patches.reshape(b, n * (s // p) ** 2, p * p)))
        return self.norm(h + self.mix(h))


class MediaProjector(nn.Module):
    """Encoder features -> backbone width; ``token_mask`` [B, M] zeroes absent media tokens.

    The model-structure probes read the mask from this call's second argument."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.encoder_dim, cfg.d_model)

    def forward(
        self, features: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = self.proj(features)
        return y if token_mask is None else y * token_mask.unsqueeze(-1).to(y.dtype)


class MTPHead(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.mix = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h + self.mix(self.ln(h)))


class TinyLM(nn.Module):
    bos_id = BOS

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.media_tiles:
            self.encoder = MediaEncoder(cfg)
            self.projector = MediaProjector(cfg)
            self.media_pos = nn.Embedding(cfg.media_slots, cfg.d_model)
        if cfg.mtp_depth:
            self.mtp = nn.ModuleList(MTPHead(cfg) for _ in range(cfg.mtp_depth))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)  # matrices only: gate logits keep gate_init
        if cfg.media_tiles:  # media tokens enter at the text embeddings' scale: γ ≈ 1 at init
            nn.init.normal_(self.projector.proj.weight, std=0.02 / cfg.encoder_dim**0.5)
            nn.init.zeros_(self.projector.proj.bias)

    def forward(
        self,
        tokens: torch.Tensor,
        media: torch.Tensor | None = None,
        media_mask: torch.Tensor | None = None,
        *,
        return_mtp: bool = False,
    ):
        """Logits [B, T, V] for ``tokens`` [B, T]; with ``media`` [B, N, S, S] (N ≤
        ``media_tiles``; ``media_mask`` [B, N] marks the images present) the media tokens are
        prepended. ``return_mtp``: also the MTP logits, one [B, T, V] per depth."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        attn_mask, n_media = None, 0
        if media is not None and self.cfg.media_tiles:
            x, attn_mask, n_media = self._prepend_media(x, media, media_mask)
        for block in self.blocks:
            x = block(x, attn_mask) if attn_mask is not None else block(x)
        h = self.ln_f(x)[:, n_media:]
        logits = self.head(h)
        if not return_mtp:
            return logits
        return logits, [head(h) for head in getattr(self, "mtp", ())]

    def _prepend_media(
        self, x: torch.Tensor, media: torch.Tensor, media_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        b, n = media.shape[:2]
        if n > self.cfg.media_tiles:
            raise ValueError(f"{n} images per row; the model takes at most {self.cfg.media_tiles}")
        per = self.cfg.media_tokens_per_image
        present = (
            media_mask
            if media_mask is not None
            else torch.ones(b, n, dtype=torch.bool, device=media.device)
        )
        token_mask = present.repeat_interleave(per, dim=1)  # [B, M]
        m = token_mask.shape[1]
        media_x = self.projector(self.encoder(media.to(x.dtype)), token_mask)
        media_x = media_x + self.media_pos(torch.arange(m, device=x.device))
        length = m + x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        keys = torch.cat(
            [token_mask, torch.ones(b, x.shape[1], dtype=torch.bool, device=x.device)], dim=1
        )
        allowed = causal & (keys[:, None, :] | torch.eye(length, dtype=torch.bool, device=x.device))
        return torch.cat([media_x, x], dim=1), allowed[:, None], m

    def flops_per_token(self) -> float:
        """6·N + 12·L·d·T: dense-transformer training FLOPs per token (PaLM, Appendix B)."""
        return flops_per_token(self)


def flops_per_token(model: TinyLM) -> float:
    """6·N + 12·L·d·T with N all parameters (every expert counted: a fixed estimator; an
    MoE's active parameters per token are fewer)."""
    n = sum(p.numel() for p in model.parameters())
    c = model.cfg
    return 6.0 * n + 12.0 * c.n_layer * c.d_model * c.seq_len


def mtp_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """Targets of MTP depth ``depth`` (≥ 1): position t predicts the main target of t+depth."""
    out = torch.full_like(targets, IGNORE)
    out[:, : targets.shape[1] - depth] = targets[:, depth:]
    return out


def save_checkpoint(
    model: TinyLM, path: Path, ema: dict[str, torch.Tensor] | nn.Module | None = None
) -> None:
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
