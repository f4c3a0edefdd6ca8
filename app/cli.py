"""Tandem: a private assistant in the terminal that works in tandem with a cloud.

`tandem` alone starts the TUI; every subcommand is headless (none imports Textual)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from collab.plumbing.paths import index_dir, index_paths


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from tandem_packaging.prepare import prepare

    prepare(args.device_model, args.cloud_model, only=args.only, say=print)
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from tandem_packaging.listing import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("No models prepared. Run `tandem models prepare`.")
        return 0
    for row in rows:
        print(f"{row['role']:6} {row['key']}  ({row['root']})")
        for step in row["steps"]:
            print(f"  {step['name']:10} {step['size_h']:>9}  {step['detail']}")
            for f in step["files"]:
                print(f"      {f['sha256'][:16]}  {f['size_h']:>9}  {f['path']}")
    return 0


def _cmd_ask(args: argparse.Namespace) -> int:
    import asyncio

    from app.ask import run_ask

    return asyncio.run(run_ask(args))


def _cmd_serve(args: argparse.Namespace) -> int:
    from app.serve import run_serve

    return run_serve(args)


def _open_store():
    """The store alone (no model): enough to list and remove documents."""
    from retrieval.embedder import DIM
    from retrieval.store import IndexStore

    return IndexStore(index_dir(), DIM)


def _cmd_ingest(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from app.settings import Settings, SettingsError, load_settings
    from personal_index.index import IndexWriteError, IngestBusyError, PersonalIndex

    try:
        max_file_mb = load_settings().ingest_max_mb
    except SettingsError as exc:
        print(f"warning: {exc}; using the defaults", file=sys.stderr)
        max_file_mb = Settings().ingest_max_mb
    bar = tqdm(total=0, unit="file", desc="ingest", disable=args.json)

    def on_progress(p) -> None:
        bar.total, bar.n = p.total, p.done
        bar.set_postfix_str(Path(p.result.path).name[-40:], refresh=False)
        bar.refresh()

    try:
        with PersonalIndex(*index_paths()) as index:
            results = index.ingest(args.paths, on_progress, max_file_mb=max_file_mb)
    except (IngestBusyError, IndexWriteError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        for r in results:
            detail = f"{r.chunks} chunks" if r.outcome == "indexed" else (r.reason or "")
            print(f"{r.outcome:9}  {r.path}  {detail}".rstrip())
        counts = {
            o: sum(r.outcome == o for r in results)
            for o in ("indexed", "unchanged", "failed", "skipped", "removed")
        }
        print(", ".join(f"{n} {o}" for o, n in counts.items() if n) or "nothing to ingest")
    return 1 if any(r.outcome == "failed" for r in results) else 0


def _cmd_docs_list(args: argparse.Namespace) -> int:
    with _open_store() as store:
        rows, stats = store.documents(), store.stats()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return 0
    for r in rows:
        detail = f"{r.chunk_count} chunks" if r.status == "indexed" else f"failed: {r.error}"
        print(f"{r.path}  ({r.kind or '?'}, {detail})")
    print(
        f"{stats.documents} documents, {stats.chunks} chunks, {stats.failed} failed;"
        f" index at {index_dir()}"
    )
    return 0


def _cmd_docs_remove(args: argparse.Namespace) -> int:
    target = os.path.abspath(os.path.expanduser(args.path))
    with _open_store() as store:
        removed = store.remove_prefix(target)
    if not removed:
        print(f"error: no indexed document at or under {target}", file=sys.stderr)
        return 2
    print(f"removed {removed} document{'s' * (removed != 1)}")
    return 0


def _cmd_search(args: argparse.Namespace) -> int:
    """Inspect retrieval: what each search finds, its relevance and what found it. Without
    --min-score nothing is held back, so passages under the answer's floor show too (marked)."""
    from app.plain import safe_json, strip_controls
    from app.settings import load_settings
    from personal_index.index import PersonalIndex

    floor = load_settings().relevance_floor
    with PersonalIndex(*index_paths()) as index:
        try:
            hits = index.search(args.query, args.k, args.min_score, mode=args.mode)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(safe_json([h.__dict__ | {"cited": h.score >= floor} for h in hits]))
        return 0
    if not hits:
        print("no matches")
    for rank, h in enumerate(hits, 1):
        where = h.location or f"chunk {h.ordinal}"
        excerpt = " ".join(h.text.split())[:160]
        below = "" if h.score >= floor else f"  (below the floor {floor:g}: not cited)"
        print(
            strip_controls(f"[{rank}] {h.score:.3f} {h.found_by:<7}  {h.label}  ({where}){below}")
        )
        print(strip_controls(f"     {h.path}"))
        print(strip_controls(f"     {excerpt}"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from app.serve_log import LOG_BACKUPS, LOG_MAX_MB
    from app.settings import AGGREGATORS, CLOUD_ENGINES
    from collab.variants import variant_names
    from edge_runtime.modes import mode_names

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare and list the model pair")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="assemble, convert, export and quantise the pair")
    prep.add_argument(
        "--device-model",
        help="Hugging Face id or local folder (default: Qwen2.5-Coder-0.5B-Instruct)",
    )
    prep.add_argument(
        "--cloud-model",
        help="Hugging Face id or local folder (default: Qwen2.5-Coder-1.5B-Instruct)",
    )
    prep.add_argument("--only", choices=["device", "cloud"], help="prepare one side only")
    prep.set_defaults(func=_cmd_models_prepare)
    lst = msub.add_parser(
        "list", help="show prepared models: paths, sizes, checksums, quantisation"
    )
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=_cmd_models_list)

    ask = sub.add_parser("ask", help="ask a question and stream the answer")
    ask.add_argument("question")
    from_settings = " (default: the settings file's)"
    ask.add_argument("--max-tokens", type=int, help="longest answer" + from_settings)
    ask.add_argument("--temperature", type=float, help="0 = greedy" + from_settings)
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--seed", type=int, default=0)
    ask.add_argument("--mode", choices=mode_names(), default="local")
    ask.add_argument(
        "--variant",
        choices=variant_names(),
        help="split mode's verification scheme (dssd-topk is approximate)" + from_settings,
    )
    ask.add_argument(
        "--eta", type=float,
        help="split: RAPID's η, how far the device's drafts (which read your documents) pull "
        "the cloud's answer when sampling; 0 = exactly the cloud model, about 20 lets facts "
        "from your documents through (≤ 2 does not)" + from_settings,
    )  # fmt: skip
    ask.add_argument(
        "--pipeline", action=argparse.BooleanOptionalAction,
        help="split: draft on while the cloud verifies (PicoSpec); --no-pipeline waits for "
        "each verdict (stop-and-wait). Same answers either way" + from_settings,
    )  # fmt: skip
    ask.add_argument(
        "--aggregator",
        choices=AGGREGATORS,
        help="dragon mode's aggregating side (auto: the scheduler picks before every token)"
        + from_settings,
    )
    ask.add_argument(
        "-k", type=int,
        help="private passages to retrieve; in dragon, documents per side" + from_settings,
    )  # fmt: skip
    ask.add_argument(
        "--cloud-url", help="ws://host:port or wss://host:port (the session path is added "
        "when none is given; default: $TANDEM_CLOUD_URL, the settings file's, else the "
        "embedded backend)",
    )  # fmt: skip
    ask.add_argument("--cloud-engine", choices=CLOUD_ENGINES,
                     help="embedded cloud's engine" + from_settings)  # fmt: skip
    ask.add_argument(
        "--no-finish-locally",
        action="store_true",
        help="if the cloud drops mid-answer, stop instead of finishing on the device",
    )
    ask.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ask.set_defaults(func=_cmd_ask)

    serve = sub.add_parser("serve", help="run the cloud backend")
    serve.add_argument("--config", type=Path, help="TOML file with a [cloud] table")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    secret = serve.add_mutually_exclusive_group()
    secret.add_argument("--token-file", type=Path,
                        help="read the access token from this file (keep it 0600)")  # fmt: skip
    secret.add_argument(
        "--token",
        help="access token (default: $TANDEM_CLOUD_TOKEN or config); visible to every user "
        "of this machine in `ps`: prefer --token-file",
    )
    serve.add_argument(
        "--engine",
        choices=["ort", "torch", "vllm"],
        help="vllm: in its own install (docs/benchmarks/vllm.md#install)",
    )
    serve.add_argument("--model-dir", type=Path, help="model folder (default: the prepared one)")
    serve.add_argument("--dtype", choices=["bfloat16", "float32"], help="torch and vLLM dtype")
    serve.add_argument("--threads", type=int)
    serve.add_argument("--no-corpus", action="store_true", help="serve without the public corpus")
    serve.add_argument("--corpus-limit", type=int, help="index only the first N summaries")
    serve.add_argument("--corpus-k", type=int, help="public passages per cloud-mode answer")
    serve.add_argument("--corpus-floor", type=float,
                       help="relevance below which a public passage is not used")  # fmt: skip
    serve.add_argument("--max-batch", type=int, dest="max_batch_sequences",
                       help="sequences of all sessions in one pass (1: no batching)")  # fmt: skip
    serve.add_argument("--document-cache-mb", type=float,
                       help="memory for public documents' prefix KV, reused by later questions "
                            "over them (0: off; default 512)")  # fmt: skip
    serve.add_argument("--document-cache-scope", choices=["user", "session", "all"],
                       help="who shares a cached document (default user: one access "
                            "token's sessions; all: anyone, who can then time what others "
                            "read)")  # fmt: skip
    serve.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve wss://")
    serve.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    serve.add_argument("--log-file", type=Path,
                       help="also log to this file (INFO: sessions, requests, refusals), "
                            "rotated by size, created 0600")  # fmt: skip
    serve.add_argument("--log-max-mb", type=float, default=LOG_MAX_MB,
                       help="rotate the log file at this size (default %(default)g)")  # fmt: skip
    serve.add_argument("--log-backups", type=int, default=LOG_BACKUPS,
                       help="rotated files kept (default %(default)d)")  # fmt: skip
    serve.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=_cmd_serve)

    ingest = sub.add_parser("ingest", help="index private files and folders (on this device)")
    ingest.add_argument("paths", nargs="+")
    ingest.add_argument("--json", action="store_true")
    ingest.set_defaults(func=_cmd_ingest)
    docs = sub.add_parser("docs", help="list or remove indexed documents")
    dsub = docs.add_subparsers(dest="docs_command", required=True)
    dlist = dsub.add_parser("list", help="indexed documents and failures")
    dlist.add_argument("--json", action="store_true")
    dlist.set_defaults(func=_cmd_docs_list)
    dremove = dsub.add_parser("remove", help="forget a file, or every document under a folder")
    dremove.add_argument("path")
    dremove.set_defaults(func=_cmd_docs_remove)
    search = sub.add_parser("search", help="search the private index")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=5)
    search.add_argument("--min-score", type=float, help="leave out passages less relevant")
    search.add_argument("--mode", choices=["dense", "keyword", "hybrid"], default="hybrid",
                        help="by meaning, by keyword, or both (answers use both)")  # fmt: skip
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=_cmd_search)
    paths = sub.add_parser("paths", help="where Tandem keeps its config, data, index and models")
    paths.add_argument("--json", action="store_true")
    paths.set_defaults(func=_cmd_paths)
    tui = sub.add_parser("tui", help="the terminal app (also what `tandem` alone starts)")
    tui.set_defaults(func=lambda _args: _run_tui())
    return parser


