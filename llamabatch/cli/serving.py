"""`serve` (one engine, or replicas on Ray) and `rpc-server`."""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .. import display
from ..catalog import Catalog
from ..engine.native.backend import init_backend
from ..engine.sizing.options import AUTO, EngineOptions, memory_budget
from ..engine.rpc import DEFAULT_PORT as DEFAULT_RPC_PORT
from ..errors import LlamabatchError
from .options import BatchOpt, CacheTypeKOpt, CacheTypeVOpt, CatalogOpt, ChatTemplateOpt, MmprojOffloadOpt, MmprojOpt, CheckpointEveryOpt, CheckpointMemoryOpt, StepTargetOpt, OverlapOpt, CacheRamOpt, CacheDirOpt, CacheDiskOpt, CtxOpt, CtxPerSeqOpt, DeterministicOpt, DraftMaxOpt, DraftModelOpt, EmbedPackOpt, FlashAttnOpt, GpuLayersOpt, KvUnifiedOpt, LoraOpt, MaxItlOpt, ParallelOpt, ReplicasOpt, RpcOpt, RpcTimeoutOpt, SharePrefixesOpt, SpeculativeOpt, TensorSplitOpt, ThreadsOpt, UbatchOpt, VerboseOpt, parse_pooling, parse_replicas, reports_errors

if TYPE_CHECKING:  # the server's imports load only when serving
    from ..serve.access import Access
    from ..serve.app import ServerSettings


