"""DeepInfer hooks of the ``samplers`` plugin (hooks only; the code lives beside it).

Every registration here is a placeholder: NOT IMPLEMENTED YET.  They are reported as
unavailable with that reason so that nobody mistakes them for working components.
"""

from deepinfer_core.hookspecs import hookimpl
from deepinfer_samplers import placeholders

DEEPINFER_API = ">=1.0,<2"


@hookimpl
def deepinfer_register_samplers(register):
    """Register the DSpark confidence-scheduled verification stage (placeholder, not implemented)."""
    factory, probe = placeholders.not_implemented("sampler 'dspark_verify'")
    register(
        "dspark_verify",
        factory,
        description="NOT IMPLEMENTED YET: DSpark confidence-scheduled speculative verification",
        is_available=probe,
    )


@hookimpl
def deepinfer_register_drafters(register):
    """Register the DSpark block drafter (placeholder, not implemented)."""
    factory, probe = placeholders.not_implemented("drafter 'dspark'")
    register(
        "dspark",
        factory,
        description="NOT IMPLEMENTED YET: DSpark 3-layer block drafter with confidence head (mtp.*)",
        is_available=probe,
    )


@hookimpl
def deepinfer_register_structured_backends(register):
    """Register the llguidance structured-output backend (placeholder, not implemented)."""
    factory, probe = placeholders.llguidance_placeholder()
    register(
        "llguidance",
        factory,
        description="NOT IMPLEMENTED YET: regex / JSON schema / EBNF constrained decoding via llguidance",
        is_available=probe,
    )
