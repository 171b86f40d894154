"""minlora: LoRA adapters through torch.nn.utils.parametrize (see issue: minlora)."""
