"""The metric catalog: the wire contract between training ranks and the stream.

Each metric a rank emits is written here once: its name (units in the name), priority,
default cadence, the cross-rank reduction the stream applies, its unit, its bounded
labels, where it is measured, and which parallel groups hold identical copies of it.
Torch-free: the stream, the sink and the docs import it without a training stack.

The names themselves are constants (``Loss.SUM``, ``Label.SOURCE``, ``Tensor.ALL``): the
ranks, the stream, the sink and the reports refer to them and never spell a name again.
A metric's cadence is a ``Tier`` (every step, every scan interval, on demand) that drives
when the rank measures it; its priority says who looks (P0 pages).

Ranks send reducible *components* (sums, counts, maxima), never means or ratios; the
stream forms L, L_max, G2, ... from them (seeds 001 §3-§6, "distributed reduction").

Two rules decide who reports what, so that nothing is counted twice:

* ``replicated_over`` is declared per metric. The stream keeps one representative per
  replica class (ranks that differ only in those groups) before reducing.
* Where replication depends on the tensor rather than on the metric (a LayerNorm weight
  is identical on every tensor-parallel rank while a column-parallel weight is a shard;
  a DDP parameter is identical on every data-parallel rank), the *rank* decides: a
  contribution that is identical across a group the metric does not declare is reported
  only by the rank at coordinate 0 of that group. ``probewire.instrument`` applies this
  for gradients, parameters, updates and activations (see ``ProbeConfig.tp_replicated``).

Sampled components are emitted only when measured: a rank without a valid token sends
no ``loss.*`` point at all, never a zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

__all__ = [
    "CATALOG",
    "GRAD_GROUPS",
    "NAMESPACES",
    "TENSOR_FIELDS",
    "Attn",
    "Comm",
    "Device",
    "Export",
    "Grad",
    "Group",
    "Guard",
    "Host",
    "Label",
    "Loss",
    "Memory",
    "MetricSpec",
    "Optim",
    "Modality",
    "Module",
    "Moe",
    "Net",
    "Output",
    "Priority",
    "Reduction",
    "Residual",
    "System",
    "Tensor",
    "Tier",
    "User",
    "describe",
    "spec",
    "tier_of",
]


class Priority(StrEnum):
    """P0 pages someone; P1 is opened when a P0 moves; P2 is for one investigation (§0)."""

    P0 = "P0"
    P1 = "P1"
    P2 = "P2"


class Reduction(StrEnum):
    """How the stream combines one metric's per-rank components into one step value."""

    SUM = "sum"  # numerators and counts: summed, then divided downstream
    MAX = "max"  # maxima over ranks (never averaged)
    MIN = "min"
    MEDIAN = "median"  # median over ranks, where the definition asks for it
    PER_RANK = "per_rank"  # kept per rank; the stream reduces nothing


class Group(StrEnum):
    """Parallel groups a rank belongs to; its coordinate in each is sent with every message."""

    DATA = "dp"
    TENSOR = "tp"
    PIPELINE = "pp"
    CONTEXT = "cp"
    EXPERT = "ep"


# ----------------------------------------------------------------------------- names
# Every metric name, label key and tensor field is written here once; the rest of the code
# refers to these constants (``Loss.SUM``, ``Label.SOURCE``), never to a string of its own,
# so a misspelt name fails where it is written instead of dead-lettering a rank's message.


class Label:
    """Label keys (bounded sets; see each metric's entry)."""

    SOURCE = "source"  # a registered data source or modality of the loss
    GROUP = "group"  # gradient parameter group: GRAD_GROUPS
    OP = "op"  # collective name
    TENSOR = "tensor"  # registered observation point
    KIND = "kind"  # fwd, bwd, grad, param, update, opt_*
    LAYER = "layer"  # block index
    EXPERT = "expert"  # expert index within a layer
    SHARD = "shard"  # expert-parallel shard of an expert
    BRANCH = "branch"  # attn | mlp
    THETA = "theta"  # gate-saturation threshold
    MODALITY = "modality"  # text | media
    DEPTH = "depth"  # MTP depth
    MODULE = "module"  # parameter role (discover.PARAM_ROLES) or activation view
    PARAM_GROUP = "param_group"  # optimizer parameter group: its index, or its "name" entry
    NAME = "name"  # a user metric's name (``userlog.check_name``; bounded per run)


class Loss:
    SUM = "loss.sum"
    TOKENS = "loss.tokens"


class Grad:
    NORM_SQ = "grad.norm_sq"
    ABS_SUM = "grad.abs_sum"
    ABS_MAX = "grad.abs_max"
    ZEROS = "grad.zeros"
    ELEMENTS = "grad.elements"
    NONFINITE = "grad.nonfinite"
    CLIPPED = "grad.clipped"
    CLIP_THRESHOLD = "grad.clip_threshold"
    CLIP_NORM = "grad.clip_norm"


GRAD_GROUPS: tuple[str, ...] = ("embedding", "expert", "other")
"""Values of Label.GROUP: embedding and expert parameters are reported apart (001 §4)."""


class Guard:
    SKIPPED = "guard.skipped"
    REPLAYED = "guard.replayed"
    REPLAY_MISMATCH = "guard.replay_mismatch"


class System:
    STEP_TIME = "step.duration"
    FLOPS = "flops.step"
    POSITIONS = "tokens.positions"


class Memory:
    PEAK_ALLOCATED = "memory.peak_allocated"
    PEAK_RESERVED = "memory.peak_reserved"
    PEAK_RSS = "memory.peak_rss"
    ALLOCATED = "memory.allocated"
    RESERVED = "memory.reserved"
    CAPACITY = "memory.capacity"


class Comm:
    WAIT = "comm.wait"
    CALLS = "comm.calls"
    BYTES = "comm.bytes"


class Host:
    RSS = "host.rss"
    CPU_PERCENT = "host.cpu_percent"
    CPU_PRESSURE = "host.cpu_pressure"
    FAULTS_MINOR = "host.page_faults_minor"
    FAULTS_MAJOR = "host.page_faults_major"
    INTERVAL = "host.interval"


class Device:
    UTILIZATION = "device.utilization"
    MEMORY_USED = "device.memory_used"
    POWER = "device.power"
    TEMPERATURE = "device.temperature"
    CLOCK = "device.clock_mhz"


class Net:
    RX = "net.rx"
    TX = "net.tx"


class Output:
    LOGITS_ABS_MAX = "output.logits_abs_max"
    LOGITS_SUM_SQ = "output.logits_sum_sq"
    LOGITS_N = "output.logits_n"
    POSITIONS = "output.positions"
    TOP2_GAP_SUM = "output.top2_gap_sum"
    TOP2_EQUAL = "output.top2_equal"
    MTP_POSITIONS = "output.mtp_positions"
    MTP_AGREE = "output.mtp_agree"


class Tensor:
    """The one-pass scan's components, in the scan vector's order (``scan.ScanFields``)."""

    N = "tensor.n"
    SUM = "tensor.sum"
    SUM_SQ = "tensor.sum_sq"
    ABS_SUM = "tensor.abs_sum"
    ABS_MAX = "tensor.abs_max"
    ZEROS = "tensor.zeros"
    NONFINITE = "tensor.nonfinite"
    SUM3 = "tensor.sum3"
    SUM4 = "tensor.sum4"
    ALL = (N, SUM, SUM_SQ, ABS_SUM, ABS_MAX, ZEROS, NONFINITE, SUM3, SUM4)


TENSOR_FIELDS: tuple[str, ...] = tuple(name.removeprefix("tensor.") for name in Tensor.ALL)
"""Column names of a reduced scan (``tensor_stats``): n, sum, sum_sq, ..., sum4."""


class Export:
    DROPPED = "export.dropped_total"


class Optim:
    LR = "optim.lr"


