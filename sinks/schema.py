"""ClickHouse schema of database ``probewire``: table definitions, migrations and views.

Idempotency. Every table is a ReplacingMergeTree whose sorting key is the row's natural
key and whose version is an insert (or update) time, so re-delivering rows leaves the
deduplicated contents unchanged and a corrected re-delivery wins. Read with ``FINAL``
or through the views, which already do. No table is partitioned by time: rows of one
key in different partitions would never be merged into one.

Cardinality. Names (run, metric, source, tensor, layer, signal, ...) are
LowCardinality; labels are one bounded, sorted ``k=v|k=v`` string that sits in the key.

The tables are declared once below (``TABLES``); the DDL of migration 1 and the
writer's column lists (``TABLE_COLUMNS``) are generated from those declarations, so
they cannot drift apart. After a first deployment, a change to a table is a new
``Migration`` (``ALTER TABLE ...``) plus the matching edit to its declaration. Views
hold no data: ``migrate`` re-creates all of them on every run (``CREATE OR REPLACE``).
"""

from __future__ import annotations

from dataclasses import dataclass

from probewire.instrument.catalog import TENSOR_FIELDS
from probewire.stream.series import STEP_SERIES, GradGroupStats, Series

__all__ = [
    "Column",
    "MIGRATIONS",
    "Migration",
    "RECENT_TABLES",
    "SENSITIVE_ARTIFACTS",
    "TABLES",
    "TABLE_COLUMNS",
    "Table",
    "VIEWS",
    "View",
]

_VERSION = "inserted_at"


@dataclass(frozen=True, slots=True)
class Column:
    """One column: ClickHouse type, optional DEFAULT expression, and what it means."""

    name: str
    type: str
    default: str | None = None
    comment: str = ""

    def ddl(self) -> str:
        text = f"`{self.name}` {self.type}"
        if self.default is not None:
            text += f" DEFAULT {self.default}"
        if self.comment:
            text += " COMMENT '" + self.comment.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return text


@dataclass(frozen=True, slots=True)
class Table:
    """A ReplacingMergeTree keyed by its natural key, deduplicated on ``version``."""

    name: str
    comment: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    version: str = _VERSION
    ttl: str | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        missing = [k for k in (*self.key, self.version) if k not in names]
        if missing or len(set(names)) != len(names):
            raise ValueError(f"table {self.name}: bad key/version {missing} or duplicate columns")

    def ddl(self, db: str) -> str:
        columns = ",\n    ".join(c.ddl() for c in self.columns)
        ttl = f"\nTTL {self.ttl}" if self.ttl else ""
        comment = self.comment.replace("'", "\\'")
        key = self.key[0] if len(self.key) == 1 else f"({', '.join(self.key)})"
        return (
            f"CREATE TABLE IF NOT EXISTS {db}.{self.name} (\n    {columns}\n)\n"
            f"ENGINE = ReplacingMergeTree({self.version})\n"
            f"ORDER BY {key}{ttl}\nCOMMENT '{comment}'"
        )

    @property
    def writer_columns(self) -> tuple[str, ...]:
        """Every column a writer may send (``inserted_at`` is always the server's)."""
        return tuple(c.name for c in self.columns if c.name != _VERSION)


def _inserted_at() -> Column:
    return Column(_VERSION, "DateTime64(6)", "now64(6)", "version: the latest insert of a key wins")


def _name(name: str, comment: str = "") -> Column:
    return Column(name, "LowCardinality(String)", comment=comment)


def _f(name: str, comment: str = "") -> Column:
    """A measurement that may be absent: NULL means not measured, never zero."""
    return Column(name, "Nullable(Float64)", "NULL", comment)


_RUN = _name("run_id")
_STATUS_DOC = (
    "running; finished (the run closed its monitor, or, never having announced itself, sent "
    "no step for stream.stage2.run_idle_s); crashed (an exception left a step, or the "
    "launcher exited non-zero); stalled (announced, not ended, silent for run_idle_s: a "
    "job_state page)"
)
_STEP = Column("step", "UInt64", comment="optimizer step")

_NOTE_COLUMNS = (  # migration 12
    Column("note", "String", "''", "a note a user set in probewire ui (a note event)"),
    Column(
        "tags",
        "Array(String)",
        "[]",
        "tags a user set in probewire ui (a note event); the config's tags are apart",
    ),
)

