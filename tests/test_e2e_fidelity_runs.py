"""``benchmarks/e2e_fidelity.py`` split over several runs: the oracle's outputs are reused only
for the same parameters, and the rows of an earlier output are kept beside the new ones unless
measured again (the script itself needs a GPU; these are its bookkeeping functions)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_fidelity as ef  # noqa: E402

PARAMS = {"layers": 4, "experts": 64, "prompts": 4, "prompt_len": 512, "new_tokens": 16, "top": 5, "seed": 0}


def test_the_key_is_the_parameters_fixing_the_oracle():
    args = Namespace(**PARAMS, backend="cuda_sm100", candidates=["floor"], output=Path("x.json"))
    assert ef.key(args) == PARAMS


def test_the_oracle_cache_answers_only_for_its_parameters(tmp_path):
    path = tmp_path / "oracle.json"
    assert ef.cached_oracle(path, PARAMS) is None  # absent
    path.write_text("{not json")
    assert ef.cached_oracle(path, PARAMS) is None  # unreadable
    outputs = [{"tokens": [1, 2], "positions": [{"1": -0.5}]}]
    path.write_text(json.dumps({"params": PARAMS, "outputs": outputs}))
    assert ef.cached_oracle(path, PARAMS) == outputs
    assert ef.cached_oracle(path, {**PARAMS, "seed": 1}) is None


def test_earlier_rows_are_kept_unless_measured_again_or_of_other_parameters(tmp_path):
    path = tmp_path / "out.json"
    rows = [
        {"backend": "reference", "fp8_prefill": "-", "top1_agreement": 0.94},
        {"backend": "cuda_sm100", "fp8_prefill": "w8a16", "top1_agreement": 0.93},
    ]
    path.write_text(json.dumps({"params": {**PARAMS, "backend": "cuda_sm100"}, "rows": rows}))
    assert ef.kept_rows(path, PARAMS, {("cuda_sm100", "w8a16")}) == rows[:1]
    assert ef.kept_rows(path, PARAMS, set()) == rows
    assert ef.kept_rows(path, {**PARAMS, "prompts": 8}, set()) == []
    assert ef.kept_rows(tmp_path / "absent.json", PARAMS, set()) == []
