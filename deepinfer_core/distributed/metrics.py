"""One ``get_metrics()`` dict of a distributed run from every rank's (:func:`merge_metrics`)."""

from __future__ import annotations

from typing import Any

_MAX_KEYS = ("peak_cache_usage", "num_steps")


def merge_metrics(per_rank: list[dict[str, Any]], cp_size: int = 1) -> dict[str, Any]:
    """One ``get_metrics()`` dict from every rank's: integer counters summed over the CP
    leaders (the followers repeat their leader's work), ``elapsed_s`` and ``num_steps`` the
    largest, tokens/s from the sums, ``cache_usage`` the mean, ``peak_cache_usage`` the
    largest, ``last_step`` and ``eplb`` rank 0's (EPLB's loads are the same on every EP rank);
    ``per_rank`` holds the ranks' own dicts."""
    leaders = per_rank[::cp_size]
    merged: dict[str, Any] = {}
    for key, value in leaders[0].items():
        if key in ("last_step", "speculative", "eplb"):
            continue
        values = [m[key] for m in leaders]
        if key in _MAX_KEYS or key == "elapsed_s":
            merged[key] = max(values)
        elif key == "cache_usage":
            merged[key] = sum(values) / len(values)
        elif isinstance(value, int) and not isinstance(value, bool):
            merged[key] = sum(values)
    elapsed = merged.get("elapsed_s", 0.0)
    merged["generation_tokens_per_s"] = merged["num_generated_tokens"] / elapsed if elapsed > 0 else 0.0
    merged["tokens_per_s"] = merged["num_scheduled_tokens"] / elapsed if elapsed > 0 else 0.0
    merged["last_step"] = per_rank[0].get("last_step")
    if "eplb" in per_rank[0]:
        merged["eplb"] = per_rank[0]["eplb"]
    if "speculative" in leaders[0]:
        merged["speculative"] = _merge_speculative([m["speculative"] for m in leaders])
    merged["per_rank"] = per_rank
    return merged


def _merge_speculative(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in parts[0] if k.startswith("num_")}
    drafts = out.get("num_drafts", 0)
    out["acceptance_rate"] = (
        out["num_accepted_tokens"] / out["num_draft_tokens"] if out["num_draft_tokens"] else 0.0
    )

    def weighted(key: str) -> float:
        return sum(p[key] * p["num_drafts"] for p in parts) / drafts if drafts else 0.0

    out["mean_acceptance_length"] = weighted("mean_acceptance_length")
    width = len(parts[0]["acceptance_per_position"])
    out["acceptance_per_position"] = [
        sum(p["acceptance_per_position"][i] * p["num_drafts"] for p in parts) / drafts if drafts else 0.0
        for i in range(width)
    ]
    out["verify_length_histogram"] = [
        sum(x) for x in zip(*(p["verify_length_histogram"] for p in parts), strict=False)
    ]
    return out
