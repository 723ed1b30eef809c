"""The wire module: OTLP bytes -> RankStep, held against the stock protobuf classes, and the
reasons malformed messages are dead-lettered with."""

from __future__ import annotations

import math
import random

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from probewire.instrument import wire
from probewire.instrument.catalog import CATALOG
from probewire.instrument.export import StepEmitter
from probewire.instrument.testing import MemoryTransport, ProtoEncoder
from probewire.instrument.wire import (
    DecodeError,
    Point,
    RankIdentity,
    WireEncoder,
    decode_rank_step,
    message_key,
    series_key,
)

IDENTITY = RankIdentity(run_id="run1", rank=1, world_size=2, host="n1", coords={"dp": 1})


def emitted(points, step: int = 7) -> tuple[bytes, bytes]:
    transport = MemoryTransport()
    emitter = StepEmitter(
        RankIdentity(run_id="run1", rank=1, world_size=2, host="n1", coords={"dp": 1}), transport
    )
    emitter.emit(step, points)
    emitter.close()
    (message,) = transport.messages
    return message


def test_round_trip_including_nonfinite_values():
    key, value = emitted(
        [
            Point("loss.sum", math.nan),
            Point("loss.tokens", 12),
            Point("grad.norm_sq", math.inf),
            Point("step.duration", 0.25),
        ]
    )
    assert key == b"run1:7"
    step = decode_rank_step(key, value)
    assert (step.run_id, step.step, step.rank, step.world_size, step.host) == (
        "run1",
        7,
        1,
        2,
        "n1",
    )
    assert step.coords == {"dp": 1}
    assert math.isnan(step.values[series_key("loss.sum")])
    assert math.isinf(step.values[series_key("grad.norm_sq")])
    assert step.values[series_key("loss.tokens")] == 12.0
    assert step.values[series_key("step.duration")] == 0.25


def test_garbage_bytes_are_a_decode_error():
    with pytest.raises(DecodeError, match="not an OTLP"):
        decode_rank_step(b"k", b"\xff\xfe not protobuf")


def test_key_that_does_not_match_content_is_rejected():
    key, value = emitted([Point("loss.tokens", 1)])
    with pytest.raises(DecodeError, match="does not match"):
        decode_rank_step(b"run1:8", value)


def test_unknown_metric_is_rejected():
    key, value = emitted([Point("loss.tokens", 1)])
    request = ExportMetricsServiceRequest.FromString(value)
    request.resource_metrics[0].scope_metrics[0].metrics[0].name = "made.up"
    with pytest.raises(DecodeError, match="unknown metric"):
        decode_rank_step(key, request.SerializeToString())


def test_missing_rank_attribute_is_rejected():
    key, value = emitted([Point("loss.tokens", 1)])
    request = ExportMetricsServiceRequest.FromString(value)
    attrs = request.resource_metrics[0].resource.attributes
    keep = [a for a in attrs if a.key != "probewire.rank"]
    del attrs[:]
    attrs.extend(keep)
    with pytest.raises(DecodeError, match="probewire.rank"):
        decode_rank_step(key, request.SerializeToString())


# --------------------------------------------------------------- against the stock classes
def stock_decode(payload: bytes) -> dict:
    """What the stock opentelemetry-proto classes read from a message, as the wire decoder's
    values: {(name, sorted labels): value} with the non-finite marker applied."""
    request = ExportMetricsServiceRequest.FromString(payload)
    out = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.gauge.data_points:
                    attrs = {
                        a.key: getattr(a.value, a.value.WhichOneof("value"))
                        for a in point.attributes
                    }
                    marker = attrs.pop("probewire.nonfinite", None)
                    attrs.pop("step")
                    value = (
                        float(marker)
                        if marker is not None
                        else point.as_double
                        if point.WhichOneof("value") == "as_double"
                        else float(point.as_int)
                    )
                    out[(metric.name, tuple(sorted(attrs.items())))] = value
    return out


