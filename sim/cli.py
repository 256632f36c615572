"""``inferlb sim-backend``: run one simulated GPU inference backend."""

from __future__ import annotations

import logging
import os

import click

from sim.config import ENGINES, BackendConfig
from sim.engines.hardware import DEFAULT_MODEL, GPU_CLASSES, MODELS


@click.command("sim-backend")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port to listen on (0 = any free port).",
)
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    default="llm",
    show_default=True,
    help="llm: continuous batching as vLLM V1 schedules it; job: the seed's per-request GPU server.",
)
@click.option(
    "--model",
    type=click.Choice(sorted(MODELS)),
    default=DEFAULT_MODEL,
    show_default=True,
    help="The model the llm engine serves: its step times, KV bytes per token and weights.",
)
@click.option(
    "--gpu-class",
    type=click.Choice(sorted(GPU_CLASSES)),
    default="a100",
    show_default=True,
    help="Simulated GPU: speed and memory.",
)
@click.option(
    "--version",
    "version",
    default="v1",
    show_default=True,
    help="Model version string reported in x-backend-version.",
)
@click.option("--model-name", default="sim-7b", show_default=True, help="Model name served and reported.")
@click.option(
    "--gpu-memory-mib",
    type=click.FloatRange(min=1),
    default=None,
    help="GPU memory in MiB  [default: per GPU class]",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Requests run at once, the rest wait (llm: vLLM's max_num_seqs)  [default: llm: vLLM's for the "
         "GPU class (256; H100 1024), job: 8]",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="llm: tokens per engine step (chunked prefill budget)  [default: vLLM's for the GPU class (2048; "
         "H100 8192)]",
)
@click.option(
    "--kv-mib-per-token",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="job: memory a request holds per prompt or generated token, MiB (0.5 = a 7B model in fp16).",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="llm: vLLM's automatic prefix caching (16-token blocks, LRU eviction).",
)
@click.option(
    "--session-history-tokens",
    type=click.IntRange(min=0),
    default=400,
    show_default=True,
    help="Tokens of history a session key stands for (cached like a prompt prefix; 0 = none).",
)
@click.option(
    "--long-tail",
    type=click.FloatRange(0.0, 1.0),
    default=0.0,
    show_default=True,
    help="Probability (0-1) that a request runs 10x slower (llm: it takes part in one step in 10).",
)
@click.option(
    "--legacy-metrics",
    is_flag=True,
    help="Expose vllm:gpu_cache_usage_perc instead of vllm:kv_cache_usage_perc.",
)
@click.option("--seed", type=int, default=None, help="Random seed (long-tail draws) for reproducible runs.")
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Wall seconds per simulated second (0.1: the GPU runs 10x faster than the one modelled, for "
         "time-compressed tests and benchmarks; reported times are wall times).",
)
@click.option(
    "--push-status",
    metavar="HOST:PORT",
    default=None,
    help="Stream this node's status (inferlb.v1.NodeStatus) to an inferlb push source at HOST:PORT.",
)
@click.option(
    "--push-interval-s",
    type=click.FloatRange(0.01, 60.0),
    default=0.5,
    show_default=True,
    help="Seconds between node-status messages.",
)
@click.option("--push-instance", default=None, help="Instance name pushed  [default: the bound HOST:PORT]")
@click.option("--etcd", metavar="URL", default=None,
              help="Register in etcd at URL (http://HOST:PORT; several: comma-separated) with a status snapshot, "
                   "for inferlb's etcd discovery.")
@click.option("--etcd-prefix", default="/inferlb/endpoints/", show_default=True,
              help="Key prefix; the key is PREFIX + HOST:PORT.")
@click.option("--etcd-ttl", "etcd_ttl_s", type=click.IntRange(1, 3600), default=10, show_default=True,
              help="Lease TTL (s): the registration disappears this long after the node stops renewing it.")
@click.option("--etcd-service", default=None, help="Service name registered  [default: the model name]")
@click.option("--etcd-address", default=None, help="HOST:PORT registered  [default: the bound HOST:PORT]")
@click.option("--etcd-status-interval-s", type=click.FloatRange(0.1, 3600), default=5.0, show_default=True,
              help="Seconds between status snapshots written to the registration.")
@click.option("--etcd-drain-s", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="At shutdown: seconds of serving after announcing drain, before the lease is revoked.")
@click.option("--etcd-user", default=None, envvar="INFERLB_SIM_ETCD_USER", metavar="NAME:PASSWORD",
              help="etcd user authentication (or the INFERLB_SIM_ETCD_USER environment variable).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Count prompt tokens with the Hugging Face tokenizer in this directory (its tokenizer.json; a chat "
                   "template there, rendered with transformers, renders chat prompts; "
                   "the tokenizers package: pip install 'inferlb[tokenizer]')  [default: 4 bytes a token]")
@click.option("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
              help="Publish the llm engine's KV-cache events as vLLM does (ZMQ PUB, msgpack) on a socket bound here "
                   "(pyzmq and msgpack: pip install 'inferlb[kv-events]')  [default: not published]")
@click.option("--kv-events-opaque", is_flag=True, default=False,
              help="Publish each block's hash as 32 opaque bytes (a digest of its key under a seed random per start), "
                   "as vLLM's sha256 hashes look to a consumer, not the engine's key")
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def sim_backend(
    host: str,
    port: int,
    engine: str,
    model: str,
    gpu_class: str,
    version: str,
    model_name: str,
    gpu_memory_mib: float | None,
    max_concurrency: int | None,
    max_num_batched_tokens: int | None,
    kv_mib_per_token: float,
    prefix_caching: bool,
    session_history_tokens: int,
    long_tail: float,
    legacy_metrics: bool,
    seed: int | None,
    time_scale: float,
    push_status: str | None,
    push_interval_s: float,
    push_instance: str | None,
    etcd: str | None,
    etcd_prefix: str,
    etcd_ttl_s: int,
    etcd_service: str | None,
    etcd_address: str | None,
    etcd_status_interval_s: float,
    etcd_drain_s: float,
    etcd_user: str | None,
    tokenizer_dir: str | None,
    kv_events_endpoint: str | None,
    kv_events_opaque: bool,
    log_level: str,
) -> None:
    """Run a simulated vLLM-style inference backend on one GPU (OpenAI API, /metrics, /sim/fault)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if tokenizer_dir is not None:
        _use_tokenizer(tokenizer_dir)
    try:
        cfg = BackendConfig(
            host=host,
            port=port,
            engine=engine,
            model=model,
            gpu_class=gpu_class,
            version=version,
            model_name=model_name,
            gpu_memory_mib=gpu_memory_mib,
            max_concurrency=max_concurrency,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_mib_per_token=kv_mib_per_token,
            prefix_caching=prefix_caching,
            session_history_tokens=session_history_tokens,
            long_tail=long_tail,
            legacy_metrics=legacy_metrics,
            seed=seed,
            time_scale=time_scale,
            push_status=push_status,
            push_interval_s=push_interval_s,
            push_instance=push_instance,
            etcd=etcd,
            etcd_prefix=etcd_prefix,
            etcd_ttl_s=etcd_ttl_s,
            etcd_service=etcd_service,
            etcd_address=etcd_address,
            etcd_status_interval_s=etcd_status_interval_s,
            etcd_drain_s=etcd_drain_s,
            etcd_user=etcd_user,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_opaque=kv_events_opaque,
        )
        from sim.node import make_engine

        make_engine(cfg)  # an engine vLLM would refuse to start (no room for the KV cache ...) is a usage error
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    from sim.server import run_backend

    try:
        run_backend(cfg)
    except OSError as exc:  # the port is taken, or the host is not one of this machine's
        why = os.strerror(exc.errno) if exc.errno else str(exc)  # asyncio's strerror repeats the address
        raise click.ClickException(f"--host/--port {host}:{port}: {why.lower()}") from exc


def _use_tokenizer(directory: str) -> None:
    """``--tokenizer DIR``: count with that tokenizer (:mod:`sim.tokenizer`), or a one-line error."""
    from sim.protocol import use_chat_template
    from sim.tokenizer import load, load_chat_template
    from sim.tokens import use_tokenizer

    try:
        use_tokenizer(load(directory))
        use_chat_template(load_chat_template(directory))
    except ModuleNotFoundError as exc:
        extra = "vllm-keys" if exc.name == "transformers" else "tokenizer"
        raise click.ClickException(f"--tokenizer needs the {exc.name} package: pip install 'inferlb[{extra}]'") \
            from None
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="'--tokenizer'") from None


@click.command("sim-tokenizer")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--vocab-size", type=click.IntRange(512, 65536), default=8192, show_default=True,
              help="Most tokens in the vocabulary.")
def sim_tokenizer(directory: str, vocab_size: int) -> None:
    """Write a small Hugging Face tokenizer to DIRECTORY for offline use (no model hub): a byte-level BPE
    trained here, the same files every time. `inferlb sim-backend --tokenizer DIRECTORY` counts with it,
    and so does a client that loads it (transformers' AutoTokenizer, guidellm's --tokenizer)."""
    from sim.tokenizer import write_small_tokenizer

    try:
        out = write_small_tokenizer(directory, vocab_size)
    except ModuleNotFoundError:
        raise click.ClickException("sim-tokenizer needs the tokenizers package: pip install 'inferlb[tokenizer]'") \
            from None
    except OSError as err:
        raise click.ClickException(f"cannot write {directory}: {err.strerror or err}") from None
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    click.echo(f"{out}: tokenizer.json, tokenizer_config.json, special_tokens_map.json ({size} tokens)")