def _cmd_paths(args: argparse.Namespace) -> int:
    from collab.plumbing.paths import config_path, describe_paths

    paths = {"config": str(config_path()), **describe_paths()}
    if args.json:
        print(json.dumps(paths, indent=2))
    else:
        for name, path in paths.items():
            print(f"{name:14} {path}")
    return 0


def tui_logging() -> logging.Handler:
    """The TUI's log: a rotating file in the data folder, 0600 from creation (its lines name
    documents and questions). The data folder is then made private, so that a tightening of
    an older install is logged in it."""
    from app.logfile import log_to_file
    from collab.plumbing.paths import log_path, secure_data_dir

    handler = log_to_file(log_path())
    secure_data_dir()
    return handler


def _run_tui() -> int:
    """`tandem` alone: the TUI (the only place Textual is imported). Logs go to a file: a
    line on stderr would tear the screen."""
    tui_logging()
    from app.tui.app import run

    return run()


def main(argv: list[str] | None = None) -> int:
    """The `tandem` command. Everything it creates is private to the user (umask 077, on top of
    the stores' own 0600/0700: a belt for files no store knows about), and an existing data
    folder is tightened when any command opens it."""
    umask = os.umask(0o077)
    os.umask(umask | 0o077)
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        os.umask(umask)  # in-process callers (tests) get theirs back


def _main(argv: list[str]) -> int:
    if not argv:
        return _run_tui()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from collab.plumbing.paths import data_dir, secure_data_dir

    if data_dir().is_dir():  # a new one is created 0700 by whatever first writes there
        secure_data_dir()
    from tandem_packaging.sources import PrepareError

    try:
        return args.func(args)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