@reports_errors
def serve(
    context: typer.Context,
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", "-m", metavar="NAME|PATH", help="Catalog name or path to a .gguf file; repeat it to serve several, each loaded when first asked for.")] = None,
    models: Annotated[Optional[str], typer.Option(
        "--models", metavar="NAMES|all", help="Catalog models to serve, comma-separated, or 'all' of the catalog's (loaded on demand).")] = None,
    max_loaded: Annotated[Optional[int], typer.Option(
        "--max-loaded", help="Several models: at most this many loaded at once (the least recently used idle one unloads for another).")] = None,
    idle_unload: Annotated[Optional[float], typer.Option(
        "--sleep-idle", "--idle-unload", metavar="SECONDS",
        help="Free a model's memory once it has had no work this long (it sleeps: /health, /v1/models and /metrics answer without waking it, and the next request that needs it loads it again).")] = None,
    config: CatalogOpt = None,
    parallel: ParallelOpt = None,
    ctx: CtxOpt = None,
    ctx_per_seq: CtxPerSeqOpt = None,
    memory: Annotated[Optional[str], typer.Option(
        "--memory", help="With --parallel auto: the memory it plans for (default: what is free now). With several models: "
                         "the memory the loaded models share, each planned as `llamabatch plan` plans it.")] = None,
    max_itl: MaxItlOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[list[str]], typer.Option(
        help="Ask every route but /health (and /metrics) for 'Authorization: Bearer KEY' or 'x-api-key: KEY' (repeatable).")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(help="API keys, one a line (# starts a comment), beside any --api-key.")] = None,
    private_metrics: Annotated[bool, typer.Option(help="/metrics asks for an API key too.")] = False,
    cors_origin: Annotated[Optional[list[str]], typer.Option(
        help="A browser origin allowed to call the server (repeatable; * for any). None: no CORS.")] = None,
    cors_methods: Annotated[str, typer.Option(help="With --cors-origin: the methods allowed, comma-separated.")] = "GET,POST,DELETE",
    cors_headers: Annotated[str, typer.Option(help="With --cors-origin: the request headers allowed, comma-separated (* for any).")] = "*",
    ssl_certfile: Annotated[Optional[Path], typer.Option(help="Serve HTTPS with this certificate (PEM), with --ssl-keyfile.")] = None,
    ssl_keyfile: Annotated[Optional[Path], typer.Option(help="The certificate's private key (PEM).")] = None,
    max_queue: Annotated[int, typer.Option(help="Sequences (and embedding requests) that may wait; beyond, requests get 429.")] = 256,
    request_timeout: Annotated[float, typer.Option(help="Seconds before a request is cancelled (504).")] = 600.0,
    sse_keepalive: Annotated[float, typer.Option(
        help="Seconds of silence after which a stream sends an SSE comment (waiting in the queue, or behind a long prompt); 0: never.")] = 15.0,
    resume_keep: Annotated[Optional[float], typer.Option(
        help="A stream that outlives its connection (Responses' background, the X-Background header) is kept this many seconds after it ends (300), to be followed again or asked after.")] = None,
    resume_events: Annotated[Optional[int], typer.Option(help="Of such a stream, this many latest events are kept (4096).")] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        help="On Ctrl-C or SIGTERM: seconds the requests in flight may finish in (new ones get 503) before they end with an error; batches are left to resume.")] = 30.0,
    pooling: Annotated[Optional[str], typer.Option(help="/v1/embeddings: mean, cls or last (default: the GGUF's, else mean).")] = None,
    embed_pack: EmbedPackOpt = None,
    lora_dir: Annotated[Optional[Path], typer.Option(
        help="Let LoRA adapters be loaded and unloaded while serving (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), from files under this folder only.")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Files and batches of the Batch API (/v1/files, /v1/batches), kept across restarts (default: ~/.local/share/llamabatch).")] = None,
    max_upload_mb: Annotated[int, typer.Option(help="Largest file upload, in MiB (413 beyond).")] = 200,
    scheduling_policy: Annotated[Optional[str], typer.Option(help="'priority' (default: by the requests' priority, batches below interactive requests, preempting) or 'fcfs'.")] = None,
    n_batch: BatchOpt = None,
    n_ubatch: UbatchOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    tensor_split: TensorSplitOpt = None,
    rpc_timeout: RpcTimeoutOpt = None,
    lora: LoraOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_unified: KvUnifiedOpt = None,
    share_prefixes: SharePrefixesOpt = None,
    deterministic: DeterministicOpt = None,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
    draft_max: DraftMaxOpt = None,
    step_target: StepTargetOpt = None,
    overlap: OverlapOpt = None,
    checkpoint_every: CheckpointEveryOpt = None,
    checkpoint_memory: CheckpointMemoryOpt = None,
    cache_ram: CacheRamOpt = None,
    cache_dir: CacheDirOpt = None,
    cache_disk: CacheDiskOpt = None,
    replicas: ReplicasOpt = None,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="With --replicas: 'local' (default), 'auto' (the running cluster) or ray://host:port.")] = None,
    chat_template: ChatTemplateOpt = None,
    mmproj: MmprojOpt = None,
    mmproj_offload: MmprojOffloadOpt = None,
    allow_remote_media: Annotated[bool, typer.Option(
        help="Fetch images that requests name by http(s) URL (20 MiB at most, 10 s); without it they must come in data: URLs.")] = False,
    reasoning_budget: Annotated[int, typer.Option(
        "--reasoning-budget", help="A chat answer's thought in tokens at most, then closed for it (-1: no limit, 0: no thinking); a request's reasoning_budget overrides it.")] = -1,
    verbose: VerboseOpt = False,
) -> None:
    """An OpenAI-compatible server: concurrent requests share the running batch."""
    from ..serve.app import ServerSettings, create_app
    from ..serve.shutdown import serve_until_stopped
    from ..serve.store import default_data_dir

    if ray is not None and replicas is None:
        raise LlamabatchError("--ray says where --replicas run: add --replicas N|auto, or drop --ray")
    if replicas is not None and parallel == AUTO:
        raise LlamabatchError("--parallel auto plans for this machine's memory, not each replica's: give --parallel N")
    names = _served_names(model, models, config)
    several = len(names) > 1
    if idle_unload is not None and idle_unload <= 0:
        raise LlamabatchError(f"--sleep-idle must be > 0 seconds, got {idle_unload}")
    if idle_unload is not None and replicas is not None:
        raise LlamabatchError("--sleep-idle frees one server's model: Ray Serve scales --replicas itself, drop one of them")
    if several:
        _check_several(replicas, parallel, max_loaded)
    elif max_loaded is not None:
        raise LlamabatchError("--max-loaded applies to several models: give more than one --model (or --models)")
    if not several:  # an unknown model or a missing file fails here, not in a thread (with several: at its load)
        for name in (names[0], draft_model) if draft_model else (names[0],):
            Catalog.load(config).resolve(name).gguf_path()
    # Streams are what a server is for: prompts are read beside them within a step budget, unless
    # told otherwise (--max-itl sets the budget when given: options.EngineOptions).
    default_target = "auto" if step_target is None and max_itl is None else step_target
    served = {
        Catalog.load(config).resolve(name).name: EngineOptions.of(
            {**context.params, "model": name, "memory": None if several else memory, "step_target": default_target}).engine_kwargs()
        for name in names
    }
    engine = next(iter(served.values()))
    if max_upload_mb < 1:
        raise LlamabatchError(f"--max-upload-mb must be >= 1, got {max_upload_mb}")
    if reasoning_budget < -1:
        raise LlamabatchError(f"--reasoning-budget must be -1 (no limit), 0 (no thinking) or a number of tokens, got {reasoning_budget}")
    if replicas is not None and data_dir is not None:
        raise LlamabatchError("--data-dir is for the Batch API of one server; replicas (--replicas) serve no batches")
    if shutdown_timeout < 0:
        raise LlamabatchError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    access = _access(api_key, api_key_file, private_metrics, cors_origin, cors_methods, cors_headers)
    tls = _tls(ssl_certfile, ssl_keyfile, replicas)
    if sse_keepalive < 0:
        raise LlamabatchError(f"--sse-keepalive must be >= 0 seconds (0: never), got {sse_keepalive}")
    if resume_keep is not None and resume_keep < 0:
        raise LlamabatchError(f"--resume-keep must be >= 0 seconds, got {resume_keep:g}")
    if resume_events is not None and resume_events < 1:
        raise LlamabatchError(f"--resume-events must be >= 1, got {resume_events}")
    resume = {k: v for k, v in (("resume_keep", resume_keep), ("resume_events", resume_events)) if v is not None}
    settings = ServerSettings(engine=engine, access=access, max_queue=max_queue, request_timeout=request_timeout,
                              keepalive=sse_keepalive or None, **resume,
                              shutdown_timeout=shutdown_timeout,
                              pooling=parse_pooling(pooling), max_upload=max_upload_mb << 20, reasoning_budget=reasoning_budget, lora_dir=lora_dir,
                              allow_remote_media=allow_remote_media,
                              data_dir=None if replicas is not None else data_dir or default_data_dir(),
                              models=served if several else {}, max_loaded=max_loaded, idle_unload=idle_unload,
                              memory=memory_budget(memory) if several else None)
    if replicas is not None:
        _serve_replicas(settings, parse_replicas(replicas), ray or "local", host, port)
        return
    app = create_app(settings)
    display.err.print(f"llamabatch serving on {'https' if tls else 'http'}://{host}:{port}/v1 (Ctrl-C stops)")
    serve_until_stopped(app, host, port, "info" if verbose else "warning", shutdown_timeout, tls)


