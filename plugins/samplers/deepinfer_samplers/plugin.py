"""DeepInfer hooks of the ``samplers`` plugin (hooks only; the code lives beside it).

The ``llguidance`` structured-output backend needs the plugin's ``[structured]`` extra, and
``xgrammar`` its ``[xgrammar]`` extra (without it the backend is registered as unavailable, its
probe saying what is missing and the command that installs it).  The plugin registers no
drafter: the DSpark block drafter is the core's ``dspark``.
"""

import importlib.util
from collections.abc import Callable
from typing import Any

from deepinfer_core.hookspecs import hookimpl

DEEPINFER_API = ">=1.0,<2"

# what the llguidance probe reports when it is missing (the pin is the [structured] extra's)
LLGUIDANCE_MISSING = (
    "llguidance is not installed: pip install llguidance==1.9.1, or from the root of a DeepInfer "
    "checkout: pip install -e 'plugins/samplers[structured]'"
)


@hookimpl
def deepinfer_register_logits_processors(register: Callable[..., None]) -> None:
    """Register the ``no_repeat_ngram`` logits processor."""

    def factory() -> Any:
        from deepinfer_samplers.no_repeat_ngram import NoRepeatNgram

        return NoRepeatNgram

    register(
        "no_repeat_ngram",
        factory,
        description="bans tokens that would repeat an n-gram of prompt + output (HF no_repeat_ngram_size)",
    )


@hookimpl
def deepinfer_register_structured_backends(register: Callable[..., None]) -> None:
    """Register the structured-output backends: ``llguidance`` (the default) and ``xgrammar``."""

    def factory() -> Any:
        from deepinfer_samplers.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend

    def is_available() -> tuple[bool, str | None]:
        if importlib.util.find_spec("llguidance") is None:
            return False, LLGUIDANCE_MISSING
        return True, None

    register(
        "llguidance",
        factory,
        description="choice / regex / JSON schema constrained decoding via llguidance",
        is_available=is_available,
    )

    def xgrammar_factory() -> Any:
        from deepinfer_samplers.xgrammar_backend import XGrammarBackend

        return XGrammarBackend

    register(
        "xgrammar",
        xgrammar_factory,
        description="choice / regex / JSON schema / GBNF / Lark constrained decoding via xgrammar",
        is_available=_xgrammar_available,
    )


# what `import xgrammar` needs besides torch (xgrammar installed with --no-deps lacks them)
_XGRAMMAR_MODULES = ("xgrammar", "tvm_ffi", "transformers", "pydantic", "numpy")


def _xgrammar_available() -> tuple[bool, str | None]:
    """Whether xgrammar and the modules it imports are installed (found, not imported: importing
    xgrammar takes seconds); the reason naming the missing ones and the extra to install."""
    missing = [m for m in _XGRAMMAR_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return False, (
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
            "pip install xgrammar==0.2.9, or from the root of a DeepInfer checkout: "
            "pip install -e 'plugins/samplers[xgrammar]'"
        )
    return True, None
