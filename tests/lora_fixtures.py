"""Random PEFT LoRA adapters for tests: built with ``peft`` on a transformers model, with
non-zero B (PEFT starts B at zero, which would make every adapter the base model)."""

from __future__ import annotations

import os

import torch
from torch import nn

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_random_adapter(
    model: nn.Module,
    name: str,
    path: str,
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
    std: float = 0.05,
    use_rslora: bool = False,
) -> tuple[nn.Module, str]:
    """Add adapter ``name`` to ``model`` (a transformers model, or a PeftModel from an earlier
    call), randomise its A and B and save it under ``path``; returns the PeftModel and the
    adapter's folder (PEFT writes a named adapter to ``path/name``)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        bias="none",
    )
    if isinstance(model, PeftModel):
        model.add_adapter(name, config)
    else:
        model = get_peft_model(model, config, adapter_name=name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if f".lora_A.{name}." in module_name or f".lora_B.{name}." in module_name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(path, selected_adapters=[name])
    return model.eval(), os.path.join(path, name)


def greedy(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decoding: the full sequence through the model at every step."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]
