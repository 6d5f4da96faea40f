"""A batched forward equals one forward per request: logits, KV handed to the sinks, memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.mil import ForwardSetup, probe_peak
from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import load_model
from tiered.hybrid.model import CausalLM

# fp32: batched and single runs differ only in summation order (matmul blocking over M, the
# log-sum-exp merge of prefix and own keys): max |Δ logit| / max |logit| within 1e-4.
TOLERANCE = 1e-4


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


class Collector:
    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer] = (k.clone(), v.clone())

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.kv[i] for i in range(len(self.kv))]


def _prefix(model: CausalLM, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sink = Collector()
    forward(model, ids, kv_sink=sink)
    return sink.layers()


def _mixed(model: CausalLM) -> list[BatchItem]:
    """Three requests on one shared prefix, one on another prefix, two with none; lengths 1..300."""
    shared = _prefix(model, _ids(400, 1))
    other = _prefix(model, _ids(77, 2))
    return [
        BatchItem(_ids(150, 10), shared),
        BatchItem(_ids(300, 11)),
        BatchItem(_ids(1, 12), shared),
        BatchItem(_ids(33, 13), other),
        BatchItem(_ids(90, 14), shared),
        BatchItem(_ids(5, 15)),
    ]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-llama3"])
@pytest.mark.parametrize(("mode", "chunk"), [("hybrid", 64), ("hybrid", 4096), ("vanilla", 1), ("chunked", 64)])
def test_batched_logits_equal_single_runs(model_dirs: dict[str, Path], name: str, mode: str, chunk: int) -> None:
    model = load_model(model_dirs[name], "float32")
    items = _mixed(model)
    batched = forward_batch(model, items, mode=mode, chunk_tokens=chunk)  # type: ignore[arg-type]
    assert batched.shape == (len(items), model.args.vocab_size)
    for i, it in enumerate(items):
        single = forward(model, it.token_ids, mode="vanilla", prefix_kv=it.prefix_kv)
        assert _rel_err(batched[i], single) <= TOLERANCE, (i, _rel_err(batched[i], single))


def test_a_batch_equals_computing_each_prompt_whole(model_dirs: dict[str, Path]) -> None:
    """The reference without any prefix machinery: each request's prefix tokens + new tokens."""
    model = load_model(model_dirs["tiny"], "float32")
    profile = _ids(500, 3)
    posts = [_ids(n, 20 + n) for n in (40, 41, 60, 7)]
    shared = _prefix(model, profile)
    batched = forward_batch(model, [BatchItem(p, shared) for p in posts], chunk_tokens=50)
    for i, p in enumerate(posts):
        whole = forward(model, torch.cat([profile, p]), mode="vanilla")
        assert _rel_err(batched[i], whole) <= TOLERANCE


