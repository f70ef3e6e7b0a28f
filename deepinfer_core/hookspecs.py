"""Every hook a DeepInfer plugin can implement.

Plugins are Python modules exposed through the entry-point group ``deepinfer`` (see
:mod:`deepinfer_core.plugins`).  A plugin implements hooks by defining functions with the
names below, decorated with :data:`hookimpl`::

    from deepinfer_core.hookspecs import hookimpl

    @hookimpl
    def deepinfer_register_backends(register):
        register(BackendSpec(name="mine", device_type="cuda", priority=50, ops=load_ops))

Registration hooks receive a ``register`` callback rather than returning values, so the core
knows which plugin registered what and can report name clashes naming both plugins.  They
run once, at start-up; the per-token path only calls the plain objects they registered.

Hook implementations may accept a subset of the documented parameters (pluggy passes only
the arguments a function names).  Each parameter is annotated with its type; a type defined in
a higher layer of the core (the engine configuration, the engine, its step statistics, a
backend spec) cannot be imported here and is named in the parameter's ``:type:`` line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pluggy

PROJECT_NAME = "deepinfer"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterBackend(Protocol):
    """The ``register`` callback of :func:`deepinfer_register_backends`."""

    def __call__(self, spec: Any, /) -> None:
        """Register one :class:`deepinfer_core.backends.BackendSpec`."""


class Register(Protocol):
    """The ``register`` callback of every component registration hook (models, logits
    processors, drafters, structured-output backends, schedulers)."""

    def __call__(
        self,
        name: str,
        factory: Callable[[], Any],
        description: str = "",
        is_available: Callable[[], tuple[bool, str | None]] | None = None,
    ) -> None:
        """Register component ``name``: ``factory()`` returns it (imported lazily),
        ``is_available()`` says whether it can run here and, if not, why."""


# -------------------------------------------------------------------------------------------
# Registration hooks: called once when the plugins are loaded
# -------------------------------------------------------------------------------------------


@hookspec
def deepinfer_register_backends(register: RegisterBackend) -> None:
    """Register hardware backends.

    :param register: call ``register(spec)`` once per backend, with a
        :class:`deepinfer_core.backends.BackendSpec` (name, device type, priority, the op
        implementations or a zero-argument callable returning them, an availability probe
        returning ``(available, reason)``, graph capture support, description).  The plugin
        name is filled in by the core.

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_models(register: Register) -> None:
    """Register model architectures by ``model_type`` (the field of the model's ``config.json``).

    :param register: call ``register(model_type, factory, description="", is_available=None)``;
        ``factory`` is a zero-argument callable returning the architecture's
        :class:`~deepinfer_core.models.registry.ModelFamily` (it imports lazily, so registering
        costs nothing); ``is_available`` an optional zero-argument probe returning
        ``(available, reason)``.  The engine resolves a checkpoint's family by its
        ``config.json`` ``model_type`` among these (docs/writing-a-model-plugin.md).

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_logits_processors(register: Register) -> None:
    """Register logits processors, selected per request by name
    (``SamplingParams(logits_processors={"name": {...}})``).

    :param register: call ``register(name, factory, description="", is_available=None)``;
        ``factory`` is a zero-argument callable returning a
        :class:`~deepinfer_core.sampling.logits_processors.LogitsProcessor` subclass, which the
        engine instantiates once with ``(vocab_size, device)`` on first use
        (:mod:`deepinfer_core.engine.logits_processing`).

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_samplers(register: Register) -> None:
    """Deprecated name of :func:`deepinfer_register_logits_processors` (same parameter, same
    effect); a plugin implementing it gets one deprecation line in the log at load time.

    :param register: as for :func:`deepinfer_register_logits_processors`.

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_drafters(register: Register) -> None:
    """Register speculative-decoding drafters, selected by ``SpeculativeConfig.drafter``.

    :param register: call ``register(name, factory, description="", is_available=None)``;
        ``factory`` is a zero-argument callable returning a
        :class:`~deepinfer_core.speculative.Drafter` subclass, which the engine instantiates
        once with ``(speculative_config, vocab_size)`` and asks for drafts every step
        (:mod:`deepinfer_core.engine.speculative`).

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_verify_policies(register: Register) -> None:
    """Register speculative decoding's verify-length policies, selected by
    ``SpeculativeConfig.method``.

    :param register: call ``register(name, factory, description="", is_available=None)``;
        ``factory`` is a zero-argument callable returning a
        :class:`~deepinfer_core.speculative.verify_policy.VerifyPolicy` subclass, which the
        engine instantiates once with ``(speculative_config)`` and asks for each drafting step's
        verify lengths.

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_structured_backends(register: Register) -> None:
    """Register structured-output (grammar / JSON schema / regex) backends.

    :param register: call ``register(name, factory, description="", is_available=None)``;
        ``factory`` is a zero-argument callable returning the grammar backend class, built once
        per engine as ``cls(tokenizer, vocab_size, eos_token_ids)``; the engine calls its
        ``matcher(spec)`` per request (a :class:`~deepinfer_core.StructuredOutputsParams`; raise
        ``ValueError`` for an invalid spec) and, each step, ``fill_bitmasks([(matcher, row)],
        bitmask)`` to write the allowed tokens of those rows into a packed CPU int32
        ``[B, ceil(V/32)]`` bitmask; a matcher has ``num_consumed`` and ``consume(token_ids)``,
        and for speculative decoding ``num_valid(token_ids)`` (how many leading tokens the
        grammar accepts) and ``rollback(num_tokens)`` (a matcher without them decodes its
        request without drafts).  The class may also have a ``check_spec(spec)`` class or static
        method that compiles a spec without a tokenizer and raises ``ValueError`` with a
        one-line reason when it is invalid: the CLI calls it (through
        :func:`deepinfer_core.engine.structured.check_spec`) before the engine starts.

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