class Moe:
    EXPERT_TOKENS = "moe.expert_tokens"
    ROUTER_BIAS = "moe.router_bias"
    BIAS_ABS_SUM = "moe.expert_bias_abs_sum"
    MARGIN_TOKENS = "moe.topk_margin_tokens"
    MARGIN_SUM = "moe.topk_margin_sum"
    MARGIN_P90 = "moe.topk_margin_p90"
    MARGIN_P99 = "moe.topk_margin_p99"
    MARGIN_MAX = "moe.topk_margin_max"
    MARGIN_P10 = "moe.topk_margin_p10"
    MARGIN_MIN = "moe.topk_margin_min"


class Residual:
    """Per (layer, branch): ``residual.<stat>_<field>`` for every stat of ``STATS`` and field
    of ``FIELDS`` (``Residual.name``), the token count, and the gate saturation counts."""

    TOKENS = "residual.tokens"
    GATE_CLOSED = "residual.gate_closed"
    GATE_CHANNELS = "residual.gate_channels"
    STATS = ("stream_norm", "branch_norm", "ratio", "importance", "angle", "noop")
    FIELDS = ("sum", "p90", "p99", "max")

    @staticmethod
    def name(stat: str, field: str) -> str:
        """``residual.<stat>_<field>``; a ValueError for a stat or field that is not one."""
        if stat not in Residual.STATS or field not in Residual.FIELDS:
            raise ValueError(f"no residual metric for stat {stat!r}, field {field!r}")
        return f"residual.{stat}_{field}"


class Modality:
    TOKENS = "modality.tokens"
    MEDIA_SUM_SQ = "modality.media_sum_sq"
    MEDIA_N = "modality.media_n"
    TEXT_SUM_SQ = "modality.text_sum_sq"
    TEXT_N = "modality.text_n"
    ENCODER_GRAD_SQ = "modality.encoder_grad_sq"
    ALL_GRAD_SQ = "modality.all_grad_sq"
    ENCODER_PARAMS = "modality.encoder_params"
    ALL_PARAMS = "modality.all_params"


class Attn:
    BOS_SUM_SQ = "attn.bos_value_grad_sum_sq"
    BOS_N = "attn.bos_value_grad_n"
    BOS_ABS_MAX = "attn.bos_value_grad_abs_max"
    VALUE_SUM_SQ = "attn.value_grad_sum_sq"
    VALUE_N = "attn.value_grad_n"


class Module:
    GRAD_SUM_SQ = "module.grad_sum_sq"
    GRAD_N = "module.grad_n"
    GRAD_ABS_MAX = "module.grad_abs_max"
    ACT_SUM_SQ = "module.act_sum_sq"
    ACT_N = "module.act_n"


class User:
    """A user's own metrics (``Monitor.log``, ``StepContext.log``): one series per name (label
    ``name``); the reduction the user declared is carried by the metric it is sent as."""

    MEAN = "user.mean"  # the value; with user.ranks: mean over ranks = Σ / Σ ranks
    RANKS = "user.ranks"  # 1 per rank that sent user.mean
    SUM = "user.sum"
    MAX = "user.max"
    FIRST = "user.first"  # rank 0 only


NAMESPACES = (
    Loss,
    Grad,
    Guard,
    System,
    Memory,
    Comm,
    Host,
    Device,
    Net,
    Output,
    Tensor,
    Export,
    Moe,
    Residual,
    Modality,
    Attn,
    Module,
    Optim,
    User,
)
"""The classes above that hold metric names (``Label`` holds label keys)."""


class Tier(StrEnum):
    """When a metric is measured, after the seeds' cadence rule (001 §0): cheap alerting
    metrics and their every-step companions on every step; tensor scans and per-layer views
    every K steps (the seeds' 100); forensics on demand. A rank's ``ProbeConfig.cadence``
    sets each tier's interval; a probe runs on a step where its metrics' tier is due."""

    STEP = "step"
    SCAN = "scan"
    DEMAND = "demand"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One metric's definition.

    ``replicated_over`` lists the groups across which ranks hold identical values (an
    all-reduced gradient is identical on every data-parallel rank; the loss is identical on
    every tensor-parallel rank). The stream keeps one representative per replica class
    before applying ``reduction`` over the remaining ranks, so nothing is counted twice.
    """

    name: str
    priority: Priority
    cadence_steps: int  # the seeds' default: 1 every step, 100 every 100th, 0 on demand
    reduction: Reduction
    unit: str  # UCUM: s, By, %, 1, or an annotation such as {token}
    point: str  # where and when it is measured
    doc: str  # formula and meaning
    seed: str  # citation into ../shared/seeds
    labels: tuple[str, ...] = ()
    replicated_over: frozenset[Group] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.cadence_steps not in (0, 1, 100):
            raise ValueError(f"{self.name}: cadence_steps must be 0, 1 or 100 (a Tier)")
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"bad metric name {self.name!r}")

    @property
    def nonnegative(self) -> bool:
        """A count, a size or a duration: a negative or non-finite value cannot be a
        measurement. A loss sum (nats) is not one: NaN or inf there is what a diverging
        run measures, and must reach the store."""
        return (self.unit.startswith("{") and self.unit != "{nat}") or self.unit in ("By", "s")

    @property
    def tier(self) -> Tier:
        """When it is measured: its cadence as a tier the rank's config sets the interval of."""
        return {1: Tier.STEP, 100: Tier.SCAN, 0: Tier.DEMAND}[self.cadence_steps]


_ALL = frozenset(Group)
_OWNED: frozenset[Group] = frozenset()  # parameter-side: each element reported by its owner
_TP_PP = frozenset({Group.TENSOR, Group.PIPELINE})
P0, P1, P2 = Priority.P0, Priority.P1, Priority.P2
SUM, MAX, MIN = Reduction.SUM, Reduction.MAX, Reduction.MIN


def _m(
    name: str,
    priority: Priority,
    cadence: int,
    reduction: Reduction,
    unit: str,
    *,
    point: str,
    doc: str,
    seed: str,
    labels: tuple[str, ...] = (),
    rep: frozenset[Group] = frozenset(),
) -> MetricSpec:
    return MetricSpec(
        name=name,
        priority=priority,
        cadence_steps=cadence,
        reduction=reduction,
        unit=unit,
        point=point,
        doc=doc,
        seed=seed,
        labels=labels,
        replicated_over=rep,
    )


# ------------------------------------------------------------------------------- loss (§3)
_LOSS_POINT = (
    "per-token NLL of every micro-batch under the valid-target mask (padding and "
    "ignored labels excluded), accumulated in float64 over the optimizer step"
)
_LOSS = (
    _m(
        Loss.SUM,
        P0,
        1,
        SUM,
        "{nat}",
        point=_LOSS_POINT,
        labels=(Label.SOURCE,),
        rep=frozenset({Group.TENSOR}),
        doc="Σ_t m_t·ℓ_t over this rank's valid targets; with label source=μ only targets of "
        "the registered data source or modality μ. Reduction: sum over ranks, then "
        "L = Σ loss.sum / Σ loss.tokens, L_r = loss.sum/loss.tokens, L^(μ) likewise. "
        "Not sent when the rank (or μ) has no valid target.",
        seed="001 §3 (global mean loss, local mean loss, loss by source and modality)",
    ),
    _m(
        Loss.TOKENS,
        P0,
        1,
        SUM,
        "{token}",
        point=_LOSS_POINT,
        labels=(Label.SOURCE,),
        rep=frozenset({Group.TENSOR}),
        doc="Σ_t m_t: valid targets on this rank (per source μ with the label). Reduction: "
        "sum over ranks; the denominator of L and L^(μ), N_tok of TPS, and the token "
        "share π^(μ) = Σ tokens{μ} / Σ tokens. Not sent when it would be 0.",
        seed="001 §3 (π^(μ)), §5 (N_tok)",
    ),
)