def random_points(rng: random.Random) -> list[Point]:
    """Points of random catalog metrics with labels from their label sets, random values
    (some non-finite, some huge), at most one point per series."""
    names = sorted(CATALOG)
    points, seen = [], set()
    for _ in range(rng.randint(1, 60)):
        name = rng.choice(names)
        labels = tuple(
            sorted(
                (key, rng.choice(["0", "1", "blocks.3.attn", "é", "x" * 200]))
                for key in CATALOG[name].labels
                if rng.random() < 0.7
            )
        )
        if (name, labels) in seen:
            continue
        seen.add((name, labels))
        value = rng.choice(
            [
                rng.gauss(0, 1e3),
                0.0,
                -0.0,
                1e308,
                5e-324,
                math.nan,
                math.inf,
                -math.inf,
                float(rng.randint(-(2**53), 2**53)),
            ]
        )
        points.append(Point(name, value, labels))
    return points


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("encoder", [WireEncoder, ProtoEncoder])
def test_the_wire_decoder_reads_what_the_stock_classes_read(seed, encoder):
    rng = random.Random(seed)
    identity = RankIdentity(
        run_id=f"run-{seed}",
        rank=seed % 7,
        world_size=8,
        host=f"h{seed}",
        coords={"dp": seed % 7, "tp": seed % 2},
    )
    points = random_points(rng)
    step = rng.choice([0, 1, 2**40, seed])
    payload = encoder(identity.resource_attributes()).encode(step, points)
    record = decode_rank_step(f"run-{seed}:{step}".encode(), payload)
    stock = stock_decode(payload)
    assert record.values.keys() == stock.keys()
    assert all(same(record.values[k], stock[k]) for k in stock)
    assert (
        record.run_id,
        record.step,
        record.rank,
        record.world_size,
        record.host,
        record.coords,
    ) == (identity.run_id, step, identity.rank, 8, f"h{seed}", {"dp": seed % 7, "tp": seed % 2})


def one_gauge_request(name: str):
    """A stock-built request from rank 0 of run "r" with one (empty) gauge metric ``name``."""
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    for key, value in (
        ("probewire.run_id", "r"),
        ("probewire.rank", 0),
        ("probewire.world_size", 1),
    ):
        kv = rm.resource.attributes.add(key=key)
        if isinstance(value, str):
            kv.value.string_value = value
        else:
            kv.value.int_value = value
    return request, rm.scope_metrics.add().metrics.add(name=name)


def test_attributes_after_the_value_and_an_integer_value_decode_too():
    """Another producer may order a point's fields differently or send as_int."""
    request, metric = one_gauge_request("loss.tokens")
    point = metric.gauge.data_points.add(as_int=7)
    point.attributes.add(key="step").value.int_value = 3
    point.attributes.add(key="source").value.string_value = "web"
    payload = request.SerializeToString()
    # move the attributes behind the value: same message, fields in another order
    body = point.SerializeToString()
    value_field = body[body.index(b"\x31") : body.index(b"\x31") + 9]
    reordered = value_field + body.replace(value_field, b"")
    payload = payload.replace(body, reordered)
    record = decode_rank_step(b"r:3", payload)
    assert record.values == {("loss.tokens", (("source", "web"),)): 7.0}


def test_a_point_ending_in_time_and_value_after_other_fields_decodes_as_any_point():
    """The decoder's fast path takes what precedes a point's trailing time and value as its
    attributes; where something else precedes them (a start time here) it reads the point
    field by field, as the stock classes do."""
    request, metric = one_gauge_request("loss.tokens")
    point = metric.gauge.data_points.add(start_time_unix_nano=1, time_unix_nano=2, as_double=7.5)
    point.attributes.add(key="step").value.int_value = 3
    point.attributes.add(key="source").value.string_value = "web"
    payload = request.SerializeToString()
    body = point.SerializeToString()  # start time, time, value, attributes (field order)
    attrs = body[body.index(b"\x3a") :]
    reordered = body[:9] + attrs + body[9 : body.index(b"\x3a")]  # start, attrs, time, value
    assert reordered[-18] == 0x19 and reordered[-9] == 0x21 and len(reordered) == len(body)
    payload = payload.replace(body, reordered)
    record = decode_rank_step(b"r:3", payload)
    assert record.values == {("loss.tokens", (("source", "web"),)): 7.5} == stock_decode(payload)