RUNS = Table(
    "runs",
    "one row per training run, replaced as the run progresses",
    (
        _RUN,
        Column("world_size", "UInt32", comment="ranks in the job"),
        Column("first_step", "UInt64", "0"),
        Column("last_step", "UInt64", "0"),
        Column("started_at", "DateTime64(3)", "now64(3)"),
        Column("updated_at", "DateTime64(3)", "now64(3)", "version"),
        Column("status", "LowCardinality(String)", "'running'", _STATUS_DOC),
        Column("config", "String", "'{}'", "the run configuration as JSON"),
        Column("planned_tokens", "Nullable(UInt64)", "NULL", "tokens the run plans to train on"),
        *_NOTE_COLUMNS,
    ),
    key=("run_id",),
    version="updated_at",
)


def _series_column(s: Series) -> Column:
    return Column(s.name, s.sql, s.default, s.doc)


# step_metrics is the registry's (``stream.series``): one column per row, in its order
STEP_METRICS = Table(
    "step_metrics",
    "every step, unsmoothed: the reduced P0 series",
    (*(_series_column(s) for s in STEP_SERIES), _inserted_at()),
    key=("run_id", "step"),
)


def _added_in(version: int) -> tuple[Column, ...]:
    """The step_metrics columns migration ``version`` added (the registry's ``since``)."""
    return tuple(_series_column(s) for s in STEP_SERIES if s.since == version)


_STEP_METRICS_V2, _STEP_METRICS_V3, _STEP_METRICS_V4 = (_added_in(v) for v in (2, 3, 4))


def _add_columns(version: int) -> tuple[str, ...]:
    """``ADD COLUMN`` for each registry row of ``version``, each after the column before it
    in the registry among those of that version or earlier (so a migrated store has the
    declared column order)."""
    out = []
    for i, s in enumerate(STEP_SERIES):
        if s.since != version:
            continue
        after = next(p for p in reversed(STEP_SERIES[:i]) if p.since <= version)
        out.append(
            f"ALTER TABLE {{db}}.step_metrics ADD COLUMN IF NOT EXISTS "
            f"{_series_column(s).ddl()} AFTER {after.name}"
        )
    return tuple(out)


SOURCE_METRICS = Table(
    "source_metrics",
    "loss by data source or modality",
    (
        _RUN,
        _STEP,
        _name("source"),
        Column("loss", "Float64", comment="valid-token mean loss of the source"),
        Column("token_share", "Float64", comment="share of the step's valid tokens"),
        Column("tokens", "UInt64", comment="valid tokens of the source in this step"),
        _inserted_at(),
    ),
    key=("run_id", "source", "step"),
)

USER_METRICS = Table(
    "user_metrics",
    "a user's own metrics (Monitor.log, StepContext.log): one row per run, step and name",
    (
        _RUN,
        _STEP,
        _name("name", "the name the script logged (letters, digits, _ . - /)"),
        Column(
            "value",
            "Float64",
            comment="reduced over ranks by the declared reduction; NaN or inf as measured",
        ),
        _name(
            "reduction",
            "mean (over the ranks that logged it), sum, max, rank0; mixed: the ranks "
            "declared different reductions (value NaN)",
        ),
        _inserted_at(),
    ),
    key=("run_id", "name", "step"),
)

RANK_METRICS = Table(
    "rank_metrics",
    "per-rank components of retained steps",
    (
        _RUN,
        _STEP,
        Column("rank", "UInt32"),
        _name("metric"),
        Column("labels", "String", "''", "sorted k=v|k=v, bounded"),
        Column("value", "Float64"),
        Column("late", "UInt8", "0", "1 when the rank reported after its step was reduced"),
        _inserted_at(),
    ),
    key=("run_id", "metric", "step", "labels", "rank"),
)


def _scan_column(field: str) -> Column:
    """A reduced one-pass scan field (``catalog.TENSOR_FIELDS``): counts default to 0, the
    third and fourth power sums are NULL where the scan did not measure them."""
    n, _, _, _, _, zeros, nonfinite, sum3, sum4 = TENSOR_FIELDS
    if field in (sum3, sum4):
        return Column(field, "Nullable(Float64)", "NULL")
    if field in (zeros, nonfinite):
        return Column(field, "Float64", "0")
    return Column(field, "Float64", comment="element count" if field == n else "")


TENSOR_STATS = Table(
    "tensor_stats",
    "one-pass tensor statistics reduced across ranks",
    (
        _RUN,
        _STEP,
        _name("tensor"),
        _name("kind", "fwd, bwd, grad, param, update, ..."),
        *(_scan_column(field) for field in TENSOR_FIELDS),
        _inserted_at(),
    ),
    key=("run_id", "kind", "tensor", "step"),
)

