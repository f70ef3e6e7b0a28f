"""EMULATOR: the moe family's torch_npu entry points (see the package docstring).

The functions live in :mod:`.moe_gating` (``npu_moe_gating_top_k``), :mod:`.moe_mx`
(``npu_dynamic_mx_quant`` and the MX dtype constants) and :mod:`.moe_gmm` (``npu_quant_matmul``,
``npu_grouped_matmul``); this module gathers them into one ``FUNCTIONS`` table.
"""

from __future__ import annotations

from . import moe_gating, moe_gmm, moe_mx

FUNCTIONS: dict = {**moe_gating.FUNCTIONS, **moe_mx.FUNCTIONS, **moe_gmm.FUNCTIONS}
