"""Rewards: exact values per rule, robustness on anything a policy can emit, and a real TRL GRPO run."""

from __future__ import annotations

import doctest
import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vlmrl.grading.rewards
from tests.helpers import tiny_text_policy
from vlmrl.contract import render_answer
from vlmrl.grading.rewards import (
    DEFAULT_REWARD_WEIGHTS,
    REWARD_FUNCS,
    correctness_reward,
    extract_solution,
    format_reward,
    is_degenerate,
    numeric_equal,
    reward_functions,
    score_completion,
)

R0, R1, S0, S1 = "<REASONING>", "</REASONING>", "<SOLUTION>", "</SOLUTION>"
GOOD = f"{R0}\n2 + 2 = 4\n{R1}\n{S0}\n4\n{S1}"
MB = 1 << 20
BUDGET_S = 0.050  # per 1 MB completion, per reward function


def conversational(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# --- extract_solution --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD, "4"),  # the contract's layout
        (f"{S0}  42.5 \n{S1}", "42.5"),  # whitespace stripped
        (f"{S0}{S1}", ""),  # empty solution is "", not None
        (f"{S0}a {R0} b{S1}", f"a {R0} b"),  # other tags inside are kept
        ("no tags", None),  # no tags
        (f"{S0}4", None),  # no closing tag
        (f"{S1}4{S0}", None),  # closing before opening
        (f"{S0}4{S1}{S0}5{S1}", None),  # two pairs
        (f"{S0}{S0}4{S1}", None),  # nested opening
        ("<solution>4</solution>", None),  # tags are case-sensitive
    ],
)
def test_extract_solution(text, expected):
    assert extract_solution(text) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.text().filter(lambda s: "<SOLUTION>" not in s and "</SOLUTION>" not in s),
    st.text().filter(lambda s: "<SOLUTION>" not in s and "</SOLUTION>" not in s),
    st.text().filter(lambda s: "<SOLUTION>" not in s and "</SOLUTION>" not in s),
)
def test_extract_solution_round_trips_what_is_between_the_tags(before, inside, after):
    assert extract_solution(f"{before}{S0}{inside}{S1}{after}") == inside.strip()


# --- format_reward / is_degenerate -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD, 2.0),  # both pairs
        (f"{R0}r{R1}", 1.0),  # reasoning only
        (f"{S0}4{S1}", 1.0),  # solution only
        ("4", 0.0),  # nothing
        ("", 0.0),  # empty: not degenerate
        (f"{R1}r{R0}{S0}4{S1}", 1.0),  # reasoning tags reversed
        (f"{R0}{R0}r{R1}{S0}4{S1}", 1.0),  # nested reasoning opening
        (f"{R0}r{R1}{R0}r{R1}{S0}4{S1}", 1.0),  # two reasoning pairs
        (GOOD + "addCriterion", 0.0),  # well formed but degenerate: 2 - 2
        (f"{S0}4{S1}addCriterion", -1.0),  # 1 - 2
        ("addCriterion", -2.0),  # 0 - 2
        ("addCriterion" * 5 + GOOD * 10, -2.0),  # repeated pairs earn nothing, penalty once: 0 - 2
        ("\n" * 40 + f"{S0}4{S1}", -1.0),  # 40 newlines in 61 chars: degenerate
        ("\n" * 10 + f"{S0}4{S1}", 1.0),  # 10 newlines in 31 chars: fine
    ],
)
def test_format_reward(text, expected):
    assert format_reward([text]) == [expected]
    assert format_reward([conversational(text)]) == [expected]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("addCriterion", True),  # the token itself
        ("x addCriterion y" * 3 + "z" * 1000, True),  # any occurrence
        ("\n", True),  # all newlines
        ("a\n", True),  # exactly half newlines
        ("ab\n", False),  # under half
        ("", False),  # empty is not degenerate
        (GOOD, False),  # a normal answer
        ("addcriterion", False),  # case-sensitive
    ],
)
def test_is_degenerate(text, expected):
    assert is_degenerate(text) is expected


FRAGMENTS = [R0, R1, S0, S1, "addCriterion", "\n", "4", " ", "x", "<", "SOLUTION>", "\x00", "\u0663", "1e999"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=40).map("".join))
def test_format_reward_values_are_always_in_the_set(text):
    assert format_reward([text])[0] in {-2.0, -1.0, 0.0, 1.0, 2.0}


