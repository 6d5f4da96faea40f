"""`tiered serve`'s command line: vLLM's serving flags, mapped onto the config tree.

A flag wins over the YAML (`--config`) and over `--set`, as in vLLM. Importing this module does
not import torch, so `tiered --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tiered.config import Config, ConfigError
from tiered.config.options import add_pipeline_args, engine_overrides

API_KEY_VARIABLES = ("TIERED_API_KEY", "VLLM_API_KEY")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's --dtype names -> ours ("auto": per machine, see tiered/hybrid/precision.py).
DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def parse_lora_module(text: str) -> tuple[str, str]:
    """vLLM's --lora-modules item: NAME=PATH, or JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
            return str(item["name"]), str(item["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"'{text}' is not a JSON object with 'name' and 'path'") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"'{text}' must look like NAME=PATH")
    return name, path


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be > 0")
    return value


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """vLLM's flags that `tiered serve` honours (each maps onto a config key, named in its help)."""
    g = serve.add_argument_group("serving (vLLM's flags; each sets the config key named in its help)")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0: every interface)"
    )
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/... and /generative_scoring (and /metrics with "
        "server.metrics_require_key); /health, /version, /tokenize, /detokenize stay open; default: "
        f"${API_KEY_VARIABLES[0]}, else ${API_KEY_VARIABLES[1]} (the environment keeps the key out of "
        "`ps`)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the base model's ids: the first is reported in responses, /v1/models and metrics, all are "
        "accepted (default: the model argument as given, e.g. /path/to/model or embedded:tiny; the "
        "folder's name is accepted too)",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="write every token in logprobs as 'token_id:<id>' (a request's return_tokens_as_token_ids wins)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt, tokens (model.max_model_len)")
    g.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPE_NAMES),
        help="compute precision (model.dtype; default: the config's, itself auto). auto: the "
        "checkpoint's dtype where the device computes it natively (CUDA; avx512_bf16 / amx_bf16 "
        "CPUs for bf16), else float32; the choice is logged and shown in /v1/models",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=list(DTYPE_NAMES),
        help="precision of the KV kept in both tiers (cache.kv_dtype; auto: the compute dtype; "
        "bfloat16 under fp32 compute holds twice the tokens)",
    )
    g.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block = LMCache chunk (cache.block_tokens)"
    )
    g.add_argument(
        "--kv-offloading-size",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="host tier size in GiB (cache.host.lmcache.max_local_cpu_size)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cache prefix KV (on by default); --no-enable-prefix-caching keeps nothing on the device "
        "(cache.retention=none) and has no host tier (cache.suffix=discard, cache.host.enabled=false)",
    )
    add_pipeline_args(g)
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, as a file or inline (default: the tokenizer's, else a documented role-tagged one)",
    )
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS, help="uvicorn's log level")
    lora = serve.add_argument_group(
        "LoRA adapters (vLLM's flags; lora.* in the config)",
        "A request picks an adapter by its `model` field; the base weights stay unmerged and a batch may mix "
        "adapters. Cached KV is shared only between requests of the same adapter. GET /v1/models lists the base "
        "model and the adapters; an unknown model is a 404.",
    )
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (lora.enabled)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        metavar="NAME=PATH",
        help="adapters in PEFT format (adapter_config.json + adapter_model.safetensors), as NAME=PATH "
        'or \'{"name": NAME, "path": PATH}\'; they replace lora.modules of the YAML',
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters resident at once, least recently used dropped (lora.max_loras, default 8)",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (lora.max_lora_rank, default 16)"
    )
    cluster = serve.add_argument_group(
        "replicas on Ray Serve (cluster.* in the config; needs the `ray` extra)",
        "N engine replicas behind one ingress with the same routes, errors and metrics; a call's prompts go "
        "together to one replica, chosen by a consistent-hash ring on x-user-id (else on the prompt's first "
        "blocks) with a bounded load (cluster.routing, cluster.load_factor); the response names it in "
        "x-tiered-replica. Share a remote tier (cache.host.lmcache.remote_url: redis://...) so a user who moves "
        "finds their KV. Ray binds the machine's address: on a machine that must stay on loopback, run this "
        "inside a network namespace (README).",
    )
    cluster.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="engine replicas on Ray Serve (cluster.replicas; 1 without --ray-address: no Ray)",
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="Ray cluster to deploy to: auto, ray://HOST:PORT (cluster.address; default: start a local one)",
    )


