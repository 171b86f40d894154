"""The exceptions of the minlora package.

Every error minlora raises on purpose is a :class:`MinloraError`, so ``except minlora.MinloraError``
catches all of them. Each subclass keeps its builtin base too (``ValueError``, ``TypeError``, ...), so an
``except ValueError`` written against an older version still catches what it caught before.
"""


class MinloraError(Exception):
    """Base of every error the minlora package raises on purpose."""


class LoRAValueError(MinloraError, ValueError):
    """A LoRA setting, model layer or adapter content that minlora cannot use; the message says what to do."""


class LoRAFileNotFoundError(MinloraError, FileNotFoundError):
    """An adapter file or folder that is not there."""


class LoRATypeError(MinloraError, TypeError):
    """An argument of the wrong kind: a LoRA config, a factory's result, a layer without a usable weight."""


class LoRAIndexError(MinloraError, IndexError):
    """An adapter index out of range (:func:`minlora.select_lora`)."""
