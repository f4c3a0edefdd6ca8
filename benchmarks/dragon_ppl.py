"""DRAGON §7.3 / Figure 5: language-model perplexity when the retrieved documents are split
between the device and the cloud, as the number of documents per side grows.

    python -m benchmarks.dragon_ppl                     # 40 windows, 0–8 documents a side
    python -m benchmarks.dragon_ppl --windows 10 --counts 0 2 --settings same
    python -m benchmarks.dragon_ppl --quick             # CI: 1 window, and the network check

Held-out text: the Wikipedia excerpt in gensim's wheel (`benchmarks.heldout`). Windows of 128
tokens (the real tokenizer), one from each article in turn; the first eighth is the retrieval
query and the context, the other seven eighths are scored. Retrieval: the public corpus's top
2k passages for the query (passages titled like the window's own article are left out, as
RETRO filters neighbours from the same document), split between the sides as the paper does
(alternating halves of the same ranking: the cloud ranks 1, 3, 5…, the device 2, 4, 6…), each
cut to its first 64 tokens. Plain text, no chat template: [documents; window].

    no-retrieval  the device model on the window alone (and the cloud model: "cloud alone")
    crcg-device   the device model, its k documents concatenated before the window
    crcg-cloud    the cloud model, its k documents concatenated
    drcg          the device model, all 2k documents concatenated (context aggregation)
    dragon        output aggregation: log p(x) = logsumexp_d [log softmax(R)_d + log p_d(x)]
                  over all 2k documents, each scored alone by its own side's model
    dragon-rerank the same with dynamic re-ranking (§4.1): every 8 tokens R is recomputed from
                  the cosine of each document with the query plus the text scored so far
    dragon-random the control for plain ensembling (`--random-control`): DRAGON's mixture,
                  weighted the same way (relevance of each passage's cosine with the query),
                  over the same number of RANDOM passages of the corpus per side, not
                  retrieved for the window: what averaging several differently conditioned
                  predictions gains without retrieval

Settings: `same` (the device model on both sides, as the paper; the 0.5B for cost) and `pair`
(Tandem's real pair). DRAGON and DRDG give the same teacher-forced outputs (§7.3), so DRDG is
not repeated. The network check: for `--check` windows the cloud's half of DRAGON is computed
by a real `tandem serve` over a websocket (policy SCORE: teacher forcing over its own top-k
public passages in the product's per-document prompts) and must equal the same mixture computed
in this process, position by position. JSON goes to benchmarks/results/dragon/ppl-<name>.json."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if __package__ in (None, ""):  # run as a file: the repository root is the import root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collab.dragon.aggregation import logsumexp
from collab.dragon.ledger import RELEVANCE_SCALE, relevance

log = logging.getLogger("tandem.bench")

if TYPE_CHECKING:
    from benchmarks.heldout import Article
    from model_runtime.runtime import CausalLM

RESULTS = Path(__file__).resolve().parent / "results" / "dragon"
WIDTH = 128  # tokens per window
DOC_TOKENS = 64
COUNTS = (0, 1, 2, 4, 8)  # documents per side
METHODS = (
    "no-retrieval",
    "cloud-alone",
    "crcg-device",
    "crcg-cloud",
    "drcg",
    "dragon",
    "dragon-rerank",
)
CONTROL = "dragon-random"  # the plain-ensembling control's line (not in METHODS: an option)
RERANK_EVERY = 8  # tokens between re-rankings (DRAGON §4.1), for the dragon-rerank line
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Window:
    title: str
    ids: list[int]

    @property
    def split(self) -> int:
        return len(self.ids) // 8

    @property
    def context(self) -> list[int]:
        return self.ids[: self.split]

    @property
    def targets(self) -> list[int]:
        return self.ids[self.split :]


def make_windows(
    articles: Sequence[Article], tokenizer: Any, n: int, width: int = WIDTH
) -> list[Window]:
    """`n` windows of `width` tokens: the first window of each article, then the second…"""
    per_article = []
    for a in articles:
        ids = tokenizer.encode(a.text)
        per_article.append(
            [Window(a.title, ids[i : i + width]) for i in range(0, len(ids) - width + 1, width)]
        )
    out: list[Window] = []
    for depth in range(max(map(len, per_article), default=0)):
        for windows in per_article:
            if depth < len(windows):
                out.append(windows[depth])
                if len(out) == n:
                    return out
    return out


def logprobs(lm: CausalLM, context: Sequence[int], targets: Sequence[int]) -> np.ndarray:
    """log p(targets[t] | context, targets[:t]) for every t, float64."""
    first = lm.prefill([list(context)])[0]
    rows = [first[None, :]]
    if len(targets) > 1:
        rows.append(lm.forward([list(targets[:-1])])[0])
    z = np.concatenate(rows).astype(np.float64)
    picked = z[np.arange(len(targets)), np.asarray(targets)]
    out: np.ndarray = picked - logsumexp(z, axis=1)
    return out


@dataclass
class Documents:
    """One window's retrieved passages (as token ids, cut), their relevance, and the hits
    themselves (for re-ranking)."""

    cloud: list[list[int]]
    device: list[list[int]]
    cloud_scores: np.ndarray
    device_scores: np.ndarray
    cloud_hits: list[Any] = field(default_factory=list)
    device_hits: list[Any] = field(default_factory=list)


# cosines of the hits with a text (`PublicCorpus.rescore`)
Rescore = Callable[[Sequence[Any], str], np.ndarray]


def retrieve(corpus: Any, tokenizer: Any, window: Window, most: int) -> Documents:
    """The top 2·most passages for the window's first eighth, its own article's left out,
    split alternately (the cloud takes ranks 1, 3, …), each cut to DOC_TOKENS tokens."""
    query = tokenizer.decode(window.context)
    hits = [
        h
        for h in corpus.search(query, 2 * most + 8)
        if h.title.strip().lower() != window.title.strip().lower()
    ][: 2 * most]
    ids = [tokenizer.encode(h.text)[:DOC_TOKENS] for h in hits]
    cos = np.array([h.score for h in hits])
    return Documents(
        ids[0::2], ids[1::2], relevance(cos[0::2]), relevance(cos[1::2]), hits[0::2], hits[1::2]
    )


def random_documents(
    corpus: Any, tokenizer: Any, window: Window, most: int, rng: np.random.Generator
) -> Documents:
    """2·most passages drawn at random from the whole corpus (the window's own article left
    out), split and cut as `retrieve` does, weighted by the relevance of their cosine with the
    window's query as retrieved ones are: the plain-ensembling control."""
    store = corpus.store
    ids = [row[0] for row in store.db.execute("SELECT id FROM chunks ORDER BY id")]
    own = window.title.strip().lower()
    chosen: list[Any] = []
    for i in rng.permutation(len(ids)):
        chunk = store.get_chunks([ids[int(i)]])[0]
        if (chunk.title or "").strip().lower() != own:
            chosen.append(chunk)
        if len(chosen) == 2 * most:
            break
    docs = [tokenizer.encode(c.text)[:DOC_TOKENS] for c in chosen]
    cos = np.asarray(corpus.rescore(chosen, tokenizer.decode(window.context)), dtype=np.float64)
    return Documents(
        docs[0::2],
        docs[1::2],
        relevance(cos[0::2]),
        relevance(cos[1::2]),
        chosen[0::2],
        chosen[1::2],
    )


