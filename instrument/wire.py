"""The wire contract, torch-free: one rank's step as an OTLP ``ExportMetricsServiceRequest``.

Ranks encode with ``WireEncoder``; the stream decodes with ``decode_rank_step``. Both work
on the protobuf wire format directly (field numbers of ``opentelemetry-proto``'s
metrics/v1 and collector/metrics/v1), so neither builds a Python object per point; the
messages are ordinary OTLP and decode with the stock classes too (what an OpenTelemetry
Collector's Kafka receiver with ``otlp_proto`` uses). The tests hold both against the
stock classes on random messages. A rank sends the same series step after step, so the
decoder learns each sender's layout from two messages of one length and reads the next
ones with one ``struct`` unpack, once one masked comparison proved the bytes around the
step and values unchanged (``_Layout``); anything else is read field by field.

One message per rank per step: every point is a Gauge data point with the integer
attribute ``step`` and its labels, in the catalog's UCUM unit. A non-finite value is sent as
itself (OTLP allows NaN and ±Inf in a double gauge, so a generic consumer sees it) with the
attribute ``probewire.nonfinite`` naming it ("nan", "inf", "-inf"), the marker probewire
reads. The resource carries who is speaking (``RankIdentity``): ``service.name``,
``service.instance.id`` (one per rank of a run), run id, rank, world size, host and the
rank's coordinate in each parallel group; the scope is ``probewire.instrument`` with the
package version. The Kafka key is ``<run_id>:<step>``; a key of another form (a Collector's,
say) is ignored and the message is read by its content.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .catalog import CATALOG, Group

__all__ = [
    "GROUPS",
    "NONFINITE_ATTR",
    "REPLAY_ATTR",
    "STEP_ATTR",
    "DecodeError",
    "Labels",
    "Point",
    "RankIdentity",
    "RankStep",
    "SeriesKey",
    "WireEncoder",
    "decode_rank_step",
    "message_key",
    "run_id_problem",
    "scope_version",
    "series_key",
]

STEP_ATTR = "step"  # data point attribute: the optimizer step
NONFINITE_ATTR = "probewire.nonfinite"  # data point attribute: "nan", "inf" or "-inf"
REPLAY_ATTR = "probewire.replay"  # resource attribute of a message re-sent on request
SCOPE = "probewire.instrument"
INSTANCE_ATTR = "service.instance.id"
RUN_ID_ATTR = "probewire.run_id"
RANK_ATTR = "probewire.rank"
WORLD_SIZE_ATTR = "probewire.world_size"
LOCAL_RANK_ATTR = "probewire.local_rank"
HOST_ATTR = "host.name"
SERVICE_ATTR = "service.name"
GROUPS: tuple[str, ...] = tuple(g.value for g in Group)
"""Parallel groups, in the order coordinates are compared (resource ``probewire.<group>``)."""
_GROUP_ATTRS = {f"probewire.{g}": g for g in GROUPS}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_LABEL_KEYS = {name: frozenset(spec.labels) for name, spec in CATALOG.items()}

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (metric name, labels sorted by key)


class Point(NamedTuple):
    """One measurement: a catalog metric name, its value and its (bounded) labels."""

    name: str
    value: float
    labels: Labels = ()


def series_key(name: str, labels: Mapping[str, str] | Labels = ()) -> SeriesKey:
    items = labels.items() if isinstance(labels, Mapping) else labels
    return name, tuple(sorted((str(k), str(v)) for k, v in items))


def message_key(run_id: str, step: int, block: int | None = None) -> bytes:
    """``<run_id>:<step>``, or ``<run_id>:<step>:<block>`` for a rank of a job whose
    step is reduced in rank blocks (``ProbeConfig.block_ranks``): the blocks of one step
    spread over the partitions, and so over the stage-1 workers."""
    if block is None:
        return f"{run_id}:{step}".encode()
    return f"{run_id}:{step}:{block}".encode()


def scope_version() -> str:
    """The instrumentation scope's version: the installed probewire's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("probewire")
    except PackageNotFoundError:
        return "0"


