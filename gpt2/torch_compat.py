"""The private PyTorch names gpt2 uses, in one place.

Each entry says why the public API does not do, and the torch versions it was checked on. Nothing
else in the package may name ``torch._*`` or ``torch.ops`` (``tests/test_torch_compat.py``).
"""
