"""DeepInfer sampler plugins: structured outputs and logits processors.

Structured outputs work through :mod:`deepinfer_samplers.llguidance_backend` (extra
``structured``) and :mod:`deepinfer_samplers.xgrammar_backend` (extra ``xgrammar``); the
``no_repeat_ngram`` logits processor is :mod:`deepinfer_samplers.no_repeat_ngram`.  The hooks
are in :mod:`deepinfer_samplers.plugin`.  (The DSpark block drafter is the core's ``dspark``.)
"""