def run_id_problem(run_id: str) -> str | None:
    """What makes ``run_id`` unusable, or None: it must be non-empty, without ``:`` (the
    message key separator) and without control characters (it is printed in commands)."""
    if not run_id:
        return "must not be empty"
    if ":" in run_id:
        return "must not contain ':'"
    if not run_id.isprintable():
        return "must not contain control characters"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankIdentity:
    """Who is speaking: the OTLP resource attributes of every message from this rank."""

    run_id: str
    rank: int
    world_size: int
    host: str = field(default_factory=socket.gethostname)
    local_rank: int = 0
    coords: Mapping[str, int] = field(default_factory=dict)  # group name (dp/tp/...) -> index

    def __post_init__(self) -> None:
        problem = run_id_problem(self.run_id)
        if problem is not None:
            raise ValueError(f"run_id {problem}, got {self.run_id!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        unknown = set(self.coords) - set(GROUPS)
        if unknown:
            raise ValueError(f"coords: unknown group(s) {sorted(unknown)}; groups: {GROUPS}")

    @classmethod
    def from_env(
        cls,
        run_id: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        coords: Mapping[str, int] | None = None,
    ) -> RankIdentity:
        """This process's identity from its launcher's environment.

        Rank, world size and local rank come from torchrun (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``), else SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``),
        else a single process (0, 1, 0). The run id, which every rank must share, is
        ``run_id``, else ``PROBEWIRE_RUN_ID`` (exported by ``probewire up`` / ``run``),
        else torchrun's rendezvous id ``TORCHELASTIC_RUN_ID`` (when not the default
        "none"), else ``slurm-<SLURM_JOB_ID>``. A ValueError names what to set otherwise."""
        env = os.environ if env is None else env

        def number(*names: str, default: int) -> int:
            for name in names:
                text = env.get(name)
                if text not in (None, ""):
                    try:
                        return int(text)
                    except ValueError:
                        raise ValueError(f"{name}={text!r} is not an integer") from None
            return default

        rank = number("RANK", "SLURM_PROCID", default=0)
        world = number("WORLD_SIZE", "SLURM_NTASKS", default=1)
        local = number("LOCAL_RANK", "SLURM_LOCALID", default=0)
        elastic = env.get("TORCHELASTIC_RUN_ID", "")
        slurm = env.get("SLURM_JOB_ID", "")
        run_id = (
            run_id
            or env.get("PROBEWIRE_RUN_ID")
            or (elastic if elastic not in ("", "none") else "")
            or (f"slurm-{slurm}" if slurm else "")
        )
        if not run_id:
            raise ValueError(
                "no run id: pass run_id=..., or set PROBEWIRE_RUN_ID (probewire "
                "run sets it), or launch with torchrun --rdzv-id or SLURM"
            )
        return cls(
            run_id=run_id, rank=rank, world_size=world, local_rank=local, coords=dict(coords or {})
        )

    def coord(self, group: str) -> int:
        """This rank's index in ``group`` ("dp", "tp", ...); 0 for a group the layout lacks."""
        coords = dict(self.coords) or {Group.DATA.value: self.rank}
        return int(coords.get(group, 0))

    def resource_attributes(self) -> dict[str, str | int]:
        attrs: dict[str, str | int] = {
            SERVICE_ATTR: "probewire-rank",
            INSTANCE_ATTR: f"{self.run_id}/rank{self.rank}",
            HOST_ATTR: self.host,
            RUN_ID_ATTR: self.run_id,
            RANK_ATTR: self.rank,
            WORLD_SIZE_ATTR: self.world_size,
            LOCAL_RANK_ATTR: self.local_rank,
        }
        coords = dict(self.coords) or {Group.DATA.value: self.rank}
        for group, index in coords.items():
            attrs[f"probewire.{group}"] = int(index)
        return attrs


# ------------------------------------------------------------------------------ writing
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")


def _varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1  # int64 as protobuf writes it: two's complement, 10 bytes
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any_value(value: str | int | float | bool) -> bytes:
    """AnyValue: string (1), bool (2), int (3) or double (4)."""
    if isinstance(value, bool):
        return bytes((2 << 3,)) + _varint(int(value))
    if isinstance(value, int):
        return bytes((3 << 3,)) + _varint(value)
    if isinstance(value, float):
        return bytes((4 << 3 | 1,)) + _DOUBLE.pack(value)
    return _field(1, str(value).encode())


def _key_value(key: str, value: str | int | float | bool) -> bytes:
    return _field(1, key.encode()) + _field(2, _any_value(value))


_POINT_ATTR = 7  # NumberDataPoint.attributes
_TIME_TAG = bytes((3 << 3 | 1,))  # NumberDataPoint.time_unix_nano, fixed64
_DOUBLE_TAG = bytes((4 << 3 | 1,))  # NumberDataPoint.as_double


class WireEncoder:
    """Writes the request field by field from cached fragments: the resource, each metric's
    name and unit and each label set are written once; per point it packs the step, time and
    value. About 1 µs per point and no state per step; its caches are bounded by the catalog
    and the bounded label sets."""

    def __init__(self, resource_attributes: Mapping[str, str | int | bool]) -> None:
        resource = b"".join(_field(1, _key_value(k, v)) for k, v in resource_attributes.items())
        replay = resource + _field(1, _key_value(REPLAY_ATTR, True))
        self._resource = _field(1, resource)  # ResourceMetrics.resource
        self._replay_resource = _field(1, replay)
        self._scope = _field(
            1,
            _field(1, SCOPE.encode())  # ScopeMetrics.scope: name,
            + _field(2, scope_version().encode()),
        )  # version
        self._metric_head: dict[str, bytes] = {}
        self._labels: dict[Labels, bytes] = {}
        self._nonfinite = {
            tag: _field(_POINT_ATTR, _key_value(NONFINITE_ATTR, tag)) for tag in _NONFINITE
        }

    def _head(self, name: str) -> bytes:
        head = self._metric_head.get(name)
        if head is None:  # Metric.name (1) and Metric.unit (3)
            spec = CATALOG.get(name)
            unit = spec.unit if spec is not None else "1"
            head = self._metric_head[name] = _field(1, name.encode()) + _field(3, unit.encode())
        return head

    def _label_bytes(self, labels: Labels) -> bytes:
        cached = self._labels.get(labels)
        if cached is None:
            cached = self._labels[labels] = b"".join(
                _field(_POINT_ATTR, _key_value(k, str(v))) for k, v in labels
            )
        return cached

    def encode(self, step: int, points: Sequence[Point], *, replay: bool = False) -> bytes:
        step_attr = _field(_POINT_ATTR, _key_value(STEP_ATTR, int(step)))
        stamp = _TIME_TAG + _FIXED64.pack(time.time_ns()) + _DOUBLE_TAG
        by_metric: dict[str, list[bytes]] = {}
        for name, raw, labels in points:
            number = float(raw)
            if math.isfinite(number):
                body = step_attr + self._label_bytes(labels) + stamp + _DOUBLE.pack(number)
            else:
                tag = "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")
                body = (
                    step_attr
                    + self._label_bytes(labels)
                    + self._nonfinite[tag]
                    + stamp
                    + _DOUBLE.pack(number)
                )
            points_of = by_metric.get(name)
            if points_of is None:
                points_of = by_metric[name] = []
            points_of.append(b"\x0a" + _varint(len(body)) + body)  # Gauge.data_points (1)
        metrics = b"".join(
            _field(2, self._head(name) + _field(5, b"".join(data)))  # ScopeMetrics.metrics,
            for name, data in by_metric.items()
        )  # Metric.gauge (5)
        resource_metrics = (self._replay_resource if replay else self._resource) + _field(
            2, self._scope + metrics
        )  # scope_metrics (2)
        return _field(1, resource_metrics)  # ExportMetricsServiceRequest.resource_metrics


