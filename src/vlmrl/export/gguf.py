"""Stage 8, GGUF: convert `merged-16bit/` with llama.cpp's own converter, read the file back, run it if we can.

Where the converter comes from: `export.llama_cpp_dir` or `$VLMRL_LLAMA_CPP_DIR` (a llama.cpp checkout), else
vlmrl's tool cache (`~/.cache/vlmrl/llama.cpp-<version>/`, or under `$VLMRL_LLAMA_CPP_CACHE`), filled once by `python -m vlmrl.export.gguf fetch`, which
runs `pip download --no-deps --no-binary :all: llama-cpp-python==<version>` and extracts the converter
(`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`) from the source distribution's `vendor/llama.cpp/`.
llama.cpp at that version converts Qwen3-VL (`Qwen3VLForConditionalGeneration`) and its vision projector
(`--mmproj`). The converter itself does f16/bf16/q8_0; q4_k_m needs the `llama-quantize` binary. Both run as
children that die with vlmrl (`vlmrl.common.children`): a killed export leaves nothing writing a GGUF file.

Checks recorded: the file parses with the `gguf` package, its block count and embedding shape match the merged
config, the token embedding matches the merged weights to the output type's rounding, and, when `llama_cpp` is
importable, llama.cpp loads the file and generates. Left out: GGUF LoRA adapters (llama.cpp's
convert_lora_to_gguf.py), and image input through llama.cpp's mtmd (the projector is converted and read back).
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from vlmrl.common import children

LLAMA_CPP_PYTHON = "0.3.36"
QUANTIZATIONS = ("f16", "q8_0", "q4_k_m")  # export.gguf's values but `off`
# llama.cpp identifies a BPE pre-tokenizer by hashing the token ids of a fixed text, so a vocabulary it has not
# seen (vlmrl's tiny models) is refused even when its split rule is Qwen2's. This is Qwen2's rule, verbatim.
QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
NEEDED = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


class GgufError(RuntimeError):
    """GGUF export cannot run; the message says exactly what to install or set."""


def cached_converter_dir() -> Path:
    """A tool, not a run artifact: kept under the user's cache even when $VLMRL_CACHE points elsewhere (tests
    give each session a fresh $VLMRL_CACHE), unless $VLMRL_LLAMA_CPP_CACHE says where."""
    root = os.environ.get("VLMRL_LLAMA_CPP_CACHE") or Path.home() / ".cache" / "vlmrl"
    return Path(root) / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def find_converter(configured: str | None) -> Path | None:
    """The llama.cpp folder to convert with: configured, then $VLMRL_LLAMA_CPP_DIR, then the cache."""
    for candidate in (configured, os.environ.get("VLMRL_LLAMA_CPP_DIR"), str(cached_converter_dir())):
        if candidate and (Path(candidate) / "convert_hf_to_gguf.py").is_file():
            return Path(candidate)
    return None


def fetch_converter(target: Path | None = None) -> Path:
    """Download llama-cpp-python's sdist with pip and extract llama.cpp's converter into the cache."""
    target = target or cached_converter_dir()
    with tempfile.TemporaryDirectory() as tmp:
        # plain subprocess: pip writes into a temporary folder only, never into a run
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp],
                              check=False, capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise GgufError(f"pip could not download llama-cpp-python=={LLAMA_CPP_PYTHON}'s source distribution: "
                            + (done.stderr.strip().splitlines() or ["no output"])[-1])
        staging = Path(tempfile.mkdtemp(dir=target.parent if target.parent.exists() else None))
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].split("/")[0] in NEEDED]
            tar.extractall(staging, members=members, filter="data")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(staging / prefix), target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def missing_requirements() -> list[str]:
    """Python packages the converter imports that are not installed (it needs sentencepiece even for BPE)."""
    return [name for name in ("gguf", "sentencepiece") if importlib.util.find_spec(name) is None]


def convert(merged: Path, out_dir: Path, quantization: str, llama_cpp: Path) -> dict:
    """Write `model-<type>.gguf` (+ `mmproj-<type>.gguf` where the converter knows the family's projector)."""
    if quantization not in QUANTIZATIONS:
        raise GgufError(f"export.gguf={quantization!r}: choose one of {', '.join(QUANTIZATIONS)}.")
    quantize = shutil.which("llama-quantize") if quantization == "q4_k_m" else None
    if quantization == "q4_k_m" and quantize is None:
        raise GgufError("export.gguf=q4_k_m needs llama.cpp's llama-quantize on PATH (build llama.cpp: "
                        "cmake -B build && cmake --build build --target llama-quantize); q8_0 needs nothing more.")
    out_dir.mkdir(parents=True, exist_ok=True)
    outtype = "q8_0" if quantization == "q8_0" else "f16"
    files = {"model": out_dir / f"model-{outtype}.gguf"}
    _run_converter(llama_cpp, merged, files["model"], outtype)
    mmproj = out_dir / "mmproj-f16.gguf"
    mmproj_error = _run_converter(llama_cpp, merged, mmproj, "f16", mmproj=True, check=False)
    if mmproj_error is None:
        files["mmproj"] = mmproj
    if quantize is not None:
        quantized = out_dir / "model-q4_k_m.gguf"
        done = children.run([quantize, str(files["model"]), str(quantized), "Q4_K_M"])
        if done.returncode:
            raise GgufError(f"llama-quantize failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        files["model"].unlink()
        files["model"] = quantized
    return {"files": {k: str(v) for k, v in files.items()}, "outtype": outtype, "quantization": quantization,
            "mmproj": "converted" if mmproj_error is None else f"not converted: {mmproj_error}"}


def _run_converter(llama_cpp: Path, merged: Path, outfile: Path, outtype: str, *, mmproj: bool = False,
                   check: bool = True) -> str | None:
    argv = [sys.executable, "-m", "vlmrl.export.gguf", "convert", str(llama_cpp), str(merged),
            "--outfile", str(outfile), "--outtype", outtype, *(["--mmproj"] if mmproj else [])]
    done = children.run(argv)  # killed with vlmrl: never left writing into the run after its lock is released
    if done.returncode == 0 and outfile.is_file():
        return None
    last = next((line for line in reversed(done.stderr.strip().splitlines()) if line.strip()), "no output")
    if check:
        raise GgufError(f"llama.cpp's converter failed on {merged}: {last}")
    return last


def read_back(files: dict, merged: Path) -> dict:
    """Parse the GGUF files and compare them with the merged model they came from."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    reader = gguf.GGUFReader(files["model"])
    fields = {name: reader.fields[name] for name in reader.fields}
    arch = _field(fields["general.architecture"])
    config = json.loads((merged / "config.json").read_text())
    text = config.get("text_config", config)
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    problems = []
    if _field(fields.get(f"{arch}.block_count")) != text["num_hidden_layers"]:
        problems.append("block count differs from num_hidden_layers")
    if embed is None or list(embed.shape) != [text["hidden_size"], text["vocab_size"]]:
        problems.append("token_embd shape differs from (hidden_size, vocab_size)")
    embed_diff = None
    if embed is not None and embed.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
        with safe_open(str(next(merged.glob("*.safetensors"))), "np") as f:
            key = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))  # noqa: SIM118
            reference = f.get_tensor(key).astype(np.float32)
        embed_diff = float(np.abs(np.asarray(embed.data, dtype=np.float32).reshape(reference.shape) - reference).max())
        if embed_diff > 1e-3 * max(1.0, float(np.abs(reference).max())):  # f16 keeps ~3 decimal digits
            problems.append(f"token_embd differs from the merged weights by {embed_diff:.3g}")
    result = {"architecture": arch, "tensors": len(reader.tensors), "token_embd_max_diff": embed_diff,
              "problems": problems}
    if "mmproj" in files:
        projector = gguf.GGUFReader(files["mmproj"])
        result["mmproj_tensors"] = len(projector.tensors)
        result["mmproj_projector_type"] = _field(projector.fields.get("clip.projector_type"))
    return result


def _field(field) -> object:
    if field is None:
        return None
    value = field.contents()
    return value


def try_generate(model_file: str, prompt: str = "2 + 2 =") -> dict:
    """Load with llama.cpp (llama-cpp-python) and generate a few tokens; skipped, with the reason, without it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"generated": None, "detail": "skipped: llama_cpp not importable (pip install llama-cpp-python "
                "builds llama.cpp; then re-run vlmrl export)"}
    from llama_cpp import Llama

    llm = Llama(model_path=model_file, n_ctx=256, verbose=False)
    out = llm(prompt, max_tokens=8, temperature=0.0)
    text = out["choices"][0]["text"]
    return {"generated": out["usage"]["completion_tokens"] > 0, "text": text, "detail": "llama.cpp generated"}


def _convert_main(llama_cpp: str, args: list[str]) -> None:
    """Run llama.cpp's converter in this process, naming a Qwen2-rule tokenizer it does not know 'qwen2'."""
    sys.path[:0] = [llama_cpp, str(Path(llama_cpp) / "gguf-py")]
    from conversion import base  # llama.cpp's package, from the folder just put on the path

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if _split_rule(self.dir_model) != QWEN2_SPLIT:
                raise
            return "qwen2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", *args]
    runpy.run_path(str(Path(llama_cpp) / "convert_hf_to_gguf.py"), run_name="__main__")


def _split_rule(model_dir: Path) -> str | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    for step in [pre, *pre.get("pretokenizers", [])]:
        if step.get("type") == "Split":
            return step.get("pattern", {}).get("Regex")
    return None


if __name__ == "__main__":
    if sys.argv[1:2] == ["fetch"]:  # idempotent: a cached converter is kept
        cached = cached_converter_dir()
        print(cached if (cached / "convert_hf_to_gguf.py").is_file() else fetch_converter())
    elif sys.argv[1:2] == ["convert"]:
        _convert_main(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: python -m vlmrl.export.gguf fetch | convert LLAMA_CPP_DIR MODEL_DIR [converter args]")
