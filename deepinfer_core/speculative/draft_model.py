"""The draft-model interface: layers of a drafter's own, run beside the target model.

A drafter whose proposals come from model layers (the checkpoint's MTP layer, DSpark's block,
a plugin's EAGLE-like head over the target's hidden states) names a :class:`DraftModel`
subclass in :attr:`~deepinfer_core.speculative.drafter.Drafter.draft_model`.  The engine builds
it with the model runner, right after the target model (:meth:`DraftModel.check_model` first:
every member of :attr:`DraftModel.required_members` must be set on the model, else one
:class:`~deepinfer_core.errors.ConfigError` naming the missing one), lets it capture its own
device-graph families (:meth:`DraftModel.capture_graphs`, through the runner's graph manager)
and hands it to the drafter as ``runner.draft_model`` in :meth:`Drafter.bind`.

What a draft model may use of the runner (``runner``): ``model``, ``cache``, ``cache_specs``,
``inputs`` (the step buffers: ``inputs.prepare(chunks, rows, ...)``), ``run_step(metadata,
forward, inputs, *args)`` (the plans derived and the forward run under the engine's modes),
``hidden`` (with :attr:`DraftModel.taps_hidden`: every row's hidden state of the latest target
step), ``graph_manager`` (``bucket``, ``replay``, ``capture_family``), ``device``, ``dtype``,
``config``, ``page_size``, ``max_model_len``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from deepinfer_core.errors import ConfigError


class DraftModel:
    """Base class of a drafter's layers (see the module docstring).

    Args:
        runner: the engine's :class:`~deepinfer_core.engine.model_runner.ModelRunner`, its
            target model built and its cache allocated.
    """

    required_members: ClassVar[tuple[str, ...]] = ()
    """Attributes the target model must have set (not ``None``): its draft layers (``mtp``,
    ``dspark``), their step methods, ``hidden_shape`` for the hidden-state taps..."""

    taps_hidden: ClassVar[bool] = False
    """The runner keeps every row's hidden state of each target step (``runner.hidden``,
    ``runner.last_hidden``; the model's ``forward(..., hidden_out=...)``, whose one row is
    ``model.hidden_shape``): for layers that read the target's hidden states."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    @classmethod
    def check_model(cls, model: Any, drafter: str) -> None:
        """One-line :class:`ConfigError` when ``model`` lacks one of :attr:`required_members`
        (``drafter``: the drafter's name, for the message)."""
        for member in cls.required_members:
            if getattr(model, member, None) is None:
                raise ConfigError(
                    f"speculative.drafter={drafter!r}: its draft layers ({cls.__name__}) need the model "
                    f"member {member!r}, which {type(model).__name__} does not have (a checkpoint "
                    "without these draft layers, or another architecture); use another drafter"
                )

    def capture_graphs(self, graphs: Any, buckets: list[int]) -> str | None:
        """Capture this model's graph families on the runner's graph manager ``graphs``
        (:meth:`~deepinfer_core.engine.graph_manager.GraphManager.capture_family`) for the
        batch ``buckets``; ``None``, or why not (every graph is then dropped and the runner runs
        eagerly).  Default: none."""
        return None