@pytest.mark.parametrize("seed", range(30))
def test_damaged_bytes_are_a_decode_error_and_nothing_else(seed):
    """Truncations, flipped bytes and junk: the decoder raises DecodeError or returns."""
    rng = random.Random(seed)
    payload = bytearray(WireEncoder(IDENTITY.resource_attributes()).encode(5, random_points(rng)))
    for _ in range(40):
        damaged = bytearray(payload)
        kind = rng.randrange(3)
        if kind == 0:
            damaged = damaged[: rng.randrange(len(damaged))]
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        else:
            at = rng.randrange(len(damaged))
            damaged[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        try:
            decode_rank_step(None, bytes(damaged))
        except DecodeError:
            pass


@pytest.mark.parametrize("payload", [None, b"", "text", 12, b"\x00", b"\x0a\x05abc"])
def test_a_payload_that_is_not_bytes_or_is_empty_is_a_decode_error(payload):
    with pytest.raises(DecodeError):
        decode_rank_step(b"k", payload)


# ------------------------------------------------------------------ OTLP conventions
UCUM_BASE = {"1", "s", "By", "%", "W", "Cel", "MHz"}


def test_a_rank_message_follows_the_opentelemetry_conventions():
    """Read with the stock classes, as a Collector or Prometheus would: each rank is its own
    service instance, units are UCUM, a NaN is a NaN, the scope has a name and a version."""
    from importlib.metadata import version

    messages = {}
    for rank in (0, 1):
        identity = RankIdentity(run_id="conv", rank=rank, world_size=2, host="h")
        points = [
            Point("loss.sum", math.nan),
            Point("loss.tokens", 8.0),
            Point("step.duration", 0.5),
            Point("flops.step", 1e9),
        ]
        messages[rank] = ExportMetricsServiceRequest.FromString(
            WireEncoder(identity.resource_attributes()).encode(3, points)
        )
    instances = set()
    for request in messages.values():
        [rm] = request.resource_metrics
        resource = {
            a.key: getattr(a.value, a.value.WhichOneof("value")) for a in rm.resource.attributes
        }
        instances.add(resource["service.instance.id"])
        assert resource["service.name"] == "probewire-rank"
        [sm] = rm.scope_metrics
        assert (sm.scope.name, sm.scope.version) == ("probewire.instrument", version("probewire"))
        for metric in sm.metrics:
            assert metric.unit in UCUM_BASE or (
                metric.unit.startswith("{") and metric.unit.endswith("}")
            ), metric.unit
        loss = next(m for m in sm.metrics if m.name == "loss.sum").gauge.data_points[0]
        assert math.isnan(loss.as_double)  # not 0.0: a generic consumer must not see loss 0
    assert len(instances) == 2


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_catalog_unit_is_ucum(name):
    unit = CATALOG[name].unit
    assert unit in UCUM_BASE or (unit.startswith("{") and unit.endswith("}") and " " not in unit)


def test_a_key_of_another_form_is_ignored_and_a_probewire_key_must_match():
    key, value = emitted([Point("loss.tokens", 1)])
    assert decode_rank_step(b"collector-partition-key-7f3a", value).step == 7
    assert decode_rank_step(None, value).step == 7
    with pytest.raises(DecodeError, match="does not match"):
        decode_rank_step(b"run1:8", value)


# ------------------------------------------------------------- a known layout, read at once
def decode_both(key, payload):
    """(decode_rank_step's outcome, the field-by-field reading's outcome): a RankStep or the
    DecodeError's reason."""
    outcomes = []
    for decode in (decode_rank_step, wire._decode_fields):
        try:
            outcomes.append(decode(key, bytes(payload)))
        except DecodeError as exc:
            outcomes.append(exc.reason)
    return outcomes


def same_outcome(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    fields = ("run_id", "step", "rank", "world_size", "host", "coords", "replay")
    return (
        all(getattr(a, f) == getattr(b, f) for f in fields)
        and a.values.keys() == b.values.keys()
        and all(same(a.values[k], b.values[k]) for k in a.values)
    )


@pytest.mark.parametrize("seed", range(25))
def test_a_message_of_a_learned_layout_reads_as_field_by_field(seed, monkeypatch):
    """A rank's messages of the same series are read through the layout its first two of
    one length taught (one unpack), and must give exactly what the field-by-field reading
    gives: at steps whose varint grows, with new values (non-finite ones change the layout),
    and as a replay; the field-by-field reading runs only where no layout serves."""
    rng = random.Random(seed)
    identity = RankIdentity(
        run_id=f"layout-{seed}", rank=seed % 5, world_size=5, host="h", coords={"dp": seed % 5}
    )
    names = [n for n in sorted(CATALOG) if not CATALOG[n].labels]
    series = list(
        {
            series_key(p.name, p.labels): p._replace(value=0.0)
            for p in (
                [Point(n, 0.0) for n in rng.sample(names, rng.randint(1, 40))] + random_points(rng)
            )
        }.values()
    )  # each series once
    encoder = WireEncoder(identity.resource_attributes())
    fields, read_fields = [], wire._decode_fields
    monkeypatch.setattr(wire, "_decode_fields", lambda *a: fields.append(1) or read_fields(*a))
    finite = [rng.gauss(0, 1e3), 0.0, -0.0, 1e308, 5e-324, float(rng.randint(-(2**53), 2**53))]
    for step in (5, 6, 127, 128, 129, 2**14 - 1, 2**14, 2**40):
        for replay in (False, True):
            points = [p._replace(value=rng.choice(finite)) for p in series]
            payload = encoder.encode(step, points, replay=replay)
            key = message_key(identity.run_id, step)
            before = len(fields)
            record = decode_rank_step(key, payload)
            assert same_outcome(record, read_fields(key, payload))
            assert record.values == {series_key(p.name, p.labels): p.value for p in points}
            read_whole = len(fields) - before
            # a sender's second message in a row of one length teaches the layout
            assert read_whole == (step in (5, 6, 128, 129, 2**14, 2**40)), (step, replay)
    points = [p._replace(value=math.nan) if i == 0 else p for i, p in enumerate(points)]
    payload = encoder.encode(2**40, points, replay=True)  # a marker: another layout
    assert same_outcome(*decode_both(message_key(identity.run_id, 2**40), payload))
    assert math.isnan(
        decode_rank_step(None, payload).values[series_key(points[0].name, points[0].labels)]
    )


@pytest.mark.parametrize("seed", range(25))
def test_a_damaged_message_of_a_learned_layout_reads_as_field_by_field(seed):
    """Bytes changed inside a message of a learned layout (its length kept, so the layout
    is looked up): whatever the field-by-field reading makes of it, a record or the reason
    for a dead letter, the decoder makes of it too; a wrong key is refused as before."""
    rng = random.Random(seed)
    identity = RankIdentity(
        run_id=f"damaged-{seed}", rank=1, world_size=2, host="h", coords={"dp": 1}
    )
    encoder = WireEncoder(identity.resource_attributes())
    series = [p._replace(value=1.0) for p in random_points(rng)]
    for step in (299, 300):  # learned here
        decode_rank_step(None, encoder.encode(step, series))
    payload = encoder.encode(301, [p._replace(value=rng.gauss(0, 1)) for p in series])
    assert same_outcome(*decode_both(message_key(identity.run_id, 301), payload))
    assert (
        decode_both(message_key(identity.run_id, 302), payload)[0]
        == f"key {message_key(identity.run_id, 302)!r} does not match content "
        f"{message_key(identity.run_id, 301)!r}"
    )
    for tail in (b"\xff", b"\x78\x01"):  # junk after the message; an unknown field 15
        assert same_outcome(*decode_both(None, payload + tail))
        for _ in range(2):
            decode_rank_step(None, payload)  # the layout learned again
    one = encoder.encode(301, [Point("loss.tokens", 2.0)])
    decode_rank_step(None, one)
    decode_rank_step(None, one)  # learned
    at = one.index(b"\x18" + wire._varint(301)) + 1
    for byte in (0x2D, 0x80):  # the step's varint ends a byte early, or runs on
        damaged = bytearray(one)
        damaged[at] = byte
        assert same_outcome(*decode_both(None, damaged))
        damaged = bytearray(one)
        damaged[at + 1] = byte
        assert same_outcome(*decode_both(None, damaged))
    for _ in range(60):
        damaged = bytearray(payload)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        outcomes = decode_both(None, damaged)
        assert same_outcome(*outcomes), outcomes


def _check_counts(senders) -> list:
    layouts = [x for lengths in senders._seen.values() for x in lengths.values() if x]
    assert senders._bytes == sum(x.size for x in layouts) <= senders.max_bytes
    assert len(senders._seen) <= senders.max_senders
    assert all(len(lengths) <= senders.per_sender for lengths in senders._seen.values())
    assert all(
        x.size == size for lengths in senders._seen.values() for size, x in lengths.items() if x
    )
    return layouts


def test_a_sender_s_p0_and_scan_step_layouts_are_both_kept(monkeypatch):
    """A rank's step tier is laid out one way at P0 steps and another at scan steps (their
    tensors' moment sums ride along): once each length was heard twice, every message of
    either reads through its layout, however they alternate; a fifth length lets the
    least recently heard go (``per_sender`` 4). Every message reads as field by field."""
    senders = wire._Senders(max_senders=8, max_bytes=1 << 20)
    monkeypatch.setattr(wire, "_SENDERS", senders)
    fields, read_fields = [], wire._decode_fields
    monkeypatch.setattr(wire, "_decode_fields", lambda *a: fields.append(a[1]) or read_fields(*a))
    encoder = WireEncoder(
        RankIdentity(
            run_id="tiers", rank=3, world_size=8, host="h", coords={"dp": 3}
        ).resource_attributes()
    )
    names = [n for n in sorted(CATALOG) if not CATALOG[n].labels]
    tiers = {"p0": names[:6], "scan": names[:12]} | {f"other{k}": names[: 13 + k] for k in range(3)}

    def hear(step: int, tier: str) -> bool:
        """Whether the message was read field by field."""
        payload = encoder.encode(
            step, [Point(n, step * 0.5 + i) for i, n in enumerate(tiers[tier])]
        )
        before = len(fields)
        assert same_outcome(*decode_both(message_key("tiers", step), payload))
        _check_counts(senders)
        return len(fields) > before + 1  # decode_both reads it field by field once itself

    pattern = ["p0", "p0", "scan", "p0", "p0", "p0", "scan", "p0", "scan", "scan", "p0"]
    whole = [hear(200 + i, tier) for i, tier in enumerate(pattern)]
    # each length's first two messages teach its layout; after that, none is read whole
    assert whole == [True, True, True, False, False, False, True, False, False, False, False]
    for k in range(3):  # three more lengths: p0, heard least recently of the four, goes
        hear(300 + k, f"other{k}")
        hear(310 + k, f"other{k}")
        hear(320, "scan")
    assert hear(330, "p0") and not hear(331, "scan")


def test_the_learned_layouts_stay_within_their_bounds(monkeypatch):
    """More senders than the layouts' bytes allow, heard from in turn: the layouts that fit
    are kept and used, the others' messages are read field by field without learning a
    layout again and again; when senders go quiet, a sweep lets their layouts go and new
    senders' are learned; more senders than ``max_senders``: all let go. Every message
    reads as field by field throughout."""
    series = [Point(n, 1.0) for n in sorted(CATALOG) if not CATALOG[n].labels][:20]
    encoders = [
        WireEncoder(
            RankIdentity(
                run_id="bounds", rank=r, world_size=10, host="h", coords={"dp": r}
            ).resource_attributes()
        )
        for r in range(10)
    ]
    size = len(encoders[0].encode(10, series))  # every sender's, at every step here
    senders = wire._Senders(max_senders=8, max_bytes=int(3.5 * size))
    monkeypatch.setattr(wire, "_SENDERS", senders)
    learned, learn = [], wire._Layout.learn
    monkeypatch.setattr(
        wire._Layout, "learn", classmethod(lambda cls, *a: learned.append(1) or learn(*a))
    )

    def hear(ranks, steps):
        for step in steps:
            for r in ranks:
                payload = encoders[r].encode(step, series)
                assert len(payload) == size
                assert same_outcome(*decode_both(message_key("bounds", step), payload))
                _check_counts(senders)

    hear(range(5), range(10, 20))  # five senders, room for three layouts
    assert len(_check_counts(senders)) == 3 and len(learned) == 3
    hear(range(5, 7), range(20, 24))  # 0-4 go quiet, 5 and 6 start: theirs are learned
    assert {s.rank for s in (x.speaker for x in _check_counts(senders))} >= {5, 6}
    hear(range(10), range(24, 25))  # ten senders: past max_senders all are let go
    assert len(senders._seen) <= 8
    hear([0, 1], range(25, 29))  # senders whose series change: their layouts are replaced
    for step in range(29, 33):
        for encoder in encoders[:2]:
            payload = encoder.encode(step, series[: 10 + step // 2 % 2])
            assert same_outcome(*decode_both(message_key("bounds", step), payload))
            _check_counts(senders)


@pytest.mark.parametrize("run_id", ["", "a:b", "a\nb", "a\x1b[31mb", "a\x00", "a\u2028b"])
def test_a_run_id_that_cannot_be_printed_or_keyed_is_refused_at_attach(run_id):
    """RankIdentity (what attach builds) refuses an empty run id, one with ':' and one with
    a control or line-separator character, with a one-line message that shows it escaped."""
    with pytest.raises(ValueError, match="run_id must not") as info:
        RankIdentity(run_id=run_id, rank=0, world_size=1)
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


def test_printable_run_ids_with_shell_characters_are_accepted():
    """Quotes, $() and spaces are data, not an error: the printed commands quote them."""
    assert RankIdentity(run_id="$(touch X) it's", rank=0, world_size=1).run_id == "$(touch X) it's"
