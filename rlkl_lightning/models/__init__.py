"""Loading causal LMs and tokenizers, their forward passes and log-probs, LoRA, FSDP units."""