# --------------------------------------------------------------------------- gradients (§4)
_GRAD_POINT = (
    "global gradient after accumulation over micro-batches and loss-scale removal, "
    "before clipping; one value per optimizer step"
)
_GRAD_LABEL_DOC = (
    " Label group ∈ {embedding, expert, other} restricts it to that parameter "
    "group; unlabelled = all parameters. Each rank sums the parameters it owns "
    "(``parallel``): a replica — an all-reduced DDP gradient, a DTensor "
    "Replicate dim, a hand-declared tp/ep replica — only at coordinate 0, a "
    "shard on every rank holding one; so the stream sums over all ranks."
)
_G: dict[str, Any] = dict(labels=(Label.GROUP,), point=_GRAD_POINT)
_GRAD = (
    _m(
        Grad.NORM_SQ,
        P0,
        1,
        SUM,
        "1",
        **_G,
        doc="Σ_j g_j² over the gradient elements this rank holds. Reduction: sum over shards; "
        "G2 = sqrt(Σ). Unlabelled (every step), it is computed like clip_grad_norm_ "
        "(per-tensor norms, their norm, squared), so a NaN/Inf element makes it "
        "non-finite; per group it comes with the P1 gradient scans (finite elements)."
        + _GRAD_LABEL_DOC,
        seed="001 §4 (global gradient norm G2)",
    ),
    _m(
        Grad.ABS_SUM,
        P1,
        1,
        SUM,
        "1",
        **_G,
        doc="Σ_j |g_j| over finite elements. Reduction: sum; G_mean = Σ abs_sum / Σ elements."
        + _GRAD_LABEL_DOC,
        seed="001 §4 (mean absolute gradient)",
    ),
    _m(
        Grad.ABS_MAX,
        P1,
        1,
        MAX,
        "1",
        **_G,
        doc="max_j |g_j| over finite elements. Reduction: max over ranks (G_max)."
        + _GRAD_LABEL_DOC,
        seed="001 §4 (maximum absolute gradient)",
    ),
    _m(
        Grad.ZEROS,
        P1,
        1,
        SUM,
        "{element}",
        **_G,
        doc="Σ_j 1[g_j = 0]. Reduction: sum; Z_g = Σ zeros / Σ elements." + _GRAD_LABEL_DOC,
        seed="001 §4 (gradient zero fraction)",
    ),
    _m(
        Grad.ELEMENTS,
        P1,
        1,
        SUM,
        "{element}",
        **_G,
        doc="P: gradient elements held (parameters without a gradient are left out, as "
        "clip_grad_norm_ does). Reduction: sum." + _GRAD_LABEL_DOC,
        seed="001 §4 (P)",
    ),
    _m(
        Grad.NONFINITE,
        P1,
        1,
        SUM,
        "{element}",
        **_G,
        doc="Σ_j 1[g_j is NaN or ±Inf]. Reduction: sum." + _GRAD_LABEL_DOC,
        seed="001 §4, §6 (overflow)",
    ),
    _m(
        Grad.CLIPPED,
        P0,
        1,
        MAX,
        "1",
        rep=_ALL,
        point=_GRAD_POINT + "; compared with the loop's clip threshold c",
        doc="1[G2 > c] for the global G2 the loop clips with. "
        "Identical on every rank; reduction: max. Clip rate = mean over a window of W steps.",
        seed="001 §4 (clip rate)",
    ),
    _m(
        Grad.CLIP_THRESHOLD,
        P1,
        1,
        MAX,
        "1",
        rep=_ALL,
        point="the loop's configuration",
        doc="c, the global-norm clip threshold behind grad.clipped. Reduction: max.",
        seed="001 §4 (clip rate)",
    ),
    _m(
        Grad.CLIP_NORM,
        P0,
        1,
        MAX,
        "1",
        rep=_ALL,
        point="the total norm the loop clipped with, as the loop computed it "
        "(``s.clipped(total_norm)``), when it is not the monitor's own measurement",
        doc="the loop's own global gradient norm, sent only when the loop reports one it "
        "computed itself (through ``StepContext.clip_grad_norm_`` the clipping norm is G2). "
        "The stream compares it with G2 every step (grad_norm_audit): a loop that norms "
        "only its local shard, or a wrong sharded reduction, reports another value. "
        "Identical on every rank for a global norm; reduction: max.",
        seed="001 §4 (clip rate)",
    ),
)

# --------------------------------------------------------------------- spike guard (§4)
_GUARD_POINT = "the training loop's spike guard, once per optimizer step"
_GUARD = (
    _m(
        Guard.SKIPPED,
        P1,
        1,
        MAX,
        "{step}",
        rep=_ALL,
        point=_GUARD_POINT,
        doc="Updates the guard skipped in this step (0 or 1). A global decision: identical on "
        "every rank, reduction max; the stream accumulates the count.",
        seed="001 §4 (skip and replay counters)",
    ),
    _m(
        Guard.REPLAYED,
        P1,
        1,
        MAX,
        "{step}",
        rep=_ALL,
        point=_GUARD_POINT,
        doc="Replays counted at this step: the loop's own check inside the step "
        "(StepContext.replayed), or Monitor.replay of an earlier kept step, counted with "
        "the next emitted step. Identical on every rank; reduction max.",
        seed="001 §4 (skip and replay counters)",
    ),
    _m(
        Guard.REPLAY_MISMATCH,
        P1,
        1,
        MAX,
        "{step}",
        rep=_ALL,
        point=_GUARD_POINT,
        doc="Replays counted at this step (as guard.replayed) whose loss (and, for "
        "Monitor.replay, gradient norm) differed from the original on identical inputs: "
        "verdict hardware (the device or non-deterministic kernels, not the batch); a "
        "replay that reproduced (replayed − mismatch) says data. Identical on every rank; "
        "reduction max.",
        seed="001 §4 (skip and replay counters)",
    ),
)

