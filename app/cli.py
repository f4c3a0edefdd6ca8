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


def _watch_book():
    """The watched folders' records and exclusions (no model): open after the store."""
    from personal_index.watched import WatchBook

    return WatchBook(index_dir())


def _forget_citations(paths: list[str]) -> None:
    """Documents left the index: their text leaves the stored citations too (the app's
    Assistant does the same for removals made in the TUI)."""
    from app.conversations import ConversationStore, ConversationStoreError
    from collab.plumbing.paths import conversations_path

    if not conversations_path().exists():
        return
    try:
        with ConversationStore(conversations_path()) as conversations:
            conversations.forget_document_text(paths)
    except ConversationStoreError as exc:
        print(f"warning: stored citations still quote the removed text: {exc}", file=sys.stderr)


def _open_index():
    """The private index (loads the embedder); removals it makes reach the citations."""
    from personal_index.index import PersonalIndex

    index = PersonalIndex(*index_paths())
    index.on_removed(_forget_citations)
    return index


def _max_file_mb() -> float:
    from app.settings import Settings, SettingsError, load_settings

    try:
        return load_settings().ingest_max_mb
    except SettingsError as exc:
        print(f"warning: {exc}; using the defaults", file=sys.stderr)
        return Settings().ingest_max_mb


def _progress_bar(disable: bool):
    """A tqdm bar and the ingest progress callback that draws it."""
    from tqdm import tqdm

    bar = tqdm(total=0, unit="file", desc="ingest", disable=disable)

    def on_progress(p) -> None:
        bar.total, bar.n = p.total, p.done
        bar.set_postfix_str(Path(p.result.path).name[-40:], refresh=False)
        bar.refresh()

    return bar, on_progress


_OUTCOMES = ("indexed", "unchanged", "failed", "skipped", "removed")


def _print_results(results, *, unchanged: bool = True) -> None:
    """One line per file (without the unchanged ones unless `unchanged`), then the counts."""
    from app.plain import strip_controls

    for r in results:
        if r.outcome == "unchanged" and not unchanged:
            continue
        detail = r.reason or ""
        if r.outcome == "indexed":
            detail = f"{r.chunks} chunks" + (f"; {r.reason}" if r.reason else "")
        print(strip_controls(f"{r.outcome:9}  {r.path}  {detail}".rstrip()))
    counts = {o: sum(r.outcome == o for r in results) for o in _OUTCOMES}
    print(", ".join(f"{n} {o}" for o, n in counts.items() if n) or "nothing to ingest")


