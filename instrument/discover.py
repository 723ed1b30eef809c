"""Model-structure observation points, found once at attach time by module patterns.

``discover(model, config)`` walks ``named_modules`` and ``named_parameters`` and returns a
``Structure``: blocks with their attention and feed-forward branches, MoE routers, residual
gates, value projections, the text embedding, the media projector and encoder, the logits
and MTP heads, and the parameter and activation views of 002's per-module rows. Nothing
in the model changes; the probes (``structure_probes``) hook what is found here.

Residual branches assume the sequential pre-norm form every supported block has:
``x = x + attn(norm(x)); x = x + mlp(norm(x))``. The attention branch's incoming stream is
the block input s; the feed-forward branch's is s + b_attn. A parallel-residual block
(GPT-J, Falcon: both branches read the same s) would get a wrong s for its feed-forward
branch; such blocks need their own patterns and are not matched by default.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .registry import label_name
from .structure_config import StructureConfig

__all__ = [
    "PARAM_ROLES",
    "BlockPoint",
    "GatePoint",
    "ModuleView",
    "ParamView",
    "RouterPoint",
    "Structure",
    "ValuePoint",
    "discover",
    "layer_of",
]

# (parameter-name pattern, role, part roles of a fused tensor along its output features)
_PARAM_ROLES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"(.*\.)?(q_proj|wq|query)\.weight", "q", ()),
    (r"(.*\.)?(k_proj|wk|key)\.weight", "k", ()),
    (r"(.*\.)?(v_proj|wv|value)\.weight", "v", ()),
    (r"(.*\.)?(q_a_proj|linear_q_down_proj)\.weight", "q_down", ()),
    (r"(.*\.)?(q_b_proj|linear_q_up_proj)\.weight", "q_up", ()),
    (r"(.*\.)?(kv_a_proj_with_mqa|linear_kv_down_proj)\.weight", "kv_down", ()),
    (r"(.*\.)?(kv_b_proj|linear_kv_up_proj)\.weight", "kv_up", ()),
    (
        r"(.*\.)?(attn|self_attn|attention|self_attention)\.(o_proj|out_proj|wo|proj|c_proj|dense|"
        r"linear_proj)\.weight",
        "o",
        (),
    ),
    (r"(.*\.)?(mlp|feed_forward|ffn|block_sparse_moe|moe)\.(gate|router)\.weight", "router", ()),
    (r"(.*\.)?experts\.gate_up_proj", "expert_gate_up", ("expert_gate", "expert_up")),
    (r"(.*\.)?experts\.down_proj", "expert_down", ()),
    (r"(.*\.)?experts\.\d+\.(gate_proj|w1)\.weight", "expert_gate", ()),
    (r"(.*\.)?experts\.\d+\.(up_proj|w3|up|c_fc|fc1)\.weight", "expert_up", ()),
    (r"(.*\.)?experts\.\d+\.(down_proj|w2|down|c_proj|fc2)\.weight", "expert_down", ()),
    (r"(.*\.)?(mlp|feed_forward|ffn)\.(gate_proj|w1)\.weight", "mlp_gate", ()),
    (
        r"(.*\.)?(mlp|feed_forward|ffn)\.(up_proj|w3|up|c_fc|fc1|dense_h_to_4h)\.weight",
        "mlp_up",
        (),
    ),
    (
        r"(.*\.)?(mlp|feed_forward|ffn)\.(down_proj|w2|down|c_proj|fc2|dense_4h_to_h)\.weight",
        "mlp_down",
        (),
    ),
    (r"(.*\.)?(input_layernorm|ln_1|ln_attn|attention_norm)\.weight", "norm_attn", ()),
    (r"(.*\.)?(post_attention_layernorm|ln_2|ln_mlp|ffn_norm)\.weight", "norm_mlp", ()),
    (r"(.*\.)?(q_norm|q_layernorm)\.weight", "norm_q", ()),
    (r"(.*\.)?(k_norm|k_layernorm)\.weight", "norm_k", ()),
)
_FINAL_NORM = re.compile(r"(.*\.)?(norm|ln_f|final_layernorm|norm_f|final_norm)\.weight")
_O_CHILDREN = ("o_proj", "out_proj", "wo", "proj", "c_proj", "dense", "linear_proj")
_V_CHILDREN = ("v_proj", "wv", "value")
PARAM_ROLES: tuple[str, ...] = tuple(
    dict.fromkeys(
        [r for _, r, parts in _PARAM_ROLES for r in (parts or (r,))]
        + ["qkv", "norm_final", "embedding", "output"]
    )
)
"""Every value of label ``module`` on module.grad_* (bounded)."""


@dataclass(frozen=True, slots=True)
class BlockPoint:
    layer: int
    name: str
    module: nn.Module
    attn: nn.Module | None
    mlp: nn.Module | None


@dataclass(frozen=True, slots=True)
class RouterPoint:
    layer: int
    name: str
    module: nn.Module
    n_experts: int
    top_k: int | None  # None: read from the output's expert ids
    bias: torch.Tensor | None  # expert-selection bias (parameter or buffer)


@dataclass(frozen=True, slots=True)
class GatePoint:
    layer: int
    branch: str  # attn | mlp
    name: str
    module: nn.Module
    logits: torch.Tensor  # g [d]
    temperature: float


@dataclass(frozen=True, slots=True)
class ValuePoint:
    layer: int
    name: str
    module: nn.Module
    part: int | None  # None: the whole output is V; 2: last third of [Q|K|V]


@dataclass(frozen=True, slots=True)
class ParamView:
    layer: int | None  # None: model-level (embedding, output, final norm)
    role: str
    name: str
    param: nn.Parameter
    dim: int  # output-feature dimension the parts split
    part: int | None  # index among ``parts`` equal parts, None: whole
    parts: int


@dataclass(frozen=True, slots=True)
class ModuleView:
    layer: int
    role: str  # attn_core (input of the output projection) | gate_score
    name: str
    module: nn.Module
    pre: bool  # True: the module's input, False: its output


@dataclass(frozen=True, slots=True)
class Structure:
    blocks: tuple[BlockPoint, ...]
    routers: tuple[RouterPoint, ...]
    gates: tuple[GatePoint, ...]
    values: tuple[ValuePoint, ...]
    params: tuple[ParamView, ...]
    activations: tuple[ModuleView, ...]
    embedding: nn.Module | None
    projector: nn.Module | None
    encoder_params: tuple[nn.Parameter, ...]
    logits: nn.Module | None
    mtp_heads: tuple[tuple[int, str, nn.Module], ...]  # (depth, name, module)
    bos_id: int | None

    def points(self) -> dict[str, list[str]]:
        """Kind of observation point -> names found (what a test or a person checks)."""
        return {
            "blocks": [b.name for b in self.blocks],
            "branches": [
                f"{b.name}.{k}"
                for b in self.blocks
                for k, m in (("attn", b.attn), ("mlp", b.mlp))
                if m is not None
            ],
            "routers": [r.name for r in self.routers],
            "gates": [g.name for g in self.gates],
            "values": [v.name for v in self.values],
            "params": sorted({f"{p.layer}:{p.role}" for p in self.params}),
            "activations": [f"{a.layer}:{a.role}" for a in self.activations],
            "embedding": [] if self.embedding is None else ["embedding"],
            "projector": [] if self.projector is None else ["projector"],
            "mtp": [name for _, name, _ in self.mtp_heads],
        }


def layer_of(name: str, blocks: dict[str, int]) -> int | None:
    """Layer index of the block that contains module/parameter ``name``, else None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        layer = blocks.get(".".join(parts[:i]))
        if layer is not None:
            return layer
    return None


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return None


