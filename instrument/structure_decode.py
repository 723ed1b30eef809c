"""Decoders of the model-structure probes: host values of one step -> catalog points.

They run on the emitter thread after the monitor's one device-to-host copy (``collect``).
Each gets the parts one probe added during the step (one per micro-batch, layer or call)
and implements "no measurement, never a zero": a component with no valid token yields no
point. Metric names and labels are the catalog's (``catalog``, model-structure section).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .otlp import Point
from .structure import TokenField

__all__ = ["RESIDUAL_STATS", "decode_encoder_grad", "decode_experts", "decode_gates",
           "decode_margin", "decode_media_scale", "decode_module_acts", "decode_module_grads",
           "decode_mtp", "decode_residual", "decode_router_bias", "decode_tokens",
           "decode_value_grad"]

RESIDUAL_STATS = ("stream_norm", "branch_norm", "ratio", "importance", "angle", "noop")
"""Metric stems of ``structure.ResidualStat`` rows, in its order (residual.{stem}_*)."""
_TOKEN_FIELDS = (("sum", TokenField.SUM), ("p90", TokenField.P90), ("p99", TokenField.P99),
                 ("max", TokenField.MAX))
Parts = list[tuple[np.ndarray, Any]]


def _labels(**kv: Any) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in kv.items()))


def decode_experts(parts: Parts) -> list[Point]:
    """moe.expert_tokens{layer, expert}: every expert of a layer that saw a valid token."""
    totals: dict[Any, np.ndarray] = {}
    for values, layer in parts:
        totals[layer] = totals.get(layer, 0) + values
    out = []
    for layer, counts in sorted(totals.items()):
        if counts.sum() > 0:  # a layer that received no valid token records nothing
            out += [Point("moe.expert_tokens", float(c), _labels(layer=layer, expert=i))
                    for i, c in enumerate(counts.tolist())]
    return out


def decode_router_bias(parts: Parts) -> list[Point]:
    out = []
    for values, layer in parts:
        bias, total = values[:-1].tolist(), float(values[-1])
        out += [Point("moe.router_bias", v, _labels(layer=layer, expert=i))
                for i, v in enumerate(bias)]
        out.append(Point("moe.expert_bias_abs_sum", total, _labels(layer=layer)))
    return out


def decode_margin(parts: Parts) -> list[Point]:
    out = []
    for values, layer in parts:
        block = values.reshape(2, len(TokenField))
        count = block[0, TokenField.COUNT]
        if not count > 0:
            continue
        lab = _labels(layer=layer)
        up, down = block[0].tolist(), block[1].tolist()
        out += [Point("moe.topk_margin_tokens", count, lab),
                Point("moe.topk_margin_sum", up[TokenField.SUM], lab),
                Point("moe.topk_margin_p90", up[TokenField.P90], lab),
                Point("moe.topk_margin_p99", up[TokenField.P99], lab),
                Point("moe.topk_margin_max", up[TokenField.MAX], lab),
                Point("moe.topk_margin_p10", -down[TokenField.P90], lab),
                Point("moe.topk_margin_min", -down[TokenField.MAX], lab)]
    return out


def decode_residual(parts: Parts) -> list[Point]:
    out = []
    for values, (layer, branch) in parts:
        block = values.reshape(len(RESIDUAL_STATS), len(TokenField))
        count = block[0, TokenField.COUNT]
        if not count > 0:
            continue
        lab = _labels(layer=layer, branch=branch)
        out.append(Point("residual.tokens", float(count), lab))
        for row, stem in enumerate(RESIDUAL_STATS):
            out += [Point(f"residual.{stem}_{field}", float(block[row, f]), lab)
                    for field, f in _TOKEN_FIELDS]
    return out


def decode_gates(parts: Parts) -> list[Point]:
    out = []
    for values, (layer, branch, d, thresholds) in parts:
        lab = dict(layer=layer, branch=branch)
        out.append(Point("residual.gate_channels", float(d), _labels(**lab)))
        out += [Point("residual.gate_closed", float(round(c)), _labels(**lab, theta=f"{t:g}"))
                for t, c in zip(thresholds, values.tolist())]
    return out


def decode_tokens(parts: Parts) -> list[Point]:
    totals: dict[str, float] = {}
    for values, modality in parts:
        totals[modality] = totals.get(modality, 0.0) + float(values[0])
    return [Point("modality.tokens", v, _labels(modality=k))
            for k, v in sorted(totals.items()) if v > 0]


def decode_media_scale(parts: Parts) -> list[Point]:
    totals = {"media": [0.0, 0.0], "text": [0.0, 0.0]}
    for values, modality in parts:
        totals[modality][0] += float(values[0])
        totals[modality][1] += float(values[1])
    out = []
    for modality, (sum_sq, n) in totals.items():
        if n > 0:  # a rank that received no media has no media measurement
            out += [Point(f"modality.{modality}_sum_sq", sum_sq),
                    Point(f"modality.{modality}_n", n)]
    return out


def decode_encoder_grad(parts: Parts) -> list[Point]:
    values, (enc_params, all_params) = parts[0]
    enc, total = values.tolist()
    return [Point("modality.encoder_grad_sq", enc), Point("modality.all_grad_sq", total),
            Point("modality.encoder_params", enc_params), Point("modality.all_params", all_params)]


def decode_value_grad(parts: Parts) -> list[Point]:
    totals: dict[int, list[float]] = {}
    for values, layer in parts:
        v = values.tolist()
        t = totals.setdefault(layer, [0.0, 0.0, 0.0, 0.0, 0.0])
        t[0] += v[0]
        t[1] += v[1]
        t[2] = v[2] if math.isnan(v[2]) else max(t[2], v[2])
        t[3] += v[3]
        t[4] += v[4]
    out = []
    for layer, (bos_sq, bos_n, bos_max, sq, n) in sorted(totals.items()):
        lab = _labels(layer=layer)
        if bos_n > 0:
            out += [Point("attn.bos_value_grad_sum_sq", bos_sq, lab),
                    Point("attn.bos_value_grad_n", bos_n, lab),
                    Point("attn.bos_value_grad_abs_max", bos_max, lab)]
        if n > 0:
            out += [Point("attn.value_grad_sum_sq", sq, lab), Point("attn.value_grad_n", n, lab)]
    return out


def decode_mtp(parts: Parts) -> list[Point]:
    totals: dict[int, list[float]] = {}
    for values, depth in parts:
        t = totals.setdefault(depth, [0.0, 0.0])
        t[0] += float(values[0])
        t[1] += float(values[1])
    out = []
    for depth, (positions, agree) in sorted(totals.items()):
        if positions > 0:
            lab = _labels(depth=depth)
            out += [Point("output.mtp_positions", positions, lab),
                    Point("output.mtp_agree", agree, lab)]
    return out


def decode_module_grads(parts: Parts) -> list[Point]:
    values, metas = parts[0]
    rows = values.reshape(-1, 2)
    totals: dict[tuple[Any, str], list[float]] = {}
    for (layer, role, n), (sq, peak) in zip(metas, rows.tolist()):
        t = totals.setdefault((layer, role), [0.0, 0.0, 0.0])
        t[0] += sq
        t[1] += n
        t[2] = peak if math.isnan(peak) else max(t[2], peak)
    out = []
    for (layer, role), (sq, n, peak) in totals.items():
        lab = _labels(module=role) if layer is None else _labels(layer=layer, module=role)
        out += [Point("module.grad_sum_sq", sq, lab), Point("module.grad_n", n, lab),
                Point("module.grad_abs_max", peak, lab)]
    return out


def decode_module_acts(parts: Parts) -> list[Point]:
    totals: dict[tuple[int, str], list[float]] = {}
    for values, key in parts:
        t = totals.setdefault(key, [0.0, 0.0])
        t[0] += float(values[0])
        t[1] += float(values[1])
    out = []
    for (layer, role), (sq, n) in sorted(totals.items()):
        if n > 0:
            lab = _labels(layer=layer, module=role)
            out += [Point("module.act_sum_sq", sq, lab), Point("module.act_n", n, lab)]
    return out
