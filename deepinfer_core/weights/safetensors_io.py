"""Find a checkpoint's safetensors shards and read tensors from them, safely.

Only the safetensors format is read (never pickle).  A model directory holds either

* ``model.safetensors.index.json`` whose ``weight_map`` names the shard of every tensor,
* a single ``model.safetensors``, or
* one or more ``*.safetensors`` files without an index (their headers are scanned).

Every shard path must stay inside the model directory: absolute paths, ``..`` and symlinks
that escape it are refused — except the Hugging Face cache's own layout, where a snapshot
``models--org--name/snapshots/<commit>/`` holds symlinks into ``models--org--name/blobs/``.
Errors are :class:`WeightLoadError` naming the file and tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deepinfer_core.errors import WeightLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # the safetensors format's own bound on a header's size


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor as its shard's header describes it: the safetensors ``dtype`` string
    (``"F8_E4M3"``, ``"I8"``, ``"BF16"``, ...) and the ``shape``."""

    dtype: str
    shape: tuple[int, ...]


def shard_header(path: Path) -> dict[str, Any]:
    """The JSON header of safetensors file ``path`` (``{tensor name: {"dtype", "shape",
    "data_offsets"}}``, ``__metadata__`` left out), read without touching the tensor data; a
    :class:`WeightLoadError` naming the file when it has no readable header."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_HEADER:
                raise ValueError(f"header size {size} is not in (0, {_MAX_HEADER}]")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as e:
        raise WeightLoadError(
            f"cannot read the safetensors header of {path}: {e}. The file is truncated or corrupt: "
            "re-download it."
        ) from None
    header.pop("__metadata__", None)
    return header


def read_headers(shard_of: Mapping[str, Path]) -> dict[str, TensorInfo]:
    """Dtype and shape of every tensor of ``shard_of`` (name -> shard, as :func:`discover_shards`
    gives it) from the shards' headers alone; a tensor its shard's header does not list is a
    :class:`WeightLoadError` naming both."""
    headers: dict[Path, dict[str, Any]] = {}
    out: dict[str, TensorInfo] = {}
    for name, path in shard_of.items():
        if path not in headers:
            headers[path] = shard_header(path)
        meta = headers[path].get(name)
        if meta is None:
            raise WeightLoadError(
                f"tensor {name!r} is listed in the shard index for {path} but that file does not contain "
                "it; the index and shards are out of sync: re-download the checkpoint."
            )
        out[name] = TensorInfo(str(meta.get("dtype")), tuple(int(d) for d in meta.get("shape", ())))
    return out


def _resolve_inside(model_dir: Path, entry: str, origin: str) -> Path:
    """Resolve shard ``entry`` relative to ``model_dir``; refuse anything that escapes it."""
    root = model_dir.resolve()
    if Path(entry).is_absolute():
        raise WeightLoadError(
            f"{origin} lists shard {entry!r}, an absolute path; shard paths must be relative to {root}. "
            "Fix the index so it names files inside the model directory."
        )
    path = (root / entry).resolve()
    if not path.is_relative_to(root) and not _hf_cache_blob(root, entry, path):
        raise WeightLoadError(
            f"{origin} lists shard {entry!r}, which resolves to {path}, outside the model directory "
            f"{root} (via '..' or a symlink); refusing to read it. Copy the shard into the model directory."
        )
    return path


def _hf_cache_blob(root: Path, entry: str, path: Path) -> bool:
    """``root`` is a Hugging Face cache snapshot (``models--*/snapshots/<commit>``), ``entry``
    names a file inside it (no ``..``) and ``path`` (its resolved target) is one of that repo's
    ``blobs``: how ``huggingface_hub.snapshot_download`` lays out every download."""
    repo = root.parent.parent
    if root.parent.name != "snapshots" or not repo.name.startswith("models--"):
        return False
    if ".." in Path(entry).parts:
        return False
    return path.parent == repo / "blobs"


def _read_index(model_dir: Path) -> dict[str, Path]:
    index_path = model_dir / INDEX_FILE
    try:
        data = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WeightLoadError(
            f"cannot read shard index {index_path}: {e}. Re-download or re-create it."
        ) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightLoadError(
            f"shard index {index_path} has no 'weight_map' object mapping tensor names to files."
        )
    resolved: dict[str, Path] = {}
    files: dict[str, Path] = {}
    for name, entry in weight_map.items():
        if not isinstance(entry, str):
            raise WeightLoadError(
                f"shard index {index_path}: entry for tensor {name!r} is not a file name: {entry!r}"
            )
        if entry not in files:
            path = _resolve_inside(model_dir, entry, f"shard index {index_path} (tensor {name!r})")
            if not path.is_file():
                raise WeightLoadError(
                    f"shard {entry!r} listed in {index_path} for tensor {name!r} does not exist at {path}. "
                    "The download is incomplete: fetch the missing shard."
                )
            files[entry] = path
        resolved[name] = files[entry]
    return resolved


def _scan_headers(model_dir: Path, shards: list[Path]) -> dict[str, Path]:
    resolved: dict[str, Path] = {}
    for shard in shards:
        path = _resolve_inside(model_dir, shard.name, f"model directory {model_dir}")
        with open_shard(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                if name in resolved:
                    raise WeightLoadError(
                        f"tensor {name!r} appears in both {resolved[name]} and {path}; without "
                        f"{INDEX_FILE} the shards must not overlap. Remove the duplicate file."
                    )
                resolved[name] = path
    return resolved


def discover_shards(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint at ``model_dir`` to the shard file holding it.

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else all
    ``*.safetensors`` files of the directory.  Raises :class:`WeightLoadError` when the
    directory has no safetensors, when a shard is missing, or when a shard path escapes the
    directory.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise WeightLoadError(f"model directory {root} does not exist or is not a directory.")
    if (root / INDEX_FILE).is_file():
        return _read_index(root)
    if (root / SINGLE_FILE).exists():
        return _scan_headers(root, [root / SINGLE_FILE])
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        found = ", ".join(sorted(p.name for p in root.iterdir())[:8]) or "nothing"
        raise WeightLoadError(
            f"no safetensors weights in {root} (found: {found}). DeepInfer reads only safetensors; "
            "convert .bin/.pt checkpoints with transformers' save_pretrained(safe_serialization=True)."
        )
    return _scan_headers(root, shards)


class open_shard:  # noqa: N801 - used like the ``safe_open`` context manager it wraps
    """Context manager around ``safetensors.safe_open`` turning its errors into WeightLoadError."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None

    def __enter__(self) -> Any:
        try:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
            return self._handle.__enter__()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise WeightLoadError(
                f"cannot read safetensors file {self.path}: {e}. The file is truncated or corrupt: "
                "re-download it."
            ) from None

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.__exit__(*exc)


