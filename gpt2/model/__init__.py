"""gpt2.model."""
