"""A GGUF model as a plain model directory: dequantized to fp32 by transformers and saved without its
quantization config (data/smollm2.py's target stage)."""
import importlib.util
from pathlib import Path

import torch

from data.wheel_files import MissingPackage


def load_gguf(gguf: Path):
    """The GGUF file's tokenizer and model, dequantized to fp32 by transformers (needs `gguf`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise MissingPackage(f"loading a GGUF file needs the {module} package: pip install {module}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model


def save_plain(tokenizer, model, out_dir: Path) -> None:
    """Save a GGUF-loaded model as a plain model directory: without its quantization config it loads
    with a bare `from_pretrained(out_dir)` and never looks for the GGUF again."""
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
