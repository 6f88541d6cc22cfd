"""Shared test fixtures.

Data fixtures (used by tests/test_data_*.py): a local copy of MathVista testmini in the hub's exact schema,
built from the real 1,000 annotations in `shared/data/` with small drawn placeholder images (one distinct
random-block pattern per pid, so the contamination guard never mistakes two of them for each other).
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import zlib
from pathlib import Path

import pytest

# The tests run the host's fastest CPU kernels (about 1.4x faster than the pinned AVX2 ones); the demo's printed
# digits are checked where `make run` computes them, in `vlmrl run` subprocesses with the kernels pinned
# (tests/test_learning.py, tests/test_cpu_numerics.py).
os.environ.setdefault("VLMRL_CPU_KERNELS", "native")
import vlmrl  # noqa: F401  (reads VLMRL_CPU_KERNELS before torch first computes: vlmrl.common.cpu_numerics)

# isort: split
import torch  # (does not import Triton)
from PIL import Image, ImageDraw, ImageFont

if not torch.cuda.is_available():
    # Triton kernels (vlmrl.engine.rollout.decode_attention) run in Triton's CPU interpreter, which Triton chooses when it
    # is imported (transformers imports it): set before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parent.parents[1] / "shared" / "data"  # beside the repo root
ANNOTATIONS = SHARED_DATA / "mathvista_testmini_annotations.json"


def _load_annotations() -> dict[str, dict]:
    if not ANNOTATIONS.is_file():
        pytest.fail(
            f"{ANNOTATIONS} is missing: the data tests build their MathVista fixture from it. "
            "It lives in the "
            "`shared/data` folder beside the repository root (see shared/data/README.md).",
            pytrace=False,
        )
    return json.loads(ANNOTATIONS.read_text(encoding="utf-8"))


def placeholder_image(key: str, size: tuple[int, int] = (64, 48)) -> Image.Image:
    """A small picture unique to `key`: an 8x6 grid of random colour blocks with the key written on it."""
    rng = random.Random(f"placeholder:{key}")
    cols, rows = 8, 6
    small = Image.new("RGB", (cols, rows))
    small.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(cols * rows)])
    img = small.resize(size, Image.Resampling.NEAREST)
    ImageDraw.Draw(img).text((3, 3), key[:6], fill=(255, 255, 255), font=ImageFont.load_default(size=12))
    return img


def mathvista_query(row: dict) -> str:
    """A query in the style of MathVista's (`query` is not in the annotation file)."""
    if row["question_type"] == "multi_choice":
        hint = (
            "Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
        )
        letters = "ABCDEFGH"
        options = "\n".join(f"({letters[i]}) {c}" for i, c in enumerate(row["choices"] or []))
        return f"Hint: {hint}\nQuestion: {row['question']}\nChoices:\n{options}"
    kind = {
        "integer": "an integer answer",
        "float": f"a floating-point number with {row['precision']} decimal places",
        "list": "a Python list as an answer",
    }.get(row["answer_type"], "an answer")
    hint = f"Please answer the question requiring {kind} and provide the final value at the end."
    return f"Hint: {hint}\nQuestion: {row['question']}"


def mathvista_features():
    import datasets

    strings = datasets.List(datasets.Value("string"))
    metadata = {
        "category": datasets.Value("string"),
        "context": datasets.Value("string"),
        "grade": datasets.Value("string"),
        "img_height": datasets.Value("int64"),
        "img_width": datasets.Value("int64"),
        "language": datasets.Value("string"),
        "skills": strings,
        "source": datasets.Value("string"),
        "split": datasets.Value("string"),
        "task": datasets.Value("string"),
    }
    return datasets.Features(
        {
            "pid": datasets.Value("string"),
            "question": datasets.Value("string"),
            "image": datasets.Value("string"),
            "decoded_image": datasets.Image(),
            "choices": strings,
            "unit": datasets.Value("string"),
            "precision": datasets.Value("float64"),
            "answer": datasets.Value("string"),
            "question_type": datasets.Value("string"),
            "answer_type": datasets.Value("string"),
            "metadata": metadata,
            "query": datasets.Value("string"),
        }
    )


def mathvista_dataset(rows: list[dict]):
    """A `datasets.Dataset` in the hub's schema; rows are annotation dicts (decoded_image drawn if absent)."""
    import datasets

    columns: dict[str, list] = {name: [] for name in mathvista_features()}
    for row in rows:
        full = {**row, "query": row.get("query") or mathvista_query(row)}
        full.setdefault("decoded_image", placeholder_image(str(row["pid"])))
        for name, values in columns.items():
            values.append(full.get(name))
    return datasets.Dataset.from_dict(columns, features=mathvista_features())


@pytest.fixture(scope="session")
def mathvista_annotations() -> dict[str, dict]:
    """The 1,000 real testmini annotations keyed by pid (everything but the images)."""
    return _load_annotations()


@pytest.fixture(scope="session")
def mathvista_parquet(mathvista_annotations, tmp_path_factory) -> Path:
    """testmini as one Parquet file written by datasets, decoded_image stored with the Image feature."""
    path = tmp_path_factory.mktemp("mathvista_parquet") / "testmini.parquet"
    mathvista_dataset(list(mathvista_annotations.values())).to_parquet(str(path))
    return path


