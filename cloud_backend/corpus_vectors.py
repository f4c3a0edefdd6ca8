"""Vectors shipped with the project for the public corpus, so a fresh install's first start
does not spend minutes embedding 10,033 summaries on one core (issue 46).

`data/public-vectors.npz` holds one int8 vector per distinct chunk text (the text the embedder
reads, keyed by its sha256), a scale per vector, and what made them: the embedder's model
file checksum, the summaries' checksum and the chunker. A build uses a shipped vector for a
chunk whose text it holds, and embeds the rest; but first it spot-checks the file against this
machine's embedder (`SPOT_CHECKS` chunks spread over the corpus, each within `MIN_COSINE`), and
ignores it when they disagree, so a different export or a damaged file costs time, never
relevance.

    python -m cloud_backend.corpus --write-vectors    # regenerate the shipped file (minutes)
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from collab.plumbing.files import atomic_write, sha256_file

__all__ = [
    "MIN_COSINE",
    "SHIPPED",
    "SPOT_CHECKS",
    "ShippedVectors",
    "spot_check",
    "text_key",
    "write",
]

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "data" / "public-vectors.npz"
SPOT_CHECKS = 16
# int8 with a scale per vector keeps cosine ≈ 0.9999 to what was stored; a different CPU's
# kernels move it by ~1e-3; another quantisation of the embedder by ~1e-2: that is refused.
MIN_COSINE = 0.995


def text_key(text: str) -> int:
    """The first 8 bytes of the text's sha256, as the file's sorted uint64 keys hold them."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def _quantize(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scales = np.maximum(np.abs(vectors).max(axis=1), 1e-12) / 127.0
    codes = np.clip(np.rint(vectors / scales[:, None]), -127, 127).astype(np.int8)
    return codes, scales.astype(np.float32)


@dataclass(frozen=True)
class ShippedVectors:
    """The shipped file, opened: look vectors up by chunk text."""

    keys: np.ndarray  # uint64, sorted, distinct
    codes: np.ndarray  # int8 [n, dim]
    scales: np.ndarray  # float32 [n]
    info: dict[str, Any]

    @classmethod
    def load(cls, path: Path = SHIPPED) -> ShippedVectors | None:
        """The file at `path`, or None (with the reason logged) when it is missing or unreadable:
        a build then embeds everything, as before."""
        try:
            with np.load(path, allow_pickle=False) as data:
                keys, codes, scales = data["keys"], data["codes"], data["scales"]
                info = json.loads(bytes(data["info"]).decode("utf-8"))
        except FileNotFoundError:
            log.info("no shipped public-corpus vectors at %s: embedding every summary", path)
            return None
        except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as exc:
            log.warning(
                "shipped public-corpus vectors at %s are unreadable (%s): ignored", path, exc
            )
            return None
        n = len(keys)
        if (
            keys.dtype != np.uint64
            or codes.dtype != np.int8
            or codes.ndim != 2
            or codes.shape[0] != n
            or scales.shape != (n,)
            or (n > 1 and not bool(np.all(keys[1:] > keys[:-1])))
            or not isinstance(info, dict)
        ):
            log.warning("shipped public-corpus vectors at %s are malformed: ignored", path)
            return None
        return cls(keys, codes, scales.astype(np.float32), info)

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(found, vectors): whether each text has a shipped vector, and the unit vectors of
        those that do (rows of the others are zero)."""
        wanted = np.array([text_key(t) for t in texts], dtype=np.uint64)
        at = np.searchsorted(self.keys, wanted)
        at_clipped = np.minimum(at, max(len(self.keys) - 1, 0))
        found = (
            (at < len(self.keys)) & (self.keys[at_clipped] == wanted)
            if len(self.keys)
            else (np.zeros(len(texts), dtype=bool))
        )
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)
        rows = at_clipped[found]
        raw = self.codes[rows].astype(np.float32) * self.scales[rows, None]
        vectors[found] = raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)
        return found, vectors


def spot_check(
    shipped: ShippedVectors, texts: Sequence[str], embed: Callable[[list[str]], np.ndarray]
) -> float | None:
    """The lowest cosine between the shipped vector and this machine's embedding over up to
    `SPOT_CHECKS` of `texts` that the file holds, spread evenly; None when it holds none."""
    found, vectors = shipped.lookup(texts)
    held = np.flatnonzero(found)
    if len(held) == 0:
        return None
    picks = held[np.unique(np.linspace(0, len(held) - 1, min(SPOT_CHECKS, len(held))).astype(int))]
    mine = embed([texts[i] for i in picks])
    return float(np.min(np.sum(mine * vectors[picks], axis=1)))


def write(
    path: Path, texts: Sequence[str], vectors: np.ndarray, info: dict[str, Any]
) -> dict[str, Any]:
    """Store one vector per distinct text (the first one given), with `info`; returns what was
    written (sizes and checksum) for the log."""
    by_key: dict[int, int] = {}
    for i, text in enumerate(texts):
        by_key.setdefault(text_key(text), i)
    keys = np.array(sorted(by_key), dtype=np.uint64)
    rows = np.array([by_key[int(k)] for k in keys], dtype=np.int64)
    codes, scales = _quantize(np.asarray(vectors, dtype=np.float32)[rows])
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        keys=keys,
        codes=codes,
        scales=scales,
        info=np.frombuffer(json.dumps(info, sort_keys=True).encode("utf-8"), dtype=np.uint8),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buffer.getvalue())
    return {"vectors": len(keys), "bytes": path.stat().st_size, "sha256": sha256_file(path)}
