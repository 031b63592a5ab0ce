"""Adapter errors: one base class, a branch per stage, a leaf per failure.

`AdapterFormatError`: the files or tensors cannot be read as an adapter at
all (truncated file, wrong tensor names/shapes/dtypes, pickle payloads).
`UnsupportedOptionError`: a PEFT option loraplex cannot serve; names it.
`AdapterValidationError`: the adapter reads but does not fit the base model;
carries the offending row index (or None when the adapter as a whole fails).
`AdapterTooLargeError` and `BaseModelMismatchError` stand apart because
services answer them with other status codes (RESOURCE_EXHAUSTED,
FAILED_PRECONDITION); everything else is the user's input (INVALID_ARGUMENT).
"""
from __future__ import annotations


class AdapterError(ValueError):
    """Base of every adapter error; the message says what to fix."""


class AdapterFormatError(AdapterError):
    """The input is not a readable adapter in the format it claims to be."""


class UnsafeFileError(AdapterFormatError):
    """A `.bin` file holds objects other than tensors (a pickle payload)."""


class UnsupportedOptionError(AdapterFormatError):
    """A PEFT option loraplex cannot serve; `option` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"unsupported PEFT option {option!r}: {message}")
        self.option = option


class AdapterValidationError(AdapterError):
    """The adapter does not fit the base model; `row` is the offending row index."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message if row is None else f"row {row}: {message}")
        self.row = row


class EmptyAdapterError(AdapterValidationError):
    """The adapter has no rows."""


class UnknownModuleError(AdapterValidationError):
    """A module id outside the table (0-17)."""


class ModuleNotEnabledError(AdapterValidationError):
    """A known module id the server does not apply."""


class LayerOutOfRangeError(AdapterValidationError):
    """A layer index outside [0, num_layers)."""


class RankError(AdapterValidationError):
    """A rank outside [1, max_lora_rank]."""


class RowShapeError(AdapterValidationError):
    """A row too short for its module's A and B."""


class PaddingError(AdapterValidationError):
    """Non-zero values after a row's A and B (wrong shapes, or garbage)."""


class DuplicateRowError(AdapterValidationError):
    """Two rows for the same (module, layer)."""


class NonFiniteError(AdapterValidationError):
    """NaN or Inf in a row (before or after conversion to the storage dtype)."""


class DtypeError(AdapterValidationError):
    """A weights dtype loraplex cannot store, or values it cannot convert."""


class AdapterTooLargeError(AdapterError):
    """The converted adapter is over a size limit."""


class BaseModelMismatchError(AdapterError):
    """The adapter was validated for another base model (fingerprints differ)."""
