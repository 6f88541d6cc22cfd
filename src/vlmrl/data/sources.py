"""Reading raw rows from wherever `data.source` points: the Hub, a Parquet/JSON(L)/CSV file, or a folder.

Every reader yields plain dicts with the dataset's own field names, and images left *undecoded* (datasets'
`{"bytes", "path"}` storage, or a path): decoding is the image module's job, after the cheap field checks, and
behind its size guard. Local rows carry `__base_dir__` so relative image paths resolve against their file.

A bad line becomes a row `{"__error__": ..., "__reason__": ...}` that the stage drops with that reason
(`bad_row`: not JSON or not an object; `bad_encoding`: not UTF-8; `too_deeply_nested`; `cell_too_large`: a
CSV cell over `MAX_CELL_CHARS` characters; `row_too_large`: a JSONL line over `MAX_LINE_BYTES`, which is never
read whole): it never stops a run. Every format's cells are bounded again, after reading, by
`values.cell_problem`. A source with more than `MAX_COLUMNS` columns (a CSV header, a Parquet or datasets
schema) is refused in one line before any row is read.
A UTF-8 byte-order mark is skipped. A file that cannot be read at all (a corrupt Parquet or CSV file) is one
`DataError` naming the file and the cause. A folder in the Hugging Face `imagefolder` layout is read through
its `metadata.jsonl`/`metadata.csv` (the `file_name` column names each image, relative to that file).
CSV cells are text: a list column (`images`, `choices`) holds a JSON list (`["a.png", "b.png"]`).

Every row carries `__where__`, its file name and row number (`train.parquet:12`; the line number for JSONL
and CSV; `name/split:12` for datasets), which names rows without an id. Splits: a folder's files naming a
split (`data/test-0000.parquet`, `train/metadata.jsonl`), a DatasetDict's or a hub dataset's splits. The split
read is `data.split`, else the source's own default (`DEFAULT_SPLITS`: testmini where there is one, as
MathVista has, else train, else everything); its rows carry `__split__`. `data.holdout_split` is opened the
same way, and must exist.
Deliberately left out: streaming from the Hub (MathVista testmini is 1,000 rows), compressed files.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config.schema import DataConfig
from vlmrl.data.items import DataError
from vlmrl.data.values import MAX_CELL_CHARS, MAX_COLUMNS

BATCH = 64
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ROW_FILES = (".parquet", ".jsonl", ".json", ".csv")
BOM = b"\xef\xbb\xbf"
DEFAULT_SPLITS = ("testmini", "train")  # the split read when data.split is unset, the first the source has
MAX_CSV_CELL = MAX_CELL_CHARS  # the csv module's own default limit
MAX_LINE_BYTES = 8 * 1024 * 1024  # a JSONL line longer than this is dropped unread (64 cells at the cell limit)
CHUNK = 1024 * 1024  # bytes read at a time while skipping an over-long line


@dataclass
class RowSource:
    """Rows to convert, how many there will be (for progress and the counts), a name for messages, and the
    split read (None: a single file, or every file of a folder)."""

    name: str
    total: int
    rows: Iterator[dict[str, Any]]
    split: str | None = None


def open_rows(data: DataConfig, *, holdout: bool = False) -> RowSource:
    """Open `data.source` (anything but `synthetic`) at `data.split` (or, with `holdout`, at
    `data.holdout_split`, which must exist), capped at `data.max_items` rows."""
    path = Path(data.source).expanduser()
    split = data.holdout_split if holdout else data.split
    if holdout and path.is_file():
        raise DataError(f"data.holdout_split {split!r}: {path} is one file, with no splits; point data.source at "
                        "a folder of split files (train.parquet, test.parquet), a save_to_disk DatasetDict or a hub "
                        "id, or unset data.holdout_split to hold out part of this file.")
    if path.is_dir():
        source = _open_folder(path, split, strict=holdout)
    elif path.is_file():
        source = _open_file(path)
    elif HUB_ID.match(data.source) and not data.source.startswith((".", "/")):
        source = _open_hub(data.source, split)
    else:
        raise DataError(
            f"data.source {data.source!r}: no such file or folder, and not a Hugging Face Hub id "
            "(owner/name). "
            "Use `synthetic`, a hub id such as AI4Math/MathVista, "
            "or a local Parquet/JSONL/CSV file or folder."
        )
    if data.max_items is not None and source.total > data.max_items:
        source = RowSource(source.name, data.max_items, itertools.islice(source.rows, data.max_items), source.split)
    if source.split is not None:
        source.rows = _tagged(source.rows, source.split)
    return source


def default_split(names: list[str]) -> str | None:
    """The split read when data.split is unset: testmini (MathVista's), else train, else the only one.

    >>> default_split(["test", "testmini"]), default_split(["train", "test"]), default_split(["dev"])
    ('testmini', 'train', 'dev')
    """
    found = [name for name in DEFAULT_SPLITS if name in names]
    return found[0] if found else (names[0] if len(names) == 1 else None)


def _tagged(rows: Iterator[dict[str, Any]], split: str) -> Iterator[dict[str, Any]]:
    for row in rows:
        row["__split__"] = split
        yield row


def _open_file(path: Path) -> RowSource:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return RowSource(path.stem, _parquet_rows_count(path), _parquet_rows(path))
    if suffix == ".jsonl":
        with path.open("rb") as handle:
            total = sum(1 for _, raw in _bounded_lines(handle) if raw is None or (raw.strip() and raw.strip() != BOM))
        return RowSource(path.stem, total, _jsonl_rows(path))
    if suffix == ".json":
        rows = _json_rows(path)
        return RowSource(path.stem, len(rows), iter(rows))
    if suffix == ".csv":
        rows = _csv_rows(path)
        return RowSource(path.stem, len(rows), iter(rows))
    raise DataError(f"{path}: unsupported file type {suffix!r}; use .parquet, .jsonl, .json or .csv.")


def _open_folder(folder: Path, split: str | None, *, strict: bool = False) -> RowSource:
    if any(
        (folder / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        return _open_saved(folder, split)
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in ROW_FILES and p.is_file())
    files = [p for p in files if not p.name.startswith(".")]
    metadata = [p for p in files if p.stem == "metadata"]
    files = metadata or files  # imagefolder layout: the metadata files are the rows, the rest are images
    if not files:
        raise DataError(
            f"{folder}: no .parquet, .jsonl or .json files (and not a datasets.save_to_disk folder)."
        )
    # A hub snapshot holds every split (data/testmini-0000.parquet, data/test-0000.parquet): keep `split`'s.
    # (imagefolder: train/metadata.jsonl, so the split may name the folder rather than the file)
    def named(name: str) -> list[Path]:
        pattern = rf"(^|[^a-z]){re.escape(name.lower())}([^a-z]|$)"
        return [p for p in files if re.search(pattern, p.relative_to(folder).as_posix().lower())]

    if split is None:
        split = next((name for name in DEFAULT_SPLITS if named(name)), None)
    chosen = named(split) if split is not None else []
    if strict and not chosen:
        raise DataError(f"{folder}: no file names the split {split!r} (files: "
                        f"{', '.join(p.relative_to(folder).as_posix() for p in files[:10])}); check data.holdout_split.")
    opened = [_open_file(p) for p in chosen or files]  # an explicit split no file names: every file, as before
    return RowSource(
        folder.name, sum(s.total for s in opened), itertools.chain.from_iterable(s.rows for s in opened),
        split if chosen else None,
    )


def _open_saved(folder: Path, split: str) -> RowSource:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as exc:  # noqa: BLE001  a damaged or foreign folder: one line naming it
        raise DataError(
            f"{folder}: not a readable datasets.save_to_disk folder ({_one_line(exc)})."
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        split = split or default_split(list(loaded))
        if split not in loaded:
            raise DataError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)}); set data.split "
                            "(and data.holdout_split, to hold out another split).")
        loaded = loaded[split]
        _check_width(len(loaded.column_names), str(folder))
        return RowSource(folder.name, len(loaded), _dataset_rows(loaded, folder, f"{folder.name}/{split}"), split)
    _check_width(len(loaded.column_names), str(folder))
    return RowSource(folder.name, len(loaded), _dataset_rows(loaded, folder, folder.name))


def _open_hub(repo_id: str, split: str | None) -> RowSource:
    import datasets

    try:
        if split is None:
            names = datasets.get_dataset_split_names(repo_id)
            split = default_split(names)
            if split is None:
                raise DataError(f"data.source {repo_id!r} has the splits {', '.join(names)} and none is testmini "
                                "or train; set data.split.")
        loaded = datasets.load_dataset(repo_id, split=split)
    except DataError:
        raise
    except Exception as exc:  # network, auth, unknown split: all need the same advice
        raise DataError(
            f"data.source {repo_id!r} (split {split!r}) could not be loaded from the Hugging Face Hub: "
            f"{exc}. "
            "Check the id and split, your network and HF_TOKEN, or point data.source at a local copy."
        ) from exc
    name = repo_id.split("/")[-1]
    _check_width(len(loaded.column_names), f"data.source {repo_id!r}")
    return RowSource(name, len(loaded), _dataset_rows(loaded, None, f"{name}/{split}"), split)


def _dataset_rows(dataset: Any, base_dir: Path | None, name: str) -> Iterator[dict[str, Any]]:
    # Arrow format yields images as their stored {"bytes", "path"} structs: no decoding here, so the size
    # guard in images.py sees every picture before PIL allocates its pixels.
    arrow = dataset.with_format("arrow")
    for start in range(0, len(dataset), BATCH):
        for number, row in enumerate(arrow[start : start + BATCH].to_pylist(), start=start + 1):
            row["__base_dir__"], row["__where__"] = base_dir, f"{name}:{number}"
            yield row


def _parquet_rows_count(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        width, rows = len(parquet.schema_arrow.names), parquet.metadata.num_rows
    except Exception as exc:  # noqa: BLE001  pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(exc)}).") from None
    _check_width(width, str(path))
    return rows


def _check_width(columns: int, where: str) -> None:
    """Refuse a source wider than MAX_COLUMNS before a row is read: each row would carry every column."""
    if columns > MAX_COLUMNS:
        raise DataError(f"{where}: {columns:,} columns, more than vlmrl reads ({MAX_COLUMNS:,}); keep the columns "
                        "the task needs (question, answer, image and those your rewards take).")


def _bounded_lines(handle: Any) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes) for each line of a binary file; None for a line over MAX_LINE_BYTES,
    which is skipped a chunk at a time, so no more than MAX_LINE_BYTES of it is ever in memory."""
    number = 0
    while raw := handle.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) <= MAX_LINE_BYTES:
            yield number, raw
            continue
        while not raw.endswith(b"\n") and (raw := handle.readline(CHUNK)):
            pass
        yield number, None


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        number = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            for row in batch.to_pylist():
                number += 1
                row["__base_dir__"], row["__where__"] = path.parent, f"{path.name}:{number}"
                yield row
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001  a damaged page shows only when it is read
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(exc)}).") from None


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    # Bytes, decoded line by line: one undecodable byte costs its own row, not the file.
    with path.open("rb") as handle:
        for number, raw in _bounded_lines(handle):
            if raw is None:
                yield _error(f"{path.name}:{number}", "row_too_large",
                             f"a line of more than {MAX_LINE_BYTES:,} bytes (not read)")
                continue
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 1]
                yield _error(where, "bad_encoding", f"not UTF-8 (byte {exc.start}: {bad!r})")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield _error(where, "bad_row", f"not valid JSON ({exc.msg})")
                continue
            except RecursionError:
                yield _error(where, "too_deeply_nested", "JSON nested too deeply to read")
                continue
            if not isinstance(row, dict):
                yield _error(where, "bad_row", f"expected a JSON object, got {type(row).__name__}")
                continue
            row["__base_dir__"], row["__where__"] = path.parent, where
            yield row


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV file with a header line; empty cells are missing values (None)."""
    rows: list[dict[str, Any]] = []
    # the csv module refuses the whole file at a cell over its limit: read any size, then drop that row alone
    limit = csv.field_size_limit(2**31 - 1)
    # surrogateescape keeps an undecodable byte in its row, which is then dropped alone (`bad_encoding`)
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as handle:
        reader = csv.DictReader(handle)
        try:
            if reader.fieldnames is not None:  # reads the header line
                _check_width(len(reader.fieldnames), str(path))
            for record in reader:
                where = f"{path.name}:{reader.line_num}"
                longest = max((len(v) for v in (*record.keys(), *record.values()) if isinstance(v, str)), default=0)
                if longest > MAX_CSV_CELL:
                    rows.append(_error(where, "cell_too_large", f"a cell of {longest:,} characters (limit {MAX_CSV_CELL:,})"))
                    continue
                if None in record:
                    extra = len(record[None])
                    rows.append(_error(where, "bad_row", f"{extra} more cell(s) than the header has"))
                    continue
                if any(_has_surrogates(v) for v in (*record.keys(), *record.values()) if isinstance(v, str)):
                    rows.append(_error(where, "bad_encoding", "not UTF-8"))
                    continue
                row: dict[str, Any] = {k: (v if v != "" else None) for k, v in record.items()}
                row["__base_dir__"], row["__where__"] = path.parent, where
                rows.append(row)
        except csv.Error as exc:
            raise DataError(f"{path}: not a readable CSV file (line {reader.line_num}: {exc}).") from None
        finally:
            csv.field_size_limit(limit)
    if reader.fieldnames is None:
        raise DataError(f"{path}: empty CSV file (no header line).")
    return rows


def _error(where: str, reason: str, detail: str) -> dict[str, Any]:
    return {"__error__": f"{where}: {detail}", "__reason__": reason, "__where__": where}


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _json_rows(path: Path) -> list[dict[str, Any]]:
    """A JSON list of rows, or a mapping of id -> row (MathVista's annotation files are keyed by pid)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise DataError(f"{path}: not valid JSON ({_one_line(exc)}).") from None
    rows = list(data.values()) if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{path}: expected a list of objects or a mapping of id -> object.")
    return [{**row, "__base_dir__": path.parent, "__where__": f"{path.name}:{number}"}
            for number, row in enumerate(rows, start=1)]