def _access(keys: list[str] | None, key_file: Path | None, private_metrics: bool, origins: list[str] | None,
            methods: str, headers: str) -> Access:
    """Who may call the server: the keys given and those of the file; the browser origins."""
    from ..serve.access import Access, read_keys

    every = [*(keys or ()), *(read_keys(key_file) if key_file is not None else ())]
    if any(not key.strip() for key in every):
        raise LlamabatchError("--api-key: an empty key would let anyone in")
    if private_metrics and not every:
        raise LlamabatchError("--private-metrics asks for an API key: give --api-key or --api-key-file")
    if (methods, headers) != ("GET,POST,DELETE", "*") and not origins:
        raise LlamabatchError("--cors-methods and --cors-headers apply to the origins --cors-origin allows: give one")
    return Access(frozenset(every), private_metrics, tuple(origins or ()), _listed(methods), _listed(headers))


def _listed(text: str) -> tuple[str, ...]:
    """A comma-separated option's items."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _tls(certfile: Path | None, keyfile: Path | None, replicas: str | None) -> tuple[Path, Path] | None:
    """The certificate and key HTTPS is served with, both or neither."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise LlamabatchError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    for option, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not path.is_file():
            raise LlamabatchError(f"{option}: file not found: {path}")
    if replicas is not None:
        raise LlamabatchError("--ssl-certfile with --replicas: Ray Serve's proxy serves plain HTTP (put a TLS proxy before it)")
    return certfile, keyfile


