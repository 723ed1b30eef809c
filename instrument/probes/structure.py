"""The model-structure probes of one rank: experts, residual paths, modality, MTP, the BOS
value gradient and 002's per-module views, hooked at attach on the points ``discover``
found (each probe's math, layout and decoder live in its own module here).

The hooks that only scan-tier and demand-tier probes use are installed for steps where
one of those tiers is due (the root pre-hook arms them), unless ``persistent`` keeps them
installed (torch.compile guards recompile when hooks come and go). Every hook's first line
reads the step's due tiers and returns on a step that does not measure it (001 §12).
Statistics are per valid token: the step's ``micro_batch`` mask, else the model call's
``attention_mask``; padding never enters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..catalog import Tier
from ..discover import Structure, discover
from ..registry import Registry
from ..state import StepState
from ..structure_config import StructureConfig
from .attention import value_hook
from .common import recomputing
from .experts import COUNTS_TIER, expert_placement, finish_margins, router_hook
from .layout import StructureState
from .modality import TOKENS_TIER, EncoderShare, embedding_hook, projector_hook
from .modules import ModuleGrads, activation_hook
from .mtp import main_logits_hook, mtp_hook
from .residual import block_hook, branch_hook, finish_residual, gate_hook

__all__ = ["StructureProbes", "attach_structure"]


def attach_structure(
    state: StepState,
    model: nn.Module,
    registry: Registry,
    config: StructureConfig,
    *,
    logits_module: str,
    persistent: bool,
) -> StructureProbes | None:
    """Discover ``model``'s structure points and hook them; None when the config is off or
    the model has no block, router, projector or MTP head to measure."""
    if not config.enabled:
        return None
    structure = discover(model, config, logits_module)
    if not (
        structure.blocks
        or structure.routers
        or structure.projector is not None
        or structure.mtp_heads
    ):
        return None
    return StructureProbes(
        state, model, structure, registry, config.gate_thresholds, persistent=persistent
    )


class StructureProbes:
    """Hooks and step-end work of the structure probes (see the module docstring); a probe
    set of the monitor (``step.ProbeSet``)."""

    def __init__(
        self,
        state: StepState,
        model: nn.Module,
        structure: Structure,
        registry: Registry,
        thresholds: tuple[float, ...],
        *,
        persistent: bool,
    ) -> None:
        self.structure = structure
        self._state = state
        self._ctx = StructureState()
        owned = self._owned = {id(i.param) for i in registry.params if i.owned}
        encoder = [p for p in structure.encoder_params if id(p) in owned]
        encoder_ids = {id(p) for p in encoder}
        others = [i.param for i in registry.params if i.owned and id(i.param) not in encoder_ids]
        self._encoder = EncoderShare(encoder, others)
        self._modules = ModuleGrads([v for v in structure.params if id(v.param) in owned])
        self._persistent = persistent
        self.handles: list[Any] = []
        self._armed: list[Any] = []
        self._install(model, thresholds)

    # ------------------------------------------------------------------ install
    def _install(self, model: nn.Module, thresholds: tuple[float, ...]) -> None:
        """Every-step hooks (root, routers, embedding, projector) stay installed; the rest
        are built now and installed for steps that measure them (the root hook arms them)."""
        s, state, ctx = self.structure, self._state, self._ctx
        add = self.handles.append
        add(model.register_forward_pre_hook(self._root_hook, with_kwargs=True))
        modules = dict(model.named_modules())
        for router in s.routers:
            moe = modules.get(router.name.rpartition(".")[0])
            shards = expert_placement(moe, router.n_experts)
            add(router.module.register_forward_hook(router_hook(state, ctx, router, shards)))
        if s.projector is not None:
            add(s.projector.register_forward_hook(projector_hook(state, ctx), with_kwargs=True))
            if s.embedding is not None:
                add(s.embedding.register_forward_hook(embedding_hook(state, ctx)))
        sampled: list[tuple[Callable, Callable, dict]] = []
        for block in s.blocks:
            sampled.append(
                (
                    block.module.register_forward_pre_hook,
                    block_hook(state, ctx, block.layer),
                    {"with_kwargs": True},
                )
            )
            if block.attn is not None:
                sampled.append(
                    (
                        block.attn.register_forward_hook,
                        branch_hook(state, ctx, block.layer, "attn", keep=block.mlp is not None),
                        {},
                    )
                )
            if block.mlp is not None:
                sampled.append(
                    (
                        block.mlp.register_forward_hook,
                        branch_hook(state, ctx, block.layer, "mlp", keep=False),
                        {},
                    )
                )
        for gate in s.gates:  # a gate is a parameter: its owner reports it
            if id(gate.logits) not in self._owned:
                continue
            sampled.append(
                (gate.module.register_forward_hook, gate_hook(state, ctx, gate, thresholds), {})
            )
        if s.bos_id is not None:
            for value in s.values:
                sampled.append(
                    (
                        value.module.register_forward_hook,
                        value_hook(state, ctx, value, s.bos_id),
                        {},
                    )
                )
        for view in s.activations:
            register = (
                view.module.register_forward_pre_hook
                if view.pre
                else view.module.register_forward_hook
            )
            sampled.append((register, activation_hook(state, ctx, view), {}))
        if s.mtp_heads and s.logits is not None:
            sampled.append((s.logits.register_forward_hook, main_logits_hook(state, ctx), {}))
            for depth, _, module in s.mtp_heads:
                sampled.append((module.register_forward_hook, mtp_hook(state, ctx, depth), {}))
        self._sampled_hooks = sampled
        self._every_step = (
            (COUNTS_TIER if s.routers else None),
            (TOKENS_TIER if s.projector is not None else None),
        )
        if self._persistent:
            self.handles += [register(hook, **kw) for register, hook, kw in sampled]

    def _arm(self, on: bool) -> None:
        if on and not self._armed:
            self._armed = [register(hook, **kw) for register, hook, kw in self._sampled_hooks]
        elif not on and self._armed:
            for handle in self._armed:
                handle.remove()
            self._armed = []

    # ------------------------------------------------------------------ model call
    def _root_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        state = self._state
        sampled = state.due[Tier.SCAN] or state.due[Tier.DEMAND]
        if not self._persistent and bool(self._armed) != sampled:
            self._arm(sampled)
        every_step = any(tier is not None and state.due[tier] for tier in self._every_step)
        if not (sampled or every_step) or recomputing():
            return None
        self._ctx.sync(state)
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("tokens"))
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            ids = None
        self._ctx.new_forward(state, ids, kwargs.get("attention_mask"))
        return None

    # ------------------------------------------------------------------ step calls
    def on_gradients(self, state: StepState, inv_scale: Any) -> None:
        """At the gradient point (accumulated, before clipping), once per step: S_enc and
        the per-module gradient views; ``inv_scale`` removes a loss scale."""
        if not (state.due[Tier.SCAN] or state.due[Tier.DEMAND]):
            return None
        self._ctx.sync(state)
        if self._ctx.grads_done:
            return None
        self._ctx.grads_done = True
        self._encoder.record(state, inv_scale)
        self._modules.record(state, inv_scale)
        return None

    def finish(self, state: StepState) -> None:
        """Before the step is sealed: the per-token blocks over all micro-batches."""
        ctx = self._ctx
        if ctx.current(state):
            finish_residual(state, ctx)
            finish_margins(state, ctx)
        ctx.new_step(None)
        ctx.streams, ctx.main_logits = {}, None

    def remove(self) -> None:
        self._arm(False)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