class TensorSource:
    """Read tensors by name from a set of shards, keeping each shard open once.

    Use as a context manager; :meth:`get` reads one tensor (a fresh CPU tensor), checking
    that the shard the index names really holds it.
    """

    def __init__(self, shard_of: dict[str, Path]) -> None:
        self.shard_of = shard_of
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}
        self._keys: dict[Path, set[str]] = {}

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            self._open[path] = self._stack.enter_context(open_shard(path))
            self._keys[path] = set(self._open[path].keys())
        return self._open[path]

    def _checked(self, name: str) -> tuple[Any, Path]:
        path = self.shard_of[name]
        handle = self._handle(path)
        if name not in self._keys[path]:
            raise WeightLoadError(
                f"tensor {name!r} is listed in the shard index for {path} but that file does not contain "
                "it; the index and shards are out of sync: re-download the checkpoint."
            )
        return handle, path

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` from its shard."""
        handle, path = self._checked(name)
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise WeightLoadError(
                f"cannot read tensor {name!r} from {path}: {e}. The file is corrupt."
            ) from None

    def get_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows ``rows`` (indices along dim 0) of tensor ``name``, reading only those rows."""
        handle, path = self._checked(name)
        try:
            part = handle.get_slice(name)
            return torch.stack([part[r : r + 1][0] for r in rows]) if rows else part[0:0]
        except Exception as e:
            raise WeightLoadError(
                f"cannot read rows of tensor {name!r} from {path}: {e}. The file is corrupt."
            ) from None

    def dtype_of(self, name: str) -> str:
        """The safetensors dtype string (e.g. ``"F8_E4M3"``) of ``name`` without reading its data."""
        handle, _ = self._checked(name)
        return handle.get_slice(name).get_dtype()

    def names_by_shard(self) -> Iterator[tuple[Path, list[str]]]:
        """Tensor names grouped by shard, shards in sorted order (to read shard by shard)."""
        groups: dict[Path, list[str]] = {}
        for name, path in self.shard_of.items():
            groups.setdefault(path, []).append(name)
        for path in sorted(groups):
            yield path, groups[path]
