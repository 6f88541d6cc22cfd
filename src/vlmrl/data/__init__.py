"""The data stage and its parts.

- `prepare.py`   the stage function `prepare_data` (and `load_prepared` for later stages)
- `collect.py`   read a source row by row, keep (image stored) or drop (with a reason)
- `items.py`     the `Item` / `Dropped` records and atomic JSON(L) files
- `images.py`    normalisation, the size guard, sha256 and dHash
- `sources.py`   rows from the Hub, Parquet/JSON(L) files, folders, `save_to_disk` output
- `mathvista.py` MathVista rows (and `data.columns`-mapped datasets) to candidates
- `splits.py`    the held-out split and the contamination guard
- `synthetic.py` procedural visual math (`canvas.py`, `charts.py`, `plots.py`, `geometry.py` draw it)
"""
