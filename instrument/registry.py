"""Observation points and parameter table, decided once at attach time.

Each observed module gets its label name, its fused-split parts and whether this rank
reports it; each parameter gets its gradient group (embedding / expert / other) and two
ownership flags that implement the catalog's rank-side rule: a contribution identical
across a group the metric does not declare as replicated is reported only by the rank at
coordinate 0 of that group.

Replication of a parameter (``replicated_groups``):

* ``dp`` when ``ProbeConfig.dp_replicated`` (DDP; ZeRO-3/FSDP shards are not replicas),
* ``cp`` always (context parallelism shards the sequence, not the weights),
* ``tp`` when its name or its module's name matches ``ProbeConfig.tp_replicated``
  (a LayerNorm weight on every tensor-parallel rank): only tp=0 counts it,
* ``ep`` for non-expert parameters when the layout has an expert-parallel coordinate
  (dense weights are identical across expert-parallel ranks; experts are sharded).

``grad.*`` declares ``{dp, cp}`` replicated (the stream dedups those), so a parameter enters
the rank's gradient sums iff its coordinate is 0 in every *other* replicating group.
``tensor.*`` declares nothing, so a parameter-side tensor is reported iff the coordinate is
0 in every replicating group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .config import ProbeConfig
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
    parts: tuple[str, ...]        # fused-split part names, () = whole output
    report: bool                  # this rank reports its statistics
    is_logits: bool


@dataclass(frozen=True, slots=True)
class ParamInfo:
    name: str
    param: nn.Parameter
    group: int                    # index into catalog.GRAD_GROUPS
    in_grad: bool                 # enters this rank's grad.* sums
    report: bool                  # this rank reports its tensor.* statistics
    parts: tuple[str, ...]        # fused-split part names along dim 0, () = whole


@dataclass(frozen=True, slots=True)
class Registry:
    modules: tuple[ObservedModule, ...]
    logits: ObservedModule | None
    params: tuple[ParamInfo, ...]
    whole_gradient: bool          # this rank's gradient sums are the global G2 (no sharding)
    n_params: int


def _owner(identity: RankIdentity, groups: set[str]) -> bool:
    return all(identity.coord(g) == 0 for g in groups)


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
    has_ep = "ep" in identity.coords
    params: list[ParamInfo] = []
    for qualified, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = label_name(qualified)
        module_name = module_of_param.get(id(p), "")
        expert = _any(expert_re, name)
        group = 1 if expert else (0 if id(p) in embedding_params or _any(emb_re, name) else 2)
        replicated = {"cp"}
        if config.dp_replicated:
            replicated.add("dp")
        if _any(tp_rep, name) or (module_name and _any(tp_rep, module_name)):
            replicated.add("tp")
        if has_ep and not expert:
            replicated.add("ep")
        parts = next((pp for rx, pp in splits if module_name and rx.fullmatch(module_name)), ())
        if parts and p.shape and p.shape[0] % len(parts):
            parts = ()  # not evenly divisible: scanned whole
        params.append(ParamInfo(name, p, group, _owner(identity, replicated - {"dp", "cp"}),
                                _owner(identity, replicated), parts))
    # the rank's sums are the global G2 only without tp/pp/ep sharding of the weights
    whole = config.dp_replicated and not set(identity.coords) & {"tp", "pp", "ep"}
    return Registry(tuple(modules), logits, tuple(params), whole,
                    sum(p.numel() for p in model.parameters()))
