"""Does vLLM load a project-made model folder and agree with our forward?

Run with a Python that has vLLM installed (the `bench` extra), e.g.:
    VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2 PYTHONPATH=. \
        python -m benchmarks.vllm_loads .models/bench [dtype] [adapter]
Prints, per prompt, vLLM's and our logprob of vLLM's top token, and the largest difference. With
an adapter folder (PEFT format, e.g. from `tiered make-adapter`), both run with that LoRA adapter.
"""

from __future__ import annotations

import sys

import torch


def main(folder: str, dtype: str = "float32", adapter: str | None = None) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from tiered.hybrid.forward import forward
    from tiered.hybrid.loader import DTYPES, load_model
    from tiered.hybrid.lora import load_adapter, read_adapter

    prompts = [[0] + list(range(5, 5 + n)) for n in (7, 100, 700)]
    lora = {"enable_lora": True, "max_lora_rank": 64} if adapter else {}
    llm = LLM(model=folder, dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=2048, **lora)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    request = LoRARequest("adapter", 1, adapter) if adapter else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request)
    ours = load_model(folder, dtype)
    weights = None
    if adapter:
        spec = read_adapter("adapter", adapter, ours.args, 64)
        weights = load_adapter(spec, ours.args.num_layers, DTYPES[dtype], "cpu")
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        top = out.outputs[0].logprobs[0]
        mine = torch.log_softmax(forward(ours, torch.tensor(prompt), adapter=weights), dim=-1)
        for token_id, lp in top.items():
            worst = max(worst, abs(lp.logprob - float(mine[token_id])))
        first = next(iter(top))
        print(f"{len(prompt)} tokens: vLLM top {first} logprob {top[first].logprob:.5f}, ours {float(mine[first]):.5f}")
    print(f"max |logprob difference| over the top-5 tokens: {worst:.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