# ------------------------------------------------------------------------- system (§5)
_STEP_POINT = "the monitor's step context on this rank: entry to exit"
_NODE = "sampled on the emitter thread when the step's P1 probes run"
_SYSTEM = (
    _m(
        System.STEP_TIME,
        P0,
        1,
        MAX,
        "s",
        point="wall time of the whole step on this rank: data "
        "loading, forward, backward, optimizer and synchronisation",
        doc="τ_r. The step's wall time is τ = max_r τ_r. The straggler is the rank with the "
        "largest own time τ_r - τ_wait,r (comm.wait summed over ops), scored against "
        "the other ranks' median own time.",
        seed="001 §5 (step time, straggler score)",
    ),
    _m(
        System.FLOPS,
        P0,
        1,
        SUM,
        "{FLOP}",
        rep=_TP_PP,
        point=_STEP_POINT + "; token positions "
        "given to the model (padding included: the hardware computes them)",
        doc="F = f·T_pos with the fixed estimator f = 6N + 12·L·d·S per token (PaLM, App. B; N "
        "parameters of the whole model, L layers, d width, S sequence length). Every "
        "tensor-parallel rank and pipeline stage of one replica works on the same positions "
        "and reports the same F, so one counts; data/context/expert-parallel ranks hold "
        "different positions and are summed. Φ = Σ F / (D·τ).",
        seed="001 §5 (compute rate Φ)",
    ),
    _m(
        System.POSITIONS,
        P1,
        1,
        SUM,
        "{token}",
        rep=_TP_PP,
        point=_STEP_POINT,
        doc="T_pos: input positions fed to the model this step, padding included. Reduction: "
        "sum over replicas; 1 - Σ loss.tokens / Σ tokens.positions is the padding fraction.",
        seed="001 §5, §11 (padding counted as tokens)",
    ),
    _m(
        Memory.PEAK_ALLOCATED,
        P0,
        1,
        MAX,
        "By",
        point="CUDA caching allocator; the "
        "peak is reset when the step context opens, so each value covers exactly one step",
        doc="max allocated bytes during the step on this device. Reduction: max over ranks "
        "(the device closest to out-of-memory).",
        seed="001 §5 (peak memory)",
    ),
    _m(
        Memory.PEAK_RESERVED,
        P0,
        1,
        MAX,
        "By",
        point="CUDA caching allocator; reset when the step context opens",
        doc="max reserved (allocator-held) bytes during the step. Reduction: max over ranks.",
        seed="001 §5 (peak memory)",
    ),
    _m(
        Memory.PEAK_RSS,
        P0,
        1,
        MAX,
        "By",
        point="getrusage(RUSAGE_SELF).ru_maxrss at "
        "step exit; the kernel's high-water mark since process start (never reset)",
        doc="max over the process lifetime of its resident set size (the CPU analogue of peak "
        "device memory). Reduction: max over ranks.",
        seed="001 §5 (peak memory, CPU)",
    ),
    _m(
        Memory.ALLOCATED,
        P1,
        1,
        MAX,
        "By",
        point="CUDA allocator at step exit",
        doc="bytes held by live tensors. Reduction: max. reserved - allocated widening means "
        "fragmentation or an oversized cache.",
        seed="001 §5 (allocated and reserved)",
    ),
    _m(
        Memory.RESERVED,
        P1,
        1,
        MAX,
        "By",
        point="CUDA allocator at step exit",
        doc="bytes held by the allocator, cached blocks included. Reduction: max.",
        seed="001 §5 (allocated and reserved)",
    ),
    _m(
        Memory.CAPACITY,
        P0,
        1,
        MIN,
        "By",
        point="read once at attach: the CUDA device's total (torch.cuda.mem_get_info), on "
        "CPU the process's cgroup limit (memory.max, v1 memory.limit_in_bytes) or the "
        "system's physical memory, whichever is smaller",
        doc="the memory the rank's peak (memory.peak_allocated, on CPU memory.peak_rss) may "
        "reach before it fails. Reduction: min (the smallest device); the stream also reads it "
        "per rank for the headroom 1 - peak_r / capacity_r.",
        seed="001 §5 (peak memory: headroom before the first out-of-memory failure)",
    ),
    _m(
        Comm.WAIT,
        P1,
        1,
        MAX,
        "s",
        labels=(Label.OP,),
        point="around every torch.distributed "
        "collective the loop issues while attached (sync calls; Work.wait of async ones; CUDA "
        "events on the current stream, read later by the emitter thread), on P1 steps; and "
        "the wait the loop measures itself and reports with StepContext.comm_wait(op, s) "
        "(DDP's bucketed all-reduce through a comm hook, op ddp_allreduce), on every step it "
        "is reported",
        doc="τ_wait: exposed collective wait summed over the step's calls of op (a reported "
        "wait adds to the wrappers' for the same op). Reduction: max over ranks; W_comm = "
        "τ_wait/τ. Per rank, the stream takes the sum over ops off τ_r: the rank's own "
        "time τ_r - τ_wait,r names the straggler (the ranks waiting for it carry its "
        "delay in τ_r, not in their own time). DDP's bucketed all-reduce is internal: "
        "included only when the loop reports it.",
        seed="001 §5 (exposed collective wait)",
    ),
    _m(
        Comm.CALLS,
        P1,
        1,
        SUM,
        "{call}",
        labels=(Label.OP,),
        point="as comm.wait",
        doc="number of calls of collective op in the step (a change in the count is a change "
        "in the loop, not the network). Reduction: sum. Every step, like comm.wait (the "
        "seeds' default is every 10 steps; the straggler rule reads the wait every step "
        "and a wrapped call costs two clock reads).",
        seed="001 §5",
    ),
    _m(
        Comm.BYTES,
        P1,
        1,
        SUM,
        "By",
        labels=(Label.OP,),
        point="as comm.wait",
        doc="input bytes of those calls (numel·element size). Reduction: sum.",
        seed="001 §5",
    ),
    _m(
        Host.RSS,
        P1,
        1,
        MAX,
        "By",
        point="psutil, " + _NODE,
        doc="process resident set size at the sample (host memory pressure, leaks in data "
        "loaders). Reduction: max.",
        seed="001 §5 (host telemetry)",
    ),
    _m(
        Host.CPU_PERCENT,
        P1,
        1,
        MAX,
        "%",
        point="getrusage user + system time, " + _NODE,
        doc="process CPU use since the previous sample, percent of one core. Reduction: max.",
        seed="001 §5 (host telemetry)",
    ),
    _m(
        Host.CPU_PRESSURE,
        P1,
        1,
        MAX,
        "%",
        point="/proc/pressure/cpu 'some avg10', " + _NODE,
        doc="share of the last 10 s in which some task waited for a CPU (Linux PSI); absent "
        "where PSI is not available. Reduction: max.",
        seed="001 §5 (CPU pressure)",
    ),
    _m(
        Host.FAULTS_MINOR,
        P1,
        1,
        SUM,
        "{fault}",
        point="getrusage, " + _NODE,
        doc="minor page faults of the process since the previous sample. Reduction: sum.",
        seed="001 §5 (page faults)",
    ),
    _m(
        Host.FAULTS_MAJOR,
        P1,
        1,
        SUM,
        "{fault}",
        point="getrusage, " + _NODE,
        doc="major page faults (disk reads) since the previous sample. Reduction: sum.",
        seed="001 §5 (page faults)",
    ),
    _m(
        Host.INTERVAL,
        P1,
        1,
        MAX,
        "s",
        point=_NODE,
        doc="seconds covered by this sample's 'since the previous sample' counters (page "
        "faults, net.*); rates are counter / interval. Reduction: max.",
        seed="001 §5",
    ),
    _m(
        Device.UTILIZATION,
        P1,
        1,
        MIN,
        "%",
        point="NVML (pynvml, optional), " + _NODE,
        doc="GPU utilisation over NVML's last sample period. Reduction: min (the idlest device).",
        seed="001 §5 (device telemetry)",
    ),
    _m(
        Device.MEMORY_USED,
        P1,
        1,
        MAX,
        "By",
        point="NVML, " + _NODE,
        doc="device memory in use by all processes, as NVML sees it (includes other processes "
        "and the CUDA context). Reduction: max.",
        seed="001 §5",
    ),
    _m(
        Device.POWER,
        P1,
        1,
        MAX,
        "W",
        point="NVML, " + _NODE,
        doc="board power draw averaged over NVML's last sample period, in watts. Reduction: max "
        "(power capping throttles clocks).",
        seed="001 §5 (power)",
    ),
    _m(
        Device.TEMPERATURE,
        P1,
        1,
        MAX,
        "Cel",
        point="NVML, " + _NODE,
        doc="GPU die temperature in degrees Celsius; thermal throttling lowers the clock. "
        "Reduction: max.",
        seed="001 §5 (temperature)",
    ),
    _m(
        Device.CLOCK,
        P1,
        1,
        MIN,
        "MHz",
        point="NVML, " + _NODE,
        doc="current SM clock in MHz; a device below its peers is throttled. Reduction: min "
        "(the most throttled device).",
        seed="001 §5 (clock)",
    ),
    _m(
        Net.RX,
        P1,
        1,
        SUM,
        "By",
        point="psutil net_io_counters, non-loopback "
        "interfaces, local rank 0 only (once per node), " + _NODE,
        doc="bytes received by the node since the previous sample. Reduction: sum over nodes. "
        "Read once per node: every local rank reading it would multiply the traffic.",
        seed="001 §5 (node counters)",
    ),
    _m(
        Net.TX,
        P1,
        1,
        SUM,
        "By",
        point="as net.rx",
        doc="bytes sent by the node since the previous sample. Reduction: sum over nodes.",
        seed="001 §5 (node counters)",
    ),
)