# ------------------------------------------------------------------------------ reading
class DecodeError(ValueError):
    """A message that cannot become a RankStep; ``reason`` goes to the dead-letter topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True, kw_only=True)
class RankStep:
    """Everything one rank reported for one step (one Kafka message)."""

    run_id: str
    step: int
    rank: int
    world_size: int
    host: str
    coords: dict[str, int]
    values: dict[SeriesKey, float]
    replay: bool = False  # sent from the rank's ring buffer on a dump (``REPLAY_ATTR``)


_unpack_double = _DOUBLE.unpack_from
_unpack_fixed64 = _FIXED64.unpack_from


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int):
    """Yield (field number, wire type, value) of one message: the value of a varint, the
    offset of a fixed64 (unpack it as the field's type), the value of a fixed32, and the
    (start, end) span of a length-delimited field."""
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(buf, pos, end)
        number, kind = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("not an OTLP ExportMetricsServiceRequest: field number 0")
        if kind == 2:
            size = buf[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _read_varint(buf, pos, end)
            stop = pos + size
            if stop > end:
                raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated field")
            yield number, 2, (pos, stop)
            pos = stop
        elif kind == 0:
            value, pos = _read_varint(buf, pos, end)
            yield number, 0, value
        elif kind == 1:
            if pos + 8 > end:
                raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated fixed64")
            yield number, 1, pos
            pos += 8
        elif kind == 5:
            if pos + 4 > end:
                raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated fixed32")
            yield number, 5, int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise DecodeError(f"not an OTLP ExportMetricsServiceRequest: wire type {kind}")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(buf: bytes, span: tuple[int, int]) -> str:
    try:
        return buf[span[0] : span[1]].decode()
    except UnicodeDecodeError:
        raise DecodeError("a string field is not UTF-8") from None


def _key_value_of(buf: bytes, span: tuple[int, int]) -> tuple[str, str | int | float | bool]:
    """KeyValue -> (key, value); the value is the AnyValue's one scalar field."""
    key: str | None = None
    value: str | int | float | bool | None = None
    for number, kind, item in _fields(buf, *span):
        if number == 1 and kind == 2:
            key = _text(buf, item)
        elif number == 2 and kind == 2:
            for vnum, vkind, v in _fields(buf, *item):
                if vnum == 1 and vkind == 2:
                    value = _text(buf, v)
                elif vnum == 2 and vkind == 0:
                    value = bool(v)
                elif vnum == 3 and vkind == 0:
                    value = _signed(v)
                elif vnum == 4 and vkind == 1:
                    value = _unpack_double(buf, v)[0]
                else:
                    raise DecodeError(f"attribute {key!r} has no scalar value")
    if key is None:
        raise DecodeError("attribute without a key")
    if value is None:
        raise DecodeError(f"attribute {key!r} has no value")
    return key, value


def _resource(buf: bytes, span: tuple[int, int]) -> dict[str, str | int | float | bool]:
    attrs = {}
    for number, kind, item in _fields(buf, *span):
        if number == 1 and kind == 2:
            raw = buf[item[0] : item[1]]
            kv = _KV_CACHE.get(raw)
            if kv is None:
                if len(_KV_CACHE) >= _KV_CACHE_MAX:
                    _KV_CACHE.clear()
                kv = _KV_CACHE[raw] = _key_value_of(buf, item)
            attrs[kv[0]] = kv[1]
    return attrs


def _int_attr(resource: Mapping[str, object], key: str) -> int:
    try:
        value = resource[key]
    except KeyError:
        raise DecodeError(f"resource attribute {key} missing") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"resource attribute {key} must be an integer, got {value!r}")
    return value


