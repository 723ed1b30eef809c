"""Model-structure probes: experts, residual paths, modality, MTP, BOS value gradient, and
002's per-module views, hooked at attach time on the points ``discover`` found.

Every hook's first line checks the monitor's priority flag and returns on a step whose
probe is not sampled, before touching a tensor (001 §12). Statistics are per valid token
(the step's ``micro_batch`` mask, else the model call's ``attention_mask``); padding never
enters, and tokens are never flattened together with features. Device work produces small
vectors added to the step's collector (``collect.StepCollector``), so they travel in the
monitor's one device-to-host copy; the decoders (``structure_decode``) turn them into
catalog points on the emitter thread, and a component with no valid token yields no point
(never a zero).

Per-token quantiles (residual paths, top-k margins) need every token of the step: the
per-token values of each micro-batch are kept on the device (24 bytes per valid position
and residual branch, 8 per MoE layer, on sampled steps only) and reduced once, in
``finish``, when the monitor seals the step. p90/p99 are rank-local, by the "higher" rule
(``token_quantiles(method="higher")``), and the stream reduces them with a maximum over
ranks, an upper bound of the global quantile (``quantile_bound``).

Sequence layout. With a media projector, the backbone sequence is [media tokens | text
tokens]: the projector's token mask [B, M] (its second argument) and the text mask [B, T]
are concatenated for activations of length M + T. Activations whose leading shape matches
neither layout are measured over every position.

Activation checkpointing: a forward hook that fires inside backward is a recomputation
and measures nothing (as ``hooks.forward_hook``); the BOS value-gradient hook is placed in
the recomputation when the original forward had no graph (reentrant checkpointing).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from .discover import GatePoint, ModuleView, RouterPoint, Structure, ValuePoint, discover
from .hooks import first_tensor
from .structure import (TokenField, encoder_grad_share_components, expert_bias_abs_sum,
                        expert_token_counts, gate_saturation, media_scale_components,
                        mtp_top1_agreement, residual_token_values, token_quantiles, topk_margin)
from .structure_config import StructureConfig
from .structure_decode import (RESIDUAL_STATS, decode_encoder_grad, decode_experts, decode_gates,
                               decode_margin, decode_media_scale, decode_module_acts,
                               decode_module_grads, decode_mtp, decode_residual,
                               decode_router_bias, decode_tokens, decode_value_grad)

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["RESIDUAL_STATS", "StructureProbes", "attach_structure", "quantile_bound"]

F64 = torch.float64
_graph_task_id = torch._C._current_graph_task_id


def quantile_bound(per_rank: list[float]) -> float:
    """The stream's cross-rank value of a per-rank token quantile: the maximum.

    Rank r sends Q_r, the order statistic at index ⌈q·(n_r − 1)⌉ of its n_r tokens, so at
    least ⌈q·(n_r − 1)⌉ + 1 ≥ q·n_r of them are ≤ Q_r. With Q = max_r Q_r, at least
    Σ_r(⌈q(n_r − 1)⌉ + 1) ≥ q·(N − 1) + 1 of all N tokens are ≤ Q, so the global
    q-quantile (by the same rule, or interpolated, which is never larger) is ≤ Q. Exact with
    one rank; rank-local *interpolated* quantiles would not bound it (ranks {0, 10} and
    {0, 10} at q = 0.9: 9 each, global 10)."""
    return max(per_rank)


def attach_structure(monitor: "Monitor", model: nn.Module, config: StructureConfig
                     ) -> "StructureProbes | None":
    """Discover ``model``'s structure points and hook them for ``monitor``; None when the
    config is off or the model has no block, router, projector or MTP head to measure."""
    if not config.enabled:
        return None
    structure = discover(model, config, monitor.config.logits_module)
    if not (structure.blocks or structure.routers or structure.projector is not None
            or structure.mtp_heads):
        return None
    return StructureProbes(monitor, model, structure, thresholds=config.gate_thresholds)


def _recompute() -> bool:
    return _graph_task_id() != -1


class StructureProbes:
    """The structure probes of one monitor (built by ``Monitor`` when enabled)."""

    def __init__(self, monitor: "Monitor", model: nn.Module, structure: Structure, *,
                 thresholds: tuple[float, ...]) -> None:
        self._m = monitor
        self.structure = structure
        self._thresholds = thresholds
        owned = {id(i.param) for i in monitor._registry.params if i.in_grad}
        self._params = [v for v in structure.params if id(v.param) in owned]
        self._encoder = [p for p in structure.encoder_params if id(p) in owned]
        encoder_ids = {id(p) for p in self._encoder}
        self._others = [i.param for i in monitor._registry.params
                        if i.in_grad and id(i.param) not in encoder_ids]
        self._param_counts = (float(sum(p.numel() for p in self._encoder)),
                              float(sum(p.numel() for p in self._encoder)
                                    + sum(p.numel() for p in self._others)))
        self._step: tuple[int | None, float] | None = None
        self._new_step(None)
        self._new_forward(None, None)
        self.handles: list[Any] = []
        self._install(model)

    # ------------------------------------------------------------------ state
    def _new_step(self, step: tuple[int | None, float] | None) -> None:
        self._step = step  # (step, the step context's start time): a replay is a new step
        self._residual: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._margins: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._once: set[int] = set()          # id of gates / routers measured this step
        self._grads_done = False
        self._pending_values: dict[int, int] = {}

    def _step_key(self) -> tuple[int | None, float]:
        return self._m._step, self._m._t0

    def _sync_step(self) -> None:
        key = self._step_key()
        if key != self._step:
            self._new_step(key)

    def _new_forward(self, ids: torch.Tensor | None, attention_mask: Any) -> None:
        m = self._m
        text = m._mask if m._mask is not None and m._mask.dtype == torch.bool else None
        if text is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            text = attention_mask.bool()
        if text is not None and ids is not None and tuple(text.shape) != tuple(ids.shape):
            text = None
        self._ids, self._text = ids, text
        self._media: torch.Tensor | None = None
        self._layouts: dict[tuple[int, ...], torch.Tensor | None] = {}
        self._streams: dict[int, torch.Tensor] = {}
        self._main_logits: torch.Tensor | None = None

    # ------------------------------------------------------------------ layout
    def _layout(self, lead: tuple[int, ...], text: torch.Tensor | None, media_fill: bool
                ) -> torch.Tensor | None:
        """``text`` [B, T] laid out like an activation with leading shape ``lead``: [B, T],
        [B, M + T] (media positions ``media_fill``, or the media mask when True) or the
        flattened [B·L]; None when no layout fits."""
        media = self._media
        candidates = []
        if text is not None:
            candidates.append(text)
            if media is not None and media.shape[0] == text.shape[0]:
                head = media if media_fill else torch.zeros_like(media)
                candidates.append(torch.cat([head, text], dim=1))
        elif media is not None and media_fill:
            b = media.shape[0]
            total = math.prod(lead)
            length = lead[1] if len(lead) == 2 else (total // b if total % b == 0 else 0)
            if length > media.shape[1]:
                rest = media.new_ones((b, length - media.shape[1]))
                candidates.append(torch.cat([media, rest], dim=1))
        total = math.prod(lead)
        for c in candidates:
            if c.numel() == total and (len(lead) != 2 or tuple(c.shape) == tuple(lead)):
                return c.reshape(lead)
        return None

    def _valid(self, lead: tuple[int, ...]) -> torch.Tensor | None:
        key = tuple(lead)
        if key not in self._layouts:
            self._layouts[key] = self._layout(key, self._text, True)
        return self._layouts[key]

    def _valid_flat(self, x: torch.Tensor) -> torch.Tensor:
        valid = self._valid(tuple(x.shape[:-1]))
        if valid is None:
            return torch.ones(math.prod(x.shape[:-1]), dtype=torch.bool, device=x.device)
        return valid.reshape(-1).to(x.device)

    # ------------------------------------------------------------------ install
    def _install(self, model: nn.Module) -> None:
        """P0 hooks (root, routers, embedding, projector) stay installed; the hooks only P1/P2
        probes use are built now and installed for sampled steps only (the root hook arms
        them), unless ``ProbeConfig.persistent_hooks`` keeps them installed."""
        s = self.structure
        add = self.handles.append
        add(model.register_forward_pre_hook(self._root_hook, with_kwargs=True))
        for router in s.routers:
            add(router.module.register_forward_hook(self._router_hook(router)))
        if s.projector is not None:
            add(s.projector.register_forward_hook(self._projector_hook, with_kwargs=True))
            if s.embedding is not None:
                add(s.embedding.register_forward_hook(self._embedding_hook))
        sampled: list[tuple[Callable, Callable, dict]] = []
        for block in s.blocks:
            sampled.append((block.module.register_forward_pre_hook,
                            self._block_hook(block.layer), {"with_kwargs": True}))
            if block.attn is not None:
                sampled.append((block.attn.register_forward_hook, self._branch_hook(
                    block.layer, "attn", keep=block.mlp is not None), {}))
            if block.mlp is not None:
                sampled.append((block.mlp.register_forward_hook,
                                self._branch_hook(block.layer, "mlp", keep=False), {}))
        for gate in s.gates:
            sampled.append((gate.module.register_forward_hook, self._gate_hook(gate), {}))
        for value in (s.values if s.bos_id is not None else ()):
            sampled.append((value.module.register_forward_hook, self._value_hook(value), {}))
        for view in s.activations:
            register = (view.module.register_forward_pre_hook if view.pre
                        else view.module.register_forward_hook)
            sampled.append((register, self._activation_hook(view), {}))
        if s.mtp_heads and s.logits is not None:
            sampled.append((s.logits.register_forward_hook, self._main_logits_hook, {}))
            for depth, _, module in s.mtp_heads:
                sampled.append((module.register_forward_hook, self._mtp_hook(depth), {}))
        self._sampled_hooks = sampled
        self._p0_probes = bool(s.routers) or s.projector is not None
        self._armed: list[Any] = []
        self._persistent = bool(self._m.config.persistent_hooks)
        if self._persistent:
            self.handles += [register(hook, **kw) for register, hook, kw in sampled]

    def _arm(self, on: bool) -> None:
        if on and not self._armed:
            self._armed = [register(hook, **kw) for register, hook, kw in self._sampled_hooks]
        elif not on and self._armed:
            for handle in self._armed:
                handle.remove()
            self._armed = []

    # ------------------------------------------------------------------ forward hooks
    def _root_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        m = self._m
        sampled = m._p1_on or m._p2_on
        if not self._persistent and bool(self._armed) != sampled:
            self._arm(sampled)
        if not (sampled or (m._p0_on and self._p0_probes)) or _recompute():
            return None
        self._sync_step()
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("tokens"))
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            ids = None
        self._new_forward(ids, kwargs.get("attention_mask"))
        return None

    def _block_hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._m._p1_on or _recompute():
                return None
            s = args[0] if args else kwargs.get("hidden_states")
            if isinstance(s, torch.Tensor) and s.is_floating_point() and s.dim() >= 2:
                self._streams[layer] = s.detach()
            return None
        return hook

    def _branch_hook(self, layer: int, branch: str, *, keep: bool) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._m._p1_on or _recompute():
                return None
            s = self._streams.pop(layer, None)
            b = first_tensor(output)
            if s is None or b is None or b.shape != s.shape:
                return None
            b = b.detach()
            values = residual_token_values(s, b)
            self._residual.setdefault((layer, branch), []).append((values, self._valid_flat(s)))
            if keep:
                self._streams[layer] = s + b  # the feed-forward branch's incoming stream
            return None
        return hook

    def _router_hook(self, router: RouterPoint) -> Callable:
        m = self._m

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not (m._p0_on or m._p2_on) or _recompute():
                return None
            ids, scores = _router_output(output, router)
            if ids is None and scores is None:
                return None
            if router.bias is not None and scores is not None:
                scores = scores.detach().float() + router.bias.detach().float()
            if ids is None:
                ids = scores.topk(router.top_k or 1, dim=-1).indices  # type: ignore[union-attr]
            valid = self._valid_flat(ids)
            if m._p0_on:
                counts = expert_token_counts(ids, valid, router.n_experts)
                m._collector.add("structure.experts", counts, decode_experts, router.layer)
            if m._p2_on and scores is not None and ids.shape[-1] < router.n_experts:
                margin = topk_margin(scores, ids.shape[-1])
                self._margins.setdefault(router.layer, []).append(
                    (torch.stack([margin, -margin], dim=-1), valid))
                if router.bias is not None and id(module) not in self._once:
                    self._once.add(id(module))
                    bias = router.bias.detach().to(F64)
                    m._collector.add("structure.router_bias",
                                     [bias, expert_bias_abs_sum(bias).reshape(1)],
                                     decode_router_bias, router.layer)
            return None
        return hook

    def _gate_hook(self, gate: GatePoint) -> Callable:
        m = self._m

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not m._p1_on or _recompute() or id(module) in self._once:
                return None
            self._once.add(id(module))
            block = gate_saturation(gate.logits, temperature=gate.temperature,
                                    thresholds=self._thresholds)
            d = gate.logits.numel()
            m._collector.add("structure.gates", block[:, TokenField.SUM] * d, decode_gates,
                             (gate.layer, gate.branch, d, self._thresholds))
            return None
        return hook

    def _embedding_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        m = self._m
        if not (m._p0_on or m._p1_on) or _recompute():
            return None
        e = first_tensor(output)
        if e is None or e.dim() < 2:
            return None
        valid = self._text if self._text is not None and tuple(self._text.shape) == tuple(
            e.shape[:-1]) else None
        if m._p0_on:
            count = (valid.sum() if valid is not None
                     else torch.tensor(float(math.prod(e.shape[:-1])), device=e.device))
            m._collector.add("structure.modality_tokens", count.reshape(1), decode_tokens,
                             "text")
        if m._p1_on:
            parts = media_scale_components(None, e, text_valid=valid)[2:]
            m._collector.add("structure.media_scale", parts, decode_media_scale, "text")
        return None

    def _projector_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        m = self._m
        if not (m._p0_on or m._p1_on) or _recompute():
            return None
        e = first_tensor(output)
        if e is None or e.dim() < 2:
            return None
        mask = args[1] if len(args) > 1 else kwargs.get("token_mask", kwargs.get("mask"))
        lead = tuple(e.shape[:-1])
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                and tuple(mask.shape) == lead):
            mask = torch.ones(lead, dtype=torch.bool, device=e.device)
        self._media, self._layouts = mask, {}
        if m._p0_on:
            m._collector.add("structure.modality_tokens", mask.sum().reshape(1),
                             decode_tokens, "media")
        if m._p1_on:
            parts = media_scale_components(e, e[..., :0, :], media_valid=mask)[:2]
            m._collector.add("structure.media_scale", parts, decode_media_scale, "media")
        return None

    def _value_hook(self, value: ValuePoint) -> Callable:
        m = self._m
        key = id(value.module)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not m._p1_on:
                return None
            out = first_tensor(output)
            if out is None or out.dim() < 2:
                return None
            if _recompute():  # reentrant checkpointing: the graph exists only now
                if out.requires_grad and self._pending_values.get(key, 0) > 0:
                    self._pending_values[key] -= 1
                    out.register_hook(self._value_grad(value, out))
                return None
            if out.requires_grad:
                out.register_hook(self._value_grad(value, out))
            else:
                self._pending_values[key] = self._pending_values.get(key, 0) + 1
            return None
        return hook

    def _value_grad(self, value: ValuePoint, out: torch.Tensor) -> Callable:
        lead = tuple(out.shape[:-1])
        valid = self._valid(lead)
        bos_text = (self._ids == self.structure.bos_id) if self._ids is not None else None
        bos = self._layout(lead, bos_text, False) if bos_text is not None else None
        m = self._m

        def on_grad(grad: torch.Tensor) -> None:
            if not m._p1_on:
                return None
            g = grad.detach()
            if value.part is not None:
                g = g.chunk(3, dim=-1)[value.part]
            sq = g.float().square().sum(-1)
            peak = g.float().abs().amax(-1)
            ok = valid if valid is not None else torch.ones_like(sq, dtype=torch.bool)
            at_bos = ok & bos if bos is not None else torch.zeros_like(ok)
            other = ok & ~at_bos
            width = float(g.shape[-1])
            vec = torch.stack([
                torch.where(at_bos, sq, 0).sum(dtype=F64), at_bos.sum(dtype=F64) * width,
                torch.where(at_bos, peak, 0).amax().to(F64),
                torch.where(other, sq, 0).sum(dtype=F64), other.sum(dtype=F64) * width])
            m._collector.add("structure.value_grad", vec, decode_value_grad, value.layer)
            return None
        return on_grad

    def _activation_hook(self, view: ModuleView) -> Callable:
        m = self._m

        def hook(module: nn.Module, args: Any, output: Any = None) -> None:
            if not m._p2_on or _recompute():
                return None
            x = first_tensor(args if view.pre else output)
            if x is None or x.dim() < 2:
                return None
            x = x.detach()
            sq = x.float().square().sum(-1)
            valid = self._valid(tuple(x.shape[:-1]))
            ok = valid if valid is not None else torch.ones_like(sq, dtype=torch.bool)
            vec = torch.stack([torch.where(ok, sq, 0).sum(dtype=F64),
                               ok.sum(dtype=F64) * float(x.shape[-1])])
            m._collector.add("structure.module_acts", vec, decode_module_acts,
                             (view.layer, view.role))
            return None
        return hook

    def _main_logits_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._m._p1_on or _recompute():
            return None
        z = first_tensor(output)
        if z is not None and z.dim() == 3:
            self._main_logits = z.detach()
        return None

    def _mtp_hook(self, depth: int) -> Callable:
        m = self._m

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not m._p1_on or _recompute():
                return None
            z, main = first_tensor(output), self._main_logits
            if z is None or main is None or z.shape != main.shape or z.shape[1] <= depth:
                return None
            length = z.shape[1]
            text = self._text
            valid = (text[:, depth:] if text is not None and tuple(text.shape) == tuple(
                z.shape[:2]) else torch.ones(z.shape[0], length - depth, dtype=torch.bool,
                                              device=z.device))
            vec = mtp_top1_agreement(main[:, depth:], z.detach()[:, : length - depth], valid)
            m._collector.add("structure.mtp", vec, decode_mtp, depth)
            return None
        return hook

    # ------------------------------------------------------------------ monitor calls
    def on_gradients(self, inv_scale: Any) -> None:
        """At the monitor's gradient point (accumulated, before clipping): S_enc (P1) and the
        per-module gradient views (P2), once per step; ``inv_scale`` removes a loss scale."""
        m = self._m
        if not (m._p1_on or m._p2_on):
            return None
        self._sync_step()
        if self._grads_done:
            return None
        self._grads_done = True
        if m._p1_on and self._encoder:
            vec = encoder_grad_share_components(
                [p.grad for p in self._encoder], [p.grad for p in self._others])
            if inv_scale is not None:
                vec = vec * torch.as_tensor(inv_scale, dtype=F64, device=vec.device).square()
            m._collector.add("structure.encoder_grad", vec, decode_encoder_grad,
                             self._param_counts)
        if m._p2_on:
            rows, metas = [], []
            for view in self._params:
                grad = view.param.grad
                if grad is None:
                    continue
                g = grad.detach()
                if view.part is not None:
                    g = g.chunk(view.parts, dim=view.dim)[view.part]
                g = g.float()
                rows.append(torch.stack([g.square().sum(dtype=F64), g.abs().amax().to(F64)]))
                metas.append((view.layer, view.role, float(g.numel())))
            if rows:
                stacked = torch.stack(rows)
                if inv_scale is not None:
                    inv = torch.as_tensor(inv_scale, dtype=F64, device=stacked.device)
                    stacked = stacked * torch.stack([inv.square(), inv])
                m._collector.add("structure.module_grads", stacked, decode_module_grads,
                                 tuple(metas))
        return None

    def finish(self) -> None:
        """Before the monitor seals the step: per-token blocks over all micro-batches."""
        m = self._m
        if self._step == self._step_key():
            for (layer, branch), parts in self._residual.items():
                values = torch.cat([v for v, _ in parts])
                valid = torch.cat([ok for _, ok in parts])
                block = token_quantiles(values, valid, method="higher")
                m._collector.add("structure.residual", block, decode_residual, (layer, branch))
            for layer, parts in self._margins.items():
                values = torch.cat([v for v, _ in parts])
                valid = torch.cat([ok for _, ok in parts])
                block = token_quantiles(values, valid, method="higher")
                m._collector.add("structure.margin", block, decode_margin, layer)
        self._new_step(None)
        self._streams, self._main_logits = {}, None

    def remove(self) -> None:
        self._arm(False)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _router_output(output: Any, router: RouterPoint
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(top-k expert ids [N, k] or None, selection scores [N, E] or None) of a router call."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    ids = next((t for t in items if isinstance(t, torch.Tensor) and not t.is_floating_point()
                and t.dim() >= 1), None)
    scores = next((t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()
                   and t.dim() >= 1 and t.shape[-1] == router.n_experts), None)
    if ids is None and router.top_k is None:
        return None, None
    return ids, scores.detach() if scores is not None else None