# ------------------------------------------------------------------- optimizer (§4)
_OPTIM = (
    _m(
        Optim.LR,
        P0,
        1,
        MAX,
        "1",
        labels=(Label.PARAM_GROUP,),
        rep=_ALL,
        point="the optimizer's param_groups[i]['lr'] when the step context closes (after "
        "optimizer.step() and a scheduler's step inside the context): the rate the "
        "step's update used, unless a scheduler ran before the update",
        doc="η_i, the learning rate of parameter group i (label param_group: the group's "
        "'name' entry, else its index). Identical on every rank; reduction max. Read "
        "with clip rate: a sustained clip rate is an unplanned learning-rate schedule.",
        seed="001 §4 (clip rate as a learning-rate schedule; optimizer tensor naming)",
    ),
)

# -------------------------------------------------------------------- output layer (002)
_OUT_POINT = (
    "LM-head output logits z [..., V] of every micro-batch, valid positions only "
    "(the step's mask), accumulated over the step"
)
_OUTPUT = (
    _m(
        Output.LOGITS_ABS_MAX,
        P0,
        1,
        MAX,
        "1",
        point=_OUT_POINT,
        doc="max |z| over valid positions and this rank's vocabulary entries; NaN/Inf "
        "propagate (an overflow must show). Reduction: max. Moves before the loss.",
        seed="001 §6 (absolute maximum at the model output is P0); 002 logits_abs.max",
    ),
    _m(
        Output.LOGITS_SUM_SQ,
        P0,
        1,
        SUM,
        "1",
        point=_OUT_POINT,
        doc="Σ z² over valid positions. Reduction: sum; RMS = sqrt(Σ sum_sq / Σ logits_n).",
        seed="002 output_layer_logits_rms (P0)",
    ),
    _m(
        Output.LOGITS_N,
        P0,
        1,
        SUM,
        "{element}",
        point=_OUT_POINT,
        doc="valid positions × vocabulary entries on this rank: the RMS denominator. Sum.",
        seed="002 output_layer_logits_rms",
    ),
    _m(
        Output.POSITIONS,
        P1,
        100,
        SUM,
        "{token}",
        point=_OUT_POINT,
        doc="Σ m_t: valid positions behind the top-2 statistics, their denominator. "
        "Reduction: sum.",
        seed="002 top2_diff, top2_equal_ratio",
    ),
    _m(
        Output.TOP2_GAP_SUM,
        P1,
        100,
        SUM,
        "1",
        point=_OUT_POINT + "; needs the full "
        "vocabulary on the rank (not available with vocabulary-parallel logits)",
        doc="Σ over valid positions of z_(1) − z_(2). Reduction: sum; mean gap = Σ / Σ "
        "positions (head confidence; a small gap alone is not a collapse).",
        seed="002 output_layer_logits_top2_diff",
    ),
    _m(
        Output.TOP2_EQUAL,
        P1,
        100,
        SUM,
        "{token}",
        point=_OUT_POINT + "; full vocabulary",
        doc="Σ over valid positions of 1[z_(1) = z_(2)]. Reduction: sum; ratio = Σ / Σ positions.",
        seed="002 output_layer_logits_top2_equal_ratio",
    ),
)

# ------------------------------------------------------------------------- tensors (§6)
_T_POINT = (
    "one registered observation point; kind=fwd: module output in the original "
    "forward (never the recomputation of activation checkpointing); bwd: gradient "
    "w.r.t. that output; grad: parameter gradient at the grad.* point; param: the "
    "parameter just before the optimizer step; update: Δw = w_after − w_before; "
    "opt_grad/opt_normalized/opt_direction: AdamW chain (P2). Activations whose "
    "leading dims are the step mask's [B, T] cover valid positions only"
)
_T_DOC = (
    " Labels: tensor = registered name (model structure), kind as in the point. A "
    "tensor identical on several ranks is reported by one of them (coordinate 0 of the "
    "replicating groups); shards are summed."
)
_T: dict[str, Any] = dict(labels=(Label.TENSOR, Label.KIND), point=_T_POINT)
_TENSOR = (
    _m(
        Tensor.N,
        P1,
        100,
        SUM,
        "{element}",
        **_T,
        doc="N, elements scanned. Sum." + _T_DOC,
        seed="001 §6",
    ),
    _m(
        Tensor.SUM,
        P1,
        100,
        SUM,
        "1",
        **_T,
        doc="Σ x_j over finite elements (mean). Sum." + _T_DOC,
        seed="001 §6 (κ needs μ)",
    ),
    _m(
        Tensor.SUM_SQ,
        P1,
        100,
        SUM,
        "1",
        **_T,
        doc="Σ x_j² over finite elements; M2 = sum_sq/(n − nonfinite), RMS = sqrt(M2). Sum. "
        "ρ = RMS(update)/(RMS(param)+ε) is formed from kind=update and kind=param." + _T_DOC,
        seed="001 §6 (RMS, update ratio ρ)",
    ),
    _m(
        Tensor.ABS_SUM,
        P1,
        100,
        SUM,
        "1",
        **_T,
        doc="Σ |x_j| over finite elements; AbsMean = abs_sum/(n − nonfinite). Sum." + _T_DOC,
        seed="001 §6 (absolute mean)",
    ),
    _m(
        Tensor.ABS_MAX,
        P0,
        100,
        MAX,
        "1",
        **_T,
        doc="max |x_j| over finite elements. Reduction: max over ranks, never averaged." + _T_DOC,
        seed="001 §6 (absolute maximum)",
    ),
    _m(
        Tensor.ZEROS,
        P1,
        100,
        SUM,
        "{element}",
        **_T,
        doc="Σ 1[x_j = 0]; Z_x = zeros/n. Sum." + _T_DOC,
        seed="001 §6 (zero fraction)",
    ),
    _m(
        Tensor.NONFINITE,
        P1,
        100,
        SUM,
        "{element}",
        **_T,
        doc="Σ 1[x_j is NaN or ±Inf]. Sum." + _T_DOC,
        seed="001 §6 (non-finite values)",
    ),
    _m(
        Tensor.SUM3,
        P2,
        0,
        SUM,
        "1",
        **_T,
        doc="Σ x_j³ over finite elements (float64). "
        "Sum; with n, sum, sum_sq, sum4 gives the excess kurtosis κ." + _T_DOC,
        seed="001 §6 (excess kurtosis)",
    ),
    _m(
        Tensor.SUM4,
        P2,
        0,
        SUM,
        "1",
        **_T,
        doc="Σ x_j⁴ over finite elements (float64). Sum." + _T_DOC,
        seed="001 §6 (excess kurtosis)",
    ),
)

_EXPORT = (
    _m(
        Export.DROPPED,
        P1,
        1,
        Reduction.PER_RANK,
        "{step}",
        point="the rank's emitter, when a step's points are enqueued",
        doc="Cumulative count of steps whose measurements this rank's bounded export queue "
        "could not hold. Non-zero means data was lost on the rank, not in the pipeline.",
        seed="DESIGN 'Nothing silently lost'",
    ),
)