def with_docs(docs: Sequence[list[int]], sep: list[int], context: list[int]) -> list[int]:
    return [t for d in docs for t in (*d, *sep)] + context


def score_window(
    window: Window,
    docs: Documents,
    counts: Sequence[int],
    device: CausalLM,
    cloud: CausalLM,
    sep: list[int],
    rerank: tuple[Rescore, Callable[[list[int]], str]] | None = None,
    control: Documents | None = None,
) -> dict[str, dict[int, float]]:
    """Summed log-likelihood of the window's targets under every method at every count.
    `rerank` (the hits' rescoring and the tokenizer's decode) adds dragon-rerank; `control`
    (random passages, `random_documents`) adds dragon-random."""
    ctx, tgt = window.context, window.targets
    bare_device = float(logprobs(device, ctx, tgt).sum())
    bare_cloud = float(logprobs(cloud, ctx, tgt).sum())
    out: dict[str, dict[int, float]] = {m: {} for m in METHODS}
    per_doc: dict[tuple[str, int], np.ndarray] = {}

    def doc_lp(side: str, i: int, of: Documents = docs) -> np.ndarray:
        key = (side + ("" if of is docs else "-control"), i)
        if key not in per_doc:
            lm, d = (device, of.device[i]) if side == "device" else (cloud, of.cloud[i])
            per_doc[key] = logprobs(lm, with_docs([d], sep, ctx), tgt)
        return per_doc[key]

    def mixture(of: Documents, k: int) -> float:
        """DRAGON's output aggregation over k documents a side of `of`."""
        kd, kc = min(k, len(of.device)), min(k, len(of.cloud))
        if k == 0 or kd + kc == 0:
            return bare_device
        rows = [doc_lp("cloud", i, of) for i in range(kc)]
        rows += [doc_lp("device", i, of) for i in range(kd)]
        scores = np.concatenate([of.cloud_scores[:kc], of.device_scores[:kd]])
        log_w = scores - logsumexp(scores)
        return float(logsumexp(np.array(rows) + log_w[:, None], axis=0).sum())

    if control is not None:
        out[CONTROL] = {k: mixture(control, k) for k in counts}

    for k in counts:
        out["no-retrieval"][k], out["cloud-alone"][k] = bare_device, bare_cloud
        kd, kc = min(k, len(docs.device)), min(k, len(docs.cloud))
        if k == 0 or kd + kc == 0:
            for m in ("crcg-device", "drcg", "dragon"):
                out[m][k] = bare_device
            out["crcg-cloud"][k] = bare_cloud
            continue
        out["crcg-device"][k] = (
            float(logprobs(device, with_docs(docs.device[:kd], sep, ctx), tgt).sum())
            if kd
            else bare_device
        )
        out["crcg-cloud"][k] = (
            float(logprobs(cloud, with_docs(docs.cloud[:kc], sep, ctx), tgt).sum())
            if kc
            else bare_cloud
        )
        interleaved = (
            [d for pair in zip(docs.cloud[:kc], docs.device[:kd], strict=False) for d in pair]
            + docs.cloud[kd:kc]
            + docs.device[kc:kd]
        )
        out["drcg"][k] = float(logprobs(device, with_docs(interleaved, sep, ctx), tgt).sum())
        out["dragon"][k] = mixture(docs, k)
        if rerank is not None:
            rows = [doc_lp("cloud", i) for i in range(kc)]
            rows += [doc_lp("device", i) for i in range(kd)]
            scores = np.concatenate([docs.cloud_scores[:kc], docs.device_scores[:kd]])
            hits = docs.cloud_hits[:kc] + docs.device_hits[:kd]
            weights = reranked_weights(hits, scores, tgt, *rerank, query=window.context)
            out["dragon-rerank"][k] = float(logsumexp(np.array(rows) + weights, axis=0).sum())
    if rerank is None:
        del out["dragon-rerank"]
    else:
        for k in counts:
            out["dragon-rerank"].setdefault(k, out["dragon"][k])  # no documents: nothing to rank
    return out


