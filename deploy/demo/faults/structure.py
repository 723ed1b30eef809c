"""Faults of the demo model's optional structures: experts, media, the residual stream
(each documents its measured signature; the registry is ``training.FAULTS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from probewire.stream.series import StepMetrics as SM

from ..model import TinyConfig
from .base import Fault, FaultError, _core

__all__ = ["Bf16Swallow", "IgnoredMedia", "RoutingCollapse"]


@dataclass(kw_only=True)
class RoutingCollapse(Fault):
    """From ``step`` on, one MoE layer's router is pushed onto its first ``experts``
    experts: their selection bias is set to ``bias`` every step (the router's logits, and
    so its mixing weights and the load-balancing loss, are untouched; only which experts are
    chosen changes, as a runaway bias-balancing update would do).

    Signature (measured, --preset moe, window 50, fault at 120): with top-2 of 8 experts
    every token picks the pushed experts and MaxVio = max load / mean load - 1 goes from
    0.35-1.6 on healthy steps (p99 1.29) to exactly 3.0 at ``step``; `moe_maxvio` pages
    two steps later (122), for ``layer {layer}``: the rule wants MaxVio > 2 on 3
    consecutive steps (with > 1 a healthy 1,000-step moe run paged 4 times); so does
    `moe_h_norm`, the routing entropy's drop (issue 38), at 122. Nothing else pages.
    explain's expert-balance stage names expert 0 of ``layer {layer}`` (moe_maxvio moved,
    onset ``step``)."""

    name: ClassVar[str] = "routing-collapse"
    signal: ClassVar[str] = SM.moe_maxvio
    culprit: ClassVar[str] = "layer"
    explain_stage: ClassVar[str] = "expert balance"
    explain_signal: ClassVar[str | None] = SM.moe_maxvio
    also_pages: ClassVar[tuple[str, ...]] = (SM.moe_h_norm,)
    within: ClassVar[int] = 2
    presets: ClassVar[tuple[str, ...]] = ("moe", "full")
    layer: int = 1
    experts: int = 2
    bias: float = 10.0

    def expected_culprit(self) -> str:
        return f"layer {self.layer}"

    def explain_culprit(self) -> str:
        return f"of layer {self.layer}"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step >= self.step:
            _core(model).blocks[self.layer].mlp.router.expert_bias[: self.experts] = self.bias

    def check_preset(self, preset: str) -> None:
        super().check_preset(preset)
        cfg = TinyConfig.preset(preset)
        if not 0 <= self.layer < cfg.n_layer or not 1 <= self.experts < cfg.n_experts:
            raise FaultError(
                f"routing-collapse: layer must be in 0..{cfg.n_layer - 1} and "
                f"experts in 1..{cfg.n_experts - 1} for --preset {preset}"
            )


@dataclass(kw_only=True)
class IgnoredMedia(Fault):
    """At ``step`` the media projector's weights and bias are multiplied by ``scale``: the
    media tokens enter the backbone ~1/scale times smaller than the text embeddings, so
    attention can no longer tell an image from the noise floor.

    Signature (measured, --preset media, --p1-every 10, window 50, fault at 120):
    `media_scale` (γ = RMS of the media tokens / RMS of the text embeddings, P0 at the
    structure probes' cadence) pages at the first probe step at or after ``step`` (120:
    γ 9.9 -> 0.01, threshold 0.1; the trained projector runs ~10x the text scale, so the
    old default scale 0.01 only reached 0.098) with culprit ``media projector``. Nothing
    else pages.
    explain's layers stage reports media_scale moved (scored as 1/γ), naming the media
    projector."""

    name: ClassVar[str] = "ignored-media"
    signal: ClassVar[str] = SM.media_scale
    culprit: ClassVar[str] = "media projector"
    explain_stage: ClassVar[str] = "layers"
    explain_signal: ClassVar[str | None] = SM.media_scale
    demo_args: ClassVar[tuple[str, ...]] = ("--p1-every", "10")
    presets: ClassVar[tuple[str, ...]] = ("media", "full")
    scale: float = 0.001

    def expected_culprit(self) -> str:
        return "media projector"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step == self.step:
            proj = _core(model).projector.proj
            with torch.no_grad():
                proj.weight.mul_(self.scale)
                proj.bias.mul_(self.scale)


@dataclass(kw_only=True)
class Bf16Swallow(Fault):
    """At ``step`` the token and position embeddings are multiplied by ``scale``: the
    residual stream grows ~scale times while every branch (behind its LayerNorm) keeps its
    size, so a bfloat16 residual add s + b rounds most of each branch's update away.

    Signature (measured, window 50, --p1-every 10, fault at 120): `residual_scale` pages
    at the first residual-probe step at or after ``step`` (120): the smallest token-mean
    relative branch scale R_b = ‖b‖ / ‖s‖ falls from 0.12 (layer 1 mlp) to 6e-4 (layer 0
    attn), under bfloat16's relative precision 2^-8 (the threshold). The culprit is the
    weakest branch (``layer L attn|mlp``). The blocks' share of the output collapses with
    it: L 2.74 -> 3.93 and G2 x2, which did not reach the co-spike rule in the measured run
    but may (`cospike` at ``step`` is part of the signature). explain's layers stage
    names the cause: the residual stream grew (N_s 12.9 -> 550 at the weakest branch)
    while the branch did not shrink."""

    name: ClassVar[str] = "bf16-swallow"
    signal: ClassVar[str] = "residual_scale"
    culprit: ClassVar[str] = "residual stream"
    also_pages: ClassVar[tuple[str, ...]] = (SM.cospike,)
    explain_stage: ClassVar[str] = "layers"
    explain_signal: ClassVar[str | None] = SM.residual_ratio_min
    demo_args: ClassVar[tuple[str, ...]] = ("--p1-every", "10")
    scale: float = 1000.0

    def expected_culprit(self) -> str:
        return "layer "

    def explain_culprit(self) -> str:
        return "stream grew"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step == self.step:
            core = _core(model)
            with torch.no_grad():
                core.embed.weight.mul_(self.scale)
                core.pos.weight.mul_(self.scale)
