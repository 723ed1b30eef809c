"""``ProbeConfig``: what a rank measures, how often, and where (validated at construction).

When a metric is measured is its catalog cadence, a ``Tier``; the config sets each tier's
interval in steps, and every probe runs on the steps where its metrics' tier is due:

=======  =======  =======================================================================
tier     default  probes (catalog metrics)
=======  =======  =======================================================================
step     1        step time, FLOPs, memory, guard counters; loss (by source); G2 and the
                  clip indicator; per-group gradient Σ|g|, max|g|, zeros, non-finite;
                  output logits; collective waits; host/device/network telemetry; expert
                  token counts; modality token counts
scan     100      tensor scans (fwd, bwd, grad, param, update); output top-2; residual
                  paths and gates; media scale; S_enc; MTP agreement; BOS value gradient
demand   0        kurtosis moments on the scans; the AdamW chain; router bias and top-k
                  margins; per-module views (0: only when asked for)
=======  =======  =======================================================================

A tier runs on step t when ``cadence[tier] > 0 and t % cadence[tier] == 0``; the step and
scan tiers also run on every step while a control message has densified the monitor. The
defaults follow the seeds' cadence rule: cheap alerting metrics every step, tensor scans
every 100 steps, forensics on demand (001 §0, §12).

Name patterns are regular expressions matched in full (``re.fullmatch``) against qualified
names with wrapper prefixes removed (``module.`` of DDP, ``_orig_mod.`` of torch.compile).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .catalog import Tier
from .structure_config import StructureConfig

__all__ = ["DEFAULT_CADENCE", "DEFAULT_MODULE_NAMES", "DEFAULT_MODULE_TYPES", "ProbeConfig"]

DEFAULT_CADENCE: Mapping[Tier, int] = MappingProxyType(
    {Tier.STEP: 1, Tier.SCAN: 100, Tier.DEMAND: 0}
)

DEFAULT_MODULE_NAMES: tuple[str, ...] = (
    r"(.*\.)?(embed|embed_tokens|wte|wpe|tok_embeddings|word_embeddings|pos)",  # embeddings
    r"(.*\.)?(layers|blocks|h)\.\d+",  # residual stream (block out)
    r"(.*\.)?(attn|self_attn|attention)",  # attention output
    r"(.*\.)?(q_proj|k_proj|v_proj|qkv|qkv_proj|wq|wk|wv|c_attn)",  # query / key / value
    r"(.*\.)?(q_norm|k_norm|q_layernorm|k_layernorm)",  # normalized q / k
    r"(.*\.)?(mlp|feed_forward|ffn)",  # feed-forward output
    r"(.*\.)?(mlp|feed_forward|ffn)\.(up|up_proj|act|act_fn|w1|c_fc|fc1)",  # ffn activations
    r"(.*\.)?(lm_head|head|output|output_layer)",  # logits
)
"""Observation points of seeds §6 under the common module names of GPT/Llama-style models."""

DEFAULT_MODULE_TYPES: tuple[str, ...] = ()
"""Class-name patterns; e.g. ``("Embedding", "LayerNorm")`` observes every such module."""


def _compile(field_name: str, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"ProbeConfig.{field_name}: bad pattern {pattern!r}: {exc}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    """Root configuration of the rank-side monitor. Every check names the field it rejects."""

    enabled: bool = True
    """False: ``attach`` returns the null monitor (same API, no hooks, no thread)."""
    cadence: Mapping[Tier, int] = field(default_factory=lambda: dict(DEFAULT_CADENCE))
    """Steps between runs of each tier ("step", "scan", "demand"); 0 = off until densified
    (the demand tier is never densified)."""
    clip_threshold: float | None = None
    """The loop's global-norm clip threshold c (grad.clipped); None: not reported."""
    ring_steps: int = 16
    """Steps of unsent scan-tier detail kept on the rank (the ring buffer) for a ``dump``
    control message, which sends them once."""
    ring_every: int = 0
    """Steps between scan-tier measurements taken for the ring only: on a step ``t`` with
    ``t % ring_every == 0`` where the scan tier is not due, its probes run all the same and
    their points (the catalog's scan-tier metrics) stay in the ring instead of being sent,
    so an anomaly between two scan steps can get the detail of the steps before it
    (001 §12: a detector cannot recover expensive measurements from before the event).
    0: off. It costs a scan step's work on each such step (``benchmarks/overhead.py``,
    ring ratio)."""
    replay_steps: int = 4
    """Sampled steps whose loss and gradient-norm tensors the rank keeps (references: no
    copy) so that ``Monitor.replay`` can judge a re-run of one of them. 0: replay off."""
    queue_size: int = 256
    """Steps the export queue holds before it drops (and counts) one."""
    block_ranks: int = 256
    """Ranks per block of a step's fan-in: on a job of more ranks, a message's key names
    its rank block (``rank // block_ranks``), so one step's messages spread over the
    partitions and stage-1 workers; the stream's ``stream.block_ranks`` must be the same."""
    close_timeout_s: float = 5.0
    """How long ``Monitor.close`` waits for the broker to take what is still queued (with
    no broker, what is left is counted and said in one line; then close returns)."""
    module_names: tuple[str, ...] = DEFAULT_MODULE_NAMES
    module_types: tuple[str, ...] = DEFAULT_MODULE_TYPES
    logits_module: str = r"(.*\.)?(lm_head|head|output|output_layer)"
    """The module whose output is the logits (output.*); the first match in module order."""
    embedding_params: tuple[str, ...] = ()
    """Parameter-name patterns in group=embedding besides every nn.Embedding's weight."""
    expert_params: tuple[str, ...] = (r"(.*\.)?experts?\..*",)
    """Parameter-name patterns in group=expert (sharded over ep, not replicated)."""
    tp_replicated: tuple[str, ...] = ()
    """Module/parameter-name patterns identical on every tensor-parallel rank, for layouts
    without DTensor (Megatron-style norms, the residual stream without sequence
    parallelism): only tp=0 reports them. DTensor parameters follow their placements."""
    dp_replicated: bool | None = None
    """Plain-tensor parameters are whole replicas over dp (DDP): None (the default) or True;
    False for shards without DTensor (ZeRO-3, FSDP1 flat parameters). DTensor parameters
    (FSDP2, HSDP) follow their placements; True on a DTensor sharded over dp is refused."""
    fused_splits: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Module pattern -> part names: a fused projection (e.g. ``r".*\\.qkv": ("q","k","v")``)
    whose output (last dim) and weight (dim 0) are scanned as equal parts."""
    sources: tuple[str, ...] = ()
    """Registered data sources (label ``source`` of loss.*), indexed by the loop's ids."""
    modalities: tuple[str, ...] = ()
    """Registered modalities, the same label namespace as ``sources``."""
    mask_activations: bool = True
    update_ratio: bool = True
    """Snapshot parameters before the optimizer step on scan steps (one copy of the rank's
    reported parameters) to scan Δw exactly."""
    flops_per_token: float | None = None
    """The fixed FLOP estimator f; None: ``model.flops_per_token()`` if present, else 6·N."""
    persistent_hooks: bool = False
    """False: the tensor-probe module hooks (built at attach) are installed only for steps
    where the scan tier is due, so other steps pay nothing, not even a hook call. True keeps them
    installed (their first line returns on unsampled steps), e.g. for torch.compile, whose
    guards would recompile when hooks come and go."""
    telemetry: bool = True
    comm: bool = True
    scan_backend: str = "auto"
    """How large activations and the every-step gradient groups are scanned: "compiled"
    (``scan.fused_scan``, one fused pass per large tensor or block of small ones;
    ``torch.compile`` once per process), "eager" (``scan.scan``, chunked), or "auto":
    compiled on a CUDA device, eager on CPU (where the compile's 10-20 s would dominate a
    short run). The choice is made once at attach (``Monitor.scan_backend``)."""
    verify_layout: bool = True
    """At attach, check across the data-parallel ranks that parameters declared DDP replicas
    (plain tensors, ``dp_replicated`` not False) are identical there: one all_gather."""
    scan_chunk_elems: int | None = None
    """Elements per scan chunk; None: the scan's own default per device (``scan.CPU_CHUNK_ELEMS``
    keeps a chunk's working copy in L2 on CPU, ``DEVICE_CHUNK_ELEMS`` elsewhere)."""
    structure: StructureConfig = field(default_factory=StructureConfig)
    """Model-structure probes (experts, residual paths, modality, MTP, BOS value gradient,
    per-module views): discovered by module patterns at attach (``structure_config``)."""

    def __post_init__(self) -> None:
        cadence: dict[Tier, int] = dict(DEFAULT_CADENCE)
        for key, every in dict(self.cadence).items():
            try:
                tier = Tier(key)
            except ValueError:
                raise ValueError(
                    f"ProbeConfig.cadence: unknown tier {key!r}; tiers: {[t.value for t in Tier]}"
                ) from None
            if not isinstance(every, int) or isinstance(every, bool) or every < 0:
                raise ValueError(f"ProbeConfig.cadence[{key}]: must be an int >= 0, got {every!r}")
            cadence[tier] = every
        object.__setattr__(self, "cadence", MappingProxyType(cadence))
        object.__setattr__(self, "fused_splits", MappingProxyType(dict(self.fused_splits)))
        if self.clip_threshold is not None and not self.clip_threshold > 0:
            raise ValueError(
                f"ProbeConfig.clip_threshold: must be > 0, got {self.clip_threshold!r}"
            )
        if self.ring_steps < 0:
            raise ValueError(f"ProbeConfig.ring_steps: must be >= 0, got {self.ring_steps}")
        if not isinstance(self.block_ranks, int) or self.block_ranks < 1:
            raise ValueError(
                f"ProbeConfig.block_ranks: must be an int >= 1, got {self.block_ranks!r}"
            )
        if not isinstance(self.ring_every, int) or self.ring_every < 0:
            raise ValueError(
                f"ProbeConfig.ring_every: must be an int >= 0, got {self.ring_every!r}"
            )
        if self.ring_every and not self.ring_steps:
            raise ValueError(
                "ProbeConfig.ring_every: needs ring_steps >= 1 (the ring that "
                "keeps what it measures)"
            )
        if not isinstance(self.replay_steps, int) or self.replay_steps < 0:
            raise ValueError(
                f"ProbeConfig.replay_steps: must be an int >= 0, got {self.replay_steps!r}"
            )
        if self.queue_size < 1:
            raise ValueError(f"ProbeConfig.queue_size: must be >= 1, got {self.queue_size}")
        if not 0 <= self.close_timeout_s < float("inf"):
            raise ValueError(
                f"ProbeConfig.close_timeout_s: must be >= 0, got {self.close_timeout_s!r}"
            )
        if self.scan_backend not in ("auto", "compiled", "eager"):
            raise ValueError(
                f"ProbeConfig.scan_backend: 'auto', 'compiled' or 'eager', got "
                f"{self.scan_backend!r}"
            )
        if self.scan_chunk_elems is not None and self.scan_chunk_elems < 1:
            raise ValueError("ProbeConfig.scan_chunk_elems: must be >= 1")
        if self.flops_per_token is not None and not self.flops_per_token >= 0:
            raise ValueError("ProbeConfig.flops_per_token: must be >= 0")
        for name in (
            "module_names",
            "module_types",
            "embedding_params",
            "expert_params",
            "tp_replicated",
        ):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, tuple):
                raise ValueError(f"ProbeConfig.{name}: must be a tuple of patterns")
            _compile(name, value)
        _compile("logits_module", (self.logits_module,))
        _compile("fused_splits", tuple(self.fused_splits))
        for pattern, parts in self.fused_splits.items():
            if len(parts) < 2 or len(set(parts)) != len(parts):
                raise ValueError(f"ProbeConfig.fused_splits[{pattern!r}]: need >= 2 distinct parts")
        if not isinstance(self.structure, StructureConfig):
            raise ValueError("ProbeConfig.structure: must be a StructureConfig")
        labels = (*self.sources, *self.modalities)
        if len(set(labels)) != len(labels) or not all(isinstance(s, str) and s for s in labels):
            raise ValueError(
                "ProbeConfig.sources/modalities: names must be distinct non-empty "
                "strings (they share the label 'source')"
            )

    def every(self, tier: Tier | str) -> int:
        """Steps between runs of the probes of ``tier`` (0 = off)."""
        return self.cadence[Tier(tier)]
