"""Tiny models and tokenizers built from configs, for tests and the demo (no downloads)."""
