"""EMULATOR: the attention family's torch_npu entry points (see the package docstring), one
module per operator group: :mod:`.attention_sfa` (sparse flash attention, lightning indexer),
:mod:`.attention_qsfa` (sparse flash attention over per-tile quantised keys),
:mod:`.attention_rowwise` (RMSNorm, rotary, row scatter) and :mod:`.attention_mhc` (mHC)."""

from __future__ import annotations

from . import attention_mhc, attention_qsfa, attention_rowwise, attention_sfa

FUNCTIONS: dict = {}
for _group in (attention_sfa, attention_qsfa, attention_rowwise, attention_mhc):
    _clash = FUNCTIONS.keys() & _group.FUNCTIONS.keys()
    assert not _clash, f"emulated twice: {sorted(_clash)}"
    FUNCTIONS.update(_group.FUNCTIONS)
