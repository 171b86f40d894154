"""What gpt2 may delete or replace: only what it can prove it wrote (issue 27; filled in by the next commits)."""
