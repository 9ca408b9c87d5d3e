"""Reading a run's event archive (Parquet chunks, and for huge runs the per-bucket summaries) into
an :class:`~hdet_track.readers.base.HDETRun`: what every backend reader does once it has the files.
Nothing here imports a tracker, Streamlit or the scheduler.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..events import ControllerDecision, Converge, Guard, RunEnd, RunStart, UnknownSchemaError, event_from_dict
from ..summaries import LEVELS, SUMMARY_DIR, BucketTable, full_rows_limit, parse_piece_name
from .base import HDETRun, StepTable

__all__ = ["parse_chunks", "apply_events", "read_archive"]


def parse_chunks(
    chunks: Iterable[tuple[str, bytes]], run: HDETRun, bad: list[str] | None = None
) -> tuple[list[StepTable], list[Any]]:
    """Parse archive chunks (name, Parquet bytes) into step tables and events; bad chunks become
    warnings on ``run`` (and their names go to ``bad``), never exceptions."""
    import pyarrow.parquet as pq
    import pyarrow.types as pa_types

    tables: list[StepTable] = []
    events: list[Any] = []
    for name, data in chunks:
        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt chunk
            run.warnings.append(f"skipped unreadable archive chunk {name}: {type(exc).__name__}: {exc}")
            if bad is not None:
                bad.append(name)
            continue
        cols = table.column_names
        if name.startswith("steps-") and {"step", "replica", "loss"} <= set(cols):
            ids = [table.column(c) for c in ("step", "replica")]
            if any(not pa_types.is_integer(c.type) or c.null_count for c in ids):  # not this writer's
                run.warnings.append(f"skipped archive chunk {name}: its step or replica column is not whole numbers")
                continue
            tables.append(
                StepTable(
                    step=ids[0].to_numpy().astype(np.int64, copy=False),
                    replica=ids[1].to_numpy().astype(np.int32, copy=False),
                    loss=_floats(table.column("loss")),
                    values={c[2:]: _floats(table.column(c)) for c in cols if c.startswith("v:")},
                    multipliers={c[2:]: _floats(table.column(c)) for c in cols if c.startswith("m:")},
                )
            )
        elif name.startswith("events-") and "json" in cols:
            for text in table.column("json").to_pylist():
                try:
                    found = json.loads(text)
                    if not isinstance(found, dict):
                        raise TypeError(f"expected a JSON object, got {type(found).__name__}")
                    events.append(event_from_dict(found))
                except UnknownSchemaError as exc:
                    run.warnings.append(f"{name}: {exc}")
                except (ValueError, TypeError, KeyError, AttributeError) as exc:
                    run.warnings.append(f"{name}: unreadable event ({type(exc).__name__}: {exc})")
        else:
            run.warnings.append(f"skipped archive chunk {name}: unexpected columns {cols[:6]}")
    return tables, events


def _floats(column: Any) -> np.ndarray:
    return column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _is_piece(name: str) -> bool:
    return f"/{SUMMARY_DIR}/" in f"/{name}"


def _scope(name: str) -> str:
    """The archive a file belongs to (a W&B run resumed in a new directory numbers its chunks anew)."""
    if _is_piece(name):
        return f"/{name}".rsplit(f"/{SUMMARY_DIR}/", 1)[0][1:]
    return name.rsplit("/", 1)[0] if "/" in name else ""


def _chunk_name(scope: str, base: str) -> str:
    return f"{scope}/{base}" if scope else base


def _chunk_index(name: str) -> int:
    tail = name.rsplit("/", 1)[-1].removesuffix(".parquet").rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _rows_of(table: StepTable, lo: int | None, hi: int | None) -> StepTable:
    if lo is None and hi is None:
        return table
    mask = np.ones(len(table), dtype=bool)
    if lo is not None:
        mask &= table.step >= lo
    if hi is not None:
        mask &= table.step <= hi
    return _masked(table, mask)


def _masked(table: StepTable, mask: np.ndarray) -> StepTable:
    return StepTable(
        table.step[mask],
        table.replica[mask],
        table.loss[mask],
        {k: v[mask] for k, v in table.values.items()},
        {k: v[mask] for k, v in table.multipliers.items()},
    )


def read_archive(
    run: HDETRun,
    names: Sequence[str],
    fetch: Callable[[str], bytes | None],
    previous: HDETRun | None,
    steps: tuple[int, int] | None = None,
    max_rows: int | None = None,
) -> None:
    """Fold the archive chunks ``names`` into ``run``. With ``previous`` (the same run read before,
    e.g. while live, or its overview before a zoom), only what it has not read is fetched; ``fetch``
    returns a chunk's bytes (or None after adding a warning).

    An archive with summaries (``summary/`` pieces) is summarised from them into ``run.aggregates``;
    when the step range ``steps`` (inclusive; None for the whole run) holds at most ``max_rows`` rows
    (default :func:`~hdet_track.summaries.full_rows_limit`) its full rows are read into ``run.steps``,
    otherwise the run is an overview (``run.overview``). An archive without summaries is read in full.
    """
    max_rows = full_rows_limit() if max_rows is None else max_rows
    # A resumed W&B run (one archive per session) is read afresh: a later session's chunks may
    # supersede rows read before (see _later_steps).
    single = len({_scope(n) for n in names}) <= 1
    # A previous read rebuilt from metric histories (a live run whose first chunk was not uploaded
    # yet) has no multipliers: its rows would be kept over the archive's, so it is read afresh.
    reuse = (
        single
        and previous is not None
        and previous.run_id == run.run_id
        and bool(previous.chunks)
        and set(previous.chunks) <= set(names)
    )
    prev = previous if reuse else None
    known = set(prev.chunks) if prev is not None else set()
    step_names = [n for n in names if not _is_piece(n) and n.rsplit("/", 1)[-1].startswith("steps-")]
    pieces = [n for n in names if _is_piece(n) and parse_piece_name(n) is not None]
    others = [n for n in names if n not in set(step_names) and not _is_piece(n)]
    if prev is not None:
        run.start, run.end = prev.start, prev.end
        run.converge, run.controller = list(prev.converge), list(prev.controller)
        run.guard = list(prev.guard)
    consumed = set(known)

    def parse(chosen: list[str]) -> tuple[list[StepTable], list[Any], list[str]]:
        """The chunks' tables and events, and the names read whole: one that could not be read (torn
        while a live run wrote it) is not counted as read, so the next live read fetches it again."""
        tables: list[StepTable] = []
        events: list[Any] = []
        fetched: list[str] = []
        for name in chosen:
            data = fetch(name)
            if data is None:
                continue
            bad: list[str] = []
            t, e = parse_chunks([(name.rsplit("/", 1)[-1], data)], run, bad)
            tables.extend(t)
            events.extend(e)
            if not bad:
                fetched.append(name)
        return tables, events, fetched

    def rows_of(chosen: list[str]) -> dict[str, StepTable]:
        out = {}
        for name in chosen:
            tables, _, fetched = parse([name])
            consumed.update(fetched)
            out.update((name, table) for table in tables)
        return out

    _, events, fetched = parse([n for n in others if n not in known])
    consumed.update(fetched)
    apply_events(run, events)

    if not pieces and (prev is None or prev.aggregates is None):  # written before 0.3: every row
        whole = prev if prev is not None and prev.view is None else None
        have = set(whole.row_chunks) if whole is not None else set()
        read = rows_of([n for n in step_names if n not in have])
        later = _later_steps({n: (int(t.step.min()), int(t.step.max())) for n, t in read.items() if len(t)})
        tables = [_trim(t, later.get(_scope(n), [])) for n, t in read.items()]
        run.steps = StepTable.concat([whole.steps, *tables] if whole is not None else tables)
        run.row_chunks = tuple(sorted(have | set(read)))
        run.chunks = tuple(sorted(consumed))
        if steps is not None:
            run.steps, run.view = _rows_of(run.steps, *steps), steps
        return

    # -- the summaries: the widest rollups first, then pieces, then chunks summarised here
    covered: dict[str, tuple[int, int]] = dict(prev.aggregates.chunks) if prev and prev.aggregates else {}
    by_scope: dict[str, set[int]] = {}
    for name in covered:
        by_scope.setdefault(_scope(name), set()).add(_chunk_index(name))
    parts: list[BucketTable | None] = [prev.aggregates if prev is not None else None]
    wanted = {(_scope(n), _chunk_index(n)) for n in step_names if n not in covered}
    ranked = sorted(
        (n for n in pieces if n not in known), key=lambda n: -(parse_piece_name(n)[1] - parse_piece_name(n)[0])
    )
    for name in ranked:
        lo, hi = parse_piece_name(name)  # type: ignore[misc]
        scope = _scope(name)
        done = by_scope.setdefault(scope, set())
        if not any(s == scope and lo <= i <= hi for s, i in wanted) or any(lo <= i <= hi for i in done):
            continue
        data = fetch(name)
        if data is None:
            continue
        try:
            import pyarrow.parquet as pq

            piece = BucketTable.from_arrow(pq.read_table(io.BytesIO(data)))
        except Exception as exc:  # noqa: BLE001 - truncated or foreign file: its chunks are summarised here
            run.warnings.append(f"skipped unreadable summary {name}: {type(exc).__name__}: {exc}")
            continue
        piece.chunks = {_chunk_name(scope, base): r for base, r in piece.chunks.items()}
        parts.append(piece)
        consumed.add(name)
        done.update(range(lo, hi + 1))
        wanted = {(s, i) for s, i in wanted if not (s == scope and lo <= i <= hi)}
    levels = sorted({level for p in parts if p is not None for level in p.levels}) or list(LEVELS)
    read_rows: dict[str, StepTable] = {}
    missing = [n for n in step_names if (_scope(n), _chunk_index(n)) in wanted]
    for name, table in rows_of(missing).items():  # no summary (an older writer, a lost upload): summarise here
        read_rows[name] = table
        parts.append(_summarize(table, name, levels))
    later = _later_steps({n: r for p in parts if p is not None for n, r in p.chunks.items()})
    if any(later.values()):  # sessions that overlap: their pieces would count those steps twice
        kept = []
        for part in parts:
            if part is None or not any(_hits(r, later[_scope(n)]) for n, r in part.chunks.items()):
                kept.append(part)
                continue
            read_rows |= rows_of([n for n in part.chunks if n not in read_rows])
            for name in part.chunks:
                if name in read_rows:
                    read_rows[name] = _trim(read_rows[name], later[_scope(name)])
                    kept.append(_summarize(read_rows[name], name, levels))
        parts = kept
    run.aggregates = BucketTable.merge(parts)
    run.chunks = tuple(sorted(consumed | set(run.aggregates.chunks)))

    # -- full rows of the step range when they are few enough; an overview otherwise
    lo, hi = steps if steps is not None else (None, None)
    run.view = steps
    finest = run.aggregates.at(min(run.aggregates.levels), lo, hi) if len(run.aggregates) else run.aggregates
    if finest.rows_in(lo, hi) > max_rows:
        run.overview = True
        return
    ranges = run.aggregates.chunks
    in_range = [
        n
        for n in step_names
        if n in read_rows
        or n not in ranges
        or ((lo is None or ranges[n][1] >= lo) and (hi is None or ranges[n][0] <= hi))
    ]
    same = prev is not None and not prev.overview and prev.view == steps
    have = set(prev.row_chunks) if same and prev is not None else set()
    tables = [prev.steps] if same and prev is not None else []
    todo = [n for n in in_range if n not in have and n not in read_rows]
    fetched = rows_of(todo)
    tables += [read_rows[n] for n in in_range if n in read_rows and n not in have]
    tables += [_trim(t, later.get(_scope(n), [])) for n, t in fetched.items()]
    run.steps = _rows_of(StepTable.concat(tables), lo, hi)
    run.row_chunks = tuple(sorted(have | set(fetched) | (set(read_rows) & set(in_range))))


def _later_steps(spans: dict[str, tuple[int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Scope -> the step ranges that later scopes' chunks (``spans``: chunk -> first and last step)
    hold. A W&B run resumed from an older checkpoint has one archive per session, in name order;
    where they overlap (written before the tracker skipped stored steps) the later session's rows win."""
    out: dict[str, list[tuple[int, int]]] = {}
    ranges: list[tuple[int, int]] = []
    by_scope: dict[str, list[tuple[int, int]]] = {}
    for name, span in spans.items():
        by_scope.setdefault(_scope(name), []).append(span)
    for scope in sorted(by_scope, reverse=True):
        out[scope] = list(ranges)
        ranges = _merged(ranges + by_scope[scope])
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _hits(span: tuple[int, int], ranges: list[tuple[int, int]]) -> bool:
    return any(span[0] <= hi and lo <= span[1] for lo, hi in ranges)


