"""Models the tests make from the bundled ones, as no package ships them: LoRA adapters for the default model (a
few megabytes of seeded random weights on every layer's query and value projections, written with safetensors in
PEFT's layout, so that an adapter's answers differ from the base model's and from another seed's), and a
cross-encoder (all-MiniLM-L6-v2's encoder under a seeded random one-label head: its scores mean nothing, but any
implementation of the model must give the same ones)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from services.worker.models import default_chat_model_dir, resolve_model_dir

RANK = 8


def make_adapter(folder: Path, seed: int, scale: float = 0.6) -> Path:
    """Writes an adapter of SmolLM2-135M-Instruct into `folder` (its shapes read from the model's config)."""
    config = json.loads((default_chat_model_dir() / "config.json").read_text())
    hidden = config["hidden_size"]
    kv_width = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"q_proj": hidden, "v_proj": kv_width}  # each projection's output width; its input is `hidden`
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"]):
        for name, width in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((RANK, hidden)) / np.sqrt(hidden)).astype(
                np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((width, RANK)) * scale).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": RANK, "lora_dropout": 0.0,
        "target_modules": sorted(shapes), "bias": "none", "base_model_name_or_path": config.get("_name_or_path", ""),
    }))
    return folder


def make_cross_encoder(folder: Path, seed: int = 7) -> Path:
    """A BertForSequenceClassification of one label (a cross-encoder, as vLLM's score task serves them) in
    `folder`: the bundled embedding model's encoder, a classifier head drawn from `seed` whose scores spread."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    source = resolve_model_dir("", "embed")
    config = BertConfig.from_pretrained(source, num_labels=1, architectures=["BertForSequenceClassification"])  # nosec B615: a local folder
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(source, config=config)  # nosec B615: a local folder
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)  # nosec B615: a local folder
    return folder


def cross_encoder_scores(folder: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """The cross-encoder's scores of the pairs as transformers computes them (sentence-transformers' CrossEncoder
    with one label: the sigmoid of the logit)."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(folder)  # nosec B615: a local folder
    model = BertForSequenceClassification.from_pretrained(folder).eval()  # nosec B615: a local folder
    with torch.no_grad():
        batch = tokenizer([a for a, _ in pairs], [b for _, b in pairs], return_tensors="pt", padding=True)
        return [float(x) for x in torch.sigmoid(model(**batch).logits).flatten()]
