"""Hostile and odd rewards: each case below hung, printed a traceback, exited silently, wrote `null` totals or
scored a right answer 0 before. A reward that ran past its limit leaving threads behind ends the process after
its line; a reward file's import is done once per process, bounded in time, every failure one line; values
that are not finite, or sum to an infinity, are refused; numpy arrays and tensors are accepted; `\\text{}`,
`{,}` and their kin are read as math-verify reads them; a reward that never scores shows "no values".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import reward_batch
from vlmrl.config.schema import load_config
from vlmrl.grading.user_rewards import RewardError, load_rewards

# A two-command CLI (so typer builds the project's command group) whose command calls a reward through the guard
# and fails as every stage does, through `fail`: the real exit path, without a model or a run folder.
STUCK_CLI = '''
import asyncio, time
from concurrent.futures import ThreadPoolExecutor

import typer

from vlmrl.cli.errors import Commands, fail
from vlmrl.grading.reward_call import RewardError, call_reward


def pool(completions, **kwargs):
    return list(ThreadPoolExecutor(4).map(lambda c: time.sleep(1e6), completions))


def to_thread(completions, **kwargs):
    async def stuck():
        await asyncio.to_thread(time.sleep, 1e6)
    asyncio.run(stuck())


app = typer.Typer(cls=Commands)


@app.command()
def go(name: str) -> None:
    try:
        call_reward(globals()[name], name, timeout_s=0.3, prompts=None, completions=["a", "b"], kwargs={})
    except RewardError as exc:
        fail(str(exc))


@app.command()
def other() -> None:
    pass


app()
'''


@pytest.mark.parametrize("reward", ["pool", "to_thread"])
def test_a_reward_that_times_out_leaving_threads_does_not_hang_the_exit(tmp_path, reward):
    """Before: the line printed, then the interpreter waited forever at exit joining the reward's pool threads
    (ThreadPoolExecutor, asyncio.to_thread), the run folder's lock already released."""
    script = tmp_path / "cli.py"
    script.write_text(STUCK_CLI)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), "go", reward], capture_output=True, text=True, timeout=20,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert done.stdout.startswith(f"error: {reward} did not return within 0.3 s;")
    assert "Traceback" not in done.stderr
    assert time.perf_counter() - started < 15


def config_with(tmp_path, source: str, *entries: str):
    """The demo config with these `rewards:` entries (YAML flow mappings), `source` as r.py beside it."""
    (tmp_path / "r.py").write_text(textwrap.dedent(source))
    lines = "".join(f"  - {entry}\n" for entry in entries)
    path = tmp_path / "config.yaml"
    path.write_text(f"run: {{name: r, output_dir: {tmp_path}}}\nmodel: {{name: 'tiny:qwen3_vl'}}\n"
                    f"data: {{num_synthetic: 24, holdout_size: 4}}\nrewards:\n{lines}")
    return load_config(str(path))


FINE = "def f(completions, **kwargs):\n    return [1.0] * len(completions)\n"


@pytest.mark.parametrize(("top", "message"), [
    ("class Odd(BaseException):\n    pass\nraise Odd('at import')\n", r"failed: Odd: at import \(line 3\)$"),
    ("raise GeneratorExit\n", r"failed: GeneratorExit \(line 1\)$"),
    ("import os\nos._exit(0)\n", r"called os._exit\(0\); a reward file must define its functions, not end"),
    ("from os import _exit\n_exit(3)\n", r"called os._exit\(3\)"),
    ("import time\ntime.sleep(60)\n", r"did not finish within 0.3 s \(the reward's timeout_s\); import less"),
])
def test_every_way_out_of_a_reward_files_import_is_one_line(tmp_path, top, message):
    """Before: a custom BaseException or GeneratorExit at import was a traceback, a hang at import hung
    `vlmrl config validate`, and `os._exit(0)` at import ended it with exit 0 and no word."""
    config = config_with(tmp_path, top + FINE, "{function: 'r.py:f', timeout_s: 0.3}")
    started = time.perf_counter()
    with pytest.raises(RewardError) as info:
        load_rewards(config)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"rewards[0] (function: r.py:f): importing {tmp_path / 'r.py'} ")
    assert __import__("re").search(message, line), line
    assert time.perf_counter() - started < 5
    with pytest.raises(RewardError, match=__import__("re").escape(line)):  # the same line again, not a new import
        load_rewards(config)