def test_each_sink_gets_exactly_its_requests_kv(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["tiny"], "float32")
    items = _mixed(model)
    batch_sinks = [Collector() for _ in items]
    forward_batch(
        model,
        [BatchItem(it.token_ids, it.prefix_kv, s) for it, s in zip(items, batch_sinks, strict=True)],
        chunk_tokens=64,
    )
    for it, got in zip(items, batch_sinks, strict=True):
        ref = Collector()
        forward(model, it.token_ids, mode="vanilla", prefix_kv=it.prefix_kv, kv_sink=ref)
        assert len(got.kv) == model.args.num_layers
        for layer in range(model.args.num_layers):
            assert got.kv[layer][0].shape == (it.token_ids.numel(), model.args.num_kv_heads, model.args.head_dim)
            torch.testing.assert_close(got.kv[layer][0], ref.kv[layer][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.kv[layer][1], ref.kv[layer][1], rtol=1e-5, atol=1e-5)


def test_bfloat16_batch_stays_within_bf16_rounding(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["tiny"], "bfloat16")
    items = _mixed(model)
    batched = forward_batch(model, items, chunk_tokens=64)
    for i, it in enumerate(items):
        assert _rel_err(batched[i], forward(model, it.token_ids, mode="vanilla", prefix_kv=it.prefix_kv)) <= 1.5e-2


def test_a_batch_peaks_no_higher_than_one_request_of_the_same_total(tiny_dir: Path) -> None:
    """The scheduler admits a batch when its computed tokens plus its longest prefix fit in
    max_model_len; the start-up profile run proved one max_model_len request fits. Measured."""
    max_model_len = 16384
    setup = ForwardSetup(str(tiny_dir), "float32", "cpu", 1024)
    single = probe_peak(setup, "hybrid", max_model_len)
    batch = probe_peak(setup, "hybrid", 1024, num_requests=8, prefix_tokens=8192)
    assert batch <= single * 1.05, (batch, single)


def _followers(model: CausalLM) -> tuple[list[BatchItem], list[torch.Tensor]]:
    """Items with followers, and each item's whole tokens after its prefix (the reference input)."""
    shared = _prefix(model, _ids(256, 30))
    tail, profile = _ids(37, 31), _ids(500, 32)  # uncached shared parts
    posts = [_ids(n, 40 + n) for n in (20, 1, 65, 3)]
    whole = [
        torch.cat([tail, posts[0]]),
        torch.cat([tail, posts[1]]),
        torch.cat([tail, posts[2]]),
        torch.cat([profile, posts[3]]),
        torch.cat([profile, posts[3][:1]]),
    ]
    items = [
        BatchItem(whole[0], shared),  # the lead of items 1 and 2
        BatchItem(posts[1], shared, lead=0, num_shared=37),
        BatchItem(torch.cat([tail[30:], posts[2]]), shared, lead=0, num_shared=30),  # shares part of the tail
        BatchItem(whole[3]),  # a new user's first prompt computes the profile...
        BatchItem(posts[3][:1], lead=3, num_shared=500),  # ... for this one too (which computes 1 token)
    ]
    return items, whole


@pytest.mark.parametrize(("mode", "chunk"), [("hybrid", 64), ("hybrid", 4096), ("vanilla", 1), ("chunked", 64)])
def test_followers_equal_computing_their_whole_prompt(model_dirs: dict[str, Path], mode: str, chunk: int) -> None:
    model = load_model(model_dirs["tiny"], "float32")
    items, whole = _followers(model)
    sinks = [Collector() for _ in items]
    for it, sink in zip(items, sinks, strict=True):
        it.kv_sink = sink
    batched = forward_batch(model, items, mode=mode, chunk_tokens=chunk)  # type: ignore[arg-type]
    for i, (it, ids) in enumerate(zip(items, whole, strict=True)):
        ref_sink = Collector()
        single = forward(model, ids, mode="vanilla", prefix_kv=it.prefix_kv, kv_sink=ref_sink)
        assert _rel_err(batched[i], single) <= TOLERANCE, (i, _rel_err(batched[i], single))
        for layer in range(model.args.num_layers):  # a follower's sink gets the shared tokens too
            torch.testing.assert_close(sinks[i].kv[layer][0], ref_sink.kv[layer][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sinks[i].kv[layer][1], ref_sink.kv[layer][1], rtol=1e-5, atol=1e-5)


def test_a_bad_lead_is_refused(model_dirs: dict[str, Path]) -> None:
    from tiered.hybrid.forward import ForwardInputError

    model = load_model(model_dirs["tiny"], "float32")
    a, b = _ids(10, 1), _ids(5, 2)
    for bad in (
        [BatchItem(a), BatchItem(b, lead=1, num_shared=3)],
        [BatchItem(a), BatchItem(b, lead=0, num_shared=11)],
        [BatchItem(a), BatchItem(b, _prefix(model, a), lead=0, num_shared=2)],
    ):
        with pytest.raises(ForwardInputError, match="item 1"):
            forward_batch(model, bad)


def test_hybrid_runs_the_last_layer_past_its_kv_for_each_requests_last_token_only(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only last tokens leave the model: the last layer's MLP sees one row per request, every
    other layer all packed rows, and the logits still equal vanilla's (which runs every row)."""
    import tiered.hybrid.forward as fwd

    model = load_model(model_dirs["tiny"], "float32")
    items, whole = _followers(model)
    last = model.layers[-1]
    mlp_rows: list[tuple[bool, int]] = []
    real_mlp_step = fwd.mlp_step_

    def counting(layer, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        mlp_rows.append((layer is last, x.shape[0]))
        real_mlp_step(layer, x, *args, **kwargs)

    monkeypatch.setattr(fwd, "mlp_step_", counting)
    batched = forward_batch(model, items, chunk_tokens=64)
    num_packed = sum(it.token_ids.numel() for it in items)
    assert sum(n for is_last, n in mlp_rows if is_last) == len(items)
    assert sum(n for is_last, n in mlp_rows if not is_last) == num_packed * (model.args.num_layers - 1)
    monkeypatch.undo()
    for i, (it, ids) in enumerate(zip(items, whole, strict=True)):
        single = forward(model, ids, mode="vanilla", prefix_kv=it.prefix_kv)
        assert _rel_err(batched[i], single) <= TOLERANCE, (i, _rel_err(batched[i], single))