def _bos_id(model: nn.Module, config: StructureConfig) -> int | None:
    if config.bos_id is not None:
        return config.bos_id
    core = getattr(model, "module", model)
    for source in (core, getattr(core, "config", None)):
        value = (
            getattr(source, "bos_id", None)
            if source is core
            else getattr(source, "bos_token_id", None)
        )
        if isinstance(value, int):
            return value
    return None


def _router(
    layer: int, name: str, module: nn.Module, parent: nn.Module | None, config: StructureConfig
) -> RouterPoint | None:
    weight = getattr(module, "weight", None)
    n_experts = getattr(module, "num_experts", None)
    if not isinstance(n_experts, int):
        is_matrix = isinstance(weight, torch.Tensor) and weight.dim() == 2
        n_experts = weight.shape[0] if is_matrix else None
    if not n_experts or n_experts < 2:
        return None
    top_k = None
    for source in (module, parent):
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(source, attr, None) if source is not None else None
            if isinstance(value, int) and top_k is None:
                top_k = value
    bias = None
    for attr in config.router_bias:
        value = getattr(module, attr, None)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == n_experts:
            bias = value
            break
    return RouterPoint(layer, name, module, n_experts, top_k, bias)


def _out_dim(module: nn.Module | None, param: torch.Tensor) -> int:
    """Output-feature dim of a weight: 0 for nn.Linear [out, in], 1 for GPT-2's Conv1D
    [in, out] and for stacked expert weights [E, out, in]."""
    if param.dim() == 3 or (module is not None and type(module).__name__ == "Conv1D"):
        return 1
    return 0