def decode_rank_step(key: bytes | None, payload: bytes | None) -> RankStep:
    """Decode one rank's message for one step, checking it against its key and the catalog.

    Anything that is not a well-formed probewire message raises ``DecodeError`` (and only
    that): the stream dead-letters it with the reason."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or not payload:
        raise DecodeError("not an OTLP ExportMetricsServiceRequest: empty payload")
    buf = bytes(payload)
    try:
        return _decode(key, buf)
    except (IndexError, struct.error):
        raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated field") from None


def _decode(key: bytes | None, buf: bytes) -> RankStep:
    sender = _sender(buf)
    if sender is not None and (layout := _SENDERS.heard(sender, len(buf))) is not None:
        record = layout.read(key, buf)
        if record is not None:
            _SENDERS.used(sender, len(buf))
            return record
    record = _decode_fields(key, buf)
    if sender is not None:
        _SENDERS.note(sender, buf, record)
    return record


def _check_key(key: bytes | None, run_id: str, step: int) -> None:
    if key is None:
        return
    parts = key.split(b":")
    if len(parts) in (2, 3) and all(p.isdigit() for p in parts[1:]):
        # a probewire key must name what it carries (its block is the sender's choice)
        expected = message_key(run_id, step, int(parts[2]) if len(parts) == 3 else None)
        if key != expected:
            raise DecodeError(f"key {key!r} does not match content {expected!r}")


def _decode_fields(key: bytes | None, buf: bytes) -> RankStep:
    """The message read field by field: any OTLP layout, every check."""
    spans = [item for number, kind, item in _fields(buf, 0, len(buf)) if number == 1 and kind == 2]
    if len(spans) != 1:
        raise DecodeError(f"expected 1 resource, got {len(spans)}")
    speaker: _Speaker | None = None
    scopes: list[tuple[int, int]] = []
    for number, kind, item in _fields(buf, *spans[0]):
        if number == 1 and kind == 2:
            raw = buf[item[0] : item[1]]
            speaker = _SPEAKERS.get(raw)
            if speaker is None:
                if len(_SPEAKERS) >= _BLOCKS_MAX:
                    _SPEAKERS.clear()
                speaker = _SPEAKERS[raw] = _Speaker.parse(_resource(buf, item))
        elif number == 2 and kind == 2:
            scopes.append(item)
    if speaker is None:
        speaker = _Speaker.parse({})
    run_id = speaker.run_id

    points = _Points(buf)
    for scope in scopes:
        for number, kind, metric_span in _fields(buf, *scope):
            if number == 2 and kind == 2:  # ScopeMetrics.metrics; skip the scope, schema_url
                name, gauges = _metric(buf, metric_span)
                for gauge in gauges:
                    points.gauge(gauge, name)
    values, steps = points.values, points.steps
    if not steps:
        raise DecodeError("message holds no data point")
    if len(steps) > 1:
        first, second = sorted(steps)[:2]
        raise DecodeError(f"expected points of exactly one step, got {first} and {second}")
    step = steps.pop()
    _check_key(key, run_id, step)
    return RankStep(
        run_id=run_id,
        step=step,
        rank=speaker.rank,
        world_size=speaker.world_size,
        host=speaker.host,
        coords=dict(speaker.coords),
        values=values,
        replay=speaker.replay,
    )


@dataclass(frozen=True, slots=True)
class _Speaker:
    """The resource of a message: who is speaking (parsed once per distinct resource)."""

    run_id: str
    rank: int
    world_size: int
    host: str
    coords: tuple[tuple[str, int], ...]
    replay: bool = False

    @classmethod
    def parse(cls, resource: Mapping[str, str | int | float | bool]) -> _Speaker:
        run_id = resource.get(RUN_ID_ATTR)
        if not isinstance(run_id, str):
            raise DecodeError(
                f"resource attribute {RUN_ID_ATTR} missing"
                if run_id is None
                else f"resource attribute {RUN_ID_ATTR} must be a string"
            )
        rank, world_size = _int_attr(resource, RANK_ATTR), _int_attr(resource, WORLD_SIZE_ATTR)
        if not 0 <= rank < world_size:
            raise DecodeError(f"rank {rank} outside world size {world_size}")
        coords = []
        for attr, group in _GROUP_ATTRS.items():
            if attr in resource:
                index = _int_attr(resource, attr)
                if index < 0:
                    raise DecodeError(f"resource attribute {attr} must be >= 0")
                coords.append((group, index))
        host = resource.get(HOST_ATTR, "")
        return cls(
            run_id,
            rank,
            world_size,
            host if isinstance(host, str) else str(host),
            tuple(coords),
            resource.get(REPLAY_ATTR) is True,
        )


_SPEAKERS: dict[bytes, _Speaker] = {}


_NAMES: dict[bytes, str] = {name.encode(): name for name in CATALOG}


_OTHER_DATA_TAGS = frozenset(n << 3 | 2 for n in (7, 9, 10, 11))  # sum, histograms, summary


def _metric(buf: bytes, span: tuple[int, int]) -> tuple[str, list[tuple[int, int]]]:
    """A Metric's catalog name and its Gauge spans; a DecodeError for anything else."""
    name: str | None = None
    gauges: list[tuple[int, int]] = []
    other = False
    pos, end = span
    while pos < end:
        tag = buf[pos]
        if tag >= 0x80 or tag & 7 != 2:
            pos = _skip(buf, pos, end)
            continue
        start, stop = _payload(buf, pos, end)
        if tag == 0x0A:  # Metric.name
            name = _NAMES.get(buf[start:stop])
            if name is None:
                raise DecodeError(f"unknown metric {buf[start:stop].decode(errors='replace')!r}")
        elif tag == 0x2A:  # Metric.gauge
            gauges.append((start, stop))
        elif tag in _OTHER_DATA_TAGS:
            other = True
        pos = stop
    if name is None:
        raise DecodeError("unknown metric None")
    if other or not gauges:
        raise DecodeError(f"metric {name!r} is not a gauge")
    return name, gauges


