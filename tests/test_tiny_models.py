"""Offline tiny models: each family's folder loads through the hub path, lays out images the family's way,
agrees with itself on token ids, generates, trains, and is the same for the same seed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.contract import build_prompt_text, render_answer
from vlmrl.models.tiny import TINY_ARCHS, build_tiny_model, count_image_tokens, tiny_model_summary

QUESTION = "What is the value of the bar labelled C?"
IMAGE_TOKENS = 16  # the default 128x128 budget: one token per 32x32 pixels

# The whole prompt for [user: image, QUESTION] with add_generation_prompt=True, as each family's hub template
# writes it (Qwen2.5-VL adds a default system turn; Gemma opens with <bos> and calls the assistant "model").
QWEN_USER_TURN = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
EXPECTED_PROMPT = {
    "qwen3_vl": QWEN_USER_TURN + "<|im_start|>assistant\n",
    "qwen2_5_vl": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    + QWEN_USER_TURN
    + "<|im_start|>assistant\n",
    "gemma3": f"<bos><start_of_turn>user\n<start_of_image>{QUESTION}<end_of_turn>\n<start_of_turn>model\n",
    "idefics3": f"<|im_start|>User:<image>{QUESTION}<end_of_utterance>\nAssistant:",  # SmolVLM-Instruct's
}
# [system: "Be brief.", user: "Hi", assistant: "Hello"], string contents, no generation prompt.
QWEN_CHAT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
EXPECTED_CHAT = {
    "qwen3_vl": QWEN_CHAT,
    "qwen2_5_vl": QWEN_CHAT,  # a system turn is given, so no default one
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n",
    "idefics3": "<|im_start|>System: Be brief.<end_of_utterance>\nUser: Hi<end_of_utterance>\n"
    "Assistant: Hello<end_of_utterance>\n",
}
EXPECTED_CLASSES = {  # model, processor, tokenizer, image processor
    "qwen3_vl": (
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLProcessor",
        "Qwen2Tokenizer",
        "Qwen2VLImageProcessor",
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLProcessor",
        "Qwen2Tokenizer",
        "Qwen2VLImageProcessor",
    ),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", "GemmaTokenizer", "Gemma3ImageProcessor"),
    "idefics3": (
        "Idefics3ForConditionalGeneration",
        "Idefics3Processor",
        "GPT2Tokenizer",
        "Idefics3ImageProcessor",
    ),
}
END_OF_TURN = {
    "qwen3_vl": "<|im_end|>",
    "qwen2_5_vl": "<|im_end|>",
    "gemma3": "<end_of_turn>",
    "idefics3": "<end_of_utterance>",
}


@dataclass
class Tiny:
    arch: str
    path: Path
    model: Any
    processor: Any


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    arch = request.param
    path = build_tiny_model(arch, tmp_path_factory.mktemp(arch) / "model")
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return Tiny(arch, path, model, AutoProcessor.from_pretrained(path))


def _image_question() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def _model_inputs(tiny: Tiny) -> dict[str, torch.Tensor]:
    """The prompt as TRL builds it: templated text, then the processor, without adding special tokens again."""
    prompt = tiny.processor.apply_chat_template(_image_question(), add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", (512, 512), (200, 40, 40))
    return tiny.processor(text=[prompt], images=[image], return_tensors="pt", add_special_tokens=False)


def _image_token_id(tiny: Tiny) -> int:
    return tiny.model.config.image_token_id  # Gemma's image_token_index under its attribute_map alias


def test_folder_is_an_ordinary_hf_checkpoint(tiny: Tiny) -> None:
    files = {p.name for p in tiny.path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= files
    assert [p.name for p in tiny.path.parent.iterdir()] == ["model"]  # no staging folder left behind


def test_auto_classes_resolve_to_the_family(tiny: Tiny) -> None:
    found = (
        type(tiny.model).__name__,
        type(tiny.processor).__name__,
        type(tiny.processor.tokenizer).__name__,
        type(tiny.processor.image_processor).__name__,
    )
    assert found == EXPECTED_CLASSES[tiny.arch]


def test_chat_template_puts_the_image_before_the_question_in_the_user_turn(tiny: Tiny) -> None:
    prompt = tiny.processor.apply_chat_template(_image_question(), add_generation_prompt=True, tokenize=False)
    assert prompt == EXPECTED_PROMPT[tiny.arch]


def test_chat_template_takes_system_turns_and_string_contents(tiny: Tiny) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert tiny.processor.apply_chat_template(messages, tokenize=False) == EXPECTED_CHAT[tiny.arch]


def test_image_tokens_match_the_vision_tower_and_generate_runs(tiny: Tiny) -> None:
    inputs = _model_inputs(tiny)
    n_image_tokens = int((inputs["input_ids"] == _image_token_id(tiny)).sum())
    assert n_image_tokens == IMAGE_TOKENS
    if tiny.arch == "gemma3":
        assert n_image_tokens == tiny.model.config.mm_tokens_per_image
        assert int((inputs["input_ids"] == tiny.processor.tokenizer.bos_token_id).sum()) == 1

    vision_inputs = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    with torch.no_grad():
        features = tiny.model.get_image_features(**vision_inputs).pooler_output  # per image: [tokens, hidden]
        out = tiny.model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert sum(f.shape[-2] for f in features) == n_image_tokens

    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) == 5  # a random model never picks the end-of-turn token in 5 greedy steps
    assert isinstance(tiny.processor.decode(new_tokens, skip_special_tokens=True), str)


def test_image_features_depend_on_the_image(tiny: Tiny) -> None:
    """A blind random model (Gemma zero-initialises its projection) could never learn a visual skill."""
    embeddings = []
    for colour in ("white", "black"):
        image = Image.new("RGB", (128, 128), colour)
        inputs = tiny.processor(text=[tiny.processor.image_token], images=[image], return_tensors="pt")
        vision_inputs = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
        with torch.no_grad():
            embeddings.append(torch.cat(list(tiny.model.get_image_features(**vision_inputs).pooler_output)))
    assert not torch.allclose(embeddings[0], embeddings[1])


def test_a_training_step_has_a_finite_loss_and_reaches_the_language_layers(tiny: Tiny) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny.path).train()  # fresh: the fixture's stays clean
    inputs = _model_inputs(tiny)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    assert math.isfinite(loss.item())
    decoder = model.model.text_model if tiny.arch == "idefics3" else model.model.language_model
    q_proj = decoder.layers[0].self_attn.q_proj.weight
    assert q_proj.grad is not None and q_proj.grad.abs().sum() > 0


def test_token_ids_agree_between_tokenizer_config_and_generation_config(tiny: Tiny) -> None:
    ids = tiny.processor.tokenizer.convert_tokens_to_ids
    config, generation = tiny.model.config, tiny.model.generation_config
    if tiny.arch == "gemma3":
        assert config.image_token_id == ids("<image_soft_token>") == tiny.processor.tokenizer.image_token_id
        assert config.boi_token_id == ids("<start_of_image>")
        assert config.eoi_token_id == ids("<end_of_image>")
        assert tiny.processor.tokenizer.eos_token == "<eos>"
    elif tiny.arch == "idefics3":
        assert config.image_token_id == ids("<image>") == tiny.processor.image_token_id
        assert tiny.processor.fake_image_token_id == ids("<fake_token_around_image>")
        assert tiny.processor.global_image_token_id == ids("<global-img>")
        assert tiny.processor.tokenizer.eos_token == "<end_of_utterance>"
    else:
        assert config.image_token_id == ids("<|image_pad|>") == tiny.processor.image_token_id
        assert config.video_token_id == ids("<|video_pad|>")
        assert config.vision_start_token_id == ids("<|vision_start|>")
        assert config.vision_end_token_id == ids("<|vision_end|>")
        assert tiny.processor.tokenizer.eos_token == "<|im_end|>"
    assert generation.eos_token_id[0] == ids(END_OF_TURN[tiny.arch])
    assert generation.pad_token_id == tiny.processor.tokenizer.pad_token_id is not None
    assert config.get_text_config().pad_token_id == tiny.processor.tokenizer.pad_token_id


def test_vocabulary_is_small_and_fits_the_embeddings(tiny: Tiny) -> None:
    assert len(tiny.processor.tokenizer) < 4096
    assert len(tiny.processor.tokenizer) <= tiny.model.config.get_text_config().vocab_size


def test_tokenizer_round_trips_task_text_and_unknown_characters(tiny: Tiny) -> None:
    tokenizer = tiny.processor.tokenizer
    text = build_prompt_text("Find the slope: is it -2.5, 45% or 90°?") + render_answer(
        "√π ≈ 1.77; 你好 🙂", "12345"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level / byte fallback: nothing is lost, nothing crashes
    if tiny.arch != "idefics3":  # GPT2Tokenizer rebuilds a plain ByteLevel pre-tokenizer: digits may merge
        assert len(tokenizer("12345", add_special_tokens=False)["input_ids"]) == 5  # digits one by one
    assert len(tokenizer("<SOLUTION>", add_special_tokens=False)["input_ids"]) <= 3  # tags are merged


def test_summary_describes_the_folder(tiny: Tiny) -> None:
    summary = tiny_model_summary(tiny.path)
    assert summary == {
        "arch": tiny.arch,
        "params": sum(p.numel() for p in tiny.model.parameters()),
        "vocab_size": len(tiny.processor.tokenizer),
        "embedding_rows": 1024,
        "image_tokens_per_image": IMAGE_TOKENS,
    }
    assert count_image_tokens(tiny.processor, size=128) == IMAGE_TOKENS  # the budget, not the input, decides


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_seed_gives_the_same_folder_and_another_seed_other_weights(arch: str, tmp_path: Path) -> None:
    first = build_tiny_model(arch, tmp_path / "first", seed=3)
    again = build_tiny_model(arch, tmp_path / "again", seed=3)
    other = build_tiny_model(arch, tmp_path / "other", seed=4)
    weights = [load_file(folder / "model.safetensors") for folder in (first, again, other)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not all(torch.equal(weights[0][name], weights[2][name]) for name in weights[0])
    for name in ("tokenizer.json", "config.json", "processor_config.json", "chat_template.jinja"):
        assert (first / name).read_bytes() == (again / name).read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "llava"}, "arch="),
        ({"arch": "qwen3_vl", "hidden_size": 48}, "hidden_size=48"),
        ({"arch": "gemma3", "image_size": 100}, "image_size=100"),
        ({"arch": "qwen2_5_vl", "vocab_size": 300}, "vocab_size=300"),
    ],
)
def test_unusable_sizes_are_refused_with_the_field_named(
    kwargs: dict[str, Any], field: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=field):
        build_tiny_model(out_dir=tmp_path / "model", **kwargs)
    assert not (tmp_path / "model").exists()
