"""Reading raw rows from wherever `data.source` points: the Hub, a Parquet/JSON(L)/CSV file, or a folder.

Every reader yields plain dicts with the dataset's own field names, and images left *undecoded* (datasets'
`{"bytes", "path"}` storage, or a path): decoding is the image module's job, after the cheap field checks, and
behind its size guard. Local rows carry `__base_dir__` so relative image paths resolve against their file.

A bad line becomes a row `{"__error__": ..., "__reason__": ...}` that the stage drops with that reason
(`bad_row`: not JSON or not an object; `bad_encoding`: not UTF-8; `too_deeply_nested`): it never stops a run.
A UTF-8 byte-order mark is skipped. A file that cannot be read at all (a corrupt Parquet or CSV file) is one
`DataError` naming the file and the cause. A folder in the Hugging Face `imagefolder` layout is read through
its `metadata.jsonl`/`metadata.csv` (the `file_name` column names each image, relative to that file).
CSV cells are text: a list column (`images`, `choices`) holds a JSON list (`["a.png", "b.png"]`).
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

BATCH = 64
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ROW_FILES = (".parquet", ".jsonl", ".json", ".csv")
BOM = b"\xef\xbb\xbf"


@dataclass
class RowSource:
    """Rows to convert, how many there will be (for progress and the counts), and a name for messages."""

    name: str
    total: int
    rows: Iterator[dict[str, Any]]


def open_rows(data: DataConfig) -> RowSource:
    """Open `data.source` (anything but `synthetic`), capped at `data.max_items` rows."""
    path = Path(data.source).expanduser()
    if path.is_dir():
        source = _open_folder(path, data.split)
    elif path.is_file():
        source = _open_file(path)
    elif HUB_ID.match(data.source) and not data.source.startswith((".", "/")):
        source = _open_hub(data.source, data.split)
    else:
        raise DataError(
            f"data.source {data.source!r}: no such file or folder, and not a Hugging Face Hub id "
            "(owner/name). "
            "Use `synthetic`, a hub id such as AI4Math/MathVista, "
            "or a local Parquet/JSONL/CSV file or folder."
        )
    if data.max_items is not None and source.total > data.max_items:
        source = RowSource(source.name, data.max_items, itertools.islice(source.rows, data.max_items))
    return source


def _open_file(path: Path) -> RowSource:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return RowSource(path.stem, _parquet_rows_count(path), _parquet_rows(path))
    if suffix == ".jsonl":
        with path.open("rb") as handle:
            total = sum(1 for line in handle if line.strip() and line.strip() != BOM)
        return RowSource(path.stem, total, _jsonl_rows(path))
    if suffix == ".json":
        rows = _json_rows(path)
        return RowSource(path.stem, len(rows), iter(rows))
    if suffix == ".csv":
        rows = _csv_rows(path)
        return RowSource(path.stem, len(rows), iter(rows))
    raise DataError(f"{path}: unsupported file type {suffix!r}; use .parquet, .jsonl, .json or .csv.")


def _open_folder(folder: Path, split: str) -> RowSource:
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
    chosen = [
        p for p in files
        if re.search(rf"(^|[^a-z]){re.escape(split)}([^a-z]|$)", p.relative_to(folder).as_posix().lower())
    ]
    files = chosen or files
    opened = [_open_file(p) for p in files]
    return RowSource(
        folder.name, sum(s.total for s in opened), itertools.chain.from_iterable(s.rows for s in opened)
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
        if split not in loaded:
            raise DataError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)}); set data.split.")
        loaded = loaded[split]
    return RowSource(folder.name, len(loaded), _dataset_rows(loaded, folder))


def _open_hub(repo_id: str, split: str) -> RowSource:
    import datasets

    try:
        loaded = datasets.load_dataset(repo_id, split=split)
    except Exception as exc:  # network, auth, unknown split: all need the same advice
        raise DataError(
            f"data.source {repo_id!r} (split {split!r}) could not be loaded from the Hugging Face Hub: "
            f"{exc}. "
            "Check the id and split, your network and HF_TOKEN, or point data.source at a local copy."
        ) from exc
    return RowSource(repo_id.split("/")[-1], len(loaded), _dataset_rows(loaded, None))


def _dataset_rows(dataset: Any, base_dir: Path | None) -> Iterator[dict[str, Any]]:
    # Arrow format yields images as their stored {"bytes", "path"} structs: no decoding here, so the size
    # guard in images.py sees every picture before PIL allocates its pixels.
    arrow = dataset.with_format("arrow")
    for start in range(0, len(dataset), BATCH):
        for row in arrow[start : start + BATCH].to_pylist():
            row["__base_dir__"] = base_dir
            yield row


def _parquet_rows_count(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # noqa: BLE001  pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(exc)}).") from None


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            for row in batch.to_pylist():
                row["__base_dir__"] = path.parent
                yield row
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001  a damaged page shows only when it is read
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(exc)}).") from None


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    # Bytes, decoded line by line: one undecodable byte costs its own row, not the file.
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
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
            row["__base_dir__"] = path.parent
            yield row


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV file with a header line; empty cells are missing values (None)."""
    rows: list[dict[str, Any]] = []
    # surrogateescape keeps an undecodable byte in its row, which is then dropped alone (`bad_encoding`)
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as handle:
        reader = csv.DictReader(handle)
        try:
            for record in reader:
                where = f"{path.name}:{reader.line_num}"
                if None in record:
                    extra = len(record[None])
                    rows.append(_error(where, "bad_row", f"{extra} more cell(s) than the header has"))
                    continue
                if any(_has_surrogates(v) for v in (*record.keys(), *record.values()) if isinstance(v, str)):
                    rows.append(_error(where, "bad_encoding", "not UTF-8"))
                    continue
                row: dict[str, Any] = {k: (v if v != "" else None) for k, v in record.items()}
                row["__base_dir__"] = path.parent
                rows.append(row)
        except csv.Error as exc:
            raise DataError(f"{path}: not a readable CSV file (line {reader.line_num}: {exc}).") from None
    if reader.fieldnames is None:
        raise DataError(f"{path}: empty CSV file (no header line).")
    return rows


def _error(where: str, reason: str, detail: str) -> dict[str, Any]:
    return {"__error__": f"{where}: {detail}", "__reason__": reason}


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
    return [{**row, "__base_dir__": path.parent} for row in rows]