def test_a_reward_file_is_imported_once_per_process(tmp_path):
    """Before: `vlmrl run` imported the file four times (the run's check, evaluation, training, validation)."""
    counter = tmp_path / "imports.txt"
    config = config_with(tmp_path, f"open({str(counter)!r}, 'a').write('x')\n" + FINE, "{function: 'r.py:f'}")
    first = load_rewards(config)
    assert [load_rewards(config)[0].fn.fn is first[0].fn.fn for _ in range(3)] == [True] * 3
    assert counter.read_text() == "x"
    (tmp_path / "r.py").write_text(f"open({str(counter)!r}, 'a').write('y')\n" + FINE)  # a new version: imported
    load_rewards(config)
    assert counter.read_text() == "xy"


RETURNS = '''
import numpy as np
import torch


def huge(completions, **kwargs):
    return [1e308] * len(completions)


def large(completions, **kwargs):
    return [1e9] * len(completions)


def array(completions, **kwargs):
    return np.arange(len(completions), dtype=np.float32) / 2


def tensor(completions, **kwargs):
    return torch.arange(len(completions), dtype=torch.float64, requires_grad=True) / 2


def scalars(completions, **kwargs):
    return [np.float64(0.5), torch.tensor(1.5), None][:len(completions)]


def matrix(completions, **kwargs):
    return np.zeros((len(completions), 1))


def short_tensor(completions, **kwargs):
    return torch.zeros(len(completions) - 1)
'''


def test_a_reward_too_large_to_sum_is_refused_in_one_line(tmp_path):
    """Before: 1e308 passed, the total overflowed to inf, was written `null`, and the summary and the display
    then failed with a TypeError traceback on every re-run."""
    from vlmrl.grading.user_rewards import Reward, weighted_total

    for limit in ("", ", timeout_s: null"):
        (reward,) = load_rewards(config_with(tmp_path, RETURNS, f"{{function: 'r.py:huge'{limit}}}"))
        with pytest.raises(RewardError, match=r"^rewards\[0\] \(function: r.py:huge\): huge returned 1e\+308 "
                                              r"\(float\) for completion 0 \(item 'item-0'\); each value must be a "
                                              r"finite number within \+-1,000,000,000, or None for no reward\.$"):
            reward.fn(**reward_batch())
    (large,) = load_rewards(config_with(tmp_path, RETURNS, "{function: 'r.py:large'}"))
    assert large.fn(**reward_batch(1)) == [1e9]  # the largest value taken
    # the sum is checked too: weights the config would refuse (over 1e6), given here by hand
    loaded = [Reward("large", 1e300, print, ""), Reward("format_reward", 1.0, print, "")]
    with pytest.raises(RewardError, match=r"^the weighted total of the rewards, 1e\+300 x 1e\+09 \(large\) \+ 1 x 1 "
                                          r"\(format_reward\), is inf, not a finite number; lower the weights\.$"):
        weighted_total({"large": 1e9, "format_reward": 1.0}, loaded)


