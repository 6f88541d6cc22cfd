"""The data stage and its parts.

- `prepare.py`   the stage function `prepare_data` (and `load_prepared` for later stages)
- `collect.py`   read a source row by row, keep (image stored) or drop (with a reason)
- `items.py`     the `Item` / `Dropped` records and atomic JSON(L) files
- `images.py`    normalisation, the size guard, sha256 and dHash
- `sources.py`   rows from the Hub, Parquet/JSON(L)/CSV files, folders (imagefolder), `save_to_disk` output
- `mathvista.py` MathVista rows to candidates (and the per-row dispatch: bad rows dropped with a reason)
- `mapped.py`    any other dataset through `data.columns` (all answer types, several images, extra columns)
- `values.py`    gold numbers kept exactly as written, cells made JSON-safe, nesting depth
- `table.py`     the items as the columns of TRL's training dataset (what reward functions receive)
- `splits.py`    the held-out split and the contamination guard (sha256, dHash, pixels)
- `synthetic/`   procedural visual math: the families and the item stream in `__init__.py`; `canvas.py`,
                 `charts.py`, `plots.py`, `geometry.py` draw it
"""
