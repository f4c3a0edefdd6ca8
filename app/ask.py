"""`tandem ask`: one question in any mode, streamed to the terminal (or one JSON object).

It drives the same `Assistant` as the TUI, built from the same settings file; flags given on
the command line override it for this question. What it prints carries model output, document
titles, cloud text and error messages: every line goes out through `_say`, without control
characters (an escape sequence would be obeyed by the terminal), and `--json` is always one
valid JSON object (`app.plain.safe_json`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from app.figures import mode_parts
from app.plain import safe_json, strip_controls


def _say(text: str = "", *, err: bool = False, end: str = "\n") -> None:
    """Print untrusted text: C0/C1 controls stripped (newline and tab kept)."""
    print(strip_controls(text), end=end, file=sys.stderr if err else sys.stdout, flush=True)


def _show_progress(status) -> None:
    """The embedded cloud's first start (its corpus build), on one stderr line."""
    if status.state == "starting" and status.detail.startswith("indexing"):
        print("\r", end="", file=sys.stderr)  # ours: back to the line's start
        _say(status.detail, err=True, end="")
    elif status.state != "starting":
        _say(err=True)


def _format_stats(s: dict[str, Any], device: str) -> str:
    parts = [
        s["mode"] + (f"/{s['variant']}" if s.get("variant") else ""),
        device,
        f"{s['tokens']} tokens",
    ]
    if s.get("ttft_s") is not None:
        parts.append(f"TTFT {s['ttft_s']:.2f} s")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:.1f} tok/s")
    if s.get("acceptance") is not None:
        parts.append(f"acceptance {s['acceptance']:.2f} · {s['rounds']} rounds")
    parts += mode_parts(s)  # γ, AS², dragon's, the pipeline's, RAPID, …
    if s["bytes_up"] or s["bytes_down"]:
        parts.append(f"↑ {s['bytes_up']:,} B ↓ {s['bytes_down']:,} B")
    return "[" + " · ".join(parts) + "]"


def _sent(exchange, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """What left the device for the answer (edge_runtime.sent), out of the figures: the
    answer's ledger as far as it got, [] where nothing was sent."""
    sent = summary.pop("sent", None)
    if sent is None and exchange.stats is None:  # it ended before its figures came
        live = exchange.live_stats()
        sent = live.sent if live is not None else None
    return list(sent or [])


def settings_for(args: argparse.Namespace):
    """The settings file, with this command's flags on top (a flag left out keeps the file's
    value). A settings file that cannot be read is reported and the defaults are used."""
    from app.settings import Settings, SettingsError, load_settings

    try:
        settings = load_settings()
    except SettingsError as exc:
        _say(f"warning: {exc}; using the defaults", err=True)
        settings = Settings()
    flags = {
        "variant": args.variant,
        "aggregator": args.aggregator,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "eta": args.eta,
        "pipeline": args.pipeline,
        "cloud_url": args.cloud_url,
        "cloud_engine": args.cloud_engine,
    }
    return dataclasses.replace(settings, **{k: v for k, v in flags.items() if v is not None})


def _conversation_for(assistant, args: argparse.Namespace) -> int | None:
    """The conversation `--conversation ID` or `--continue` names (None: `--continue` with
    none stored yet, so a new one starts). Raises ConversationNotFound for an unknown ID."""
    store = assistant.conversations
    if args.conversation is not None:
        conversation = store.get(args.conversation)
    else:
        latest = store.list()[:1]
        if not latest:
            return None
        conversation = latest[0]
    if not args.json:
        _say(f"(continuing: {conversation.title})", err=True)
    return conversation.id


async def run_ask(args: argparse.Namespace) -> int:
    from app.assistant import Assistant, ScopeError
    from app.conversations import ConversationNotFound, ConversationStoreError
    from app.settings import effective_cloud
    from collab.sources import Source
    from edge_runtime.events import Citation, Failure, ModeChoice, Notice, TextDelta

    out: dict[str, Any] = {"answer": "", "citations": [], "notices": [], "errors": []}
    assistant = Assistant(settings_for(args), finish_locally=not args.no_finish_locally)
    # --continue / --conversation: the question and answer are stored, the earlier turns are
    # the history; without them nothing is saved
    save = (
        bool(getattr(args, "continue_", False)) or getattr(args, "conversation", None) is not None
    )
    conversation_id = None
    try:
        if save:
            try:
                conversation_id = _conversation_for(assistant, args)
            except (ConversationNotFound, ConversationStoreError) as exc:
                _say(f"error: {exc}", err=True)
                return 2
        device = assistant.load_device()
        if args.mode != "cloud":
            assistant.existing_index()
        if assistant.may_use_cloud(args.mode):
            if not effective_cloud(assistant.settings)[0] and not args.json:
                _say("starting the embedded cloud backend…", err=True)
            status = await assistant.connect_cloud(None if args.json else _show_progress)
            if status.state != "ready":
                out["errors"].append(f"{status.label}: {status.detail}")
                if not args.json:
                    _say(f"error: {status.label}: {status.detail}", err=True)
        try:
            scope = assistant.scope(args.within) if getattr(args, "within", None) else ()
        except ScopeError as exc:
            _say(f"error: {exc}", err=True)
            return 2
        options = assistant.options(
            top_p=args.top_p,
            seed=args.seed,
            scope=scope,
            allow_private_in_cloud=args.allow_private_in_cloud,
        )
        exchange = assistant.exchange(
            args.question, args.mode, options=options, save=save, conversation_id=conversation_id
        )
        async for event in exchange.events():
            if isinstance(event, TextDelta) and not args.json:
                _say(event.text, end="")
            elif isinstance(event, ModeChoice):
                out["choice"] = {"mode": event.mode, "reason": event.reason}
                if not args.json:
                    _say(f"(auto: {event.mode} — {event.reason})", err=True)
            elif isinstance(event, Notice):
                out["notices"].append(event.text)
                if not args.json:
                    _say(f"\n({event.text})", err=True)
            elif isinstance(event, Failure):
                out["errors"].append(event.message)
                if not args.json:
                    _say(f"\nerror: {event.message}", err=True)
            elif isinstance(event, Citation):
                pass  # collected by the exchange
    finally:
        await assistant.close()
    # by number: dragon's device passages (numbered after the cloud's) arrive first
    out["answer"] = exchange.text
    out["citations"] = sorted(exchange.citations, key=lambda row: row["number"])
    summary = exchange.stats.as_dict() if exchange.stats else {}
    if save:
        out["conversation_id"] = exchange.conversation_id
    if args.json:
        out["sent"] = _sent(exchange, summary)
        print(safe_json({**out, "stats": summary, "device_model": device.name}), flush=True)
    else:
        _say()
        for row in out["citations"]:
            _say(Source.from_dict(row).line())
        if summary:
            _say(_format_stats(summary, device.name), err=True)
    return 1 if out["errors"] and not out["answer"] else 0
