"""Random LoRA adapters for the tiny Llama, in the PEFT layout vLLM loads at run time.

An adapter is a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` holding,
for every layer, ``lora_A`` (rank x in) and ``lora_B`` (out x rank) of the target projections
(``q_proj`` and ``v_proj`` by default). The weights are drawn with a large standard deviation
(0.5, against 0.02 for the base model's), so that greedy output differs from the base model's
and between adapters of different seeds. Needs ``torch`` and ``safetensors`` (vLLM brings
both); imported lazily.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "v_proj")


def make_adapter(
    model_dir: str | Path,
    out: str | Path,
    seed: int,
    rank: int = 8,
    targets: Sequence[str] = TARGETS,
    std: float = 0.5,
) -> Path:
    """Write a rank-`rank` adapter for the tiny model at `model_dir` into `out`."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads) * (hidden // heads)
    widths = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden)}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in targets:
            fan_in, fan_out = widths[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(rank, fan_in, generator=generator) * std
            b = torch.randn(fan_out, rank, generator=generator) * std
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
