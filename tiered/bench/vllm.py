"""The peer: `vllm serve` (vLLM's OpenAI server) in its own Python, sized like our engine.

The only module that runs vLLM (the benchmarks' baseline). Its Python is the one `make
bench-env` builds; vLLM pins its own torch, so it never shares our process."""

from __future__ import annotations

import math
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import httpx

from tiered.api.launch import free_port, wait_healthy


class VLLMServer:
    """`vllm serve` in its own Python (vLLM pins its own torch), on a free port."""

    def __init__(self, python: str, model_dir: Path, dtype: str, max_model_len: int, kv_tokens: int,
                 chunked: bool, chunk_tokens: int, extra_args: Sequence[str] = ()) -> None:  # fmt: skip
        self.block = self.block_tokens(max_model_len)
        need = math.ceil(max_model_len / self.block) + 1  # vLLM refuses a cache that cannot hold one request
        self.num_blocks = max(math.ceil(kv_tokens / self.block), need)
        self.enlarged = self.num_blocks * self.block > kv_tokens + self.block
        self.port = free_port()
        batched = ["--enable-chunked-prefill", "--max-num-batched-tokens", str(min(chunk_tokens, max_model_len))]
        if not chunked:
            batched = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
        self.args = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enable-prefix-caching",
            "--block-size", str(self.block), "--num-gpu-blocks-override", str(self.num_blocks), "--enforce-eager",
            "--enable-prompt-tokens-details", "--served-model-name", "model", "--no-enable-log-requests", *batched,
            *extra_args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def block_tokens(max_model_len: int) -> int:
        """The KV block size the server is started with."""
        return 128 if max_model_len >= 128 else 16

    def start(self, log_path: Path, timeout_s: float = 600) -> None:
        """Start and wait until healthy; its output goes to `log_path` (named after the system)."""
        if self.enlarged:
            print(f"{log_path.stem}: KV cache enlarged to {self.num_blocks * self.block} tokens "
                  "(vLLM needs room for one longest request)")  # fmt: skip
        cores = os.cpu_count() or 1  # vLLM binds its OpenMP threads to these cores, as ours use all of them
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
            "OMP_NUM_THREADS": str(cores),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
        }  # fmt: skip  (dev mode: POST /reset_prefix_cache between runs)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        try:
            wait_healthy(self.proc, self.url, timeout_s, "vllm serve", f"see {log_path}",
                         lambda n: f"see {log_path}")  # fmt: skip
        except RuntimeError:
            self.stop()  # its whole process group: vLLM's workers too
            raise

    def reset(self) -> None:
        """Empty vLLM's prefix cache, so every run starts cold (as ours do)."""
        r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM did not reset its prefix cache: {r.status_code} {r.text[:200]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