TENSOR_NAMES = Table(
    "tensor_names",
    "each tensor label a run reported, written once (the "
    "first time) with its bounded dimensions: block, role, expert",
    (
        _RUN,
        _name("tensor", "the tensor label of tensor_stats: the full module or parameter name"),
        Column("layer", "Nullable(Int32)", "NULL", "block index; NULL outside the blocks"),
        _name(
            "role",
            "the name inside its block, expert index removed (the whole name outside "
            "the blocks; block: the block output)",
        ),
        Column("expert", "Nullable(Int32)", "NULL", "expert index; NULL when not one expert's"),
        Column("first_step", "UInt64", comment="the step whose detail first carried it"),
        _inserted_at(),
    ),
    key=("run_id", "tensor"),
)

GRAD_GROUP_STATS = Table(
    "grad_group_stats",
    "G_mean, G_max, Z_g per parameter group, every step",
    (
        _RUN,
        _STEP,
        _name("group", "embedding, expert or other"),
        Column("elements", "UInt64", comment="P: gradient elements of the group"),
        *(
            _series_column(c)
            for c in (
                GradGroupStats.grad_abs_mean,
                GradGroupStats.grad_abs_max,
                GradGroupStats.grad_zero_frac,
            )
        ),
        _inserted_at(),
    ),
    key=("run_id", "group", "step"),
)

RESIDUAL_STATS = Table(
    "residual_stats",
    "R_b, N_s, N_b per layer and branch (token means), on the steps that measure them: "
    "the depth profile of the residual paths (seeds 001 §8)",
    (
        _RUN,
        _STEP,
        _name("layer", "block index label"),
        _name("branch", "attn or mlp"),
        Column("tokens", "Float64", comment="valid tokens the means run over"),
        _f("ratio", "R_b = ||branch output|| / ||residual stream||, token mean"),
        _f("stream_norm", "N_s, token mean"),
        _f("branch_norm", "N_b, token mean"),
        _inserted_at(),
    ),
    key=("run_id", "layer", "branch", "step"),
)

EXPERT_STATS = Table(
    "expert_stats",
    "per-expert valid-token loads of retained steps",
    (
        _RUN,
        _STEP,
        _name("layer"),
        Column("expert", "UInt32"),
        Column("tokens", "Float64", comment="c_i summed over ranks"),
        Column("shard", "UInt32", "0", "expert-parallel shard of the expert"),
        _inserted_at(),
    ),
    key=("run_id", "layer", "step", "expert"),
)

_CULPRIT = Column(
    "culprit",
    "LowCardinality(String)",
    "''",
    "who carries it: rank 3, source code, layer 2, ... (part of the key)",
)

ANOMALIES = Table(
    "anomalies",
    "what the detectors flagged",
    (
        _RUN,
        _STEP,
        _name("signal", "what moved: loss, grad_norm, cospike, loss_by_source, step_time, ..."),
        _name("kind", "spike, cospike, nonfinite, threshold or drift"),
        Column("value", "Float64"),
        _f("baseline"),
        _f("z"),
        _CULPRIT,
        Column("detected_at", "DateTime64(3)", "now64(3)"),
        _inserted_at(),
    ),
    key=("run_id", "step", "signal", "kind", "culprit"),
)

ALERTS = Table(
    "alerts",
    "pages and warnings sent",
    (
        _RUN,
        _STEP,
        _name("signal"),
        _name("severity", "page or warn"),
        Column("value", "Float64"),
        _f("baseline"),
        _f("z"),
        Column("tokens", "UInt64", "0"),
        Column("ranks", "Array(UInt32)", "[]"),
        Column("message", "String", "''"),
        Column("next_steps", "Array(String)", "[]"),
        _CULPRIT,
        Column("fired_at", "DateTime64(3)", "now64(3)"),
        _inserted_at(),
    ),
    key=("run_id", "step", "signal", "culprit"),
)

