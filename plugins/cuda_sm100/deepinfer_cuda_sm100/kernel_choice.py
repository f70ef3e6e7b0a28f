"""Which kernel language serves an op at a shape: a table measured on the device, never a guess.

For ops that have kernels in more than one language (Triton, TileLang, DeepSeek's TileKernels),
the backend picks, per call, the one that was fastest at the nearest measured shape.  The tables
ship with the package, one per GPU architecture (``choices_sm90.json``: measured on an H200),
and are re-measured by one command per family of ops (``python
plugins/cuda_sm100/scripts/bench_attention.py --only attention --write-choices`` for
``sparse_attention``, ``python plugins/cuda_sm100/scripts/bench_tilekernels.py --write-choices``
for the TileKernels ops); each command replaces the points of the shapes it measured and keeps
the others (:func:`merge_points`).  Nothing is timed inside a request.

Rules of :func:`choose`: only points of the same op, kind, dtype and widths (``heads``,
``head_dim``) count; a call with fewer or more tokens than any measured point, or on an
architecture without a table, takes the default language (the op's own kernel, which serves
every shape: Triton unless the caller says otherwise); otherwise the point nearest in ``(log2
tokens, log2 keys)`` decides, among the languages available here that were timed at that
many tokens or fewer and at that many or more (a language is never extrapolated past the
token range it was measured over, e.g. a kernel whose larger tiles the table has not timed).
Another language displaces the default only when it was faster by more than
:data:`MARGIN`: a near tie is within the run-to-run spread of the measurements and of the
end-to-end step (measured: an FP4-expert point where TileLang led by 0.9 % in isolation ran
the e2e decode step 11 % slower), so it keeps the op's own kernel.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LANGUAGE = "triton"
MARGIN = 0.05
"""A language other than the default is chosen only when the default took more than
``1 + MARGIN`` times its time at the deciding point."""
TABLE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Point:
    """One measured shape: per-language milliseconds."""

    op: str
    kind: str
    dtype: str
    heads: int
    head_dim: int
    tokens: int
    keys: int
    ms: dict[str, float]


def table_path(arch: str) -> Path:
    """Where the table of GPU architecture ``arch`` (e.g. ``"sm90"``) lives."""
    return TABLE_DIR / f"choices_{arch}.json"


@functools.cache
def load_points(arch: str) -> tuple[Point, ...]:
    """The measured points of ``arch`` (none when no table ships for it)."""
    path = table_path(arch)
    if not path.exists():
        return ()
    data = json.loads(path.read_text())
    return tuple(Point(**p) for p in data["points"])


def device_arch(device) -> str:
    """The architecture name of a CUDA ``device`` (``"sm90"`` on an H100 / H200)."""
    import torch

    return _arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _arch(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def choose(
    op: str,
    kind: str,
    dtype: str,
    heads: int,
    head_dim: int,
    tokens: int,
    keys: int,
    arch: str,
    available: frozenset[str],
    points: tuple[Point, ...] | None = None,
    default: str = DEFAULT_LANGUAGE,
) -> str:
    """The language to run (see the module docstring); ``available`` lists those usable here;
    ``points`` replaces the shipped table of ``arch`` (tests); ``default`` is the op's own.
    Choices from the shipped table are memoised per key (a dispatcher calls this at every op
    call); :func:`forget` drops them."""
    if points is None:
        return _choose_shipped(op, kind, dtype, heads, head_dim, tokens, keys, arch, available, default)
    return _nearest(points, op, kind, dtype, heads, head_dim, tokens, keys, available, default)


@functools.cache
def _choose_shipped(op, kind, dtype, heads, head_dim, tokens, keys, arch, available, default) -> str:
    return _nearest(load_points(arch), op, kind, dtype, heads, head_dim, tokens, keys, available, default)


def _nearest(points, op, kind, dtype, heads, head_dim, tokens, keys, available, default) -> str:
    points = [
        p
        for p in points
        if (p.op, p.kind, p.dtype, p.heads, p.head_dim) == (op, kind, dtype, heads, head_dim)
    ]
    if not points:
        return default

    def distance(p: Point) -> float:
        return math.hypot(math.log2(p.tokens / tokens), math.log2(max(p.keys, 1) / max(keys, 1)))

    nearest = min(points, key=distance)
    # past every point's token count no language is measured around the call: the default
    timed = {
        lang: ms
        for lang, ms in nearest.ms.items()
        if lang in available and _measured_around(points, lang, tokens)
    }
    if not timed:
        return default
    best = min(timed, key=timed.get)
    if default in timed and timed[default] <= timed[best] * (1 + MARGIN):
        return default
    return best


def _measured_around(points, lang: str, tokens: int) -> bool:
    """Whether ``lang`` was timed at ``tokens`` or fewer and at ``tokens`` or more."""
    counts = [p.tokens for p in points if lang in p.ms]
    return bool(counts) and min(counts) <= tokens <= max(counts)


def merge_points(arch: str, points: list[dict], source: dict, path: Path | None = None) -> Path:
    """Write ``points`` (dicts of :class:`Point`'s fields) into the table of ``arch``: each
    replaces the table's point of the same op, kind, dtype, widths, token and key counts; the
    other points stay, so a run over some shapes (one expert count, a few token counts) keeps
    the shapes it did not measure.  ``source`` (``command``, ``software``, ``measured``...) is
    kept under ``sources`` for those ops (the latest run's); ``path`` replaces the shipped
    table's (tests).  Returns the path written."""
    fields = set(Point.__dataclass_fields__)
    for p in points:
        if set(p) != fields:
            raise ValueError(f"a point needs exactly the fields {sorted(fields)}, got {sorted(p)}")
    path = path or table_path(arch)
    table = json.loads(path.read_text()) if path.exists() else {}

    def shape(p: dict) -> tuple:
        return tuple(p[f] for f in sorted(fields - {"ms"}))

    measured = {shape(p) for p in points}
    kept = [p for p in table.get("points", []) if shape(p) not in measured]
    table.setdefault("sources", {}).update({op: source for op in sorted({p["op"] for p in points})})
    table["points"] = kept + points
    path.write_text(json.dumps(table, indent=1) + "\n")
    forget()
    return path


def forget() -> None:
    """Drop the loaded tables and the choices made from them (after a table changed)."""
    load_points.cache_clear()
    _choose_shipped.cache_clear()