# --- correctness_reward ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [
        (GOOD, "4", 2.0),  # exact
        (GOOD, " 4 \n", 2.0),  # gold is stripped
        (f"{S0}4.0{S1}", "4", 1.5),  # numerically equal
        (f"{S0}$\\frac{{1}}{{2}}${S1}", "0.5", 1.5),  # LaTeX fraction
        (f"{S0}1,000{S1}", "1000", 1.5),  # thousands separator
        (f"{S0}30°{S1}", "30", 1.5),  # unit
        (f"{S0}2.675{S1}", "2.68", 1.5),  # rounds half away from zero to the gold's decimals
        (f"{S0}5{S1}", "4", 0.0),  # wrong
        (f"{S0}4 or 5{S1}", "4", 0.0),  # two numbers
        (f"{S0}four{S1}", "4", 0.0),  # words
        ("4", "4", 0.0),  # no solution tags
        (f"{S0}4{S1}{S0}4{S1}", "4", 0.0),  # two solutions: no answer
        (f"{S0}Paris{S1}", "Paris", 2.0),  # non-numeric exact match still counts
        (f"{S0}{S1}", "", 2.0),  # empty equals empty gold
        (f"{S0}nan{S1}", "nan", 2.0),  # exact string match comes before the numeric rules
        (f"{S0}NaN{S1}", "nan", 0.0),  # ... but NaN is never numerically equal
    ],
)
def test_correctness_reward(text, gold, expected):
    assert correctness_reward([text], answer=[gold]) == [expected]
    assert correctness_reward([conversational(text)], answer=[gold]) == [expected]


def test_correctness_reward_accepts_numeric_gold():
    # Datasets may store answers as numbers; their written form is compared.
    assert correctness_reward([f"{S0}12{S1}", f"{S0}2.5{S1}"], answer=[12, 2.5]) == [2.0, 2.0]


def test_answer_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        correctness_reward([GOOD, GOOD], answer=["4"])


def test_mixed_batch_with_none_scores_zero_and_warns(caplog):
    batch = [GOOD, None, conversational(GOOD), 17, [{"role": "assistant", "content": None}], []]
    with caplog.at_level(logging.WARNING, logger="vlmrl.grading.rewards"):
        assert format_reward(batch) == [2.0, 0.0, 2.0, 0.0, 0.0, 0.0]
        assert correctness_reward(batch, answer=["4"] * 6) == [2.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    assert "4 of 6 completions are not text" in caplog.text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([GOOD, None, 3.5, conversational(GOOD), "", "addCriterion"]), max_size=8))
def test_any_mixed_batch_scores_every_item(batch):
    assert len(format_reward(batch)) == len(batch)
    scores = correctness_reward(batch, answer=["4"] * len(batch))
    assert [s for s, item in zip(scores, batch) if not isinstance(item, (str, list))] == [0.0] * sum(
        not isinstance(item, (str, list)) for item in batch
    )


# --- robustness and speed ----------------------------------------------------------------------------------

