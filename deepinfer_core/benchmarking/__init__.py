"""What the benchmark scripts share (:mod:`~deepinfer_core.benchmarking.harness`) and the names
``deepinfer bench NAME`` runs them by (:mod:`~deepinfer_core.benchmarking.scripts`)."""