EVALUATIONS = Table(
    "evaluations",
    "checkpoint evaluations",
    (
        _RUN,
        _STEP,
        Column("tokens", "UInt64", "0"),
        Column("flops", "Float64", "0"),
        _name("suite"),
        _name("metric", "bpb, nll, accuracy, exact_match, ..."),
        Column("value", "Float64"),
        Column("weights_stream", "LowCardinality(String)", "'raw'", "raw or ema"),
        Column("reference", "UInt8", "0", "1 for the weight stream decisions are made on"),
        Column("n_items", "UInt32", "0"),
        *(
            Column(f"{part}_version", "LowCardinality(String)", "''")
            for part in ("dataset", "tokenizer", "prompt", "decoding", "postprocess", "judge")
        ),
        Column("evaluated_at", "DateTime64(3)", "now64(3)"),
        _inserted_at(),
    ),
    key=("run_id", "suite", "metric", "weights_stream", "step"),
)

DEAD_LETTERS = Table(
    "dead_letters",
    "malformed input, kept with the reason",
    (
        Column("topic", "LowCardinality(String)"),
        Column("partition", "UInt32"),
        Column("offset", "UInt64"),
        Column("key", "String", "''"),
        Column("reason", "String"),
        Column("payload_b64", "String", "''"),
        Column("received_at", "DateTime64(3)", "now64(3)"),
        _inserted_at(),
    ),
    key=("topic", "partition", "offset"),
)

STREAM_STATE = Table(
    "stream_state",
    "detector windows and other state of the stream",
    (
        _RUN,
        Column("key", "String"),
        Column("step", "Int64", comment="last step folded into the state"),
        Column("state", "String", comment="JSON"),
        Column("updated_at", "DateTime64(6)", "now64(6)", "version"),
    ),
    key=("run_id", "key"),
    version="updated_at",
)


def _recent(table: Table) -> Table:
    """The durable look-back buffer of a detail table: every step's detail, kept one day.

    The stream writes all per-rank and P1/P2 detail here and copies the steps its
    retention policy keeps into ``table`` (seeds 001 §12): the buffer survives a worker
    restart because it lives in the store, not in the worker.
    """
    return Table(
        f"{table.name}_recent",
        f"look-back buffer of {table.name} (1 day)",
        table.columns,
        table.key,
        table.version,
        ttl=f"toDateTime({table.version}) + INTERVAL 1 DAY",
    )


RECENT_TABLES: tuple[Table, ...] = tuple(
    _recent(t) for t in (RANK_METRICS, TENSOR_STATS, EXPERT_STATS)
)

TABLES: tuple[Table, ...] = (
    RUNS,
    STEP_METRICS,
    SOURCE_METRICS,
    RANK_METRICS,
    TENSOR_STATS,
    EXPERT_STATS,
    GRAD_GROUP_STATS,
    RESIDUAL_STATS,
    TENSOR_NAMES,
    USER_METRICS,
    ANOMALIES,
    ALERTS,
    EVALUATIONS,
    DEAD_LETTERS,
    STREAM_STATE,
    *RECENT_TABLES,
)


def sensitive_artifacts(ttl_days: int) -> Table:
    """The opt-in table of raw samples and token traces; rows expire after ``ttl_days``."""
    if not 1 <= int(ttl_days) <= 90:
        raise ValueError(f"ttl_days must lie in [1, 90], got {ttl_days!r}")
    return Table(
        "sensitive_artifacts",
        "opt-in raw samples and token traces, short-lived",
        (
            _RUN,
            _STEP,
            Column("rank", "UInt32"),
            _name("kind", "sample, token_trace, ..."),
            Column("name", "String", "''"),
            Column("content", "String"),
            Column("created_at", "DateTime64(3)", "now64(3)"),
            _inserted_at(),
        ),
        key=("run_id", "step", "rank", "kind", "name"),
        ttl=f"toDateTime(created_at) + INTERVAL {int(ttl_days)} DAY",
    )


SENSITIVE_ARTIFACTS = "sensitive_artifacts"

# Columns a writer may supply per table; ``ClickHouseSink.write`` inserts the subset present.
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    **{t.name: t.writer_columns for t in TABLES},
    SENSITIVE_ARTIFACTS: sensitive_artifacts(7).writer_columns,
}


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]  # ``{db}`` stands for the database name


