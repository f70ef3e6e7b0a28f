"""Test helpers for backend plugins: the conformance suite (see :mod:`.conformance`)."""

from .conformance import CaseResult, ConformanceCase, ConformanceReport, check_backend, conformance_cases

__all__ = ["CaseResult", "ConformanceCase", "ConformanceReport", "check_backend", "conformance_cases"]