def _trim(table: StepTable, ranges: list[tuple[int, int]]) -> StepTable:
    """``table`` without its rows in the step ``ranges`` (a later session's)."""
    if not ranges or not len(table):
        return table
    drop = np.zeros(len(table), dtype=bool)
    for lo, hi in ranges:
        drop |= (table.step >= lo) & (table.step <= hi)
    return _masked(table, ~drop) if drop.any() else table


def _summarize(table: StepTable, name: str, levels: Sequence[int]) -> BucketTable:
    columns = {"loss": table.loss}
    columns |= {f"v:{k}": v for k, v in table.values.items()}
    columns |= {f"m:{k}": v for k, v in table.multipliers.items()}
    span = (int(table.step.min()), int(table.step.max())) if len(table) else (0, -1)
    return BucketTable.summarize(table.step, table.replica, columns, levels, {name: span})


def apply_events(run: HDETRun, events: Iterable[Any]) -> None:
    """Fold parsed events into ``run`` (start, converge, controller, end), in step order; of events
    that repeat one another (two sessions of a resumed run wrote them) the last one."""
    for ev in events:
        if isinstance(ev, RunStart):
            run.start = ev
        elif isinstance(ev, Converge):
            run.converge.append(ev)
        elif isinstance(ev, ControllerDecision):
            run.controller.append(ev)
        elif isinstance(ev, Guard):
            run.guard.append(ev)
        elif isinstance(ev, RunEnd):
            run.end = ev
    run.converge, run.controller, run.guard = _latest(run.converge), _latest(run.controller), _latest(run.guard)


def _latest(events: list[Any]) -> list[Any]:
    """One event per kind, step and name (a guard's: action and replicas), the last; in step order."""

    def key(e: Any) -> tuple:
        return e.kind, e.step, getattr(e, "name", None), getattr(e, "action", None), str(getattr(e, "replicas", ""))

    return sorted({key(e): e for e in events}.values(), key=lambda e: e.step)
