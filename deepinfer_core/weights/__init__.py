"""Checkpoint weights: safetensors shards, native/HF names, FP8/FP4 formats, load and save.

``load_checkpoint(model_dir, cfg, dtype)`` returns ``{HF name: tensor}`` validated against
:func:`deepinfer_core.models.deepseek_v4.params.parameter_specs` (with ``keep_quantized``, FP8
dense weights and FP4 experts as :class:`QuantizedTensor`); ``save_checkpoint`` writes the
inverse (HF or native names, optionally FP8/FP4, optionally sharded).  ``load_mtp_checkpoint``
reads the first multi-token-prediction layer (native ``mtp.0.*``) for the ``mtp`` drafter.
``check_checkpoint`` / ``check_mtp_checkpoint`` run their checks (names, missing tensors,
shapes from the shards' headers) without reading tensor data.
"""

from .loader import check_checkpoint, check_mtp_checkpoint, load_checkpoint, load_mtp_checkpoint
from .quant import QuantizedTensor
from .writer import save_checkpoint

__all__ = [
    "QuantizedTensor",
    "check_checkpoint",
    "check_mtp_checkpoint",
    "load_checkpoint",
    "load_mtp_checkpoint",
    "save_checkpoint",
]