def _cmd_ingest(args: argparse.Namespace) -> int:
    from personal_index.index import IndexWriteError, IngestBusyError

    max_file_mb = _max_file_mb()
    bar, on_progress = _progress_bar(args.json)
    try:
        with _open_index() as index:
            results = index.ingest(args.paths, on_progress, max_file_mb=max_file_mb)
    except (IngestBusyError, IndexWriteError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        _print_results(results)
    return 1 if any(r.outcome == "failed" for r in results) else 0


def _cmd_docs_list(args: argparse.Namespace) -> int:
    from app.plain import strip_controls
    from personal_index.pages import read_pages

    with _open_store() as store, _watch_book() as book:
        rows, stats, folders = store.documents(), store.stats(), store.folders()
        excluded = book.exclusions()
    if args.json:
        out = [r.__dict__ for r in rows]
        out += [
            {"path": e.path, "status": "excluded", "folder": e.folder, "excluded_at": e.excluded_at}
            for e in excluded
        ]
        print(json.dumps(out, indent=2))
        return 0
    for r in rows:
        detail = f"{r.chunk_count} chunks" if r.status == "indexed" else f"failed: {r.error}"
        if pages := read_pages(r):
            detail += f", {pages}"
        print(strip_controls(f"{r.path}  ({r.kind or '?'}, {detail})"))
    for f in folders:
        when = "not synced yet" if f.synced_at is None else f"synced {_when(f.synced_at)}"
        print(strip_controls(f"watching {f.path}  ({when})"))
    for e in excluded:
        print(strip_controls(f"excluded {e.path}  (removed from the watched {e.folder})"))
    if excluded:
        print("`tandem docs include PATH` brings an excluded file back")
    print(
        f"{stats.documents} documents, {stats.chunks} chunks, {stats.failed} failed;"
        f" index at {index_dir()}"
    )
    return 0


def _when(timestamp: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _cmd_docs_remove(args: argparse.Namespace) -> int:
    from app.plain import strip_controls
    from personal_index.watched import remove_documents

    with _open_store() as store, _watch_book() as book:
        removal = remove_documents(store, book, args.path)
    if removal.documents:
        _forget_citations([removal.path])
    for folder in removal.unwatched:
        print(strip_controls(f"stopped watching {folder}"))
    if not removal.documents and not removal.unwatched:
        print(
            strip_controls(f"error: no indexed document at or under {removal.path}"),
            file=sys.stderr,
        )
        return 2
    n = removal.documents
    print(f"removed {n} document{'s' * (n != 1)}")
    if removal.excluded_from is not None:
        print(
            strip_controls(
                f"{removal.path} stays out of the watched folder {removal.excluded_from}: "
                f"`tandem docs include {removal.path}` brings it back"
            )
        )
    return 0


def _cmd_docs_watch(args: argparse.Namespace) -> int:
    """Watch a folder and sync it once now; `/`, the home folder and very large trees need
    --yes (checked before the embedder loads: a refusal is immediate)."""
    from app.plain import strip_controls
    from personal_index.index import IndexWriteError, IngestBusyError
    from personal_index.watched import absolute, watch_guard

    folder = absolute(args.path)
    if not os.path.isdir(folder):
        print(strip_controls(f"error: {folder} is not a folder"), file=sys.stderr)
        return 2
    if not args.yes and (reason := watch_guard(folder)) is not None:
        print(
            strip_controls(
                f"refused: watching {folder} would index {reason} and keep it in sync. "
                "Pass --yes if that is what you want."
            ),
            file=sys.stderr,
        )
        return 2
    max_file_mb = _max_file_mb()
    bar, on_progress = _progress_bar(args.json)
    try:
        with _open_index() as index:
            index.watch(folder, confirmed=True)
            results = index.sync_folder(folder, on_progress, max_file_mb=max_file_mb)
    except (IngestBusyError, IndexWriteError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"folder": folder, "results": [r.__dict__ for r in results]}, indent=2))
    else:
        _print_results(results)
        print(
            strip_controls(
                f"watching {folder}: the app keeps it in sync while it runs; "
                "`tandem docs sync` syncs it now"
            )
        )
    return 1 if any(r.outcome == "failed" for r in results) else 0


def _cmd_docs_unwatch(args: argparse.Namespace) -> int:
    from app.plain import strip_controls
    from personal_index.watched import absolute, is_under, unwatch

    with _open_store() as store, _watch_book() as book:
        real = book.real_path(absolute(args.path))
        folder = unwatch(store, book, args.path)
        kept = sum(
            is_under(d.path, real) or (folder is not None and is_under(d.path, folder))
            for d in store.documents()
        )
        left = [f.path for f in store.folders()]
    if folder is None:
        print(strip_controls(f"error: {absolute(args.path)} is not watched"), file=sys.stderr)
        for other in left:
            print(strip_controls(f"watching {other}"), file=sys.stderr)
        return 2
    print(
        strip_controls(
            f"stopped watching {folder}; its {kept} document{'s' * (kept != 1)} stay in the index "
            f"(`tandem docs remove {folder}` removes them)"
        )
    )
    return 0


