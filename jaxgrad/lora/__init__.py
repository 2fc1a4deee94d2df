"""The Llama / LoRA / QLoRA family: configs (HF and PEFT names), the decoder block with a hand-written whole-block
VJP, the causal-LM model and its loss. NF4 (``jaxgrad.lora.nf4``, the format of :mod:`jaxgrad.ops.nf4`) and
PEFT / HF IO (``jaxgrad.lora.peft``, ``jaxgrad.lora.hf``) are imported from their modules."""

from jaxgrad.lora.block import base_weight, block, block_reference
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig
from jaxgrad.lora.model import apply, causal_lm_loss, count_items, init, init_lora, loss_fn

__all__ = ["PROJECTIONS", "LlamaConfig", "LoraConfig", "apply", "base_weight", "block", "block_reference",
           "causal_lm_loss", "count_items", "init", "init_lora", "loss_fn"]
