"""Observation points and parameter table, decided once at attach time.

Each observed module gets its label name, its fused-split parts and whether this rank
reports it; each parameter gets its gradient group (embedding / expert / other) and whether
this rank owns it (``parallel.param_layout``): every element of a parameter-side tensor —
gradient, weight, update — is reported by exactly one rank, so the stream sums them with
no de-duplication. A DTensor parameter's placements decide (Replicate: coordinate 0 owns;
Shard: every shard); plain tensors follow the hand declaration (``ProbeConfig``):

* ``dp`` when ``dp_replicated`` (DDP; default for plain tensors: ZeRO/FSDP shards set False),
* ``cp`` always (context parallelism shards the sequence, not the weights),
* ``tp`` when its name or its module's name matches ``tp_replicated`` (a LayerNorm weight
  on every tensor-parallel rank),
* ``ep`` for non-expert parameters when the layout has an expert-parallel coordinate.

Activations are reported by every data, context and pipeline coordinate (different data);
an activation identical on every tensor-parallel rank (``tp_replicated`` modules) by tp=0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .config import ProbeConfig
from .parallel import declared_groups, is_dtensor, param_layout
from .wire import RankIdentity

__all__ = ["ObservedModule", "ParamInfo", "Registry", "build_registry", "label_name"]

_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def label_name(qualified: str) -> str:
    """A module or parameter name without wrapper components (DDP, torch.compile, FSDP1,
    checkpoint wrappers): ``module.blocks.0._orig_mod.attn`` -> ``blocks.0.attn``."""
    parts = qualified.split(".") if qualified else []
    while parts and parts[0] in ("module", "_orig_mod"):
        parts.pop(0)
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)


def _any(patterns: list[re.Pattern[str]], text: str) -> bool:
    return any(p.fullmatch(text) for p in patterns)


@dataclass(frozen=True, slots=True)
class ObservedModule:
    name: str
    module: nn.Module
    parts: tuple[str, ...]  # fused-split part names, () = whole output
    report: bool  # this rank reports its statistics
    is_logits: bool


@dataclass(frozen=True, slots=True)
class ParamInfo:
    name: str
    param: nn.Parameter
    group: int  # index into catalog.GRAD_GROUPS
    owned: bool  # this rank reports its gradient, weight and update
    parts: tuple[str, ...]  # fused-split part names along dim 0, () = whole


@dataclass(frozen=True, slots=True)
class Registry:
    modules: tuple[ObservedModule, ...]
    logits: ObservedModule | None
    params: tuple[ParamInfo, ...]
    whole_gradient: bool  # this rank owns every gradient, none sharded: its G2 is global
    n_params: int
    dp_replicas: tuple[tuple[str, nn.Parameter], ...] = ()  # plain tensors declared DDP replicas


def build_registry(model: nn.Module, config: ProbeConfig, identity: RankIdentity) -> Registry:
    """Match observation points and classify parameters (see the module docstring)."""
    names = [re.compile(p) for p in config.module_names]
    types = [re.compile(p) for p in config.module_types]
    logits_re = re.compile(config.logits_module)
    tp_rep = [re.compile(p) for p in config.tp_replicated]
    splits = [(re.compile(p), tuple(parts)) for p, parts in config.fused_splits.items()]
    tp_rank = identity.coord("tp")

    modules: list[ObservedModule] = []
    logits: ObservedModule | None = None
    module_of_param: dict[int, str] = {}
    embedding_params: set[int] = set()
    for qualified, module in model.named_modules():
        name = label_name(qualified)
        for p in module.parameters(recurse=False):
            module_of_param.setdefault(id(p), name)
            if isinstance(module, nn.Embedding):
                embedding_params.add(id(p))
        if not name:
            continue
        parts = next((pp for rx, pp in splits if rx.fullmatch(name)), ())
        report = tp_rank == 0 or not _any(tp_rep, name)
        is_logits = logits is None and bool(logits_re.fullmatch(name))
        observed = ObservedModule(name, module, parts, report, is_logits)
        if is_logits:
            logits = observed
        if is_logits or _any(names, name) or _any(types, type(module).__name__):
            modules.append(observed)

    emb_re = [re.compile(p) for p in config.embedding_params]
    expert_re = [re.compile(p) for p in config.expert_params]
    dp_replicated = config.dp_replicated is not False
    params: list[ParamInfo] = []
    all_owned, any_sharded = True, False
    dp_replicas: list[tuple[str, nn.Parameter]] = []
    for qualified, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = label_name(qualified)
        module_name = module_of_param.get(id(p), "")
        expert = _any(expert_re, name)
        group = 1 if expert else (0 if id(p) in embedding_params or _any(emb_re, name) else 2)
        tp_replicated = _any(tp_rep, name) or bool(module_name and _any(tp_rep, module_name))
        declared = declared_groups(dp_replicated, tp_replicated, expert, identity.coords)
        owned, sharded = param_layout(
            name, p, identity, declared, dp_explicit=config.dp_replicated is True
        )
        sharded |= not dp_replicated  # declared by hand: a shard over the data ranks
        if dp_replicated and not is_dtensor(p):
            dp_replicas.append((name, p))
        all_owned &= owned
        any_sharded |= sharded
        parts = next((pp for rx, pp in splits if module_name and rx.fullmatch(module_name)), ())
        if parts and p.shape and p.shape[0] % len(parts):
            parts = ()  # not evenly divisible: scanned whole
        params.append(ParamInfo(name, p, group, owned, parts))
    whole = all_owned and not any_sharded and not set(identity.coords) & {"tp", "pp", "ep"}
    return Registry(
        tuple(modules),
        logits,
        tuple(params),
        whole,
        sum(p.numel() for p in model.parameters()),
        tuple(dp_replicas),
    )
