"""``torchrun ... -m deepinfer_core.launch <deepinfer command and flags>``: a distributed run
launched by torchrun, on one host or many.

Every rank runs this module with the same arguments (those of the ``deepinfer`` command line,
e.g. ``generate --prompt hi --data-parallel-size 2``).  Rank 0 runs the command: its ``LLM``
sees torchrun's ``RANK`` / ``WORLD_SIZE`` and joins the launched world instead of starting
workers; the other ranks serve it (:func:`deepinfer_core.distributed.worker.serve_rank`) and
exit 0 when rank 0 shuts the run down.  ``WORLD_SIZE`` must equal
``data_parallel_size * context_parallel_size`` (else one ``error:`` line, status 2, on every
rank).  See ``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig

_ENGINE_COMMANDS = ("generate", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's part of ``deepinfer <argv>``; returns the exit status on an error before
    the run, else ends the process with it."""
    from deepinfer_core import cli
    from deepinfer_core.distributed.worker import exit_rank
    from deepinfer_core.errors import DeepInferError

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0") or 0)
    parser = cli.build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else cli.EXIT_USAGE
    try:
        config = _engine_config(args) if args.command in _ENGINE_COMMANDS else None
        if config is not None and "WORLD_SIZE" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            if world != config.world_size:
                from deepinfer_core.errors import ConfigError

                raise ConfigError(
                    f"WORLD_SIZE={world} (torchrun --nproc-per-node x --nnodes) but data_parallel_size "
                    f"({config.data_parallel_size}) x context_parallel_size "
                    f"({config.context_parallel_size}) = {config.world_size}; make them equal"
                )
    except DeepInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    except ValueError as e:
        print(f"error: environment variable WORLD_SIZE: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    if rank == 0 or config is None:
        code = cli.main(argv) if rank == 0 else 0
    else:
        from deepinfer_core.distributed.worker import serve_rank

        code = serve_rank(config)
    exit_rank(code)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the command would build (this rank's environment)."""
    from deepinfer_core import cli
    from deepinfer_core.config import EngineConfig

    kwargs = cli._engine_kwargs(args)
    config_file = kwargs.pop("config", None)
    return EngineConfig.load(config_file=config_file, **kwargs)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
