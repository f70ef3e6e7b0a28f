"""``torchrun ... -m deepinfer_core.launch <deepinfer command and flags>``: a distributed run
launched by torchrun, on one host or many.

Every rank runs this module with the same arguments (those of the ``deepinfer`` command line,
e.g. ``generate --prompt hi``).  Rank 0 runs the command: its ``LLM`` sees torchrun's ``RANK`` /
``WORLD_SIZE`` and joins the launched world instead of starting workers; the other ranks serve
it (:func:`deepinfer_core.distributed.worker.serve_rank`) and exit 0 when rank 0 shuts the run
down.  Without ``data_parallel_size`` (flag, ``DEEPINFER_DATA_PARALLEL_SIZE`` or config file)
the run has ``WORLD_SIZE / context_parallel_size`` replicas; given, ``WORLD_SIZE`` must equal
``data_parallel_size * context_parallel_size``.  A refusal before the run (a bad flag or option,
sizes that do not fit ``WORLD_SIZE``) is one ``error:`` line, printed by each host's local
rank 0, and every rank exits with the same status: 0 under torchrun (a non-zero status would
add torchrun's own traceback), 2 otherwise.  See ``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig

_ENGINE_COMMANDS = ("generate", "bench")
UNDER_AGENT_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every rank's environment: the process runs under torchrun."""
_QUIET = io.StringIO()  # where the other local ranks' argparse messages go


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's part of ``deepinfer <argv>``; returns the exit status on a refusal before
    the run, else ends the process with it."""
    from deepinfer_core import cli
    from deepinfer_core.distributed.worker import exit_rank
    from deepinfer_core.errors import DeepInferError

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0") or 0)
    speaks = int(os.environ.get("LOCAL_RANK", rank) or 0) == 0  # one line per host, not per rank
    refused = 0 if UNDER_AGENT_ENV in os.environ else cli.EXIT_USAGE
    parser = cli.build_parser()
    try:
        with contextlib.ExitStack() as quiet:
            if not speaks:
                quiet.enter_context(contextlib.redirect_stdout(_QUIET))
                quiet.enter_context(contextlib.redirect_stderr(_QUIET))
            args = parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help, --version
            return 0
        return refused
    try:
        config = _engine_config(args) if args.command in _ENGINE_COMMANDS else None
        if config is not None and "WORLD_SIZE" in os.environ:
            dp = torchrun_data_parallel_size(config, os.environ["WORLD_SIZE"])
            if dp is not None:  # taken from torchrun: rank 0's command gets the same
                argv += ["--data-parallel-size", str(dp)]
                config = config.model_copy(update={"data_parallel_size": dp})
    except DeepInferError as e:
        if speaks:
            print(f"error: {e}", file=sys.stderr)
        return refused
    if rank == 0 or config is None:
        code = cli.main(argv) if rank == 0 else 0
    else:
        from deepinfer_core.distributed.worker import serve_rank

        code = serve_rank(config)
    exit_rank(code)


def torchrun_data_parallel_size(config: EngineConfig, world_size: str) -> int | None:
    """The ``data_parallel_size`` to run with in a world of ``world_size`` ranks (torchrun's
    ``WORLD_SIZE``): ``WORLD_SIZE / context_parallel_size`` when ``config`` was given none, else
    ``None`` (the configured one, checked to fit).

    Raises:
        ConfigError: ``world_size`` not a positive integer, not a multiple of
            ``context_parallel_size``, or not ``data_parallel_size * context_parallel_size``.
    """
    from deepinfer_core.errors import ConfigError

    try:
        world = int(world_size)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={world_size!r}: expected a positive integer")
    cp = config.context_parallel_size
    if "data_parallel_size" not in config.model_fields_set:
        if world % cp:
            raise ConfigError(
                f"WORLD_SIZE={world} (torchrun --nproc-per-node x --nnodes) is not a multiple of "
                f"context_parallel_size ({cp}); launch a multiple of {cp} processes"
            )
        return world // cp
    if world != config.world_size:
        raise ConfigError(
            f"WORLD_SIZE={world} (torchrun --nproc-per-node x --nnodes) but data_parallel_size "
            f"({config.data_parallel_size}) x context_parallel_size ({cp}) = {config.world_size}; "
            "make them equal, or leave data_parallel_size out to take it from WORLD_SIZE"
        )
    return None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the command would build (this rank's environment)."""
    from deepinfer_core.cli_engine_args import engine_kwargs
    from deepinfer_core.config import EngineConfig

    kwargs = engine_kwargs(args)
    config_file = kwargs.pop("config", None)
    return EngineConfig.load(config_file=config_file, **kwargs)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