_ATTR_TAG = _POINT_ATTR << 3 | 2  # 0x3a
_AS_DOUBLE_TAG, _AS_INT_TAG = 4 << 3 | 1, 6 << 3 | 1
_TIME_TAGS = (2 << 3 | 1, 3 << 3 | 1)  # start_time_unix_nano, time_unix_nano
_DATA_POINT_TAG = 1 << 3 | 2  # Gauge.data_points


class _Points:
    """The data points of one message, gathered into ``values`` (its hot loop is ``gauge``).

    A point's attributes (field 7) usually come first and together, as the common encoders
    write them, so they are taken as one byte string. When that string starts with the
    message's step attribute (as ``WireEncoder`` writes it), the rest — the labels — is
    looked up in ``_BLOCKS``, which survives across messages: a rank sends the same label
    sets every step, so each is parsed once. A point that ends in ``WireEncoder``'s time and
    value fields is not walked field by field: what precedes them is its attributes when it
    parses as attribute fields exactly (``_Block.parse`` checks their framing); any other
    point, or layout, is read field by field (``_point``)."""

    __slots__ = ("buf", "values", "steps", "prefix")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.values: dict[SeriesKey, float] = {}
        self.steps: set[int] = set()
        self.prefix = b"\xff"  # the message's leading step attribute, once seen

    def gauge(self, span: tuple[int, int], name: str) -> None:
        buf, values, prefix = self.buf, self.values, self.prefix
        blocks, unpack_double = _BLOCKS, _unpack_double
        allowed = _LABEL_KEYS[name]
        pos, end = span
        while pos < end:
            tag = buf[pos]
            start, stop = _payload(buf, pos, end)
            if tag != _DATA_POINT_TAG:
                pos = _skip(buf, pos, end)
                continue
            block = None
            if (
                stop - start >= _TAIL
                and buf[stop - _TAIL] == _TIME_TAG_3
                and buf[stop - 9] == _AS_DOUBLE_TAG
            ):
                # WireEncoder's layout: attributes, then time and value; taken only where
                # the attributes parse as exactly that, else as any point is
                value: float | None = unpack_double(buf, stop - 8)[0]
                raw = buf[start : stop - _TAIL]
                stripped = raw.startswith(prefix)
                if stripped:
                    raw = raw[len(prefix) :]
                block = blocks.get(raw)
                if block is None:
                    try:
                        block = _Block.parse(raw)
                    except DecodeError:
                        block = None
                    else:
                        if len(blocks) >= _BLOCKS_MAX:
                            blocks.clear()
                        blocks[raw] = block
            if block is None:
                raw, value = _point(buf, start, stop)
                stripped = raw.startswith(prefix)
                if stripped:  # the message's step, then labels: look the labels up
                    raw = raw[len(prefix) :]
                block = blocks.get(raw)
                if block is None:
                    if len(blocks) >= _BLOCKS_MAX:
                        blocks.clear()
                    block = blocks[raw] = _Block.parse(raw)
            if block.step is not None:
                self.steps.add(block.step)
                if block.step_field and not stripped:
                    prefix = self.prefix = raw[: block.step_field]
            elif not stripped:
                raise DecodeError(f"point of {name!r} has no integer step")
            if not block.keys <= allowed:
                bad = sorted(block.keys - allowed)[0]
                raise DecodeError(f"{name!r} has label {bad!r} outside its catalog label set")
            if block.nonfinite is not None:
                value = block.nonfinite
            elif value is None:
                raise DecodeError(f"point of {name!r} has no value")
            values[(name, block.labels)] = value
            pos = stop