# The written part of each migration; every version's step_metrics columns are the
# registry's rows with that ``since`` (``_add_columns``), added before the written statements.
_WRITTEN: tuple[Migration, ...] = (
    Migration(
        1,
        "runs, step/source/rank metrics, tensor and expert statistics (and their "
        "look-back buffers), anomalies, alerts, evaluations, dead letters, "
        "stream state",
        tuple(t.ddl("{db}") for t in TABLES),
    ),
    Migration(
        2,
        "step_metrics: media scale, the weakest residual branch, the straggler's own-time ratio",
        (),
    ),
    Migration(
        3,
        "step_metrics: learning rates; runs: status crashed",
        (f"ALTER TABLE {{db}}.runs COMMENT COLUMN status '{_STATUS_DOC}'",),
    ),
    Migration(
        4,
        "step_metrics: the seeds' formed series and the guard's per-step events; grad_group_stats",
        (GRAD_GROUP_STATS.ddl("{db}"),),
    ),
    Migration(
        5,
        "step_metrics: compact parts up to 256 MiB",
        # one data file per part instead of one or two per column: a 50,000-row insert
        # into the 61-column table spent ~0.15 s creating a wide part's files; merges
        # still write wide parts above the limit; no stored value changes
        (f"ALTER TABLE {{db}}.step_metrics MODIFY SETTING min_bytes_for_wide_part = {256 << 20}",),
    ),
    Migration(
        6,
        "tensor_names: each tensor label of a run once, with its block, role and expert",
        (TENSOR_NAMES.ddl("{db}"),),
    ),
    Migration(
        8,
        "residual_stats: R_b, N_s, N_b per layer and branch of the steps that measure them",
        (RESIDUAL_STATS.ddl("{db}"),),
    ),
    Migration(
        10,
        "user_metrics: a user's own metrics (Monitor.log), one row per run, step and name",
        (USER_METRICS.ddl("{db}"),),
    ),
    Migration(
        12,
        "runs: note and tags a user sets in probewire ui",
        tuple(
            f"ALTER TABLE {{db}}.runs ADD COLUMN IF NOT EXISTS {c.ddl()} AFTER {after}"
            for c, after in zip(_NOTE_COLUMNS, ("planned_tokens", "note"))
        ),
    ),
)


def _migrations() -> tuple[Migration, ...]:
    """Every version, written or from the registry alone: the registry's step_metrics
    columns of that version (migration 1 creates the whole table), then its written part."""
    written = {m.version: m for m in _WRITTEN}
    versions = sorted(set(written) | {s.since for s in STEP_SERIES})
    out = []
    for v in versions:
        columns = _add_columns(v) if v > 1 else ()
        if v in written:
            m = written[v]
            added = ", ".join(s.name for s in STEP_SERIES if s.since == v) if v > 6 else ""
            description = f"{m.description}; step_metrics: {added}" if added else m.description
            out.append(Migration(v, description, (*columns, *m.statements)))
        else:
            names = ", ".join(s.name for s in STEP_SERIES if s.since == v)
            out.append(Migration(v, f"step_metrics: {names}", columns))
    return tuple(out)


MIGRATIONS: tuple[Migration, ...] = _migrations()


@dataclass(frozen=True, slots=True)
class View:
    name: str
    select: str  # ``{db}`` stands for the database name

    def ddl(self, db: str) -> str:
        return f"CREATE OR REPLACE VIEW {db}.{self.name} AS\n" + self.select.replace("{db}", db)


# One row per (run_id, step): the registry's first-screen series (the nine P0 signals and
# what a reader needs beside them), held-out bits per byte alongside (the latest
# reference-stream ``bpb`` evaluation at or before the step; with several suites at one
# step, the one with the most items).
_FIRST_SCREEN_COLUMNS = ",\n    ".join(
    f"s.{c.name} AS {c.name}" for c in STEP_SERIES if c.first_screen
)
_FIRST_SCREEN = View(
    "first_screen",
    f"""
SELECT
    {_FIRST_SCREEN_COLUMNS},
    e.bpb AS heldout_bpb, e.bpb_step AS heldout_bpb_step
FROM (SELECT * FROM {{db}}.step_metrics FINAL) AS s
ASOF LEFT JOIN (
    SELECT run_id, step, toNullable(argMax(value, (n_items, suite))) AS bpb,
           toNullable(step) AS bpb_step
    FROM {{db}}.evaluations FINAL
    WHERE metric = 'bpb' AND reference = 1
    GROUP BY run_id, step
) AS e ON s.run_id = e.run_id AND s.step >= e.step
""",
)

_LOSS_BY_SOURCE = View(
    "loss_by_source",
    """
SELECT src.run_id AS run_id, src.step AS step, run.tokens AS tokens, src.source AS source,
       src.loss AS loss, src.token_share AS token_share, src.tokens AS source_tokens
FROM (SELECT run_id, step, source, loss, token_share, tokens
      FROM {db}.source_metrics FINAL) AS src
LEFT JOIN (SELECT run_id, step, tokens FROM {db}.step_metrics FINAL) AS run
    ON src.run_id = run.run_id AND src.step = run.step
""",
)

