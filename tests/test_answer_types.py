"""Answer types through the reward, the evaluation records and the prompt: grading follows each item's type."""

from __future__ import annotations

import threading

import pytest

from vlmrl.contract import INSTRUCTION, build_prompt_text
from vlmrl.data.items import Item
from vlmrl.engine.rollout.generation import Generation
from vlmrl.evaluate.stage import make_record
from vlmrl.grading.rewards import correctness_reward, score_completion

S0, S1 = "<SOLUTION>", "</SOLUTION>"
ANGLES = ["135°", "140°", "145°", "150°"]


def solution(text: str) -> str:
    return f"<REASONING>look</REASONING>{S0}{text}{S1}"


def conversational(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# --- correctness_reward reads TRL's per-item columns -------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "gold", "answer_type", "choices", "precision", "expected"),
    [
        ("140°", "140°", "choice", ANGLES, None, 2.0),  # exact text: exact match
        ("B", "140°", "choice", ANGLES, None, 1.5),  # its letter
        ("(b)", "140°", "choice", ANGLES, None, 1.5),
        ("C", "140°", "choice", ANGLES, None, 0.0),  # another letter
        ("145°", "140°", "choice", ANGLES, None, 0.0),  # another choice
        ("\\frac{1}{2}", "\\frac{1}{2}", "expression", None, None, 2.0),
        ("0.5", "\\frac{1}{2}", "expression", None, None, 1.5),
        ("2\\sqrt{2}", "\\sqrt{8}", "expression", None, None, 1.5),
        ("\\sqrt{2}", "\\sqrt{8}", "expression", None, None, 0.0),
        ("Paris", "Paris", "text", None, None, 2.0),
        ("paris.", "Paris", "text", None, None, 1.5),
        ("Lyon", "Paris", "text", None, None, 0.0),
        ("12.0", "12", "integer", None, None, 1.5),
        ("1.54", "1.5", "float", None, 2, 0.0),  # precision 2: gold read as 1.50
        ("1.54", "1.5", "float", None, None, 1.5),
        ("1.504", "1.5", "float", None, 2.0, 1.5),  # float precision from an Arrow float column
        ("1.54", "1.5", None, None, None, 1.5),  # no type: today's numeric rule
    ],
)
def test_correctness_by_answer_type(pred, gold, answer_type, choices, precision, expected):
    kwargs = {"answer_type": [answer_type], "choices": [choices], "precision": [precision]}
    assert correctness_reward([solution(pred)], answer=[gold], **kwargs) == [expected]
    assert correctness_reward([conversational(solution(pred))], answer=[gold], **kwargs) == [expected]


def test_a_mixed_batch_as_trl_passes_it():
    # TRL passes every dataset column, repeated per generation, plus its own keyword arguments.
    completions = [conversational(solution(p)) for p in ("B", "7", "x^2+2x+1", "Yes", "3.0")]
    scores = correctness_reward(
        completions,
        answer=["140°", "7", "(x+1)^2", "yes", "3"],
        answer_type=["choice", "integer", "expression", "text", None],
        choices=[ANGLES, None, None, None, None],
        precision=[None, None, None, None, None],
        prompts=[[{"role": "user", "content": "q"}]] * 5,
        completion_ids=[[1, 2]] * 5,
        trainer_state=None,
        id=["a", "b", "c", "d", "e"],
    )
    assert scores == [1.5, 2.0, 1.5, 1.5, 1.5]


def test_missing_columns_keep_the_numeric_rule():
    assert correctness_reward([solution("B")], answer=["140°"]) == [0.0]  # no answer_type: numeric
    assert correctness_reward([solution("4.0")], answer=["4"]) == [1.5]


def test_a_column_of_the_wrong_length_is_a_clear_error():
    with pytest.raises(ValueError, match="2 completions but 1 values of `answer_type`"):
        correctness_reward([solution("1")] * 2, answer=["1", "1"], answer_type=["integer"])


