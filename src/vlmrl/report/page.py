"""The page: `write_report` / `build_report` put the sections in order inside one self-contained HTML shell.

What lives here: the section order, the header (navigation, input-file inventory), the inline CSS and the one
inline script (sample filtering), and the Content-Security-Policy that pins that script by its hash. Left out:
the sections' content (`sections`, `samples`, `visual`) and any external asset.

The page names its inputs: a `vlmrl-inputs` meta tag holds the hash of every run-folder file it read (`-` for
one that was absent), so `is_current` tells whether a later command (an export, a comparison) changed what
it shows.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from vlmrl.common.io import write_text_atomic
from vlmrl.report.cells import esc
from vlmrl.report.files import RunFiles
from vlmrl.report.samples import samples_section
from vlmrl.report.sections import (
    category_section,
    data_section,
    export_section,
    flips_section,
    headline_section,
    setup_section,
    training_section,
)
from vlmrl.report.visual import report_html as visual_section
from vlmrl.run import layout


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report.html` from whatever stage outputs exist; return its path."""
    path = Path(run_dir) / layout.REPORT
    write_text_atomic(path, build_report(Path(run_dir)))
    return path


_INPUTS = re.compile(r'<meta name="vlmrl-inputs" content="([^"]*)">')


def is_current(run_dir: Path) -> bool:
    """Whether `run_dir/report.html` exists and every file it read is as it was when it was written."""
    try:
        found = _INPUTS.search((Path(run_dir) / layout.REPORT).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return False
    if found is None:  # written before pages named their inputs
        return False
    pairs = [item.rpartition("=") for item in found.group(1).split()]
    return all((layout.file_digest(Path(run_dir) / name) or "-") == digest for name, _, digest in pairs)


def _inputs(files: RunFiles) -> str:
    return " ".join(f"{esc(name)}={layout.file_digest(files.run_dir / name) or '-'}" for name in sorted(files.read))


def build_report(run_dir: Path) -> str:
    """The whole page, as a string."""
    files = RunFiles(Path(run_dir))
    sections = [
        ("headline", "Before / after", headline_section(files)),
        ("training", "Training", training_section(files)),
        ("categories", "By category", category_section(files)),
        ("visual", "Visual control", visual_section((files.json_object(layout.COMPARISON) or {}).get("visual_control"))),
        ("flips", "Flips", flips_section(files)),
        ("samples", "Samples", samples_section(files)),
        ("export", "Export checks", export_section(files)),
        ("data", "Data", data_section(files)),
        ("setup", "Config & environment", setup_section(files)),
    ]
    nav = "".join(f'<a href="#{key}">{title}</a>' for key, title, _ in sections)
    body = "".join(f'<section id="{key}"><h2>{title}</h2>{html_}</section>' for key, title, html_ in sections)
    script_hash = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    csp = f"default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    name = esc(files.run_dir.resolve().name)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        f'<meta name="vlmrl-inputs" content="{_inputs(files)}">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>vlmrl report: {name}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>vlmrl report <span>{name}</span></h1><nav>{nav}</nav>{files.inventory()}</header>"
        f"<main>{body}</main><script>{_SCRIPT}</script></body></html>\n"
    )