# ----------------------------------------------------- model structure (§7-§9, 002)
# Measured by ``structure_probes`` on the points ``discover`` finds. Labels are bounded by
# the model: layer = block index, expert < E, branch ∈ {attn, mlp}, modality ∈ {text,
# media}, theta ∈ the configured gate thresholds, depth = MTP depth, module ∈ the role
# names of ``discover.PARAM_ROLES`` and {attn_core, gate_score}.
_TP = frozenset({Group.TENSOR})
_ROUTER_POINT = (
    "each MoE layer's router output (top-k expert ids) on every micro-batch, "
    "valid tokens only (the step's mask; padding excluded), summed over the "
    "step's micro-batches"
)
_QUANTILE_DOC = (
    " Per-token quantiles do not combine across ranks: each rank sends the "
    "q-quantile of its own valid tokens by the 'higher' rule (the order statistic "
    "at index ⌈q·(n_r − 1)⌉, numpy method='higher'), so at least q·n_r of its "
    "tokens lie at or below it; the stream keeps the maximum over ranks, which is "
    "therefore an upper bound of the global quantile (exact with one rank). "
    "Never averaged."
)
_EXPERTS = (
    _m(
        Moe.EXPERT_TOKENS,
        P0,
        1,
        SUM,
        "{token}",
        labels=(Label.LAYER, Label.EXPERT, Label.SHARD),
        rep=_TP,
        point=_ROUTER_POINT,
        doc="c_i = Σ_t m_t Σ_j 1[e_(t,j) = i]: valid tokens routed to expert i (a token counts "
        "once for each of its k experts, so Σ_i c_i = k·valid tokens). Reduction: sum over "
        "ranks; then c̄ = Σc/E, I = max_i c_i / c̄, MaxVio = I − 1, shard imbalance over "
        "expert-parallel shard loads, H = −Σ p_i log p_i with p_i = c_i/Σc, H_norm = "
        "H/log E, dead-expert ratio. Every expert of a layer that received a valid token "
        "is sent (zeros included: the stream reads E from them); a layer that received "
        "none sends nothing.",
        seed="001 §7 (imbalance ratio, MaxVio, shard imbalance, H_norm); 002 moe/dead_expert_ratio",
    ),
    _m(
        Moe.ROUTER_BIAS,
        P2,
        0,
        MAX,
        "1",
        labels=(Label.LAYER, Label.EXPERT),
        rep=_ALL,
        point="the router's expert-selection bias (parameter or buffer) at its first forward "
        "of the step",
        doc="b_i, the bias added to expert i's routing score before top-k selection "
        "(auxiliary-loss-free balancing). Identical on every replica; reduction max over "
        "the one representative.",
        seed="001 §7 (routing bias terms, P2)",
    ),
    _m(
        Moe.BIAS_ABS_SUM,
        P1,
        100,
        MAX,
        "1",
        labels=(Label.LAYER,),
        rep=_ALL,
        point="as moe.router_bias, on scan steps",
        doc="Σ_i |b_i| over the layer's expert-selection bias: drift of the balancing bias. "
        "Identical on every replica; reduction max; the stream's ep_bias_abs_sum is the "
        "sum over layers.",
        seed="002 moe/ep_bias_abs_sum (P1)",
    ),
    _m(
        Moe.MARGIN_TOKENS,
        P2,
        0,
        SUM,
        "{token}",
        labels=(Label.LAYER,),
        rep=_TP,
        point=_ROUTER_POINT + "; selection scores = router logits + selection bias",
        doc="n: valid tokens behind the top-k margin statistics. Reduction: sum.",
        seed="001 §7 (top-k margin distributions, P2)",
    ),
    _m(
        Moe.MARGIN_SUM,
        P2,
        0,
        SUM,
        "1",
        labels=(Label.LAYER,),
        rep=_TP,
        point=_ROUTER_POINT + "; selection scores = router logits + selection bias",
        doc="Σ_t (s_(k) − s_(k+1)) over valid tokens, s_(j) the j-th largest selection score "
        "of token t (in logit units: the log-ratio of the k-th and (k+1)-th routing "
        "probabilities). Reduction: sum; mean margin = Σ sum / Σ tokens.",
        seed="001 §7 (top-k margin distributions, P2)",
    ),
    *(
        _m(
            name,
            P2,
            0,
            MAX,
            "1",
            labels=(Label.LAYER,),
            rep=_TP,
            point=_ROUTER_POINT + "; selection scores = router logits + selection bias",
            doc=f"{q} over this rank's valid tokens of the top-k margin s_(k) − s_(k+1) "
            "Reduction: max over ranks." + (_QUANTILE_DOC if q != "max" else ""),
            seed="001 §7 (top-k margin distributions, P2)",
        )
        for q, name in (("p90", Moe.MARGIN_P90), ("p99", Moe.MARGIN_P99), ("max", Moe.MARGIN_MAX))
    ),
    *(
        _m(
            name,
            P2,
            0,
            MIN,
            "1",
            labels=(Label.LAYER,),
            rep=_TP,
            point=_ROUTER_POINT + "; selection scores = router logits + selection bias",
            doc=f"{q} over this rank's valid tokens of the top-k margin (near-ties: tokens whose "
            "expert choice a small score change flips). Reduction: min over ranks"
            + (
                ", a lower bound of the global 10th percentile (each rank sends the order "
                "statistic at index ⌊0.1·(n_r − 1)⌋, the mirror of the upper bound of "
                "moe.topk_margin_p90)."
                if q == "p10"
                else "."
            ),
            seed="001 §7 (top-k margin distributions, P2)",
        )
        for q, name in (("p10", Moe.MARGIN_P10), ("min", Moe.MARGIN_MIN))
    ),
)

_RES_POINT = (
    "each block's residual adds a = s + b on every micro-batch's forward (never a "
    "recomputation), per valid token (padding excluded; media positions are valid): "
    "branch attn has s = the block input and b = the attention output; branch mlp "
    "has s = block input + attention output and b = the feed-forward (or MoE) "
    "output; b includes a branch gate where one exists"
)
_RES_STATS = (
    (
        "ratio",
        P0,
        "R_b = N_b / (N_s + ε): branch scale relative to the stream (small: a "
        "branch too weak to matter; large: a branch overwriting the stream)",
        "001 §8 (relative branch scale R_b, P0)",
    ),
    (
        "stream_norm",
        P1,
        "N_s = ‖s‖₂ of the incoming stream (with N_b, tells a shrinking "
        "branch from a growing stream)",
        "001 §8 (R_b: report N_s and N_b)",
    ),
    ("branch_norm", P1, "N_b = ‖b‖₂ of the branch output", "001 §8 (R_b: report N_s and N_b)"),
    (
        "importance",
        P1,
        "B = 1 − cos(s, a), cos(u, v) = uᵀv/(‖u‖‖v‖ + ε): how much the "
        "block turned the stream (0: direction kept)",
        "001 §8 (block importance B)",
    ),
    (
        "angle",
        P1,
        "A = arccos(cos(s, a))/π ∈ [0, 1]: the same turn as an angle",
        "001 §8 (angular distance A)",
    ),
    (
        "noop",
        P1,
        "F_noop = (1/d) Σ_j 1[Q_bf16(s_j + b_j) = Q_bf16(s_j) ∧ b_j ≠ 0]: the "
        "fraction of the token's non-zero branch values a bfloat16 residual add "
        "throws away (watch it with N_s)",
        "001 §8 (bfloat16 no-op fraction, P1)",
    ),
)
_RESIDUAL = (
    _m(
        Residual.TOKENS,
        P0,
        100,
        SUM,
        "{token}",
        labels=(Label.LAYER, Label.BRANCH),
        rep=_TP,
        point=_RES_POINT,
        doc="n: valid tokens behind the residual statistics of (layer, branch). Reduction: "
        "sum; the denominator of every residual.*_sum mean. Not sent when 0. With "
        "sequence parallelism the tensor-parallel ranks hold different tokens and must "
        "not be treated as replicas.",
        seed="001 §8 (aggregation: per valid token)",
    ),
    *(
        _m(
            Residual.name(stem, field),
            priority,
            100,
            SUM if field == "sum" else MAX,
            "1",
            labels=(Label.LAYER, Label.BRANCH),
            rep=_TP,
            point=_RES_POINT,
            doc=f"{text}, computed per valid token, then: "
            + {
                "sum": "Σ over valid tokens. Reduction: sum; mean = Σ sum / Σ residual.tokens.",
                "max": "maximum over valid tokens. Reduction: max over ranks.",
                "p90": "90th percentile over this rank's valid tokens." + _QUANTILE_DOC,
                "p99": "99th percentile over this rank's valid tokens." + _QUANTILE_DOC,
            }[field],
            seed=seed,
        )
        for stem, priority, text, seed in _RES_STATS
        for field in Residual.FIELDS
    ),
    _m(
        Residual.GATE_CLOSED,
        P1,
        100,
        SUM,
        "{channel}",
        labels=(Label.LAYER, Label.BRANCH, Label.THETA),
        rep=_OWNED,
        point="a gated branch's learned gate logits g (per channel), at the "
        "gate's first forward of the step",
        doc="Σ_j 1[σ(g_j/T) < θ]: channels of the branch gate β_j = σ(g_j/T) below θ (label "
        "theta). Reduction: sum; F_gate(θ) = Σ gate_closed / Σ gate_channels. A branch "
        "whose gates have all closed contributes nothing and rarely reopens.",
        seed="001 §8 (gate saturation fraction, θ ∈ {0.05, 0.1, 0.25})",
    ),
    _m(
        Residual.GATE_CHANNELS,
        P1,
        100,
        SUM,
        "{channel}",
        labels=(Label.LAYER, Label.BRANCH),
        rep=_OWNED,
        point="as residual.gate_closed",
        doc="d: gate channels of (layer, branch) on this rank, the F_gate denominator. Sum.",
        seed="001 §8 (gate saturation fraction)",
    ),
)

