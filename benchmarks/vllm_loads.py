"""Does vLLM load a project-made model folder and agree with our forward?

Run with a Python that has vLLM installed (the `bench` extra), e.g.:
    VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/vllm_loads.py .models/bench [dtype]
Prints, per prompt, vLLM's and our logprob of vLLM's top token, and the largest difference.
"""

from __future__ import annotations

import sys

import torch


def main(folder: str, dtype: str = "float32") -> None:
    from vllm import LLM, SamplingParams

    from tiered.hybrid.forward import forward
    from tiered.hybrid.loader import load_model

    prompts = [[0] + list(range(5, 5 + n)) for n in (7, 100, 700)]
    llm = LLM(model=folder, dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=2048)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ours = load_model(folder, dtype)
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        top = out.outputs[0].logprobs[0]
        mine = torch.log_softmax(forward(ours, torch.tensor(prompt)), dim=-1)
        for token_id, lp in top.items():
            worst = max(worst, abs(lp.logprob - float(mine[token_id])))
        first = next(iter(top))
        print(f"{len(prompt)} tokens: vLLM top {first} logprob {top[first].logprob:.5f}, ours {float(mine[first]):.5f}")
    print(f"max |logprob difference| over the top-5 tokens: {worst:.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
