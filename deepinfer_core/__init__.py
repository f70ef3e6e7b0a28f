"""DeepInfer: a hardware-neutral DeepSeek-V4 inference engine with swappable backend plugins.

Public API::

    from deepinfer_core import LLM, SamplingParams

    llm = LLM()  # the built-in tiny model; LLM(model="path/to/checkpoint") for a real one
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)

Names are imported lazily so that ``import deepinfer_core`` (e.g. by a plugin) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "deepinfer_core.llm",
    "SamplingParams": "deepinfer_core.sampling.params",
    "StructuredOutputsParams": "deepinfer_core.sampling.params",
    "EngineConfig": "deepinfer_core.config",
    "RequestOutput": "deepinfer_core.outputs",
    "CompletionOutput": "deepinfer_core.outputs",
    "hookimpl": "deepinfer_core.hookspecs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "hookimpl",
]

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.llm import LLM
    from deepinfer_core.outputs import CompletionOutput, RequestOutput
    from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