_MEDIA_POINT = (
    "the backbone's input on every micro-batch: media = the projector's output "
    "(media tokens, absent images masked), text = the token embedding's output at "
    "valid text positions; elements = tokens × width, non-finite elements excluded"
)
_MODALITY = (
    _m(
        Modality.TOKENS,
        P0,
        1,
        SUM,
        "{token}",
        labels=(Label.MODALITY,),
        rep=_TP,
        point="the token embedding (text: valid positions) and the media projector (media: "
        "present media tokens) of every micro-batch; registered only for models with a "
        "media path",
        doc="Tokens of modality μ entering the backbone. Reduction: sum; token share π^(μ) = "
        "Σ tokens{μ} / Σ_μ Σ tokens (a change means a data-mix or packing change). Not "
        "sent when 0: a rank without media sends no media count.",
        seed="001 §9 (token share π, P0, every 1-10 steps), §3",
    ),
    *(
        _m(
            name,
            P0,
            100,
            SUM,
            unit,
            rep=_TP,
            point=_MEDIA_POINT,
            doc=doc + " Reduction: sum over ranks, token-weighted (never averaged over samples or "
            "ranks); γ = sqrt(Σ media_sum_sq / Σ media_n) / (sqrt(Σ text_sum_sq / Σ text_n) "
            "+ ε). A rank that received no media sends no media_* point: no measurement, "
            "not a zero.",
            seed="001 §9 (media scale ratio γ, P0)",
        )
        for name, unit, doc in (
            (Modality.MEDIA_SUM_SQ, "1", "Σ e² over the media embeddings' elements."),
            (
                Modality.MEDIA_N,
                "{element}",
                "Media embedding elements (present media tokens × width).",
            ),
            (Modality.TEXT_SUM_SQ, "1", "Σ e² over the valid text embeddings' elements."),
            (Modality.TEXT_N, "{element}", "Text embedding elements (valid text tokens × width)."),
        )
    ),
    _m(
        Modality.ENCODER_GRAD_SQ,
        P1,
        100,
        SUM,
        "1",
        rep=_OWNED,
        point=_GRAD_POINT,
        doc="‖g_enc‖²: Σ of squared finite gradient elements of the media encoder's "
        "parameters. Reduction: sum over shards; S_enc = Σ encoder_grad_sq / Σ "
        "all_grad_sq, to read next to the encoder's parameter share (an encoder that "
        "stopped learning has S_enc far below it).",
        seed="001 §9 (encoder gradient share S_enc, P1)",
    ),
    _m(
        Modality.ALL_GRAD_SQ,
        P1,
        100,
        SUM,
        "1",
        rep=_OWNED,
        point=_GRAD_POINT,
        doc="‖g‖²: Σ of squared finite gradient elements of every parameter (the S_enc "
        "denominator, measured at the same point as its numerator). Reduction: sum.",
        seed="001 §9 (encoder gradient share S_enc)",
    ),
    _m(
        Modality.ENCODER_PARAMS,
        P1,
        100,
        SUM,
        "{parameter}",
        rep=_OWNED,
        point="the parameters counted in modality.encoder_grad_sq",
        doc="Parameter elements of the media encoder. Reduction: sum; parameter share = Σ "
        "encoder_params / Σ all_params, the reference S_enc is read against.",
        seed="001 §9 (S_enc next to the encoder's parameter share)",
    ),
    _m(
        Modality.ALL_PARAMS,
        P1,
        100,
        SUM,
        "{parameter}",
        rep=_OWNED,
        point="the parameters counted in modality.all_grad_sq",
        doc="Parameter elements of the whole model (with gradients). Reduction: sum.",
        seed="001 §9 (S_enc next to the encoder's parameter share)",
    ),
)

_MTP_POINT = (
    "LM-head logits and MTP depth-k logits of every micro-batch, aligned on the "
    "same target: main positions t+k against MTP positions t (main at t+k and MTP "
    "depth k at t both predict token t+k+1), valid targets only"
)
_BOS_POINT = (
    "the gradient w.r.t. the attention value projection's output v (v_proj, or the "
    "V third of a fused [Q|K|V] projection) of each block, in the backward of every "
    "micro-batch; loss scale and loss normalisation included as the loop applies "
    "them (the ratio to attn.value_grad_* cancels both)"
)
_STRUCT_OUTPUT = (
    _m(
        Output.MTP_POSITIONS,
        P1,
        100,
        SUM,
        "{token}",
        labels=(Label.DEPTH,),
        rep=_TP,
        point=_MTP_POINT,
        doc="Aligned valid positions compared for MTP depth k. Reduction: sum; the agreement "
        "denominator.",
        seed="002 act/mtp_{k}_lm_head_top1_agreement",
    ),
    _m(
        Output.MTP_AGREE,
        P1,
        100,
        SUM,
        "{token}",
        labels=(Label.DEPTH,),
        rep=_TP,
        point=_MTP_POINT,
        doc="Σ 1[argmax main = argmax MTP_k] over the aligned valid positions (ties resolve "
        "to the first index in both heads). Reduction: sum; top-1 agreement = Σ agree / "
        "Σ positions. Read with the MTP head's own accuracy.",
        seed="002 act/mtp_{k}_lm_head_top1_agreement",
    ),
    _m(
        Attn.BOS_SUM_SQ,
        P0,
        100,
        SUM,
        "1",
        labels=(Label.LAYER,),
        point=_BOS_POINT,
        doc="Σ ‖∂L/∂v_t‖² over valid BOS positions t (token id = BOS). Every query that "
        "attends to BOS sends gradient into v_BOS (∂L/∂v_BOS = Σ_q a_(q,BOS) ∂L/∂o_q), so "
        "an attention sink on BOS shows as a BOS value gradient far above other positions'. "
        "Reduction: sum over ranks (tensor-parallel ranks hold different heads); "
        "BOS RMS = sqrt(Σ sum_sq / Σ bos_value_grad_n), compared with the RMS of "
        "attn.value_grad_*. Not sent without a valid BOS position.",
        seed="002 bos_value_grad (attention, P0 diagnostic)",
    ),
    _m(
        Attn.BOS_N,
        P0,
        100,
        SUM,
        "{element}",
        labels=(Label.LAYER,),
        point=_BOS_POINT,
        doc="Elements behind attn.bos_value_grad_sum_sq: valid BOS positions × value width. "
        "Reduction: sum.",
        seed="002 bos_value_grad",
    ),
    _m(
        Attn.BOS_ABS_MAX,
        P0,
        100,
        MAX,
        "1",
        labels=(Label.LAYER,),
        point=_BOS_POINT,
        doc="max |∂L/∂v| over valid BOS positions and value features. Reduction: max over ranks.",
        seed="002 bos_value_grad",
    ),
    _m(
        Attn.VALUE_SUM_SQ,
        P1,
        100,
        SUM,
        "1",
        labels=(Label.LAYER,),
        point=_BOS_POINT,
        doc="Σ ‖∂L/∂v_t‖² over the other valid positions: the reference the BOS value gradient "
        "is read against. Reduction: sum.",
        seed="002 bos_value_grad",
    ),
    _m(
        Attn.VALUE_N,
        P1,
        100,
        SUM,
        "{element}",
        labels=(Label.LAYER,),
        point=_BOS_POINT,
        doc="Elements behind attn.value_grad_sum_sq (valid non-BOS positions × value width). Sum.",
        seed="002 bos_value_grad",
    ),
)