def reranked_weights(
    hits: Sequence[Any],
    scores: np.ndarray,
    targets: Sequence[int],
    rescore: Rescore,
    decode: Callable[[list[int]], str],
    query: Sequence[int],
    every: int = RERANK_EVERY,
) -> np.ndarray:
    """log softmax(R) per document and position [D, T]: the retrieval scores until the first
    `every` tokens are scored, then R = RELEVANCE_SCALE · cosine(document, query + the text
    scored so far), recomputed every `every` tokens, as the product's re-ranking does."""
    out = np.empty((len(hits), len(targets)))
    current = scores - logsumexp(scores)
    for t in range(len(targets)):
        if t and t % every == 0:
            r = relevance(rescore(hits, decode(list(query)) + " " + decode(list(targets[:t]))))
            current = r - logsumexp(r)
        out[:, t] = current
    return out


def perplexities(results: Sequence[dict[str, dict[int, float]]], tokens: int) -> dict:
    """exp(−mean log-likelihood per scored token), per method and count."""
    methods = results[0]
    return {
        m: {k: math.exp(-sum(r[m][k] for r in results) / tokens) for k in methods[m]}
        for m in methods
    }


def check_targets(ppl: dict[str, dict[int, float]]) -> list[tuple[int, str, bool]]:
    """DRAGON ≤ every baseline at every count ≥ 2: (count, baseline, holds)."""
    out: list[tuple[int, str, bool]] = []
    for k in sorted(ppl["dragon"]):
        if k < 2:
            continue
        for m in ("no-retrieval", "cloud-alone", "crcg-device", "crcg-cloud", "drcg"):
            if m not in ppl:
                continue
            out.append((k, m, ppl["dragon"][k] <= ppl[m][k]))
    return out


