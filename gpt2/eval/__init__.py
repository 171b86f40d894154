"""gpt2.eval."""