def _cmd_docs_sync(args: argparse.Namespace) -> int:
    """Sync the watched folders now (all, or those named); a folder that resolves elsewhere
    than where it was watched is refused with the reason."""
    from app.plain import strip_controls
    from personal_index.index import IndexWriteError, IngestBusyError
    from personal_index.watched import FolderMovedError, absolute

    max_file_mb = _max_file_mb()
    report: list[dict] = []
    bar, on_progress = _progress_bar(args.json)
    try:
        with _open_index() as index:
            folders = [f.path for f in index.folders()]
            if args.paths:
                named = {absolute(p) for p in args.paths}
                unknown = named - set(folders)
                if unknown:
                    bar.close()
                    for path in sorted(unknown):
                        print(strip_controls(f"error: {path} is not watched"), file=sys.stderr)
                    return 2
                folders = [f for f in folders if f in named]
            for folder in folders:
                try:
                    results = index.sync_folder(folder, on_progress, max_file_mb=max_file_mb)
                except FolderMovedError as exc:
                    report.append({"folder": folder, "refused": str(exc), "results": []})
                else:
                    report.append({"folder": folder, "refused": None, "results": results})
    except (IngestBusyError, IndexWriteError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    refused = any(item["refused"] is not None for item in report)
    failed = any(r.outcome == "failed" for item in report for r in item["results"])
    if args.json:
        for item in report:
            item["results"] = [r.__dict__ for r in item["results"]]
        print(json.dumps(report, indent=2))
    elif not report:
        print("no watched folders: `tandem docs watch FOLDER` adds one")
    else:
        for item in report:
            if item["refused"] is not None:
                print(strip_controls(f"refused  {item['refused']}"))
                continue
            print(strip_controls(f"{item['folder']}:"))
            _print_results(item["results"], unchanged=False)
    return 1 if refused or failed else 0


def _cmd_docs_include(args: argparse.Namespace) -> int:
    """Undo an exclusion and sync its folder, so that the file is indexed again at once."""
    from app.plain import strip_controls
    from personal_index.index import IndexWriteError, IngestBusyError
    from personal_index.watched import FolderMovedError, absolute

    try:
        with _open_index() as index:
            gone = index.watches.include(absolute(args.path))
            if not gone:
                print(
                    strip_controls(f"error: nothing excluded at or under {absolute(args.path)}"),
                    file=sys.stderr,
                )
                return 2
            for e in gone:
                print(strip_controls(f"included {e.path} again"))
            status = 0
            for folder in sorted({e.folder for e in gone}):
                try:
                    results = index.sync_folder(folder, max_file_mb=_max_file_mb())
                except FolderMovedError as exc:
                    print(strip_controls(f"refused  {exc}"))
                    status = 1
                    continue
                print(strip_controls(f"{folder}:"))
                _print_results(results, unchanged=False)
    except (IngestBusyError, IndexWriteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status


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


def _chats_store(*, create: bool = False):
    """The conversation history, or None where there is none yet (a listing or a search
    creates no file). Raises ConversationStoreError for a file that cannot be used."""
    from app.conversations import ConversationStore
    from collab.plumbing.paths import conversations_path

    if not create and not conversations_path().exists():
        return None
    return ConversationStore(conversations_path())


def _chats_error(message: str) -> int:
    from app.plain import strip_controls

    print(strip_controls(f"error: {message}"), file=sys.stderr)
    return 2


def _cmd_chats_list(args: argparse.Namespace) -> int:
    from app.conversations import ConversationStoreError
    from app.plain import safe_json, strip_controls

    try:
        store = _chats_store()
        if store is None:
            rows = []
        else:
            with store:
                rows = store.list()
    except ConversationStoreError as exc:
        return _chats_error(str(exc))
    if args.json:
        print(safe_json([r.__dict__ for r in rows]))
        return 0
    if not rows:
        print("no conversations")
    for r in rows:
        print(
            strip_controls(f"{r.id:>5}  {_when(r.updated_at)}  {r.messages:>3} messages  {r.title}")
        )
    return 0


def _cmd_chats_show(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from app.conversations import ConversationNotFound, ConversationStoreError
    from app.plain import safe_json, strip_controls

    try:
        store = _chats_store()
        if store is None:
            return _chats_error(f"no conversation with id {args.id}")
        with store:
            conversation = store.get(args.id)
            messages = store.messages(args.id)
    except (ConversationNotFound, ConversationStoreError) as exc:
        return _chats_error(str(exc))
    if args.json:
        print(safe_json({**asdict(conversation), "messages": [asdict(m) for m in messages]}))
        return 0
    print(strip_controls(f"# {conversation.title}"))
    for m in messages:
        who = "You" if m.role == "user" else f"Tandem ({m.mode})" if m.mode else "Tandem"
        if m.status != "complete":  # as the Markdown export says it
            who += " (incomplete)" if m.status == "streaming" else f" ({m.status})"
        print()
        print(strip_controls(f"{who} · {_when(m.created_at)}"))
        if m.text:
            print(strip_controls(m.text))
        if m.error:
            print(strip_controls(f"error: {m.error}"))
    return 0


def _cmd_chats_search(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from app.conversations import ConversationStoreError
    from app.plain import safe_json, strip_controls

    try:
        store = _chats_store()
        if store is None:
            hits = []
        else:
            with store:
                hits = store.search(args.query, args.limit)
    except ConversationStoreError as exc:
        return _chats_error(str(exc))
    if args.json:
        print(safe_json([asdict(h) for h in hits]))
        return 0
    if not hits:
        print("no matches")
    for h in hits:
        who = "you" if h.role == "user" else "tandem"
        snippet = " ".join(h.snippet.split())
        print(strip_controls(f"{h.conversation_id:>5}  {h.title}  (message {h.message_id}, {who})"))
        print(strip_controls(f"       {snippet}"))
    return 0


def _cmd_chats_export(args: argparse.Namespace) -> int:
    from app.conversations import ConversationNotFound, ConversationStoreError
    from app.plain import safe_json, strip_controls
    from collab.plumbing.files import PRIVATE_FILE_MODE, atomic_write

    try:
        store = _chats_store()
        if store is None:
            return _chats_error(f"no conversation with id {args.id}")
        with store:
            if args.out is not None and args.out.is_dir():  # both files, named after it
                try:
                    written = store.export_files(args.id, args.out)
                except OSError as exc:
                    return _chats_error(f"cannot write to {args.out}: {exc}")
                for path in written:
                    print(strip_controls(f"exported to {path}"), file=sys.stderr)
                return 0
            if args.format == "json":
                data = store.export_json(args.id)
                text = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
            else:
                text = store.export_markdown(args.id)
    except (ConversationNotFound, ConversationStoreError) as exc:
        return _chats_error(str(exc))
    if args.out is None:  # a terminal: no control characters, and JSON on one valid line
        if args.format == "json":
            print(safe_json(data))
        else:
            print(strip_controls(text), end="")
        return 0
    try:
        # 0600 from creation (it quotes private documents), and whole or not at all
        atomic_write(args.out, text, mode=PRIVATE_FILE_MODE)
    except OSError as exc:
        return _chats_error(f"cannot write {args.out}: {exc}")
    print(strip_controls(f"exported to {args.out}"), file=sys.stderr)
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
        "--eta",
        type=float,
        help="split: RAPID's η, how far the device's drafts (which read your documents) pull "
        "the cloud's answer when sampling; 0 = exactly the cloud model, about 20 lets facts "
        "from your documents through (≤ 2 does not)" + from_settings,
    )
    ask.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        help="split: draft on while the cloud verifies (PicoSpec); --no-pipeline waits for "
        "each verdict (stop-and-wait). Same answers either way" + from_settings,
    )
    ask.add_argument(
        "--aggregator",
        choices=AGGREGATORS,
        help="dragon mode's aggregating side (auto: the scheduler picks before every token)"
        + from_settings,
    )
    ask.add_argument(
        "-k",
        type=int,
        help="private passages to retrieve; in dragon, documents per side" + from_settings,
    )
    ask.add_argument(
        "--cloud-url",
        help="ws://host:port or wss://host:port (the session path is added "
        "when none is given; default: $TANDEM_CLOUD_URL, the settings file's, else the "
        "embedded backend)",
    )
    ask.add_argument(
        "--cloud-engine", choices=CLOUD_ENGINES, help="embedded cloud's engine" + from_settings
    )
    ask.add_argument(
        "--no-finish-locally",
        action="store_true",
        help="if the cloud drops mid-answer, stop instead of finishing on the device",
    )
    ask.add_argument(
        "--allow-private-in-cloud",
        action="store_true",
        help="for this answer, let a cloud other than the embedded one take part in an answer "
        "shaped by your documents (dragon; split's drafts): without it, and without an "
        '"always" in the settings, those modes answer without your documents\' context',
    )
    ask.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ask.add_argument(
        "--in",
        dest="within",
        action="append",
        metavar="PATH",
        help="answer from your documents at or under PATH only (a file or folder; repeatable); "
        "the public side is not scoped",
    )
    conversation = ask.add_mutually_exclusive_group()
    conversation.add_argument(
        "-c",
        "--continue",
        action="store_true",
        dest="continue_",
        help="continue the most recent conversation (a new one when there is none): the "
        "question and answer are saved, the earlier turns are the history",
    )
    conversation.add_argument(
        "--conversation",
        type=int,
        metavar="ID",
        help="continue conversation ID (`tandem chats list`); without this or --continue "
        "nothing is saved",
    )
    ask.set_defaults(func=_cmd_ask)

    serve = sub.add_parser("serve", help="run the cloud backend")
    serve.add_argument("--config", type=Path, help="TOML file with a [cloud] table")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    secret = serve.add_mutually_exclusive_group()
    secret.add_argument(
        "--token-file", type=Path, help="read the access token from this file (keep it 0600)"
    )
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
    serve.add_argument(
        "--corpus-focus-words",
        type=int,
        help="words of a public passage a cloud prompt holds (0: all)",
    )
    serve.add_argument(
        "--corpus-floor", type=float, help="relevance below which a public passage is not used"
    )
    serve.add_argument(
        "--max-batch",
        type=int,
        dest="max_batch_sequences",
        help="sequences of all sessions in one pass (1: no batching)",
    )
    serve.add_argument(
        "--document-cache-mb",
        type=float,
        help="memory for public documents' prefix KV, reused by later questions "
        "over them (0: off; default 512)",
    )
    serve.add_argument(
        "--document-cache-scope",
        choices=["user", "session", "all"],
        help="who shares a cached document (default user: one access "
        "token's sessions; all: anyone, who can then time what others "
        "read)",
    )
    serve.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve wss://")
    serve.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    serve.add_argument(
        "--log-file",
        type=Path,
        help="also log to this file (INFO: sessions, requests, refusals), "
        "rotated by size, created 0600",
    )
    serve.add_argument(
        "--log-max-mb",
        type=float,
        default=LOG_MAX_MB,
        help="rotate the log file at this size (default %(default)g)",
    )
    serve.add_argument(
        "--log-backups",
        type=int,
        default=LOG_BACKUPS,
        help="rotated files kept (default %(default)d)",
    )
    serve.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=_cmd_serve)

    ingest = sub.add_parser("ingest", help="index private files and folders (on this device)")
    ingest.add_argument("paths", nargs="+")
    ingest.add_argument("--json", action="store_true")
    ingest.set_defaults(func=_cmd_ingest)
    docs = sub.add_parser("docs", help="list, remove and watch indexed documents")
    dsub = docs.add_subparsers(dest="docs_command", required=True)
    dlist = dsub.add_parser(
        "list", help="indexed documents and failures, watched folders, excluded files"
    )
    dlist.add_argument("--json", action="store_true")
    dlist.set_defaults(func=_cmd_docs_list)
    dremove = dsub.add_parser(
        "remove",
        help="forget a file, or every document under a folder (inside a watched "
        "folder it stays out of its syncs until `docs include`)",
    )
    dremove.add_argument("path")
    dremove.set_defaults(func=_cmd_docs_remove)
    dwatch = dsub.add_parser("watch", help="keep a folder in sync with the index, and sync it now")
    dwatch.add_argument("path")
    dwatch.add_argument(
        "--yes", action="store_true", help="watch / , the home folder or a very large tree"
    )
    dwatch.add_argument("--json", action="store_true")
    dwatch.set_defaults(func=_cmd_docs_watch)
    dunwatch = dsub.add_parser("unwatch", help="stop keeping a folder in sync (its documents stay)")
    dunwatch.add_argument("path")
    dunwatch.set_defaults(func=_cmd_docs_unwatch)
    dsync = dsub.add_parser("sync", help="sync the watched folders now (all, or those named)")
    dsync.add_argument("paths", nargs="*")
    dsync.add_argument("--json", action="store_true")
    dsync.set_defaults(func=_cmd_docs_sync)
    dinclude = dsub.add_parser(
        "include", help="bring back a file removed from a watched folder (and sync it now)"
    )
    dinclude.add_argument("path")
    dinclude.set_defaults(func=_cmd_docs_include)
    chats = sub.add_parser("chats", help="list, show, search and export conversations")
    csub = chats.add_subparsers(dest="chats_command", required=True)
    clist = csub.add_parser("list", help="conversations, the most recently updated first")
    clist.add_argument("--json", action="store_true")
    clist.set_defaults(func=_cmd_chats_list)
    cshow = csub.add_parser("show", help="a conversation's messages in order")
    cshow.add_argument("id", type=int)
    cshow.add_argument("--json", action="store_true")
    cshow.set_defaults(func=_cmd_chats_show)
    csearch = csub.add_parser(
        "search",
        help="messages holding every word of QUERY (questions and answers; "
        "accents and case ignored; a word ending in * matches as a prefix)",
    )
    csearch.add_argument("query")
    csearch.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    csearch.add_argument("--json", action="store_true")
    csearch.set_defaults(func=_cmd_chats_search)
    cexport = csub.add_parser("export", help="a conversation as Markdown (default) or JSON")
    cexport.add_argument("id", type=int)
    cexport.add_argument("--format", choices=["md", "json"], default="md")
    cexport.add_argument(
        "--out",
        type=Path,
        help="write it to this file (0600), or into this folder as both "
        "<title>-<id>.md and .json (default: stdout)",
    )
    cexport.set_defaults(func=_cmd_chats_export)
    search = sub.add_parser("search", help="search the private index")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=5)
    search.add_argument("--min-score", type=float, help="leave out passages less relevant")
    search.add_argument(
        "--mode",
        choices=["dense", "keyword", "hybrid"],
        default="hybrid",
        help="by meaning, by keyword, or both (answers use both)",
    )
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