def test_numpy_arrays_and_torch_tensors_are_taken_as_trl_takes_them(tmp_path):
    """Before: a 1-D ndarray or tensor, which TRL accepts, was refused as 'not a list of numbers'."""
    names = ("array", "tensor", "scalars", "matrix", "short_tensor")
    loaded = load_rewards(config_with(tmp_path, RETURNS, *(f"{{function: 'r.py:{n}'}}" for n in names)))
    fns = {r.name: r.fn for r in loaded}
    assert fns["array"](**reward_batch()) == [0.0, 0.5, 1.0]
    assert fns["tensor"](**reward_batch()) == [0.0, 0.5, 1.0]
    assert fns["scalars"](**reward_batch()) == [0.5, 1.5, None]
    with pytest.raises(RewardError, match=r"matrix returned a 2-D ndarray of shape \(3, 1\); return one value per "
                                          r"completion \(a list, or a 1-D array or tensor\)\.$"):
        fns["matrix"](**reward_batch())
    with pytest.raises(RewardError, match=r"short_tensor returned 2 values for 3 completions"):
        fns["short_tensor"](**reward_batch())


DEGREES = ["135°", "140°", "145°"]


@pytest.mark.parametrize(("boxed", "gold", "answer_type", "choices"), [
    ("\\text{Paris}", "Paris", "text", None),          # \boxed{\text{Paris}}
    ("\\text{B}", "140°", "choice", DEGREES),          # the letter, in \text{}
    ("\\textbf{B}", "140°", "choice", DEGREES),        # ... in \textbf{}
    ("140^\\circ", "140°", "choice", DEGREES),         # the choice's text, the degree sign in LaTeX
    ("140^{\\circ}", "140°", "choice", DEGREES),
    ("1{,}000", "1000", "integer", None),              # LaTeX's thousands separator
    ("{4}", "4", "integer", None),                     # a group around the whole answer
    ("\\mathbf{4}", "4", "integer", None),
    ("4\\ \\text{apples}", "4", "integer", None),      # a unit after LaTeX's space
    ("\\mathrm{4.50}", "4.5", "float", None),
])
def test_latex_dress_is_read_away_as_math_verify_does(boxed, gold, answer_type, choices):
    """Before: under `contract: think` each of these scored 0 (TRL's accuracy_reward: 1.0)."""
    from vlmrl.contract import extract_answer
    from vlmrl.grading.grader import grade
    from vlmrl.grading.rewards import builtin_reward

    completion = f"<think>working</think>\n\\boxed{{{boxed}}}"
    pred = extract_answer(completion, "think")
    assert pred == boxed  # the record keeps what the model wrote
    assert grade(pred, gold, answer_type, choices=choices)
    correctness = builtin_reward("correctness", "think")
    assert correctness([completion], answer=[gold], answer_type=[answer_type], choices=[choices]) == [1.5]


@pytest.mark.parametrize(("pred", "gold", "answer_type", "choices"), [
    ("\\text{Lyon}", "Paris", "text", None),
    ("\\text{C}", "140°", "choice", DEGREES),
    ("145^\\circ", "140°", "choice", DEGREES),
    ("1{,}001", "1000", "integer", None),
    ("{5}", "4", "integer", None),
    ("\\mathbf{4} and 5", "4", "integer", None),
    ("{1}{2}", "12", "integer", None),  # two groups are not one
])
def test_the_dress_read_away_never_makes_a_wrong_answer_right(pred, gold, answer_type, choices):
    from vlmrl.grading.grader import grade

    assert not grade(pred, gold, answer_type, choices=choices)


def silent_record(item_id: str) -> dict:
    """An evaluation record whose reward `silent` gave no value (None)."""
    return {"id": item_id, "correct": False, "mathvista_correct": False, "format_ok": True,
            "format_reward": 2.0, "correctness_reward": 0.0, "total_reward": 0.6, "prompt_sha256": "p",
            "image_sha256": "i" + item_id, "category": "c", "rewards": {"format_reward": 2.0, "silent": None}}


