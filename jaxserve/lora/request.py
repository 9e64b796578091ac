"""What a request names to be served by a LoRA adapter (vLLM's LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # the adapter's identity: requests naming the same id share its slot and pages
    lora_path: str  # a PEFT adapter directory
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}.")