_TIME_TAG_3 = _TIME_TAGS[1]
_TAIL = 18  # time_unix_nano and as_double, tag and fixed64 each


def _point(buf: bytes, start: int, stop: int) -> tuple[bytes, float | None]:
    """A NumberDataPoint in any field order: its attribute fields as one byte string, and
    its value (None without one)."""
    first = last = -1
    parts: list[bytes] | None = None
    value: float | None = None
    p = start
    while p < stop:
        tag = buf[p]
        if tag == _ATTR_TAG:
            size = buf[p + 1]
            q = p + 2 + size if size < 0x80 else sum(_read_varint(buf, p + 1, stop))
            if last == p:
                last = q
            elif first < 0:
                first, last = p, q
            else:
                parts = (parts or [buf[first:last]]) + [buf[p:q]]
            p = q
        elif tag == _AS_DOUBLE_TAG:
            value = _unpack_double(buf, p + 1)[0]
            p += 9
        elif tag in _TIME_TAGS:
            p += 9
        elif tag == _AS_INT_TAG:
            value = float(_signed(_unpack_fixed64(buf, p + 1)[0]))
            p += 9
        else:  # exemplars, flags, fields added later
            p = _skip(buf, p, stop)
    if p != stop:
        raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated field")
    raw = b"".join(parts) if parts is not None else buf[first:last] if first >= 0 else b""
    return raw, value


