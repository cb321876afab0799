"""A model's transformers config and tokenizer from files transformers itself
would parse at a higher cost (GGUF metadata)."""
