"""Model sources on the Hugging Face Hub: ``model="org/name"`` (vLLM's convention).

A ``model`` (or ``tokenizer``) that is not an existing local path and looks like a Hub repo id
(``org/name``, optionally ``org/name@revision``) is resolved through
``huggingface_hub.snapshot_download`` into the Hugging Face cache, and the engine loads the
snapshot directory like any local one.  This is the only place DeepInfer touches the network,
and only for a Hub id the user gave: ``model=None`` is the built-in tiny model, made locally.

* Files: ``*.json``, ``*.safetensors``, ``*.jinja`` and ``tokenizer*`` (for a tokenizer: no
  safetensors); never pickled weights (``*.bin``, ``*.pt``, ...) nor code (``*.py``).
* Revision: ``revision`` (engine option) or ``org/name@revision``; default the repo's ``main``.
* Cache: ``download_dir`` (engine option), else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub`` — read when the model is resolved, not at import.
* ``HF_HUB_OFFLINE=1``: the cache only (``local_files_only``); an uncached repo or revision is a
  :class:`~deepinfer_core.errors.ConfigError`.
* ``huggingface_hub`` is optional (``pip install huggingface_hub``, or the ``hub`` extra): without
  it a Hub id is a one-line ``ConfigError`` saying so.

Every failure is one line naming the repo, the revision, what failed and how to point
``--model`` at a local copy instead.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from deepinfer_core.errors import ConfigError

logger = logging.getLogger("deepinfer.hub")

__all__ = [
    "DEFAULT_CHECKPOINT",
    "MODEL_PATTERNS",
    "TOKENIZER_PATTERNS",
    "UNSAFE_PATTERNS",
    "hub_cache_dir",
    "hub_offline",
    "parse_repo_id",
    "snapshot_dir",
]

DEFAULT_CHECKPOINT = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
"""The production checkpoint, to pass explicitly (``--model deepseek-ai/DeepSeek-V4.1-Flash-1017``);
the engine's own default stays the built-in tiny model, so nothing is downloaded unasked."""

MODEL_PATTERNS: tuple[str, ...] = ("*.json", "*.safetensors", "*.jinja", "tokenizer*")
"""What a model snapshot fetches: configs, the index, safetensors weights, tokenizer files and
chat templates."""
TOKENIZER_PATTERNS: tuple[str, ...] = ("*.json", "*.jinja", "tokenizer*")
"""What a tokenizer-only snapshot fetches."""
UNSAFE_PATTERNS: tuple[str, ...] = (
    "*.bin",
    "*.pt",
    "*.pth",
    "*.pkl",
    "*.pickle",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.py",
)
"""Never fetched, whatever the allow patterns match: pickles and other non-safetensors weights,
and code."""

# huggingface_hub's repo-name rule (letters, digits, ``-_.``; no ``--`` or ``..``; at most 96
# characters), with the namespace required: a bare ``name`` is far likelier a mistyped path.
_NAME = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_NAME}/{_NAME}")
_REVISION = re.compile(r"[\w.\-/]+")
_TRUE = {"1", "on", "yes", "true"}


