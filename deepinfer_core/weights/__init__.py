"""Format-generic checkpoint files: safetensors shards read safely (:mod:`.safetensors_io`) and
written (:mod:`.writer`), the FP8 / FP4 quantised formats (:mod:`.quant`), host tensors read in
place by a device (:mod:`.host_mapped`).

A model family's own tensor names, loader and writer live in its package (DeepSeek-V4:
:mod:`deepinfer_core.models.deepseek_v4.loader`, ``.writer``, ``.names``).  This package sits
below the ops (which take :class:`QuantizedTensor` weights) and imports nothing above it.
"""

from .quant import QuantizedTensor

__all__ = ["QuantizedTensor"]