_MODULE_POINT = (
    _GRAD_POINT + "; per role of the parameter-name patterns of "
    "``discover`` (a fused QKV weight split into equal Q, K, V parts along its "
    "output features; stacked expert weights summed over the layer's experts)"
)
_MODULE = (
    _m(
        Module.GRAD_SUM_SQ,
        P2,
        0,
        SUM,
        "1",
        labels=(Label.LAYER, Label.MODULE),
        rep=_OWNED,
        point=_MODULE_POINT,
        doc="Σ g² over the weight gradient of role module in block layer (no layer label: "
        "embedding, output, norm_final). Roles: q, k, v (own or split from fused qkv), o "
        "(attention output projection), q_down, q_up, kv_down, kv_up (MLA), mlp_gate, "
        "mlp_up, mlp_down, expert_gate, expert_up, expert_down, router, norm_attn, "
        "norm_mlp, norm_q, norm_k, norm_final, embedding, output (not sent when tied to "
        "the embedding). Reduction: sum; RMS = sqrt(Σ sum_sq / Σ grad_n).",
        seed="002 grad/W_gate_rms, grad/{name}_rms (layer norms), grad/Wq,Wk,Wv, grad/Wo, "
        "grad/mla_*",
    ),
    _m(
        Module.GRAD_N,
        P2,
        0,
        SUM,
        "{element}",
        labels=(Label.LAYER, Label.MODULE),
        rep=_OWNED,
        point=_MODULE_POINT,
        doc="Gradient elements behind module.grad_sum_sq. Sum.",
        seed="002 per-module gradient rows",
    ),
    _m(
        Module.GRAD_ABS_MAX,
        P2,
        0,
        MAX,
        "1",
        labels=(Label.LAYER, Label.MODULE),
        rep=_OWNED,
        point=_MODULE_POINT,
        doc="max |g| over the role's weight gradient; NaN propagates. Reduction: max.",
        seed="002 grad/word_embeddings_abs.max, grad/output_layer_abs.max, grad/Wq_abs.max, "
        "grad/Wo_abs.max, grad/mla_*_abs.max",
    ),
    _m(
        Module.ACT_SUM_SQ,
        P2,
        0,
        SUM,
        "1",
        labels=(Label.LAYER, Label.MODULE),
        point="module attn_core: the input of the attention output projection (attention "
        "core output, after a gated-attention gate), module gate_score: the sigmoid "
        "gate scores of gated attention; forward of every micro-batch, valid positions",
        doc="Σ x² over valid positions × features. Reduction: sum (tensor-parallel ranks hold "
        "different heads); RMS = sqrt(Σ act_sum_sq / Σ act_n).",
        seed="002 act/attn_out_before_proj_rms, act/gate_scores_rms",
    ),
    _m(
        Module.ACT_N,
        P2,
        0,
        SUM,
        "{element}",
        labels=(Label.LAYER, Label.MODULE),
        point="as module.act_sum_sq",
        doc="Elements behind module.act_sum_sq. Sum.",
        seed="002 act/attn_out_before_proj_rms, act/gate_scores_rms",
    ),
)

_USER_POINT = "the value a script passed to log(name, value, reduction) in this step"
_USER_SEED = "none: a user's own metric (issue 39), not a seeded signal"
_USER = (
    _m(
        User.MEAN,
        P2,
        1,
        SUM,
        "1",
        labels=(Label.NAME,),
        point=_USER_POINT + " (reduction mean)",
        doc="The user's value on this rank. Reduction: sum over ranks, then the stored mean "
        "over ranks = Σ user.mean / Σ user.ranks. A NaN or ±inf is sent and kept, as a loss.",
        seed=_USER_SEED,
    ),
    _m(
        User.RANKS,
        P2,
        1,
        SUM,
        "{rank}",
        labels=(Label.NAME,),
        point="with each user.mean point",
        doc="1 on each rank that logged the name with reduction mean. Reduction: sum; the "
        "denominator of the user's mean over ranks.",
        seed=_USER_SEED,
    ),
    _m(
        User.SUM,
        P2,
        1,
        SUM,
        "1",
        labels=(Label.NAME,),
        point=_USER_POINT + " (reduction sum)",
        doc="The user's value on this rank. Reduction: sum over ranks (a count or a total "
        "the ranks split between them). A NaN makes the sum NaN.",
        seed=_USER_SEED,
    ),
    _m(
        User.MAX,
        P2,
        1,
        MAX,
        "1",
        labels=(Label.NAME,),
        point=_USER_POINT + " (reduction max)",
        doc="The user's value on this rank. Reduction: max over ranks (a NaN on any rank "
        "makes it NaN: a non-finite value stays visible).",
        seed=_USER_SEED,
    ),
    _m(
        User.FIRST,
        P2,
        1,
        MAX,
        "1",
        labels=(Label.NAME,),
        point=_USER_POINT + " (reduction rank0: only rank 0 sends it)",
        doc="The value of rank 0 alone (an evaluation that rank 0 runs). Replicated over "
        "every group, so the stream keeps the lowest rank that sent it.",
        seed=_USER_SEED,
        rep=_ALL,
    ),
)

_SPECS = (
    *_LOSS,
    *_GRAD,
    *_GUARD,
    *_SYSTEM,
    *_OPTIM,
    *_OUTPUT,
    *_TENSOR,
    *_EXPORT,
    *_EXPERTS,
    *_RESIDUAL,
    *_MODALITY,
    *_STRUCT_OUTPUT,
    *_MODULE,
    *_USER,
)

CATALOG: Mapping[str, MetricSpec] = MappingProxyType({s.name: s for s in _SPECS})
if len(CATALOG) != len(_SPECS):  # pragma: no cover - a duplicated name is a programming error
    raise RuntimeError("duplicate metric name in the catalog")


def spec(name: str) -> MetricSpec:
    """The catalog entry for ``name``; a clear KeyError for an unknown metric."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; the catalog has {sorted(CATALOG)}") from None


def tier_of(*names: str) -> Tier:
    """The one tier of ``names`` (a probe's metrics): what gates the probe that measures
    them. A ValueError when they differ: one probe cannot serve two cadences."""
    tiers = {spec(name).tier for name in names}
    if len(tiers) != 1:
        raise ValueError(f"metrics {names} span tiers {sorted(tiers)}; split the probe")
    return tiers.pop()


def describe(name: str) -> str:
    """One entry as documentation: formula, reduction, replication, measurement point, seed."""
    s = spec(name)
    rep = ", ".join(sorted(g.value for g in s.replicated_over)) or "none"
    cadence = "on demand" if s.cadence_steps == 0 else f"every {s.cadence_steps} step(s)"
    labels = ", ".join(s.labels) or "none"
    return (
        f"{s.name} [{s.unit}] {s.priority.value}, {cadence}; reduction {s.reduction.value}, "
        f"replicated over {rep}; labels {labels}.\n  {s.doc}\n  Measured: {s.point}.\n"
        f"  Seed: {s.seed}"
    )
