"""Test helpers for plugins: the conformance suite (:mod:`.conformance`) and plugin managers.

See :mod:`.managers` for managers holding the core alone or the core plus a plugin under test.
"""

from .availability import backend_unavailable_reason
from .conformance import CaseResult, ConformanceCase, ConformanceReport, check_backend, conformance_cases
from .managers import core_only_manager, manager_with_plugin

__all__ = [
    "backend_unavailable_reason",
    "CaseResult",
    "ConformanceCase",
    "ConformanceReport",
    "check_backend",
    "conformance_cases",
    "core_only_manager",
    "manager_with_plugin",
]
