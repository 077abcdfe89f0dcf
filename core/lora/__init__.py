"""Multi-LoRA: PEFT adapters on the base model's linear layers, many adapters in one batch.

``peft`` reads and checks an adapter folder; ``layers`` holds one linear layer's stacked device
slots and applies them (ops/lora.py's shrink/expand); ``manager`` owns a worker's slots, its
host cache and the per-token slot index of each step.
"""

from bastion.ipc.messages import LoRARequest

__all__ = ["LoRARequest"]