# RMS, absolute mean, mean and excess kurtosis from the reduced power sums, over the finite
# elements the sums cover (m = n - nonfinite, as ``scan.summarize``); the zero fraction over
# all n elements (kurtosis only where sum3/sum4 were measured and the variance resolvable).
_TENSOR_VIEW = View(
    "tensor_view",
    """
SELECT run_id, step, tensor, kind, n, abs_max, nonfinite, rms, abs_mean, zero_frac, mean,
    if(m > 0 AND m4 IS NOT NULL AND m2 > 1e-10 * e2, m4 / (m2 * m2) - 3, NULL)
        AS excess_kurtosis
FROM (
    SELECT run_id, step, tensor, kind, n, abs_max, nonfinite, n - nonfinite AS m,
        if(m > 0, sqrt(sum_sq / m), NULL) AS rms,
        if(m > 0, abs_sum / m, NULL) AS abs_mean,
        if(n > 0, zeros / n, NULL) AS zero_frac,
        if(m > 0, `sum` / m, NULL) AS mean,
        `sum` / m AS mu, sum_sq / m AS e2, e2 - mu * mu AS m2,
        sum4 / m - 4 * mu * sum3 / m + 6 * mu * mu * e2 - 3 * pow(mu, 4) AS m4
    FROM {db}.tensor_stats FINAL
)
""",
)

# Per (run, step, tensor) of a retained scan step: the update ratio rho = ||dw|| / (||w|| +
# eps) of each tensor scanned both as its parameter and as its update (``derive.update_ratio``,
# eps = 1e-12), with both RMS beside it (seeds 001 §6), and the tensor's block (layer) and
# role from tensor_names, so that rho per layer or per role is a GROUP BY away.
_TENSOR_UPDATE_RATIO = View(
    "tensor_update_ratio",
    """
SELECT u.run_id AS run_id, u.step AS step, u.tensor AS tensor,
    sqrt(u.sum_sq) / (sqrt(p.sum_sq) + 1e-12) AS update_ratio,
    if(u.n > 0, sqrt(u.sum_sq / u.n), NULL) AS update_rms,
    if(p.n > 0, sqrt(p.sum_sq / p.n), NULL) AS param_rms,
    d.layer AS layer, d.role AS role
FROM (SELECT run_id, step, tensor, sum_sq, n FROM {db}.tensor_stats FINAL
      WHERE kind = 'update') AS u
INNER JOIN (SELECT run_id, step, tensor, sum_sq, n FROM {db}.tensor_stats FINAL
            WHERE kind = 'param') AS p
    ON u.run_id = p.run_id AND u.step = p.step AND u.tensor = p.tensor
LEFT JOIN (SELECT run_id, tensor, layer, role FROM {db}.tensor_names FINAL) AS d
    ON u.run_id = d.run_id AND u.tensor = d.tensor
WHERE u.sum_sq > 0 OR p.sum_sq > 0
""",
)

# Per (run, step, layer): I, MaxVio, H_norm, dead ratio and shard imbalance from the
# expert loads c_i (seeds 001 §7). H = log T - sum c_i log c_i / T over c_i > 0.
# Layers that received no valid token are left out, not reported as zero.
_EXPERT_BALANCE = View(
    "expert_balance",
    """
SELECT run_id, step, layer,
    count() AS experts,
    sum(tokens) AS layer_tokens,
    max(tokens) / (layer_tokens / experts) AS imbalance,
    imbalance - 1 AS max_violation,
    if(experts > 1,
       (log(layer_tokens) - sumIf(tokens * log(tokens), tokens > 0) / layer_tokens)
           / log(experts),
       NULL) AS h_norm,
    countIf(tokens = 0) / experts AS dead_ratio,
    argMax(expert, tokens) AS busiest_expert,
    arrayMax(sumMap([shard], [tokens]).2) / (layer_tokens / uniqExact(shard)) AS shard_imbalance
FROM {db}.expert_stats FINAL
GROUP BY run_id, step, layer
HAVING layer_tokens > 0
""",
)

VIEWS: tuple[View, ...] = (
    _FIRST_SCREEN,
    _LOSS_BY_SOURCE,
    _TENSOR_VIEW,
    _TENSOR_UPDATE_RATIO,
    _EXPERT_BALANCE,
)
