"""DeepInfer's ``cpu`` backend: fused float32 C++ kernels for the ops that are dispatch-bound
on CPU (``hc_pre``, ``hc_post``, ``hc_head``, ``rms_norm``, ``sparse_attention``, ``apply_rope``,
``compress_entries``, ``indexer_topk``); every other op runs the core's reference implementation."""