_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--bg:#f6f8fa;--accent:#0969da;--up:#1a7f37;--down:#cf222e}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
color:var(--fg)}header{background:var(--bg);border-bottom:1px solid var(--line);padding:16px 32px}
h1{margin:0 0 8px;font-size:22px}h1 span{color:var(--muted);font-weight:400}
nav a{margin-right:14px;color:var(--accent);text-decoration:none}nav a:hover{text-decoration:underline}
main{max-width:1280px;margin:0 auto;padding:0 32px 48px}section{margin-top:28px}
h2{font-size:18px;border-bottom:1px solid var(--line);padding-bottom:4px}h3{font-size:15px;margin:18px 0 6px}
.src{color:var(--muted);font-size:12.5px;margin:4px 0 10px}
.missing{color:#7d4e00;background:#fff8c5;padding:6px 10px;border-radius:6px;display:inline-block;
margin:4px 8px 4px 0}
table{border-collapse:collapse;margin:6px 0 12px}th,td{border-bottom:1px solid var(--line);padding:4px 10px;
text-align:left;vertical-align:top}thead th{background:var(--bg);font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.up{color:var(--up)}td.down{color:var(--down)}
table.kv th{font-weight:500;color:var(--muted)}table.kv table.kv{margin:0}td.ids{max-width:760px}
.inventory{font-size:12.5px;margin-top:8px}.inventory ul{columns:3;margin:6px 0}
.inventory li.absent{color:var(--muted);text-decoration:line-through}
.inventory li.unreadable{color:var(--down)}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(270px,1fr));gap:12px}
figure{margin:0;border:1px solid var(--line);border-radius:6px;padding:6px}
figcaption{font-size:12.5px;font-weight:600}figcaption code{font-weight:400;color:var(--muted);font-size:11px}
figure svg{width:100%;height:auto}
pre{white-space:pre-wrap;word-break:break-word;background:var(--bg);border:1px solid var(--line);
border-radius:6px;padding:8px;font-size:12px;margin:4px 0}pre.config{max-height:420px;overflow:auto}
.badge{display:inline-block;font-size:11px;font-weight:500;border-radius:10px;padding:0 7px;margin-left:4px;
background:#eaeef2;color:var(--muted)}.badge.pass,.badge.improved{background:#dafbe1;color:var(--up)}
.badge.fail,.badge.regressed{background:#ffebe9;color:var(--down)}
.badge.info{background:#ddf4ff;color:var(--accent)}
.toolbar{display:flex;flex-wrap:wrap;gap:8px;align-items:center;position:sticky;top:0;background:#fff;
padding:8px 0;z-index:1}.toolbar button{border:1px solid var(--line);background:#fff;border-radius:6px;
padding:4px 10px;cursor:pointer;font:inherit}.toolbar button span{opacity:.75}
.toolbar button[aria-pressed=true]{background:var(--accent);color:#fff;border-color:var(--accent)}
.toolbar input{border:1px solid var(--line);border-radius:6px;padding:4px 8px;font:inherit}
#sample-count{color:var(--muted);font-size:12.5px}
.sample{display:grid;grid-template-columns:104px minmax(180px,1fr) minmax(0,1.5fr) minmax(0,1.5fr);gap:12px;
border:1px solid var(--line);border-radius:8px;padding:10px;margin:8px 0}.sample[hidden]{display:none}
.sample.chosen{outline:2px solid var(--accent)}.sample h3{margin:0;font-size:13px}
.sample h4{margin:0;font-size:12.5px}
.sample p{margin:4px 0}.meta,.rewards{color:var(--muted);font-size:12px}em.none{color:var(--muted)}
.thumb img{border:1px solid var(--line);border-radius:4px}.completion{max-height:220px;overflow:auto}
@media (max-width:900px){.sample{grid-template-columns:104px 1fr}.stage{grid-column:1/-1}}
"""

# Filtering only toggles `hidden` and reads data attributes: no model text ever passes through innerHTML.
_SCRIPT = """
(function () {
  var cards = Array.prototype.slice.call(document.querySelectorAll('.sample'));
  var buttons = Array.prototype.slice.call(document.querySelectorAll('[data-filter]'));
  var search = document.getElementById('sample-search');
  var count = document.getElementById('sample-count');
  var filter = 'all';
  function keep(card) {
    var q = search ? search.value.trim().toLowerCase() : '';
    if (q && card.dataset.id.toLowerCase().indexOf(q) < 0) return false;
    if (filter === 'all') return true;
    if (filter === 'format-broken') return card.dataset.formatBroken === '1';
    return card.dataset.status === filter;
  }
  function apply() {
    var shown = 0;
    cards.forEach(function (card) { card.hidden = !keep(card); if (!card.hidden) shown++; });
    if (count) count.textContent = shown + ' of ' + cards.length + ' shown';
  }
  function choose(name) {
    filter = name;
    buttons.forEach(function (b) { b.setAttribute('aria-pressed', String(b.dataset.filter === name)); });
    apply();
  }
  buttons.forEach(function (b) { b.addEventListener('click', function () { choose(b.dataset.filter); }); });
  if (search) search.addEventListener('input', apply);
  document.querySelectorAll('[data-goto]').forEach(function (link) {
    link.addEventListener('click', function (event) {
      var card = cards.filter(function (c) { return c.dataset.id === link.dataset.goto; })[0];
      if (!card) return;
      event.preventDefault();
      if (search) search.value = '';
      choose('all');
      cards.forEach(function (c) { c.classList.toggle('chosen', c === card); });
      card.scrollIntoView({block: 'center'});
    });
  });
  apply();
})();
"""