def test_a_reward_with_no_values_shows_as_no_values(tmp_path, capsys):
    """Before: a reward that returned None for every item made `vlmrl compare` and the model card fail with
    `TypeError: unsupported format string passed to NoneType.__format__`, exit 1."""
    from vlmrl.cli.show import show_comparison
    from vlmrl.common.io import write_jsonl_atomic
    from vlmrl.compare.stage import compare_runs
    from vlmrl.config.schema import Config
    from vlmrl.export.share import write_model_card

    for stage in ("baseline", "after"):
        write_jsonl_atomic(tmp_path / f"{stage}_records.jsonl", [silent_record(f"i{k}") for k in range(4)])
    result = compare_runs(tmp_path)
    show_comparison(result.path)
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.count("│") > 3}
    assert rows["silent"].split("│")[2].strip() == "no values"
    assert rows["format_reward"].split("│")[2].strip() == "2.000"
    card = write_model_card(tmp_path, Config(), tmp_path, kind="adapter", base_name="base").read_text()
    assert "| silent | no values | | | |" in card
    assert "| format_reward | 2.000 | 2.000 | +0.000 | [+0.000, +0.000] |" in card


def test_a_reward_with_no_values_shows_as_no_values_in_the_report(tmp_path):
    """Before: report.html showed such a reward as "–", as it shows a file that is missing."""
    import re

    from vlmrl.common.io import write_json_atomic, write_jsonl_atomic
    from vlmrl.compare.stage import compare_runs
    from vlmrl.report import build_report

    for stage in ("baseline", "after"):
        write_jsonl_atomic(tmp_path / f"{stage}_records.jsonl", [silent_record(f"i{k}") for k in range(4)])
        write_json_atomic(tmp_path / f"{stage}_summary.json", {"stage": stage, "n": 4, "rewards": {
            "format_reward": {"mean": 2.0, "ci95": [2.0, 2.0]}, "silent": {"mean": None, "ci95": [None, None]}}})
    compare_runs(tmp_path)
    page = build_report(tmp_path)
    headline, summary = re.findall(r'<tr data-metric="silent">.*?</tr>', page)
    assert re.findall(r"<td[^>]*>([^<]*)</td>", headline) == ["no values", "no values", "", "", "", ""]
    assert re.findall(r"<td[^>]*>([^<]*)</td>", summary) == ["no values", "", "no values", ""]
    shown = re.search(r'<tr data-metric="format_reward">.*?</tr>', page).group(0)
    assert "2.000" in shown and "no values" not in shown


SHAPING = '''
def shortness(completions, **kwargs):
    return [max(0.0, 1.0 - 0.02 * len(c[0]["content"])) for c in completions]


def blind(completions, **kwargs):
    return [0.0] * len(completions)
'''


def test_the_unrewarded_note_is_said_once_per_run_and_never_for_a_length_reward(tmp_path, caplog, monkeypatch):
    """Before: a length reward got "seems to expect neither contract's form" three times per `vlmrl run` (the
    baseline, training and the final evaluation each check the rewards), though scoring an empty completion
    highest is its design."""
    from vlmrl.grading.user_rewards import check_rewards

    monkeypatch.setattr("vlmrl.grading.user_rewards._step_zero_state", lambda: None)  # no transformers import here
    loaded = load_rewards(config_with(tmp_path, SHAPING, "{function: 'r.py:shortness'}", "{function: 'r.py:blind'}"))
    items = [{"id": f"i{k}", "prompt": "How many?", "answer": str(k)} for k in range(2)]
    columns = [{"id": item["id"], "answer": item["answer"]} for item in items]
    with caplog.at_level("WARNING", logger="vlmrl.grading.user_rewards"):
        for _ in range(3):  # one run's three checks
            means = check_rewards(loaded, items, columns, [None, None], run=str(tmp_path))
    assert means["shortness"]["empty"] == 1.0 > means["shortness"]["well_formed"]
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "vlmrl.grading.user_rewards"]
    assert warning.startswith("rewards[1] (function: r.py:blind): blind gives a correct, well-formed `seed` "
                              "completion 0.00, no more than an empty one (0.00); it seems to expect neither")
    caplog.clear()
    with caplog.at_level("WARNING", logger="vlmrl.grading.user_rewards"):
        check_rewards(loaded, items, columns, [None, None], run=str(tmp_path / "another"))
    assert [r.name for r in caplog.records] == ["vlmrl.grading.user_rewards"]  # another run is told again