# ---------------------------------------------------------------------------- the network


async def network_check(
    window: Window,
    tokenizer: Any,
    cloud_lm: CausalLM,
    corpus: Any,
    url: str,
    token: str,
    k: int = 2,
) -> float:
    """The cloud's teacher-forced mixture over the link (policy SCORE) vs this process: the
    largest per-token difference in log-probability."""
    from collab.dragon.ledger import side_logprobs
    from collab.protocol import (
        AggregatorPolicy,
        Done,
        DragonScore,
        DragonSequence,
        DragonSetup,
        Generate,
        Mode,
        Side,
    )
    from edge_runtime.client import CloudClient
    from model_runtime.prompting import document_prompt, prompt_budget
    from model_runtime.tokenizer import tokenizer_fingerprint

    question, answer = tokenizer.decode(window.context), window.targets
    fingerprint = bytes.fromhex(tokenizer_fingerprint(tokenizer))
    client = CloudClient(url, token, Mode.DRAGON, "", fingerprint, "ppl-check")
    await client.connect()
    try:
        await client.send(
            Generate(question, max_new_tokens=len(answer), temperature=1.0, request_id=1)
        )
        await client.send(DragonSetup(k, AggregatorPolicy.SCORE, Side.DEVICE, request_id=1))
        await client.send(DragonScore(np.asarray(answer), request_id=1))
        scored = None
        while True:
            msg = await client.recv(timeout=600)
            if isinstance(msg, DragonSequence):
                scored = msg
            elif isinstance(msg, Done):
                break
    finally:
        await client.close()
    if scored is None:
        raise RuntimeError("the cloud sent no scores")
    passages = [replace(p, number=i) for i, p in enumerate(corpus.search(question, k), 1)]
    budget = prompt_budget(cloud_lm.max_context, len(answer))
    prompts = [document_prompt(tokenizer, question, [], p, budget)[0] for p in passages]
    cos = np.array([p.score for p in passages])
    # the cloud's computation, in this process: one batch of the documents' prompts, then the
    # answer fed to every sequence (ONNX Runtime's int4 kernels give other roundings for other
    # batch shapes, so the reference batches as the cloud does)
    first = cloud_lm.prefill(prompts)
    logits = np.concatenate(
        [first[:, None, :], cloud_lm.forward([answer[:-1]] * len(prompts))], axis=1
    )
    here = side_logprobs(logits, relevance(cos), np.asarray(answer), 1.0)
    return float(np.max(np.abs(here - scored.logprobs.astype(np.float64))))