@pytest.mark.parametrize("answer_type", ["integer", "float", "choice", "expression", "text"])
@pytest.mark.parametrize(
    "text",
    [S0 + "\\frac{" * 200_000 + S1, S0 + "(B) " * 250_000 + S1, S0 + "x+" * 500_000 + S1, "a" * (1 << 20)],
    ids=["latex", "letters", "polynomial", "no tags"],
)
def test_megabyte_completions_score_fast_for_every_type(answer_type, text):
    import time

    kwargs = {"answer_type": [answer_type], "choices": [ANGLES], "precision": [2]}
    best = float("inf")
    for _ in range(3):  # best of three: the budget is about the algorithm, not scheduler noise
        start = time.perf_counter()
        (score,) = correctness_reward([text], answer=["140°"], **kwargs)
        best = min(best, time.perf_counter() - start)
    assert score == 0.0 and best < 0.050, f"{answer_type}: {best * 1000:.1f} ms"


def test_expression_rewards_from_another_thread():
    # TRL may score in a worker thread; math-verify's own signal-based timeout would refuse to run there.
    result: list[list[float]] = []
    args = ([solution("\\sqrt{12}"), solution("3\\sqrt{2}")], ["2\\sqrt{3}", "2\\sqrt{3}"])
    thread = threading.Thread(
        target=lambda: result.append(correctness_reward(*args, answer_type=["expression"] * 2))
    )
    thread.start()
    thread.join(timeout=120)
    assert result == [[1.5, 0.0]]


def test_score_completion_grades_by_type():
    record = score_completion(solution("(C)"), "145°", answer_type="choice", choices=ANGLES)
    assert (record["correctness"], record["correct"], record["exact_match"], record["pred"]) == (
        1.5,
        True,
        False,
        "(C)",
    )
    assert score_completion(solution("(C)"), "145°")["correct"] is False  # without the type: numeric


# --- evaluation records --------------------------------------------------------------------------------------


def _choice_item() -> dict:
    return {"id": "mc1", "question": "Which angle?", "prompt": "Which angle? ...", "answer": "145°",
            "answer_type": "choice", "precision": None, "choices": ANGLES, "image_sha256": "ab" * 32,
            "category": "geometry", "metadata": {}}  # fmt: skip


def _gen(text: str) -> Generation:
    return Generation(text=text, tokens=5, truncated=False)


def test_records_grade_choice_items_by_letter_and_text():
    record = make_record(_choice_item(), [_gen(solution("C"))], {}, 0.1, "after")
    assert (record["correct"], record["correctness_reward"], record["answer_type"]) == (True, 1.5, "choice")
    assert record["mathvista_correct"] is True  # MathVista's normalisation maps the letter to the choice too


def test_majority_vote_counts_a_letter_and_its_text_as_one_answer():
    gens = [_gen(solution(p)) for p in ("C", "145°", "(c)", "A", "A")]  # 3 votes for 145°, 2 for 135°
    record = make_record(_choice_item(), gens, {}, 0.1, "after")
    assert record["majority_pred"] == "145°" and record["majority_correct"] is True
    assert [s["correct"] for s in record["samples"]] == [True, True, True, False, False]


# --- the prompt says what answer is wanted -------------------------------------------------------------------


def test_numeric_prompts_are_unchanged():
    expected = "How many?\n\n" + INSTRUCTION
    assert build_prompt_text(" How many? ") == expected
    assert build_prompt_text("How many?", answer_type="integer") == expected
    assert build_prompt_text("How many?", answer_type="float") == expected
    assert "final numeric answer between <SOLUTION> and </SOLUTION>" in INSTRUCTION


def test_choice_prompt_lists_the_lettered_choices_once():
    prompt = build_prompt_text("Which angle?", answer_type="choice", choices=ANGLES)
    assert prompt.startswith("Which angle?\nChoices:\n(A) 135°\n(B) 140°\n(C) 145°\n(D) 150°\n\n")
    assert "the letter of the correct choice, or the choice's text" in prompt
    already = build_prompt_text(prompt.split("\n\n")[0], answer_type="choice", choices=ANGLES)
    assert already.count("(A) 135°") == 1


@pytest.mark.parametrize(
    ("answer_type", "phrase"), [("expression", "mathematical expression"), ("text", "short")]
)
def test_other_prompts_say_what_is_wanted(answer_type, phrase):
    prompt = build_prompt_text("Q?", answer_type=answer_type)
    assert phrase in prompt and "numeric" not in prompt and prompt.endswith(f"{S0} and {S1}.")


def test_unknown_answer_type_in_a_prompt_is_an_error():
    with pytest.raises(ValueError, match="unknown answer_type 'list'"):
        build_prompt_text("Q?", answer_type="list")


# --- items take the five types ---------------------------------------------------------------------------


