"""`tandem serve`: the cloud backend (model, public corpus, websocket sessions)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("tandem.cloud")


def run_serve(args: argparse.Namespace) -> int:
    """`--announce`: started by `EmbeddedCloud` (which see), it reports on stdout alone and
    ends with the parent."""
    from app.embedded import announcer, tie_to_parent

    announce = announcer() if args.announce else None
    if announce is not None:
        tie_to_parent()  # first: the imports and the model take a while
    from app.serve_log import serve_logging
    from cloud_backend.config import ConfigError

    try:  # first: the warnings that reading the settings may log go to the file too
        logs = serve_logging(
            args.log_file,
            max_mb=args.log_max_mb,
            backups=args.log_backups,
            verbose=args.verbose,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, announce)
    finally:
        logs.close()


def _serve(args: argparse.Namespace, announce: Callable[[str], None] | None) -> int:
    from app.embedded import READY_PREFIX, SEARCH_PREFIX
    from cloud_backend.config import ConfigError, load_config
    from cloud_backend.loading import build_engine
    from cloud_backend.server import run_server, tls_context

    corpus = None
    try:
        config = _config(args, load_config)
        tls_context(config)  # a certificate that cannot be used stops here, in plain words
        if config.corpus_enabled:  # before the model: a corpus that cannot open fails fast
            on_status = (lambda what: announce(SEARCH_PREFIX + what)) if announce else None
            corpus = _open_corpus(config, on_status)
        engine = build_engine(config)
    except ConfigError as exc:
        if corpus is not None:
            corpus.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        if announce is not None:
            announce(f"{READY_PREFIX}{url}")
        else:
            print(f"serving {engine.name} at {url}", flush=True)

    try:
        asyncio.run(_serve_until_stopped(run_server(config, engine, corpus, ready=ready)))
    finally:  # vLLM's engine processes go too, within their own bound, whatever ended this
        engine.close()
        if corpus is not None:
            corpus.close()  # a build still running stops; the next start resumes it
    return 0


async def _serve_until_stopped(server: Coroutine[Any, Any, None]) -> None:
    """Serve until SIGTERM or SIGINT (systemd, a container runtime, a balancer's drain,
    Ctrl-C): the devices' websockets then close with "going away" (an answer in flight ends
    with "the cloud is shutting down" on the device) and the server returns."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(server)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()  # it failed: say why
            return
        log.info("stopping: closing the sessions and the engine")
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
    finally:
        stopping.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)


def _config(args: argparse.Namespace, load_config):
    from app.serve_token import refuse_weak_tokens, serve_token

    config = load_config(
        args.config,
        host=args.host,
        port=args.port,
        token=serve_token(args.token, args.token_file),
        engine=args.engine,
        model_dir=args.model_dir,
        torch_dtype=args.dtype,
        threads=args.threads,
        corpus_enabled=False if args.no_corpus else None,
        corpus_limit=args.corpus_limit,
        corpus_k=args.corpus_k,
        corpus_floor=args.corpus_floor,
        corpus_focus_words=args.corpus_focus_words,
        max_batch_sequences=args.max_batch_sequences,
        document_cache_bytes=_mib(args.document_cache_mb),
        document_cache_scope=args.document_cache_scope,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    config.access_tokens()
    refuse_weak_tokens(config)
    return config


def _mib(value: float | None) -> int | None:
    return None if value is None else int(value * 1024**2)


def _open_corpus(config, on_status):
    """The public corpus, serving from now on: opened if built, else by keyword while its
    meaning index builds in the background (`cloud_backend.corpus_serving`)."""
    from cloud_backend.config import ConfigError
    from cloud_backend.corpus import default_corpus_dir, default_embedder_dir
    from cloud_backend.corpus_serving import ServingCorpus

    root = config.data_dir / "corpus" if config.data_dir else default_corpus_dir()
    try:
        corpus = ServingCorpus.start(
            root,
            default_embedder_dir(),
            config.corpus_limit,
            on_status=on_status,
            shipped_vectors=config.corpus_shipped_vectors,
        )
    except ImportError as exc:  # the vLLM environment has no export toolchain
        raise ConfigError(
            f"the public corpus is not built yet and this environment cannot build it (no "
            f"{exc.name}): build it once with the device's install (`python -m "
            "cloud_backend.corpus`), or serve without it (--no-corpus)"
        ) from None
    corpus.warm_up()  # load the query embedder now, not in the first answer's TTFT
    return corpus
