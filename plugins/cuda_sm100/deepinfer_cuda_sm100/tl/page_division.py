"""A paged index's entry split into its page and slot without an integer division on the device.

The paged kernels (:mod:`~deepinfer_cuda_sm100.tl.sparse_attention`,
:mod:`~deepinfer_cuda_sm100.tl.sparse_attention_ws`, :mod:`~deepinfer_cuda_sm100.tl.indexer`,
:mod:`~deepinfer_cuda_sm100.tl.indexer_grouped`) map entry ``e`` of a sequence to pool row
``block_table[page_row, e // epp] * epp + e % epp`` for every key they gather, ``epp`` (entries a
page) a launch argument.  Written as ``//`` and ``%`` by a runtime value, that was a 64-bit
integer division subroutine on the GPU for each, twice a key.  Here the host turns ``epp`` into
a 32-bit multiplier and a shift (:func:`divider`) and the kernels divide by one widening
32 x 32 -> 64-bit multiply and a shift (:func:`page_and_slot`):

    page = (e * magic) >> shift,  shift = 30 + ceil(log2(epp)),  magic = 2**shift // epp + 1

exact for ``0 <= e < 2**30`` (the rounding error ``e (magic epp - 2**shift) / (epp 2**shift)``
stays below ``1 / epp``), with ``magic < 2**31``: an int32 launch argument.  A negative ``e``
(a key that is not in the paged source, whose row the kernels do not take) gives some page,
which the kernels clamp into the table as before.  Indexes of :data:`ENTRY_BITS` bits or more
are refused (:func:`entries_problem`).
"""

ENTRY_BITS = 30
"""Entries of a sequence the division is exact for: ``0 <= e < 2**ENTRY_BITS``."""


def entries_problem(max_count: int, kernel: str) -> str | None:
    """Why ``kernel`` cannot take a paged index of ``max_count`` entries (one line), or ``None``."""
    if max_count >= 1 << ENTRY_BITS:
        return f"{max_count} paged entries: {kernel} takes fewer than 2**{ENTRY_BITS}"
    return None


def divider(epp: int) -> tuple[int, int]:
    """``(magic, shift)`` of :func:`page_and_slot` for ``epp`` entries a page (``epp >= 1``)."""
    if epp < 1:
        raise ValueError(f"entries per page must be positive, got {epp}")
    if epp >= 1 << 31:
        raise ValueError(f"entries per page must fit in int32, got {epp}")
    shift = ENTRY_BITS + (epp - 1).bit_length()
    return (1 << shift) // epp + 1, shift  # < 2**31 for every epp < 2**31


def page_and_slot(e, epp, magic, shift):
    """TIR expressions ``(e // epp, e % epp)`` for an int32 entry ``e`` in ``[0, 2**30)``, from
    the launch arguments ``epp`` and its :func:`divider` (``magic``, ``shift``: int32)."""
    import tilelang.language as T

    wide = T.Cast("uint64", T.Cast("uint32", e)) * T.Cast("uint64", magic)
    page = T.Cast("int32", wide >> T.Cast("uint64", shift))
    return page, e - page * epp


def pool_row(block_table, page_row, e, pages):
    """TIR expression of entry ``e``'s pool row: ``block_table[page_row, e // epp] * epp + e %
    epp``, the page clamped into the table's row (``pages``: the launch's ``(epp, magic,
    shift)``, :func:`page_and_slot`)."""
    import tilelang.language as T

    epp = pages[0]
    page, slot = page_and_slot(e, *pages)
    return block_table[page_row, T.max(T.min(page, block_table.shape[1] - 1), 0)] * epp + slot