def discover(
    model: nn.Module,
    config: StructureConfig,
    logits_pattern: str = r"(.*\.)?(lm_head|head|output|output_layer)",
) -> Structure:
    """Find the structure observation points of ``model`` (see the module docstring)."""
    named = [(label_name(q), m) for q, m in model.named_modules()]
    emb_re, proj_re = re.compile(config.embedding), re.compile(config.projector)
    enc_re, mtp_re = re.compile(config.encoder), re.compile(config.mtp_heads)
    logits_re = re.compile(logits_pattern)

    projector = next(((n, m) for n, m in named if n and proj_re.fullmatch(n)), None)
    encoder = (
        next(((n, m) for n, m in named if n and enc_re.fullmatch(n)), None)
        if projector is not None
        else None
    )
    inside_encoder = lambda n: (
        encoder is not None and (n == encoder[0] or n.startswith(encoder[0] + "."))
    )
    blocks, block_layer = _blocks(named, config, inside_encoder)
    routers, gates, activations = _layer_points(named, block_layer, config)
    values, attn_cores = _attention_points(blocks, config)
    activations = sorted(activations + attn_cores, key=lambda a: (a.layer, a.role))

    logits = next((m for n, m in named if n and logits_re.fullmatch(n)), None)
    embedding = next(
        (
            m
            for n, m in named
            if n and emb_re.fullmatch(n) and isinstance(m, nn.Embedding) and not inside_encoder(n)
        ),
        None,
    )
    mtp = sorted(
        (int(mt.groups()[-1]) + 1, n, m)
        for n, m in named
        if n and (mt := mtp_re.fullmatch(n)) is not None
    )
    encoder_params = tuple(encoder[1].parameters()) if encoder is not None else ()
    params = _param_views(model, block_layer, logits, embedding, config, inside_encoder)
    return Structure(
        tuple(blocks),
        tuple(routers),
        tuple(gates),
        tuple(values),
        params,
        tuple(activations),
        embedding,
        projector and projector[1],
        encoder_params,
        logits,
        tuple(mtp),
        _bos_id(model, config),
    )


def _blocks(
    named: list[tuple[str, nn.Module]],
    config: StructureConfig,
    inside_encoder: Callable[[str], bool],
) -> tuple[list[BlockPoint], dict[str, int]]:
    """The transformer blocks outside the media encoder, by layer, and each one's layer."""
    block_re = re.compile(config.blocks)
    blocks: list[BlockPoint] = []
    block_layer: dict[str, int] = {}
    for name, module in named:
        match = block_re.fullmatch(name) if name else None
        if match is None or inside_encoder(name):
            continue
        layer = int(match.groups()[-1])
        attn, mlp = _child(module, config.attn_children), _child(module, config.mlp_children)
        blocks.append(BlockPoint(layer, name, module, attn and attn[1], mlp and mlp[1]))
        block_layer[name] = layer
    blocks.sort(key=lambda b: b.layer)
    return blocks, block_layer


