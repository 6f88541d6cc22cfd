"""What every tiny family shares: the tokenizer corpus and BPE training, layer shapes, and writing the folder.

One place for these so each family's module (tiny_qwen3_vl.py, tiny_qwen2_5_vl.py, tiny_gemma3.py,
tiny_idefics3.py; tiny.py dispatches to them) keeps only what is its own: special tokens, chat template,
processor and config. Left out: anything family-specific (the two Qwen-VL generations share theirs in
tiny_qwen.py), and any choice of sizes (the builders' arguments decide those).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedModel

from vlmrl.contract import (
    REASONING_END,
    REASONING_START,
    SOLUTION_END,
    SOLUTION_START,
    build_prompt_text,
    render_answer,
)

HEAD_DIM = 16  # every attention head, text and vision, is 16 wide: hidden sizes must be multiples of 32
VISION_DEPTH = 2
QWEN_MERGE = 2  # 2x2 patches merge into one language token, as in every Qwen-VL
PATCH = 16  # Qwen3-VL's and SigLIP's patch (Qwen2.5-VL's is 14)
# Every family gets one language token per 32x32 pixels: Qwen merges 2x2 patches, Gemma average-pools its
# SigLIP patch grid 2x2 (the hub's 896px / 14px patches pool 4x4 into 256 tokens).
PIXELS_PER_TOKEN = 32
MIN_VOCAB = 512  # room for the byte alphabet, the special tokens and a few hundred merges


def tokenizer_corpus() -> list[str]:
    """The text the tiny tokenizers are trained on: what this project's prompts and answers say.

    Deterministic (a fixed-seed generator), so a tokenizer trained on it is the same on every machine.
    Special tokens are left out: they are added whole, never learned.
    """
    rng = random.Random(0)
    labels = "ABCDEFGH"
    lines: list[str] = []
    for _ in range(300):
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(2, 12)
        x = round(rng.uniform(-20, 20), rng.choice([0, 1, 2]))
        label, other = rng.sample(labels, 2)
        questions = [
            f"What is the value of the bar labelled {label}?",
            f"What is the difference between the bars labelled {label} and {other}?",
            "Which bar is the tallest? What is its value in the chart?",
            f"What percentage of the total does category {label} represent? Answer with one decimal place.",
            f"How many bars have a value greater than {a}?",
            f"Find the area of the rectangle with width {a} and height {b}.",
            f"Find the perimeter of the square with side {c} cm.",
            f"In the right triangle ABC, angle C is 90°. If AC = {a} and BC = {b}, find the hypotenuse AB.",
            f"What is the measure of angle {label}{other}C in degrees? The other angles are {a}° and {b}°.",
            f"Find the area of the circle with radius {c}. Use π = 3.14.",
            f"What is the slope of the line through ({a}, {b}) and ({c}, {x})?",
            f"What is the y-intercept of the line y = {c}x - {a}?",
            f"At what value of x does f(x) = {c}x + {x} cross the x-axis?",
            f"What is the maximum value of the function f(x) = -x^2 + {c}x on the interval [0, {c}]?",
            "How many squares are in the image?",
            "How many circles and triangles are there in total?",
        ]
        question = rng.choice(questions)
        lines.append(build_prompt_text(question))
        reasoning = rng.choice([
            f"The bar labelled {label} reaches {a} on the y-axis, so its value is {a}.",
            f"The area is width times height: {a} × {b} = {a * b}.",
            f"The slope is the change in y over the change in x, which gives {x}.",
            f"The total is {a + b}, so the share is {a} / {a + b} = {100 * a / (a + b):.1f}%.",
            f"The angles of a triangle add up to 180°, so the angle is 180° - {a}° - {b}° = {180 - a - b}°.",
            f"I count {c} squares in the picture.",
            f"The intercept is where the graph crosses the y-axis, at y = -{a}.",
        ])  # fmt: skip
        lines.append(render_answer(reasoning, str(rng.choice([a, b, c, x, a * b, round(a / c, 2)]))))
        lines.append(
            f"Question: {question}\nChoices: (A) {a} (B) {b} (C) {c} (D) {x}\nAnswer: {rng.choice('ABCD')}"
        )
    lines += [
        f"{REASONING_START}\n{REASONING_END}\n{SOLUTION_START}\n{SOLUTION_END}",
        "You are a helpful assistant. Hint: Please answer the question and provide the final answer at the end.",
        "0 1 2 3 4 5 6 7 8 9 10 100 0.5 -1 -2.5 3/4 50% 90° 45°",
        ". , ; : ! ? - + = * / % ° ( ) [ ] { } < > ' \" ² ³ √ π × ÷ ≈ ≤ ≥ $ € # & _ ^ | ~ @ \\",
        "the a an of and or in on to is are was be by with for from as at that this it its which what how many",
        "chart bar line pie plot graph axis label value legend table year total average mean median sum",
        "triangle rectangle square circle radius diameter angle degree perimeter area volume side length",
        "function slope intercept maximum minimum increase decrease percent percentage ratio difference",
        "Which of the following is true? Is the value greater than or less than the other one? Yes No",
        "Subtract all red objects. How many objects are left? What is the age gap between these two people?",
    ]
    # Chat-template words that are plain text between special tokens (Gemma has no system role word).
    lines += ["system\nYou are a helpful assistant.", "user\n", "assistant\n", "model\n"] * 20
    return lines


def train_bpe(backend: Tokenizer, trainer: BpeTrainer) -> tuple[list[str], list[tuple[str, str]]]:
    """Train on the corpus; return the learned tokens in id order and the merges in rank order."""
    backend.train_from_iterator(tokenizer_corpus(), trainer)
    model = json.loads(backend.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].__getitem__)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return learned, merges


def text_shape(hidden_size: int, num_layers: int, vocab_size: int) -> dict[str, int]:
    heads = hidden_size // HEAD_DIM
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 3 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,  # grouped-query attention, as in every family here
        "max_position_embeddings": 32768,
    }


def vision_width(hidden_size: int) -> int:
    return max(32, hidden_size // 2)


def save_folder(model: PreTrainedModel, processor: Any, out_dir: Path) -> Path:
    """Write into a staging folder, then move files in with config.json last.

    Loaders treat a folder with config.json as complete (`resolve_model_source` skips rebuilding it), so an
    interrupted build must never leave one behind.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}-") as staging:
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        for file in sorted(Path(staging).iterdir(), key=lambda f: (f.name == "config.json", f.name)):
            os.replace(file, out_dir / file.name)
    return out_dir


def count_params(path: Path) -> int:
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not iterable)
                total += torch.Size(tensors.get_slice(name).get_shape()).numel()
    return total


def check_sizes(
    arch: str, archs: tuple[str, ...], hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> None:
    """Refuse sizes no family can build, naming the field (the CLI prints the message as one line)."""
    if arch not in archs:
        raise ValueError(f"arch={arch!r} is not a tiny arch; choose one of {', '.join(archs)}.")
    if hidden_size < 32 or hidden_size % 32:
        raise ValueError(
            f"hidden_size={hidden_size}: use a multiple of 32 (heads are {HEAD_DIM} wide, kv heads half)."
        )
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: use at least 1.")
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size}: use at least {MIN_VOCAB} (bytes + special tokens + merges)."
        )
    if image_size < PIXELS_PER_TOKEN or image_size % PIXELS_PER_TOKEN:
        raise ValueError(
            f"image_size={image_size}: use a multiple of {PIXELS_PER_TOKEN} (one image token per 32x32 pixels)."
        )