@pytest.mark.parametrize("answer_type", ["integer", "float", "choice", "expression", "text"])
def test_items_accept_the_five_types(answer_type):
    record = {"id": "1", "question": "q", "prompt": "p", "answer": "a", "answer_type": answer_type,
              "precision": None, "unit": None, "choices": ["a", "b"], "source": "s", "category": "c",
              "image": "data/images/x.png", "image_sha256": "0" * 64}  # fmt: skip
    assert Item.from_json(record).answer_type == answer_type


def test_items_refuse_other_types():
    record = {"id": "1", "question": "q", "prompt": "p", "answer": "a", "answer_type": "list",
              "precision": None, "unit": None, "choices": None, "source": "s", "category": "c",
              "image": "data/images/x.png", "image_sha256": "0" * 64}  # fmt: skip
    with pytest.raises(ValueError, match="answer_type must be one of integer, float, choice, expression, text"):
        Item.from_json(record)


# --- the training dataset carries what the reward needs --------------------------------------------------


def test_training_dataset_has_the_grading_columns(tmp_path):
    import json

    from PIL import Image

    from vlmrl.train.stage import build_train_dataset

    def item(key: str, answer: str, answer_type: str, choices, precision, colour) -> dict:
        image = f"data/images/{key}.png"
        (tmp_path / "data" / "images").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), colour).save(tmp_path / image)
        return {"id": key, "question": "q", "prompt": "q\n\n...", "answer": answer, "answer_type": answer_type,
                "precision": precision, "unit": None, "choices": choices, "source": "s", "category": "c",
                "image": image, "image_sha256": key * 64}  # fmt: skip

    train = [item("a", "140°", "choice", ANGLES, None, "red"), item("b", "1.5", "float", None, 2, "blue"),
             item("c", "\\sqrt{2}", "expression", None, None, "green")]  # fmt: skip
    holdout = [item("d", "7", "integer", None, None, "white")]
    for name, rows in (("train", train), ("holdout", holdout)):
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = build_train_dataset(tmp_path)
    assert dataset["answer_type"] == ["choice", "float", "expression"]
    assert dataset["choices"] == [ANGLES, None, None]
    assert dataset["precision"] == [None, 2, None]
    # what TRL hands the reward, per item: the columns as lists aligned with the completions
    columns = {k: dataset[k] for k in ("answer_type", "choices", "precision")}
    completions = [solution("B"), solution("1.504"), solution("\\frac{\\sqrt{8}}{2}")]
    assert correctness_reward(completions, answer=dataset["answer"], **columns) == [1.5, 1.5, 1.5]


@pytest.mark.slow
def test_grading_columns_reach_the_reward_inside_trl(tmp_path):
    """TRL's GRPOTrainer hands the dataset's grading columns to the reward, and expressions grade in its call."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers import tiny_text_policy

    # The random policy cannot write answers; the wrapper scores fixed ones with the columns TRL passed.
    fixed = {"4": solution("\\frac{8}{2}"), "140°": solution("(B)"), "7": solution("7.0")}
    seen: list[dict] = []

    def graded(completions, answer, **kwargs):
        seen.append({k: kwargs[k] for k in ("answer_type", "choices", "precision")})
        scores = correctness_reward([fixed[a] for a in answer], answer, **kwargs)
        seen[-1]["scores"] = scores
        return scores

    graded.__name__ = "correctness_reward"
    model, tokenizer = tiny_text_policy()
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=9, num_generations=3, max_completion_length=4,
        max_steps=1, report_to="none", use_cpu=True, logging_steps=1, save_strategy="no", seed=0,
    )  # fmt: skip
    dataset = Dataset.from_dict(
        {
            "prompt": ["What is 2 + 2 ?", "How many squares are there ?", "What is 2 + 2 ?"],
            "answer": ["4", "140°", "7"],
            "answer_type": ["expression", "choice", "integer"],
            "choices": [None, ANGLES, None],
            "precision": [None, None, None],
        }
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[graded], args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert {kind for call in seen for kind in call["answer_type"]} == {"expression", "choice", "integer"}
    for call in seen:
        for kind, choices, precision, score in zip(
            call["answer_type"], call["choices"], call["precision"], call["scores"]
        ):
            assert choices == (ANGLES if kind == "choice" else None) and precision is None
            assert score == 1.5  # \frac{8}{2} = 4 as an expression, (B) = 140°, 7.0 = 7