def parse_repo_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` looks like a Hub repo id (``org/name`` or
    ``org/name@revision``), else ``None``.  Says nothing about whether a local path exists."""
    repo_id, at, revision = spec.partition("@")
    if len(repo_id) > 96 or "--" in repo_id or ".." in repo_id or not _REPO_ID.fullmatch(repo_id):
        return None
    if at and not _REVISION.fullmatch(revision):
        return None
    return repo_id, (revision if at else None)


def hub_offline(env: Mapping[str, str] | None = None) -> bool:
    """``HF_HUB_OFFLINE`` (or, as huggingface_hub reads it, ``TRANSFORMERS_OFFLINE``) is set
    true (``1``/``on``/``yes``/``true``), read now: use the cache only."""
    env = os.environ if env is None else env
    raw = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE")
    if raw is not None:
        return raw.strip().lower() in _TRUE
    try:  # set before huggingface_hub was imported and since removed from the environment
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return False


def hub_cache_dir(download_dir: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The cache a Hub snapshot is looked up in and downloaded to: ``download_dir``, else
    ``$HF_HUB_CACHE`` (or the older ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (``$XDG_CACHE_HOME/huggingface/hub`` when that is set)."""
    env = os.environ if env is None else env
    for value in (download_dir, env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE")):
        if value:
            return Path(value).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def snapshot_dir(
    spec: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    what: str = "model",
    patterns: Sequence[str] = MODEL_PATTERNS,
) -> Path:
    """The local snapshot directory of the Hub repo ``spec`` (``org/name[@revision]``), fetched
    with ``huggingface_hub.snapshot_download`` unless ``HF_HUB_OFFLINE`` is set (then from the
    cache alone).

    Args:
        spec: the repo id as the user gave it (``what=spec`` is how errors name it).
        revision: branch, tag or commit; must agree with an ``@revision`` in ``spec``.
        download_dir: the cache directory (see :func:`hub_cache_dir`).
        what: the option's name, for messages (``model`` / ``tokenizer``).
        patterns: the files to fetch (:data:`UNSAFE_PATTERNS` are always left out).

    Raises:
        ConfigError: ``spec`` is not a repo id, the two revisions disagree, ``huggingface_hub``
            is not installed, or the snapshot cannot be had — one line naming the fix.
    """
    parsed = parse_repo_id(spec)
    if parsed is None:
        raise ConfigError(f"{what}={spec!r} is neither a local directory nor a Hub repo id (org/name)")
    repo_id, id_revision = parsed
    if id_revision and revision and id_revision != revision:
        raise ConfigError(
            f"{what}={spec!r} names revision {id_revision!r} but revision={revision!r}; give one of them"
        )
    revision = id_revision or revision
    offline = hub_offline()
    local_copy = _local_copy(repo_id, what)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"{what}={spec!r} is not a local directory, and loading it from the Hugging Face Hub needs "
            f"huggingface_hub: pip install huggingface_hub, or {local_copy}"
        ) from None
    cache = hub_cache_dir(download_dir)
    rev = revision or "main"
    logger.info(
        "%s %s (revision %s): %s in %s", what, repo_id, rev, "cache only" if offline else "Hub", cache
    )
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            local_files_only=offline,
            allow_patterns=list(patterns),
            ignore_patterns=list(UNSAFE_PATTERNS),
        )
    except Exception as e:  # huggingface_hub's errors, connection errors, OSError on the cache
        other = (
            "unset HF_HUB_OFFLINE to download it"
            if offline
            else "populate the Hugging Face cache and set HF_HUB_OFFLINE=1"
        )
        raise ConfigError(
            f"{what}={spec!r}: {_reason(e, repo_id, rev, cache, offline)}; {local_copy}, or {other}"
        ) from None
    logger.info("%s %s (revision %s) is at %s", what, repo_id, rev, path)
    return Path(path)


def _local_copy(repo_id: str, what: str) -> str:
    flag = "--model" if what == "model" else f"--{what}"
    return (
        f"point {what} at a local copy ({flag} /path/to/dir; make one on a connected machine with "
        f"hf download {repo_id} --local-dir DIR, or huggingface-cli download with older huggingface_hub)"
    )


def _reason(e: Exception, repo_id: str, rev: str, cache: Path, offline: bool) -> str:
    """What went wrong, in one clause (huggingface_hub's own messages span several lines)."""
    from huggingface_hub import errors

    cause = e.__cause__ if isinstance(e, errors.LocalEntryNotFoundError) and e.__cause__ else e
    name = type(cause).__name__
    detail = " ".join(str(cause).split())
    if len(detail) > 300:
        detail = detail[:297] + "..."
    where = f"Hugging Face Hub repo {repo_id} (revision {rev})"
    if isinstance(e, errors.RevisionNotFoundError):
        return f"the Hub has no revision {rev!r} of repo {repo_id}"
    if isinstance(e, errors.GatedRepoError):
        return f"{where} is gated: accept its terms on the Hub and log in (hf auth login or HF_TOKEN)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"{where} was not found on the Hub (a private repo needs hf auth login or HF_TOKEN)"
    incomplete = getattr(errors, "IncompleteSnapshotError", None)
    if incomplete is not None and isinstance(e, incomplete):
        return f"the cached snapshot of {where} in {cache} is incomplete ({detail})"
    if isinstance(e, errors.LocalEntryNotFoundError):
        if offline:
            return (
                f"{where} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set, "
                "so it cannot be downloaded"
            )
        return f"could not download {where} ({name}: {detail}) and it is not in the cache {cache}"
    return f"could not get {where} ({name}: {detail})"
