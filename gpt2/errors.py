"""The exceptions of the gpt2 package.

Every error gpt2 raises on purpose, for input it cannot use, is a :class:`Gpt2Error`, so
``except gpt2.Gpt2Error`` catches all of them. Each subclass keeps its builtin base too
(``ValueError``, ``FileNotFoundError``, ``OSError``, ...), so an ``except ValueError`` written
against an older version still catches what it caught before.
"""


class Gpt2Error(Exception):
    """Base of every error the gpt2 package raises on purpose."""


class InvalidValueError(Gpt2Error, ValueError):
    """A setting, argument or file content outside what works; the message names it and says what to do."""


class MissingFileError(Gpt2Error, FileNotFoundError):
    """A file or folder the user named (or one a run needs) is not there."""