def _served_names(model: list[str] | None, models: str | None, config: Path | None) -> list[str]:
    """The models to serve, in order (the first answers requests that name none): the --model
    ones, then --models (catalog names, or 'all'); the catalog's default without either."""
    names = list(model or [])
    if models is not None:
        catalog = Catalog.load(config)
        listed = list(catalog.models) if models.strip() == "all" else [n.strip() for n in models.split(",") if n.strip()]
        for name in listed:
            catalog.resolve(name)  # an unknown name fails here
        names += listed
    unique = list(dict.fromkeys(names))
    by_name = [Catalog.load(config).resolve(name).name for name in unique]
    if len(set(by_name)) < len(by_name):
        raise LlamabatchError(f"two served models share a name: {sorted(n for n in by_name if by_name.count(n) > 1)}")
    return unique or [None]


def _check_several(replicas, parallel, max_loaded) -> None:
    if replicas is not None:
        raise LlamabatchError("--replicas serves one model: give one --model, or drop --replicas")
    if parallel == AUTO:
        raise LlamabatchError("--parallel auto plans one model's memory: with several models give --parallel N")
    if max_loaded is not None and max_loaded < 1:
        raise LlamabatchError(f"--max-loaded must be >= 1, got {max_loaded}")


def _serve_replicas(settings: ServerSettings, replicas: int | str, address: str, host: str, port: int) -> None:
    try:
        from ..jobs.ray_stage import actor_shape, connect
        from ..serve.replicas import deploy
    except ImportError as e:
        raise LlamabatchError(f"--replicas needs Ray: pip install 'llamabatch[ray]' ({e})") from None
    import ray
    from ray import serve

    connect(address)
    engine = settings.engine
    replicas, threads, gpus = actor_shape(replicas, engine["n_threads"])
    slots = engine["n_parallel"] or Catalog.load(engine["catalog"]).resolve(engine["model"]).parallel
    deploy(settings, replicas, threads, gpus, host, port, slots)
    display.err.print(f"llamabatch serving {replicas} replicas on http://{host}:{port}/v1 (Ctrl-C stops)")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    serve.shutdown()
    ray.shutdown()


@reports_errors
def rpc_server(
    host: Annotated[str, typer.Option("--host", "-H", help="Address to listen on. The protocol has no authentication: keep it on a trusted network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on.")] = DEFAULT_RPC_PORT,
    threads: ThreadsOpt = None,
) -> None:
    """Lend this host's GPUs (else its CPU) to engines on other hosts: llama.cpp's rpc-server,
    from llama-cpp-python's own libraries (built with -DGGML_RPC=on)."""
    from ..engine import rpc

    rpc.require_rpc()
    problem = _cannot_listen(host, port)
    if problem:  # ggml's server says only that it failed: find out why first
        raise LlamabatchError(f"rpc-server cannot listen on {host}:{port}: {problem}")
    init_backend(False)
    # ggml's server loop returns only when it cannot listen: run it on a thread, so that Ctrl-C
    # still ends the process.
    server = threading.Thread(target=rpc.serve, args=(host, port, threads or max(1, (os.cpu_count() or 2) // 2)), daemon=True)
    server.start()
    try:
        while server.is_alive():
            server.join(0.5)
    except KeyboardInterrupt:
        return
    raise LlamabatchError(f"rpc-server could not listen on {host}:{port}")


def _cannot_listen(host: str, port: int) -> str | None:
    """Why this process could not listen on host:port, or None when it can. Probed as ggml's
    server binds (SO_REUSEADDR): a port whose last connections linger closing (TIME_WAIT, a
    server just stopped) is free to it; one another socket listens on is not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            probe.listen()
    except socket.gaierror as e:
        return f"{host!r} is not a host name or address ({e.strerror})"
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this host"
        if e.errno == errno.EADDRINUSE:
            return f"port {port} is taken"
        return e.strerror or str(e)
    return None
