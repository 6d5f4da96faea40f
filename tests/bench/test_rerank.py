"""The rerank harness on the tiny Qwen3 model, ours only: every call answered with a score per
document, the runs in the JSON and every call's record beside it; the vLLM side's arguments."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.rerank import RerankOptions, make_calls, run_rerank_bench, vllm_reranker_args
from benchmarks.traces import BenchError
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG


def _cfg(model_dirs: dict[str, Path], tmp_path: Path):  # type: ignore[no-untyped-def]
    return load_config(
        DEFAULT_CONFIG,
        [
            f"model.path={model_dirs['tiny-qwen3']}",
            "model.dtype=float32",
            "cache.block_tokens=16",
            "scheduler.profile_tokens=[64,256]",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
        ],
    )


def test_ours_answers_every_call_and_the_run_is_kept(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    opts = RerankOptions(
        None,
        systems=("tiered",),
        calls=3,
        documents=4,
        doc_tokens=(20, 40),
        query_tokens=8,
        instruction_tokens=32,
        multiples=(0.5,),
        load_of="tiered",
        repeats=1,
        json_path=str(tmp_path / "rerank.json"),
        out_dir=tmp_path / "out",
    )
    doc = run_rerank_bench(_cfg(model_dirs, tmp_path), opts)
    assert json.loads((tmp_path / "rerank.json").read_text())["bench"] == "rerank"
    (sat,) = doc["saturation_runs"]["tiered"]
    (load,) = doc["load_runs"]["tiered"]["0.5"]
    assert sat["num_errors"] == load["num_errors"] == 0 and sat["calls_per_s"] > 0
    # every document's prompt looked up; the shared instruction and query computed once a batch
    assert sat["prompt_tokens"] >= 3 * 4 * (32 + 8 + 20) and 0 < sat["shared_tokens"] < sat["prompt_tokens"]
    assert load["offered_calls_per_s"] == pytest.approx(0.5 * sat["calls_per_s"])
    assert doc["headline"] == [] and doc["max_score_difference"] is None  # no peer, no pair
    with gzip.open(tmp_path / "rerank.records.json.gz", "rt") as f:
        records = json.load(f)["tiered"]
    for run in records:
        assert len(run["records"]) == 3
        for call in run["records"]:
            assert call["error"] is None and len(call["scores"]) == 4 and all(0 < s < 1 for s in call["scores"])


def test_each_run_has_texts_of_its_own_and_the_calls_share_an_instruction(model_dirs: dict[str, Path]) -> None:
    opts = RerankOptions(None, calls=2, documents=3, doc_tokens=(30, 30), instruction_tokens=40)
    a, b = make_calls(model_dirs["tiny-qwen3"], opts, 1), make_calls(model_dirs["tiny-qwen3"], opts, 2)
    assert a == make_calls(model_dirs["tiny-qwen3"], opts, 1)  # seeded
    assert a[0].query.split(" Query: ")[0] == a[1].query.split(" Query: ")[0] != b[0].query.split(" Query: ")[0]
    assert not set(a[0].documents) & set(b[0].documents)


def test_vllm_reads_the_causal_lm_as_a_reranker_of_the_label_pair() -> None:
    args = vllm_reranker_args(("No", "Yes"))
    assert args[:2] == ["--runner", "pooling"]
    overrides = json.loads(args[args.index("--hf-overrides") + 1])
    assert overrides == {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["No", "Yes"],
        "is_original_qwen3_reranker": True,
    }


def test_a_bad_system_or_load_reference_is_named(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="systems must be among tiered, vllm"):
        run_rerank_bench(_cfg(model_dirs, tmp_path), RerankOptions(None, systems=("sglang",)))
    with pytest.raises(BenchError, match="--load-of vllm is not among the systems"):
        run_rerank_bench(_cfg(model_dirs, tmp_path), RerankOptions(None, systems=("tiered",)))
