"""Issue 19, shipping the model: the seed's 4-bit path on a CPU through export, merged folders that load in plain
transformers and generate, a self-contained adapter folder, GGUF through llama.cpp's converter, and the upload.

The 4-bit run uses the demo policy (the seed recipe's nf4 base, GSPO) with a length-based stand-in for the
correctness reward so every LoRA B matrix moves in two steps; see tests/test_export.py for why.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from tests.helpers import varied_reward
from vlmrl.cli.app import app
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import load_config

runner = CliRunner()
bnb_cpu = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                             reason="bitsandbytes not installed (it is in the dev extra)")


def four_bit_args(output_dir: Path) -> list[str]:
    sets = [
        "model.load_in_4bit=true", f"run.output_dir={output_dir}", "data.num_synthetic=24", "data.holdout_size=4",
        "eval.max_new_tokens=12", "train.max_completion_length=12", "train.max_steps=2",
        "train.per_device_train_batch_size=8", "train.save_steps=2",
        "export.merged_16bit=true", "export.merged_4bit=true",
    ]
    return ["run", "demo", *[arg for s in sets for arg in ("--set", s)]]


@pytest.fixture(scope="module")
def four_bit_run(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("ship4bit")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
        result = runner.invoke(app, four_bit_args(output))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return output / "demo"


def _generate(model, processor, run_dir: Path) -> list[int]:
    item = read_jsonl(run_dir / "data" / "holdout.jsonl")[0]
    with Image.open(run_dir / item["images"][0]) as img:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": item["prompt"]}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        batch = processor(text=[text], images=[img.convert("RGB")], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, suppress_tokens=[
            model.config.image_token_id, model.config.vision_start_token_id])
    return out[0, batch["input_ids"].shape[1]:].tolist()


@bnb_cpu
@pytest.mark.slow
def test_the_4bit_recipe_runs_end_to_end_on_a_cpu_and_both_merges_verify(four_bit_run: Path) -> None:
    report = read_json(four_bit_run / "export.json")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["all_passed"] is True
    for name in ("merged_16bit", "merged_4bit"):
        assert checks[name]["passed"] is True, checks[name]
        assert "tolerance" in checks[name]["value"] and checks[name]["value"]["items"] >= 1
    assert "dequantized nf4" in checks["merged_16bit"]["detail"]
    assert checks["merged_16bit"]["value"]["greedy_token_agreement"] == 1.0  # float32: exact greedy tokens
    assert "load_in_4bit: true" in (four_bit_run / "config.yaml").read_text()  # the run was the 4-bit recipe


@bnb_cpu
@pytest.mark.slow
def test_both_merged_folders_load_in_plain_transformers_and_generate(four_bit_run: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    merged16 = AutoModelForImageTextToText.from_pretrained(str(four_bit_run / "merged-16bit")).eval()
    assert not any("Linear4bit" in type(m).__name__ for m in merged16.modules())
    assert "quantization_config" not in json.loads((four_bit_run / "merged-16bit" / "config.json").read_text())
    merged4 = AutoModelForImageTextToText.from_pretrained(str(four_bit_run / "merged-4bit"), device_map="cpu").eval()
    assert any(type(m).__name__ == "Linear4bit" for m in merged4.modules())
    for folder, model in (("merged-16bit", merged16), ("merged-4bit", merged4)):
        processor = AutoProcessor.from_pretrained(str(four_bit_run / folder))  # the folder's own processor
        assert len(_generate(model, processor, four_bit_run)) > 0
        card = (four_bit_run / folder / "README.md").read_text()
        assert "from_pretrained(folder)" in card
    assert "vllm" in (four_bit_run / "merged-16bit" / "README.md").read_text().lower()


@bnb_cpu
@pytest.mark.slow
def test_the_adapter_folder_loads_with_only_what_is_inside_it(four_bit_run: Path, tmp_path: Path) -> None:
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tmp_path / "shared-adapter"
    shutil.copytree(four_bit_run / "adapter", folder)  # elsewhere: no run folder, no cache path to lean on
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "base-model"  # demo-policy is on no hub: copied in
    assert ".cache" not in json.dumps(adapter_config)
    base = AutoModelForImageTextToText.from_pretrained(str(folder / adapter_config["base_model_name_or_path"]))
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    processor = AutoProcessor.from_pretrained(str(folder))
    assert processor.tokenizer.chat_template and processor.image_processor is not None
    assert len(_generate(model, processor, four_bit_run)) > 0
    card = (folder / "README.md").read_text()
    comparison = read_json(four_bit_run / "comparison.json")
    accuracy = comparison["metrics"]["accuracy"]
    assert f"{accuracy['before']:.3f} | {accuracy['after']:.3f}" in card
    assert "95% CI" in card and "contamination check" in card and "PeftModel.from_pretrained" in card
    assert "nf4" in card and "gspo" in card.lower()


def test_push_to_hub_uploads_the_adapter_folder_through_hfapi(tmp_path: Path) -> None:
    from vlmrl.export.stage import push_to_hub

    run_dir = tmp_path / "run"
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "adapter" / "adapter_config.json").write_text("{}")
    (run_dir / "export.json").write_text(json.dumps({"all_passed": True}))
    calls = []

    class FakeApi:
        def create_repo(self, **kwargs):
            calls.append(("create_repo", kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            return type("Info", (), {"commit_url": "https://hf.co/me/x/commit/1"})()

    url = push_to_hub(run_dir, "me/x", private=True, api=FakeApi())
    assert url == "https://hf.co/me/x/commit/1"
    assert calls[0] == ("create_repo", {"repo_id": "me/x", "private": True, "exist_ok": True, "repo_type": "model"})
    assert calls[1][1]["folder_path"] == str(run_dir / "adapter") and calls[1][1]["repo_id"] == "me/x"


def test_push_to_hub_refuses_an_unverified_export(tmp_path: Path) -> None:
    from vlmrl.export.stage import ExportError, push_to_hub

    (tmp_path / "adapter").mkdir()
    (tmp_path / "export.json").write_text(json.dumps({"all_passed": False}))
    with pytest.raises(ExportError, match="no verified export"):
        push_to_hub(tmp_path, "me/x", private=False, api=object())


def test_cli_export_push_to_hub_calls_the_upload(tmp_path: Path, monkeypatch) -> None:
    seen = {}

    def fake_push(run_dir, repo_id, *, private, folder="adapter", api=None):
        seen.update(run_dir=run_dir, repo_id=repo_id, private=private)
        return "https://hf.co/commit"

    monkeypatch.setattr("vlmrl.export.stage.push_to_hub", fake_push)
    monkeypatch.setattr("vlmrl.export.stage.export_adapter", lambda config, run_dir, source=None: {"checks": []})
    result = runner.invoke(app, ["export", "--set", f"run.output_dir={tmp_path}", "--push-to-hub", "me/x",
                                 "--private"])
    assert result.exit_code == 0, result.output
    assert seen == {"run_dir": tmp_path / "demo", "repo_id": "me/x", "private": True}
    assert "https://hf.co/commit" in result.output


def test_a_run_folder_is_accepted_where_a_config_is(tmp_path: Path) -> None:
    from vlmrl.cli.app import _config
    from vlmrl.config.schema import dump_config

    config = load_config("demo", ["run.name=mine", f"run.output_dir={tmp_path / 'elsewhere'}", "train.max_steps=7"])
    run_dir = tmp_path / "copied-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(config))
    loaded = _config(str(run_dir), ["eval.max_new_tokens=5"])
    assert loaded.train.max_steps == 7 and loaded.eval.max_new_tokens == 5
    assert loaded.run_dir == run_dir  # the folder given, wherever the run was first written


# ---------------------------------------------------------------------------------------------------------------
# GGUF


def _converter():
    from vlmrl.export.gguf import find_converter

    return find_converter(None)


@pytest.mark.slow
def test_a_tiny_qwen3_vl_converts_to_gguf_and_reads_back(tmp_path: Path) -> None:
    from vlmrl.export.gguf import convert, missing_requirements, read_back, try_generate
    from vlmrl.models.tiny import build_tiny_model

    llama_cpp = _converter()
    if llama_cpp is None:
        pytest.skip("llama.cpp's converter is not in vlmrl's cache (no network in tests): fill it once with "
                    "`python -m vlmrl.export.gguf fetch` (or set VLMRL_LLAMA_CPP_DIR)")
    if missing_requirements():
        pytest.skip(f"the converter needs {missing_requirements()} (pip install 'vlmrl[gguf]')")
    model_dir = tmp_path / "tiny"
    build_tiny_model("qwen3_vl", model_dir, seed=0)
    result = convert(model_dir, tmp_path / "gguf", "f16", llama_cpp)
    assert result["mmproj"] == "converted", result["mmproj"]
    back = read_back(result["files"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())["text_config"]
    assert back["architecture"] == "qwen3vl" and back["problems"] == []
    assert back["token_embd_max_diff"] is not None and back["token_embd_max_diff"] < 1e-3
    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    # per layer: 4 attention projections, q/k norms, 2 norms, 3 MLP projections; plus embedding, final norm, head
    assert back["tensors"] == 11 * config["num_hidden_layers"] + 2 + (0 if tied else 1)
    assert back["mmproj_tensors"] > 0 and back["mmproj_projector_type"] == "qwen3vl_merger"
    generated = try_generate(result["files"]["model"])
    if importlib.util.find_spec("llama_cpp") is None:
        assert generated["generated"] is None and "skipped" in generated["detail"]
        print("skipped llama.cpp generation: llama_cpp is not importable (llama-cpp-python not built here)")
    else:
        assert generated["generated"] is True


def test_q4_k_m_without_llama_quantize_names_what_to_install(tmp_path: Path, monkeypatch) -> None:
    from vlmrl.export.gguf import GgufError, convert

    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(GgufError) as info:
        convert(tmp_path, tmp_path / "out", "q4_k_m", tmp_path)
    assert "llama-quantize" in str(info.value) and "\n" not in str(info.value)


def test_doctor_reports_whether_4bit_can_load_here(monkeypatch) -> None:
    from vlmrl.preflight.doctor import collect_environment

    env = collect_environment()
    assert env["four_bit"]["available"] is (importlib.util.find_spec("bitsandbytes") is not None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    refused = collect_environment()["four_bit"]
    assert refused["available"] is False and "bitsandbytes is not installed" in refused["reason"]


def test_export_without_an_adapter_suggests_only_options_that_exist(tmp_path: Path) -> None:
    result = runner.invoke(app, ["export", "--set", f"run.output_dir={tmp_path}"])
    assert result.exit_code == 2 and "--adapter" in result.output
    retry = runner.invoke(app, ["export", "--set", f"run.output_dir={tmp_path}", "--adapter", str(tmp_path / "none")])
    assert retry.exit_code == 2 and "No such option" not in retry.output
    assert "no adapter here" in " ".join(retry.output.split())


def test_fetch_extracts_the_converter_from_a_pip_downloaded_sdist(tmp_path: Path, monkeypatch) -> None:
    """pip is faked (no network): it drops an sdist laid out like llama-cpp-python's into the download folder."""
    import io
    import tarfile

    from vlmrl.export.gguf import LLAMA_CPP_PYTHON, fetch_converter, find_converter

    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    members = {"convert_hf_to_gguf.py": b"# converter", "conversion/qwen3vl.py": b"# family",
               "gguf-py/gguf/__init__.py": b"", "ggml/src/ggml.c": b"int x;"}
    seen = []

    def fake_pip(argv, **kwargs):
        seen.append(argv)
        folder = Path(argv[argv.index("-d") + 1])
        with tarfile.open(folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz", "w:gz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(prefix + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr("subprocess.run", fake_pip)
    target = fetch_converter(tmp_path / "cache" / "llama.cpp")
    assert "--no-binary" in seen[0] and f"llama-cpp-python=={LLAMA_CPP_PYTHON}" in seen[0]
    assert (target / "convert_hf_to_gguf.py").read_bytes() == b"# converter"
    assert (target / "conversion" / "qwen3vl.py").is_file() and (target / "gguf-py" / "gguf").is_dir()
    assert not (target / "ggml").exists()  # only what the converter needs
    assert find_converter(str(target)) == target


def test_fetch_without_pypi_is_one_line_naming_the_package(tmp_path: Path, monkeypatch) -> None:
    from vlmrl.export.gguf import GgufError, fetch_converter

    monkeypatch.setattr("subprocess.run", lambda argv, **kw: type("Done", (), {
        "returncode": 1, "stderr": "ERROR: No matching distribution found for llama-cpp-python==0.3.36"})())
    with pytest.raises(GgufError) as info:
        fetch_converter(tmp_path / "llama.cpp")
    assert "llama-cpp-python" in str(info.value) and "\n" not in str(info.value)