# ---------------------------------------------------------------------------- the run


def load_models(settings: Sequence[str], threads: int, check: bool) -> tuple[Any, dict[str, Any]]:
    """The tokenizer, and the device model and each setting's cloud model (ONNX Runtime, as
    the product runs them); the real cloud model also when the network check needs it."""
    from model_runtime.ort_runtime import OrtCausalLM
    from model_runtime.tokenizer import load_tokenizer
    from tandem_packaging.prepare import model_path

    device_dir = model_path("device", "onnx-quant")
    device = OrtCausalLM(device_dir, threads=threads, allow_spinning=False)
    clouds = {"same": device}
    if "pair" in settings or check:
        clouds["pair"] = OrtCausalLM(
            model_path("cloud", "onnx-quant"), threads=threads, allow_spinning=False
        )
    return load_tokenizer(device_dir), {"device": device, **clouds}


def run(args: argparse.Namespace) -> dict:
    from benchmarks.heldout import load_articles
    from cloud_backend.corpus import PublicCorpus, default_corpus_dir, default_embedder_dir

    tokenizer, models = load_models(args.settings, args.threads, args.check > 0)
    corpus = PublicCorpus.open(default_corpus_dir(), default_embedder_dir())
    windows = make_windows(load_articles(), tokenizer, args.windows)
    sep = tokenizer.encode(SEPARATOR)
    most = max(args.counts)
    out: dict[str, Any] = {"windows": len(windows), "tokens": sum(len(w.targets) for w in windows)}
    docs = [retrieve(corpus, tokenizer, w, most) for w in windows]
    rng = np.random.default_rng(args.seed)
    controls: list[Documents | None] = [
        random_documents(corpus, tokenizer, w, most, rng) if args.random_control else None
        for w in windows
    ]
    for setting in args.settings:
        results = []
        for i, (w, d, c) in enumerate(zip(windows, docs, controls, strict=True)):
            rerank = (corpus.rescore, tokenizer.decode)
            results.append(
                score_window(
                    w, d, args.counts, models["device"], models[setting], sep, rerank, control=c
                )
            )
            print(f"{setting}: window {i + 1}/{len(windows)} ({w.title})", file=sys.stderr)
        ppl = perplexities(results, out["tokens"])
        out[setting] = {"perplexity": ppl, "targets": check_targets(ppl)}
        print_table(setting, ppl)
    if args.check:
        try:
            cloud = args.cloud_file or args.cloud_url
            out["network_check"] = asyncio.run(
                _checks(windows[: args.check], tokenizer, models["pair"], corpus, cloud)
            )
        except Exception as exc:  # the perplexities above cost an hour: keep them
            log.exception("the network check failed")
            out["network_check_error"] = f"{type(exc).__name__}: {exc}"
    return out


async def _checks(
    windows: Sequence[Window],
    tokenizer: Any,
    cloud_lm: Any,
    corpus: Any,
    cloud_url: str | Path | None = None,
) -> list[float]:
    """The network check of each window, over the ort cloud at `cloud_url` (`dragon_eval`'s,
    shared with the grid: its token in the environment; or a file it writes both to once the
    cloud is up) or a new `tandem serve`."""
    from benchmarks.common import start_cloud
    from benchmarks.dragon import CLOUD_TOKEN_ENV

    cloud = None
    if isinstance(cloud_url, Path):  # dragon_eval's, once it has started
        url, token = await _published(cloud_url)
    elif cloud_url:
        url, token = cloud_url, os.environ[CLOUD_TOKEN_ENV]
    else:
        cloud, url, token = await start_cloud("ort", None, corpus=True)
    try:
        diffs = [await network_check(w, tokenizer, cloud_lm, corpus, url, token) for w in windows]
    finally:
        if cloud is not None:
            await cloud.stop()
    for d in diffs:
        print(f"network check: largest |Δ log p| per token {d:.2e}")
    return diffs