def serve_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as `key=value` overrides, applied after the YAML and --set."""
    out = [f"model.path={json.dumps(args.model)}"] if args.model else []
    if args.max_model_len is not None:
        out.append(f"model.max_model_len={args.max_model_len}")
    if args.dtype is not None:
        out.append(f"model.dtype={DTYPE_NAMES[args.dtype]}")
    if args.kv_cache_dtype is not None:
        out.append(f"cache.kv_dtype={DTYPE_NAMES[args.kv_cache_dtype]}")
    if args.block_size is not None:
        out.append(f"cache.block_tokens={args.block_size}")
    if args.kv_offloading_size is not None:
        out.append(f"cache.host.lmcache.max_local_cpu_size={args.kv_offloading_size}")
    if args.enable_prefix_caching is False:
        out += ["cache.retention=none", "cache.suffix=discard", "cache.host.enabled=false"]
    if args.enable_lora:
        out.append("lora.enabled=true")
    if args.lora_modules:  # all at once (a name may hold a dot)
        out.append(f"lora.modules={json.dumps(dict(args.lora_modules))}")
    if args.max_loras is not None:
        out.append(f"lora.max_loras={args.max_loras}")
    if args.max_lora_rank is not None:
        out.append(f"lora.max_lora_rank={args.max_lora_rank}")
    if args.replicas is not None:
        out.append(f"cluster.replicas={args.replicas}")
    if args.ray_address is not None:
        out.append(f"cluster.address={json.dumps(args.ray_address)}")
    return out + engine_overrides(args)


def served_model_names(args: argparse.Namespace, cfg: Config) -> list[str]:
    """--served-model-name, else the model as given (the argument, or the config's model.path),
    before `embedded:` or `~` is resolved: vLLM serves a model under the name it was given."""
    return list(args.served_model_name or [cfg.model.path])


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first of TIERED_API_KEY, VLLM_API_KEY that is set."""
    if args.api_key:
        return str(args.api_key)
    return next((os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)), None)


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself (vLLM takes either)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:  # neither a file nor a template: a typo'd path
        raise ConfigError(f"--chat-template '{value}' is neither a file nor a Jinja template")
    return value


def check_local_disk(cfg: Config) -> None:
    """Check the host tier's local disk directories (LMCache's, from the YAML, LMCACHE_* or its
    config file) before the engine starts: one that cannot hold the disk tier stops `serve` with
    a one-line error naming `cache.host.lmcache.local_disk`."""
    if cfg.cache.suffix != "offload" or not cfg.cache.host.enabled:
        return
    from tiered.offload.lmcache_setup import check_local_disk as check
    from tiered.offload.lmcache_setup import lmcache_config

    check(lmcache_config(cfg.cache.host.lmcache))


def check_model(cfg: Config) -> None:
    """Read the checkpoint's config.json before the engine process starts: a missing folder or file,
    or an architecture we do not implement, stops `serve` with one line naming it (ModelLoadError,
    FileNotFoundError), not a traceback from the engine process."""
    from tiered.embedded import resolve_model_path
    from tiered.hybrid.loader import read_args

    read_args(resolve_model_path(cfg.model.path, cfg.model.models_dir))


def check_adapters(cfg: Config) -> None:
    """Check every adapter folder before the engine starts: a bad one stops `serve` with its message."""
    if not cfg.lora.enabled:
        return
    from tiered.embedded import resolve_model_path
    from tiered.hybrid.loader import read_args
    from tiered.hybrid.lora import AdapterError, read_adapter

    args = read_args(resolve_model_path(cfg.model.path, cfg.model.models_dir))
    for name, folder in cfg.lora.modules.items():
        try:
            read_adapter(name, folder, args, cfg.lora.max_lora_rank)
        except AdapterError as exc:
            raise ConfigError(f"--lora-modules: {exc}") from None
