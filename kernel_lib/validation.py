"""The former name of :mod:`kernel_lib.equivalence` (whole components against their original), kept so that code
written against it still imports: ``from kernel_lib.validation import ComponentValidator`` gives the same class."""

from .equivalence import ComponentValidator, ValidationReport, ValidationResult

__all__ = ["ComponentValidator", "ValidationReport", "ValidationResult"]
