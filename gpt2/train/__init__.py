"""gpt2.train."""
