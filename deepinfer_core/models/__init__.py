"""Model families. Each registers through the ``deepinfer_register_models`` hook; the engine
resolves one by ``config.json``'s ``model_type`` (:mod:`deepinfer_core.models.registry`)."""
