"""Random weights for benchmarks and tests: only config.json is needed."""

from __future__ import annotations

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Norm weights 1, biases 0, everything else N(0, std) from a generator seeded by ``seed``,
    so logits stay in a sane range and two runs with one seed agree."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Drawn on the parameter's own device: an 8B model's weights on the CPU take minutes.
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            generator = generators[param.device]
            if "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                values.normal_(0.0, std, generator=generator)
                param.copy_(values)