ADVERSARIAL = {
    "plain": "a" * MB,
    "100k opening tags": (S0 * 100_000)[:MB],
    "balanced pairs": (f"{R0}r{R1}{S0}4{S1}" * 30_000)[:MB],
    "unbalanced": (S0 * 50_000 + S1 * 40_000 + R0)[:MB],
    "nested": (R0 * 20_000 + S0 * 20_000 + "4" + S1 * 20_000 + R1 * 20_000)[:MB],
    "newlines": "\n" * MB,
    "addCriterion": ("addCriterion" * 100_000)[:MB],
    "huge solution": S0 + "1" * MB + S1,
    "huge padded number": S0 + " " * MB + "4" + S1,
    "NUL bytes": "\x00" * MB,
    "unicode digits": "\u0663" * MB,
    "1e999 solution": (S0 + "1e999" + S1) + "x" * MB,
    "nan solution": S0 + "nan" + S1 + "\n" * MB,
    "digits and commas": S0 + "1," * (MB // 2) + S1,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_megabyte_completions_are_fast_and_valid(name):
    text = ADVERSARIAL[name]
    for reward, kwargs in ((format_reward, {}), (correctness_reward, {"answer": ["4"]})):
        best = float("inf")
        for _ in range(3):  # best of three: the budget is about the algorithm, not scheduler noise
            start = time.perf_counter()
            (value,) = reward([text], **kwargs)
            best = min(best, time.perf_counter() - start)
        assert best < BUDGET_S, f"{reward.__name__} took {best * 1000:.1f} ms on {name!r}"
        assert value in {-2.0, -1.0, 0.0, 1.0, 1.5, 2.0}


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS) | st.text(min_size=1, max_size=8), min_size=1, max_size=30).map(
        "".join
    )
)
def test_any_text_never_raises_and_stays_linear(seed):
    text = (seed * (MB // len(seed) + 1))[:MB]  # tile the random pattern up to 1 MB
    for reward, kwargs in ((format_reward, {}), (correctness_reward, {"answer": ["4"]})):
        start = time.perf_counter()
        reward([text], **kwargs)
        elapsed = time.perf_counter() - start
        # A generous 5x margin per single call keeps CI noise out; quadratic behaviour would take seconds.
        assert elapsed < 5 * BUDGET_S, f"{reward.__name__} took {elapsed * 1000:.1f} ms"
    score_completion(text, "4")


# --- helpers for trainers and evaluation -------------------------------------------------------------------


def test_reward_functions_and_weights_line_up():
    assert REWARD_FUNCS == [format_reward, correctness_reward]
    assert reward_functions() == REWARD_FUNCS and reward_functions() is not REWARD_FUNCS
    assert DEFAULT_REWARD_WEIGHTS == (0.3, 1.0)
    assert vlmrl.grading.rewards.numeric_equal is numeric_equal  # re-exported from grading


@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [
        (  # a perfect answer: 0.3 * 2 + 1.0 * 2
            render_answer("2 + 2", "4"),
            "4",
            {
                "format": 2.0,
                "correctness": 2.0,
                "total": 2.6,
                "pred": "4",
                "format_ok": True,
                "correct": True,
                "exact_match": True,
                "degenerate": False,
            },
        ),
        (  # numerically right, no reasoning: 0.3 * 1 + 1.5
            f"{S0}4.0{S1}",
            "4",
            {
                "format": 1.0,
                "correctness": 1.5,
                "total": 1.8,
                "pred": "4.0",
                "format_ok": False,
                "correct": True,
                "exact_match": False,
                "degenerate": False,
            },
        ),
        (  # degenerate, no answer: 0.3 * -2
            "addCriterion",
            "4",
            {
                "format": -2.0,
                "correctness": 0.0,
                "total": -0.6,
                "pred": None,
                "format_ok": False,
                "correct": False,
                "exact_match": False,
                "degenerate": True,
            },
        ),
    ],
)
def test_score_completion(text, gold, expected):
    record = score_completion(text, gold)
    assert record == pytest.approx(expected)


def test_score_completion_custom_weights():
    assert score_completion(GOOD, "4", weights=(1.0, 0.0))["total"] == 2.0


def test_doctests_pass():
    result = doctest.testmod(vlmrl.grading.rewards)
    assert result.attempted > 0 and result.failed == 0


# --- TRL ---------------------------------------------------------------------------------------------------


def test_rewards_drive_trl_grpo_for_two_steps(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = tiny_text_policy()
    # Let the random policy emit only "addCriterion", so every completion is degenerate (format -2,
    # correctness 0) and the logged reward proves TRL applied our weights: 0.3 * -2 + 1.0 * 0 = -0.6.
    keep = tokenizer.convert_tokens_to_ids("addCriterion")
    suppressed = [token_id for token_id in range(len(tokenizer)) if token_id != keep]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        report_to="none",
        reward_weights=list(DEFAULT_REWARD_WEIGHTS),
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        generation_kwargs={"suppress_tokens": suppressed},
    )
    dataset = Dataset.from_dict(
        {"prompt": ["What is 2 + 2 ?", "How many squares are there ?"] * 2, "answer": ["4", "3"] * 2}
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_functions(),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()

    assert trainer.state.global_step == 2
    steps = [entry for entry in trainer.state.log_history if "rewards/format_reward/mean" in entry]
    assert len(steps) == 2
    for entry in steps:
        assert entry["rewards/format_reward/mean"] == pytest.approx(-2.0)
        assert entry["rewards/correctness_reward/mean"] == pytest.approx(0.0)
        assert entry["reward"] == pytest.approx(-0.6)
