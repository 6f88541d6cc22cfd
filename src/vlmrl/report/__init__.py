"""The report: one self-contained `report.html` that shows what a run did and what changed.

It reads only files in the run directory (every number on the page is a value from one of them, and each
section names its file), so it can be regenerated at any time and works for a run stopped at any stage: a
missing file becomes a plain sentence saying what is missing, never an error. The page needs no network:
plots are inline SVG (matplotlib, no pyplot state), thumbnails are base64 PNGs, CSS and JS are inline, and a
Content-Security-Policy forbids every fetch and every script but ours (pinned by hash), so even a completion
that slipped past escaping could not run. All text from the model or the data goes through `html.escape`.

Where each part lives, split by what changes together:
- `page`: `write_report` / `build_report`, the section order, the HTML shell, its CSS, script and CSP;
- `sections`: the summary tables, training and validation curves, categories, flips, export, data, setup;
- `samples`: the per-sample viewer (cards, status, thumbnails);
- `plots`: matplotlib curves as inline SVG;
- `files`: reading the run folder once, and the sentence for a missing or unreadable file;
- `cells`: escaping, number cells and tables shared by every section.
- `visual`: the visual-control table;

Left out on purpose: computing statistics (that is `compare.py`'s job; the report only shows them), and
full-size images (96 px thumbnails keep a 100-item report well under a few megabytes).
"""

from vlmrl.report.page import build_report, is_current, write_report

__all__ = ["build_report", "is_current", "write_report"]