@pytest.fixture(scope="session")
def mathvista_jsonl(mathvista_annotations, tmp_path_factory) -> Path:
    """testmini as JSONL without decoded_image: `image` is a path (images/<pid>.jpg) relative to the file."""
    folder = tmp_path_factory.mktemp("mathvista_jsonl")
    (folder / "images").mkdir()
    lines = []
    for row in mathvista_annotations.values():
        placeholder_image(row["pid"]).save(folder / row["image"], format="JPEG", quality=90)
        lines.append(json.dumps({**row, "query": mathvista_query(row)}))
    path = folder / "testmini.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def png_bytes(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height but holds one empty IDAT: a bomb that costs nothing to make."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="session", autouse=True)
def demo_cache(tmp_path_factory):
    """One cache folder for the whole session (the demo policy is built at most once, never in $HOME);
    exported so `vlmrl` subprocesses started by tests use it too."""
    import os

    folder = tmp_path_factory.mktemp("vlmrl-cache")
    previous = os.environ.get("VLMRL_CACHE")
    os.environ["VLMRL_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("VLMRL_CACHE", None)
    else:
        os.environ["VLMRL_CACHE"] = previous


# Training tests (test_train.py, test_fastgen.py)


@pytest.fixture
def captured(monkeypatch) -> dict:
    """The LoRA-wrapped model `train` builds, and a copy of every parameter right after wrapping."""
    from vlmrl.models import lora

    seen: dict = {}
    original = lora.apply_lora

    def capture(model, config, **kwargs):
        wrapped, report = original(model, config, **kwargs)
        seen["model"] = wrapped
        seen["before"] = {name: p.detach().clone() for name, p in wrapped.named_parameters()}
        return wrapped, report

    monkeypatch.setattr(lora, "apply_lora", capture)
    return seen


@pytest.fixture(scope="session")
def vlmrl_cache(tmp_path_factory) -> Path:
    """A fresh cache for the demo policy, shared by the session (a fresh machine builds it once; the e2e run
    and tests/test_watch.py use the same build)."""
    return tmp_path_factory.mktemp("vlmrl_cache")


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, vlmrl_cache) -> dict:
    """`vlmrl run` with no argument, as `make run` runs it: a subprocess, the CPU kernels pinned (the suite itself
    runs the host's own), the demo policy built into `vlmrl_cache`. Shared by the e2e test of the default run and
    the learning test, which compares its printed table with the README's."""
    import subprocess
    import sys
    import time

    out = tmp_path_factory.mktemp("demo-run")
    script = Path(sys.executable).parent / "vlmrl"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vlmrl.cli"]
    env = {k: v for k, v in os.environ.items() if k != "VLMRL_CPU_KERNELS"}
    env.update(VLMRL_CACHE=str(vlmrl_cache), COLUMNS="200")
    started = time.perf_counter()
    result = subprocess.run([*command, "run", "--set", f"run.output_dir={out}"], env=env, capture_output=True,
                            text=True, timeout=1200, cwd=out, check=False)
    return {"result": result, "seconds": time.perf_counter() - started, "run_dir": out / "demo", "env": env}


# The small run (tests/helpers.py: quick_config), prepared and trained once for the session. Never written to: a
# test that writes works on a copy (`copy_run(quick_trained, tmp_path)` with `quick_config(tmp_path, ...)`).


@pytest.fixture(scope="session")
def quick_prepared(tmp_path_factory) -> Path:
    """The small run prepared (its data and base model; nothing evaluated or trained)."""
    from tests.helpers import quick_config
    from vlmrl.pipeline import prepare_with_budget

    config = quick_config(tmp_path_factory.mktemp("quick_prepared"))
    prepare_with_budget(config, config.run_dir)
    return config.run_dir


@pytest.fixture(scope="session")
def quick_trained(quick_prepared, tmp_path_factory) -> Path:
    """A copy of `quick_prepared` trained by `train(quick_config(...))` for its 2 steps, a checkpoint each, with
    `varied_reward` for the correctness reward so that LoRA B moves."""
    from tests.helpers import copy_run, quick_config, varied_reward
    from vlmrl.train.stage import train

    output_dir = tmp_path_factory.mktemp("quick_trained")
    run_dir = copy_run(quick_prepared, output_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
        train(quick_config(output_dir), run_dir)
    return run_dir


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory) -> Path:
    """A tiny random Qwen3-VL (hidden 64, 2 layers), saved once for the session (the fast-path tests)."""
    from vlmrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tiny") / "m", hidden_size=64, num_layers=2)


def load_sdpa(path: Path):
    """A saved model on transformers' sdpa attention in float32, eval mode, and its processor padding left."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(str(path))
    processor.tokenizer.padding_side = "left"
    return model.eval(), processor


@pytest.fixture
def launches(monkeypatch):
    """Each launch of the nf4 token-step kernel (`vlmrl.engine.rollout.nf4.launch`), by its rows, recorded (and the
    kernel's fallbacks, shuffle checks and split counters cleared); cuBLAS's reduced-precision reductions off, so that references sum in fp32."""
    from vlmrl.engine.rollout import arrivals, nf4

    monkeypatch.setattr(nf4, "_failed", {})
    monkeypatch.setattr(nf4, "_shuffles", {})
    monkeypatch.setattr(arrivals, "_counters", {})
    calls = []
    real = nf4.launch
    monkeypatch.setattr(nf4, "launch", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    # the reference sums in fp32 (cuBLAS may otherwise reduce split-K partial sums in bf16/fp16)
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = flags.allow_fp16_reduced_precision_reduction = False
    yield calls
    flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


@pytest.fixture
def benchmark_script():
    """Load a script of benchmarks/ by name as a module (not run as __main__), its folder importable meanwhile."""
    import importlib.util
    import sys

    folder = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str):
        sys.path.insert(0, str(folder))
        try:
            spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        finally:
            sys.path.remove(str(folder))

    return load
