"""Model families. Each registers through the ``deepinfer_register_models`` hook."""