@hookspec
def deepinfer_register_schedulers(register: Register) -> None:
    """Register request schedulers, selected by ``EngineConfig.scheduler`` (``--scheduler``).

    :param register: call ``register(name, factory, description="", is_available=None)``;
        ``factory`` is a zero-argument callable returning the scheduler class: a subclass of
        :class:`~deepinfer_core.engine.scheduler.Scheduler` (same constructor arguments), which
        typically overrides its admission order or preemption choice.

    Not ``firstresult``: every plugin's implementation is called; the return value is ignored.
    """


# -------------------------------------------------------------------------------------------
# Lifecycle hooks: called by the engine
# -------------------------------------------------------------------------------------------


@hookspec(historic=True)
def deepinfer_configure(config: Any) -> None:
    """Called once with the validated engine configuration, before the engine is built.

    :param config: the engine options as the user gave them (treat them as read-only).
    :type config: deepinfer_core.config.EngineConfig

    Historic: a plugin registered after the call still receives it.  Not ``firstresult``.
    """


@hookspec
def deepinfer_engine_started(engine: Any) -> None:
    """Called once the engine has loaded the weights and resolved its backend.

    :param engine: the running engine; ``engine.config`` (the frozen
        :class:`~deepinfer_core.engine.resolved.ResolvedConfig`), ``engine.backend`` (the chosen
        :class:`BackendSpec`) and ``engine.ops`` (the resolved :class:`OpTable`) are stable.
    :type engine: deepinfer_core.engine.llm_engine.LLMEngine

    Not ``firstresult``: every plugin's implementation is called.
    """


@hookspec
def deepinfer_step_stats(stats: Any) -> None:
    """Called after each engine step with that step's statistics.

    :param stats: a :class:`deepinfer_core.engine.metrics.StepStats` (tokens scheduled, batch
        size, prompt / generated / prefix-hit / replayed tokens, preemptions, step time, cache
        usage).  Keep implementations cheap: this runs on the engine loop.  It may call
        ``engine.abort_request(...)``; the abort applies at the next step.
    :type stats: deepinfer_core.engine.metrics.StepStats

    Not ``firstresult``: every plugin's implementation is called.
    """