def _layer_points(
    named: list[tuple[str, nn.Module]], block_layer: dict[str, int], config: StructureConfig
) -> tuple[list[RouterPoint], list[GatePoint], list[ModuleView]]:
    """Inside the blocks: the MoE routers, the branch gates and the gate-score activations."""
    by_name = dict(named)
    router_re, gate_re = re.compile(config.routers), re.compile(config.branch_gates)
    score_re = re.compile(config.gate_scores)
    routers, gates, activations = [], [], []
    for name, module in named:
        layer = layer_of(name, block_layer) if name else None
        if layer is None:
            continue
        if router_re.fullmatch(name):
            parent = by_name.get(name.rpartition(".")[0])
            router = _router(layer, name, module, parent, config)
            if router is not None:
                routers.append(router)
        elif gate_re.fullmatch(name):
            params = [p for p in module.parameters(recurse=False) if p.dim() == 1]
            branch = _branch_of(name, config)
            if params and branch is not None:
                temperature = float(getattr(module, "temperature", 1.0))
                gates.append(GatePoint(layer, branch, name, module, params[0], temperature))
        elif score_re.fullmatch(name):
            activations.append(ModuleView(layer, "gate_score", name, module, pre=False))
    return routers, gates, activations


def _attention_points(
    blocks: list[BlockPoint], config: StructureConfig
) -> tuple[list[ValuePoint], list[ModuleView]]:
    """Per attention block: the value projection (its own, or the V third of a fused QKV)
    and the attention core's output (the input of the output projection)."""
    values, activations = [], []
    for block in blocks:
        if block.attn is None:
            continue
        attn_name = next(
            f"{block.name}.{c}"
            for c in config.attn_children
            if getattr(block.module, c, None) is block.attn
        )
        value = _child(block.attn, _V_CHILDREN)
        fused = _child(block.attn, config.fused_qkv)
        if value is not None:
            values.append(ValuePoint(block.layer, f"{attn_name}.{value[0]}", value[1], None))
        elif fused is not None and _out_features(fused[1]) % 3 == 0:
            values.append(ValuePoint(block.layer, f"{attn_name}.{fused[0]}", fused[1], 2))
        out = _child(block.attn, _O_CHILDREN)
        if out is not None:
            activations.append(
                ModuleView(block.layer, "attn_core", f"{attn_name}.{out[0]}", out[1], pre=True)
            )
    return values, activations


def _branch_of(name: str, config: StructureConfig) -> str | None:
    parts = name.split(".")
    for part in reversed(parts[:-1]):
        if part in config.attn_children:
            return "attn"
        if part in config.mlp_children:
            return "mlp"
    return None


def _out_features(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return 1
    return weight.shape[_out_dim(module, weight)]


def _param_views(
    model: nn.Module,
    block_layer: dict[str, int],
    logits: nn.Module | None,
    embedding: nn.Module | None,
    config: StructureConfig,
    inside_encoder: Callable[[str], bool],
) -> tuple[ParamView, ...]:
    """Role views of the language model's weights (the media encoder's are not its roles)."""
    rules = [(re.compile(p), role, parts) for p, role, parts in _PARAM_ROLES]
    fused = [re.compile(rf"(.*\.)?({'|'.join(map(re.escape, config.fused_qkv))})\.weight")]
    owner: dict[int, nn.Module] = {}
    for _, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    special = {}
    if embedding is not None and isinstance(getattr(embedding, "weight", None), nn.Parameter):
        special[id(embedding.weight)] = "embedding"
    if logits is not None and isinstance(getattr(logits, "weight", None), nn.Parameter):
        special.setdefault(id(logits.weight), "output")  # tied to the embedding: reported once
    views: list[ParamView] = []
    for qualified, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = label_name(qualified)
        if inside_encoder(name):
            continue
        layer = layer_of(name, block_layer)
        module = owner.get(id(param))
        role, parts = special.get(id(param)), ()
        if role is None and any(rx.fullmatch(name) for rx in fused):
            role, parts = "qkv", ("q", "k", "v")
        if role is None:
            for rx, candidate, candidate_parts in rules:
                if rx.fullmatch(name):
                    role, parts = candidate, candidate_parts
                    break
        if role is None and layer is None and _FINAL_NORM.fullmatch(name):
            role = "norm_final"
        if role is None or (layer is None and role not in ("embedding", "output", "norm_final")):
            continue
        dim = _out_dim(module, param)
        if parts and param.dim() > dim and param.shape[dim] % len(parts) == 0:
            views += [
                ParamView(layer, part, name, param, dim, i, len(parts))
                for i, part in enumerate(parts)
            ]
        else:
            views.append(ParamView(layer, role, name, param, dim, None, 1))
    return tuple(views)