async def _published(where: Path, timeout_s: float = 1800.0) -> tuple[str, str]:
    """The URL and token `dragon_eval` writes to `where` once its cloud is up."""
    deadline = time.monotonic() + timeout_s
    while not where.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no cloud in {where} after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)
    lines = where.read_text().split()
    if len(lines) != 2:
        raise RuntimeError("the shared cloud did not start (benchmarks.dragon_eval)")
    return lines[0], lines[1]


def print_table(setting: str, ppl: dict[str, dict[int, float]]) -> None:
    counts = sorted(next(iter(ppl.values())))
    print(f"\n{setting} — perplexity by documents per side")
    print(f"  {'method':14}" + "".join(f"{k:>9}" for k in counts))
    for m, row in ppl.items():
        print(f"  {m:14}" + "".join(f"{row[k]:>9.2f}" for k in counts))
    for k, m, ok in check_targets(ppl):
        if not ok:
            print(f"  FAIL dragon > {m} at {k} documents a side")
    if all(ok for _, _, ok in check_targets(ppl)):
        print("  PASS dragon ≤ every baseline at every count ≥ 2")
    for k, share in retrieval_share(ppl).items():
        print(
            f"  {k} a side: retrieval {share:.0%} of DRAGON's gain over no-retrieval "
            "(the rest: plain ensembling of random passages)"
        )


def retrieval_share(ppl: dict[str, dict[int, float]]) -> dict[int, float]:
    """Per count > 0 with the control: the part of DRAGON's drop in log-perplexity below
    no-retrieval that random passages, aggregated the same way, do not also give."""
    if CONTROL not in ppl:
        return {}
    out = {}
    for k in sorted(ppl[CONTROL]):
        base = math.log(ppl["no-retrieval"][k])
        gain = base - math.log(ppl["dragon"][k])
        if k > 0 and gain > 0:
            out[k] = (math.log(ppl[CONTROL][k]) - math.log(ppl["dragon"][k])) / gain
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--counts", nargs="+", type=int, default=list(COUNTS))
    parser.add_argument("--settings", nargs="+", default=["same", "pair"], choices=["same", "pair"])
    parser.add_argument("--check", type=int, default=2, help="windows checked over the network")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cloud-url",
        help="check over this running ort cloud with its corpus (token in "
        "$TANDEM_BENCH_CLOUD_TOKEN) instead of starting one: the policy SCORE takes k from "
        "the request, and its prefill is the same with the document cache on or off",
    )
    parser.add_argument(
        "--cloud-file",
        type=Path,
        help="the same, its URL and token read from this file once it appears (dragon_eval "
        "writes it when the cloud it starts meanwhile is up)",
    )
    parser.add_argument(
        "--random-control",
        action="store_true",
        help=f"add {CONTROL}: the mixture over random passages (a control)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the random passages' seed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI: 1 window, 0–2 documents a side, same model, 1 network check",
    )
    parser.add_argument("--name", help="results/dragon/ppl-<name>.json (default: time)")
    parser.add_argument("--out", type=Path, help="write the JSON here instead")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.counts, args.settings, args.check = 1, [0, 1, 2], ["same"], 1
    started = time.time()
    out = run(args)
    name = args.name or ("quick" if args.quick else time.strftime("%Y%m%d-%H%M%S"))
    path = args.out or RESULTS / f"ppl-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    from benchmarks.provenance import command_line, record

    prov = record(
        command_line("benchmarks.dragon_ppl", argv),
        threads={"ort": args.threads},
        engines=["onnxruntime"],
    )
    path.write_text(
        json.dumps(
            {
                "provenance": prov,
                "config": config,
                "seconds": time.time() - started,
                "relevance_scale": RELEVANCE_SCALE,
                **out,
            },
            indent=1,
        )
    )
    print(f"\n{time.time() - started:.0f} s; written to {path}")


if __name__ == "__main__":
    main()
