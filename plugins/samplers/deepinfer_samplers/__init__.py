"""DeepInfer sampler plugins: DSpark drafting/verification and structured outputs.

Structured outputs work through :mod:`deepinfer_samplers.llguidance_backend` (extra
``structured``).  The DSpark components are not implemented yet: :mod:`deepinfer_samplers.plugin`
registers placeholders whose availability probes say so (``deepinfer plugins`` shows them as
unavailable with that reason) and whose factories raise :class:`~deepinfer_core.errors.PluginError`
if called anyway.
"""