def _payload(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(start, stop) of the payload of the one-byte-tag length-delimited field at ``pos``."""
    size = buf[pos + 1]
    start = pos + 2
    if size >= 0x80:
        size, start = _read_varint(buf, pos + 1, end)
    stop = start + size
    if stop > end:
        raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated field")
    return start, stop


def _skip(buf: bytes, pos: int, end: int) -> int:
    """The offset after the one field that starts at ``pos``."""
    tag, pos = _read_varint(buf, pos, end)
    kind = tag & 7
    if kind == 0:
        return _read_varint(buf, pos, end)[1]
    if kind == 1:
        return pos + 8
    if kind == 5:
        return pos + 4
    if kind == 2:
        size, pos = _read_varint(buf, pos, end)
        return pos + size
    raise DecodeError(f"not an OTLP ExportMetricsServiceRequest: wire type {kind}")


@dataclass(frozen=True, slots=True)
class _Block:
    """One data point's attributes, parsed once per distinct byte string in a message: its
    step, its labels (sorted), their keys and the non-finite marker's value."""

    step: int | None
    labels: Labels
    keys: frozenset[str]
    nonfinite: float | None
    step_field: int  # bytes of a leading step attribute (0: none leads)

    @classmethod
    def parse(cls, raw: bytes) -> _Block:
        step = nonfinite = None
        labels = []
        kvs = _key_values(raw)
        for attr, value in kvs:
            if attr == STEP_ATTR:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise DecodeError("a point's step attribute is not an integer")
                step = value
            elif attr == NONFINITE_ATTR:
                if value not in _NONFINITE:
                    raise DecodeError(f"bad {NONFINITE_ATTR} value {value!r}")
                nonfinite = _NONFINITE[value]  # type: ignore[index]
            else:
                labels.append((attr, value if isinstance(value, str) else str(value)))
        labels.sort()
        keys = frozenset(k for k, _ in labels)
        if len(keys) != len(labels):
            raise DecodeError("a point repeats a label")
        leading = kvs[0][0] == STEP_ATTR if kvs else False
        return cls(step, tuple(labels), keys, nonfinite, _field_end(raw, 0) if leading else 0)


_BLOCKS: dict[bytes, _Block] = {}
_BLOCKS_MAX = 1 << 16
"""Parsed attribute strings across messages (bounded: emptied when full)."""


def _field_end(raw: bytes, pos: int) -> int:
    return _skip(raw, pos, len(raw))


_KV_CACHE: dict[bytes, tuple[str, str | int | float | bool]] = {}
_KV_CACHE_MAX = 1 << 16
"""Decoded KeyValues by their bytes, across messages: label sets repeat step after step.
Bounded: emptied when full (a step attribute is new every step)."""


def _key_values(raw: bytes) -> list[tuple[str, str | int | float | bool]]:
    """The KeyValues of consecutive attribute fields (field 7), through ``_KV_CACHE``."""
    out = []
    pos, end = 0, len(raw)
    cache = _KV_CACHE
    while pos < end:
        if raw[pos] != _ATTR_TAG:
            raise DecodeError("not an OTLP ExportMetricsServiceRequest: bad attribute")
        size = raw[pos + 1]
        start = pos + 2
        if size >= 0x80:
            size, start = _read_varint(raw, pos + 1, end)
        stop = start + size
        if stop > end:
            raise DecodeError("not an OTLP ExportMetricsServiceRequest: truncated attribute")
        item = raw[start:stop]
        kv = cache.get(item)
        if kv is None:
            if len(cache) >= _KV_CACHE_MAX:
                cache.clear()
            kv = cache[item] = _key_value_of(raw, (start, stop))
        out.append(kv)
        pos = stop
    return out


# ------------------------------------------------------------------ reading a known layout
def _sender(buf: bytes) -> bytes | None:
    """The message's bytes up to the end of its resource (who sends it); None when the
    resource is not where ``WireEncoder`` writes it."""
    end = len(buf)
    if buf[0] != 0x0A:  # ExportMetricsServiceRequest.resource_metrics
        return None
    try:
        _, pos = _read_varint(buf, 1, end)
        if pos >= end or buf[pos] != 0x0A:  # ResourceMetrics.resource first
            return None
        size, start = _read_varint(buf, pos + 1, end)
    except DecodeError:  # what is wrong is for the field-by-field reading to say
        return None
    return buf[pos : start + size]


@dataclass(frozen=True, slots=True)
class _Layout:
    """A message ``WireEncoder`` wrote, less what changes from step to step: the step
    number (the same varint in every point), the points' times and values. A rank sends the
    same series step after step, so its next message of the same length is most likely the
    same bytes around new numbers. That is checked at once, the message as an integer
    against this layout's bytes where they must not change (``mask``), and one ``struct``
    unpack reads each point's step varint and value. Any difference, or steps that differ
    between points: the message is read field by field (``_decode_fields``). Measured:
    8-16 µs for a 46-point message, 75-80 µs field by field; ~15 kB a layout."""

    size: int
    template: int  # the message's bytes (little-endian) where they must not change
    mask: int  # 0xFF at those bytes, 0 at the steps, times and values
    unpack: Callable[[bytes], tuple]  # (step varint, value) of each point, in turn
    keys: tuple[SeriesKey, ...]
    speaker: _Speaker

    @classmethod
    def learn(cls, buf: bytes, record: RankStep) -> _Layout | None:
        """The layout of ``buf``, which ``_decode_fields`` read as ``record``; None unless
        every point is laid out as ``WireEncoder`` writes a finite value (step attribute
        first, labels, time, value)."""
        varint = _varint(record.step)
        fmt, mask, keys, pos = ["<"], bytearray(b"\xff" * len(buf)), [], 0
        try:
            for name, start, stop in _data_points(buf):
                if (
                    stop - start < _TAIL
                    or buf[stop - _TAIL] != _TIME_TAG_3
                    or buf[stop - 9] != _AS_DOUBLE_TAG
                    or buf[start] != _ATTR_TAG
                ):
                    return None
                step_end = start + _field_end(buf[start:stop], 0)
                step_attr = buf[start:step_end]  # AnyValue.int_value (3) last: the varint
                if _key_values(step_attr) != [(STEP_ATTR, record.step)] or not step_attr.endswith(
                    b"\x18" + varint
                ):
                    return None
                labels = buf[step_end : stop - _TAIL]  # as ``_Points.gauge`` looked them up
                block = _BLOCKS.get(labels) or _Block.parse(labels)
                if block.step is not None or block.nonfinite is not None:
                    return None
                at = step_end - len(varint)
                fmt.append(f"{at - pos}x{len(varint)}s{stop - 8 - step_end}xd")
                mask[at:step_end] = bytes(len(varint))
                mask[stop - 17 : stop - 9] = bytes(8)  # time_unix_nano
                mask[stop - 8 : stop] = bytes(8)  # as_double
                keys.append((name, block.labels))
                pos = stop
        except DecodeError:
            return None
        bits = int.from_bytes(mask, "little")
        speaker = _Speaker(
            record.run_id,
            record.rank,
            record.world_size,
            record.host,
            tuple(record.coords.items()),
            record.replay,
        )
        layout = cls(
            len(buf),
            int.from_bytes(buf, "little") & bits,
            bits,
            struct.Struct("".join(fmt)).unpack_from,
            tuple(keys),
            speaker,
        )
        again = layout.read(None, buf)  # the layout must read its own message as the fields did
        if again is None or again.step != record.step or again.values != record.values:
            return None
        return layout

    def read(self, key: bytes | None, buf: bytes) -> RankStep | None:
        """``buf`` as a RankStep, or None when it is not of this layout."""
        if len(buf) != self.size or (int.from_bytes(buf, "little") ^ self.template) & self.mask:
            return None
        parts = self.unpack(buf)
        steps = parts[0::2]
        first = steps[0]
        if steps.count(first) != len(steps):
            return None
        try:
            step, end = _read_varint(first, 0, len(first))
        except DecodeError:
            return None
        if end != len(first):
            return None
        speaker = self.speaker
        step = _signed(step)
        _check_key(key, speaker.run_id, step)
        return RankStep(
            run_id=speaker.run_id,
            step=step,
            rank=speaker.rank,
            world_size=speaker.world_size,
            host=speaker.host,
            coords=dict(speaker.coords),
            values=dict(zip(self.keys, parts[1::2])),
            replay=speaker.replay,
        )


def _data_points(buf: bytes) -> Iterator[tuple[str, int, int]]:
    """(metric name, start, stop) of each data point, in byte order, of a message
    ``_decode_fields`` read."""
    (resource_metrics,) = [
        item for number, kind, item in _fields(buf, 0, len(buf)) if number == 1 and kind == 2
    ]
    for number, kind, scope in _fields(buf, *resource_metrics):
        if number != 2 or kind != 2:  # ResourceMetrics.scope_metrics
            continue
        for mnum, mkind, metric in _fields(buf, *scope):
            if mnum != 2 or mkind != 2:  # ScopeMetrics.metrics
                continue
            name, gauges = _metric(buf, metric)
            for gauge in gauges:
                for pnum, pkind, point in _fields(buf, *gauge):
                    if pnum == 1 and pkind == 2:  # Gauge.data_points
                        yield name, point[0], point[1]


class _Senders:
    """Per sender (``_sender``) the layouts of its messages, by length: a rank's step tier
    is laid out one way at its P0 steps and another at its scan steps (their tensors'
    moment sums ride along), and with one layout per sender every scan step let the P0
    layout go, so the P0 step after it was read field by field, and the one after that
    too (a layout is learned from a second message of one length): stage 1 took 3-3.5x
    its decoding CPU for them in ``benchmarks/fanin.py``. At most ``per_sender`` lengths
    each, the one heard least recently let go first; a length heard once has no layout
    yet, the next message of that length teaches it.

    Bounded: layouts of at most ``max_bytes`` message bytes (a layout holds ~4x its
    message). When a new one would not fit, the layouts not used since the last such sweep
    are let go, at most once per as many messages as there are senders (each live sender
    was heard from in between); if it still does not fit, it is not learned and messages
    of that length are read field by field. More than ``max_senders`` senders: all are
    let go."""

    def __init__(self, max_senders: int, max_bytes: int, per_sender: int = 4) -> None:
        self.max_senders, self.max_bytes, self.per_sender = max_senders, max_bytes, per_sender
        # sender -> message length -> its layout (None: heard once, or did not fit);
        # the lengths in the order they were last heard
        self._seen: dict[bytes, dict[int, _Layout | None]] = {}
        self._bytes = 0  # of the messages of the layouts held
        self._used: set[bytes] = set()  # senders whose layout read a message since the sweep
        self._messages = self._swept_at = 0

    def heard(self, sender: bytes, size: int) -> _Layout | None:
        """A message of ``size`` bytes from ``sender``: the layout of that length, if any."""
        self._messages += 1
        lengths = self._seen.get(sender)
        return None if lengths is None else lengths.get(size)

    def used(self, sender: bytes, size: int) -> None:
        """The layout of ``size`` read the sender's message: heard most recently now."""
        self._used.add(sender)
        lengths = self._seen[sender]
        lengths[size] = lengths.pop(size)

    def note(self, sender: bytes, buf: bytes, record: RankStep) -> None:
        """After ``buf`` was read field by field (no layout of its length read it): the
        layout of its length is learned from it if that length was heard before (a layout
        that failed is learned again), where it fits."""
        lengths = self._seen.get(sender)
        if lengths is None:
            if len(self._seen) >= self.max_senders:
                self._seen.clear()
                self._used.clear()
                self._bytes = 0
            lengths = self._seen[sender] = {}
        size, layout = len(buf), None
        if size in lengths:
            if (old := lengths.pop(size)) is not None:
                self._bytes -= old.size
            if self._bytes + size > self.max_bytes:
                self._sweep()
            if self._bytes + size <= self.max_bytes:
                layout = _Layout.learn(buf, record)
        lengths[size] = layout
        if layout:
            self._bytes += layout.size
            self._used.add(sender)  # new: kept through the next sweep
        while len(lengths) > self.per_sender:
            if (dropped := lengths.pop(next(iter(lengths)))) is not None:
                self._bytes -= dropped.size

    def _sweep(self) -> None:
        if self._messages - self._swept_at < len(self._seen):
            return
        self._swept_at = self._messages
        for sender, lengths in self._seen.items():
            if sender in self._used:
                continue
            for size, layout in lengths.items():
                if layout is not None:
                    lengths[size] = None
                    self._bytes -= layout.size
        self._used.clear()


_SENDERS = _Senders(max_senders=1 << 16, max_bytes=16 << 20)
"""A 2,000-rank run's P0 messages of ~4 kB: 8 MB of messages, ~30 MB of layouts."""
