"""DeepInfer backend for Huawei Ascend 950 NPUs.

The hooks live in :mod:`deepinfer_ascend950.plugin`; the probe and ops in
:mod:`deepinfer_ascend950.backend`.  ``torch_npu`` is imported only inside the probe and only
when installed, so this package imports everywhere.
"""
