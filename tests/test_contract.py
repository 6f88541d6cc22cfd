"""The two output contracts (`contract: seed | think`): the prompt asks for the form, extraction and the built-in
rewards read it, TRL's own rewards score a `think` answer 1.0 unchanged, and fingerprints move only for `think`
(a run made before the field existed keeps its fingerprints)."""

from __future__ import annotations

import pytest
from trl.rewards import accuracy_reward, think_format_reward

from vlmrl.config.schema import load_config
from vlmrl.contract import INSTRUCTION, build_prompt_text, extract_answer, format_checks, render_answer
from vlmrl.grading.rewards import builtin_reward, correctness_reward, format_reward, score_completion
from vlmrl.run.layout import rewards_fingerprint, train_fingerprint


def _chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("gold", ["42", "3.5", "\\frac{1}{3}", "1/2"])
def test_trl_rewards_score_a_correct_well_formed_think_answer_one(gold: str) -> None:
    completion = render_answer("I count them.", gold, "think")
    assert accuracy_reward([_chat(completion)], [gold]) == [1.0]
    assert think_format_reward([_chat(completion)]) == [1.0]
    # and vlmrl's own rewards agree that it is well-formed and right
    assert format_reward([completion], contract="think") == [2.0]
    assert correctness_reward([completion], [gold], answer_type=["expression"], contract="think")[0] > 0


def test_the_seed_contract_is_unchanged_and_the_default() -> None:
    seed = render_answer("r", "7")
    assert seed == "<REASONING>\nr\n</REASONING>\n<SOLUTION>\n7\n</SOLUTION>"
    assert build_prompt_text("How many?") == f"How many?\n\n{INSTRUCTION}"  # the write-up's prompt, byte for byte
    assert format_reward([seed]) == [2.0] and format_reward([seed], contract="think") == [0.0]
    for preset in ("demo", "seed", "gspo-paper"):
        assert load_config(preset).contract == "seed"


@pytest.mark.parametrize(("text", "answer", "checks"), [
    ("<think>\nr\n</think>\n\\boxed{4}", "4", (True, True)),
    ("<think>r</think> so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", (True, True)),
    ("<think>r</think>\\boxed{1} or \\boxed{2}", None, (True, False)),  # two answers: neither counts
    ("\\boxed{4}<think>r</think>", None, (False, False)),  # the answer must follow the working
    (" <think>r</think>\\boxed{4}", "4", (False, True)),  # TRL's rule: the text opens with <think>
    ("<think>r</think>\\boxed{4", None, (True, False)),  # unclosed brace
    ("<SOLUTION>4</SOLUTION>", None, (False, False)),
])
def test_think_extraction_and_format(text: str, answer: str | None, checks: tuple[bool, bool]) -> None:
    assert extract_answer(text, "think") == answer
    assert format_checks(text, "think") == checks


def test_prompts_ask_for_the_contracts_form() -> None:
    think = build_prompt_text("Which?", answer_type="choice", choices=["red", "blue"], contract="think")
    assert "(A) red" in think and "<think>" in think and "\\boxed{}" in think and "<SOLUTION>" not in think
    with pytest.raises(ValueError, match="unknown contract 'r1'"):
        build_prompt_text("Q", contract="r1")


def test_the_built_ins_follow_the_configured_contract_under_their_own_names() -> None:
    fmt, right = builtin_reward("format", "think"), builtin_reward("correctness", "think")
    assert (fmt.__name__, right.__name__) == ("format_reward", "correctness_reward")  # TRL's log columns
    text = render_answer("r", "12", "think")
    assert fmt([_chat(text)]) == [2.0] and right([_chat(text)], answer=["12"]) == [2.0]
    assert builtin_reward("format", "seed") is format_reward
    record = score_completion(text, "12", contract="think")
    assert record["pred"] == "12" and record["format_ok"] and record["correct"]


def test_a_think_run_changes_the_data_and_train_fingerprints_not_the_rewards() -> None:
    seed, think = load_config("demo"), load_config("demo", ["contract=think"])
    assert rewards_fingerprint(think) == rewards_fingerprint(seed)  # the entries are the same; their contract is data's
    assert think.data_fingerprint() != seed.data_fingerprint()
    assert train_fingerprint(think) != train_fingerprint(seed)
