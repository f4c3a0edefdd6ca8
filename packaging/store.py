"""Where prepared models live, and the manifest that makes `tandem models prepare` idempotent."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

MANIFEST = "manifest.json"


def data_dir() -> Path:
    """Tandem's data directory (`TANDEM_DATA_DIR` overrides the platform default)."""
    override = os.environ.get("TANDEM_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir("tandem"))


def models_dir() -> Path:
    return data_dir() / "models"


def sha256_file(path: Path, chunk: int = 1 << 22, progress=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def describe_files(folder: Path) -> dict[str, dict]:
    """Size and sha256 of every file under `folder`, keyed by relative path."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def files_match(folder: Path, files: dict[str, dict]) -> bool:
    """True if every recorded file exists with its recorded size and checksum."""
    for rel, meta in files.items():
        p = folder / rel
        if not p.is_file() or p.stat().st_size != meta["size"]:
            return False
    return all(sha256_file(folder / rel) == meta["sha256"] for rel, meta in files.items())


@dataclass
class ModelStore:
    """One prepared model: `<models_dir>/<key>/` with a manifest of finished steps."""

    root: Path

    @property
    def key(self) -> str:
        return self.root.name

    def path(self, rel: str) -> Path:
        return self.root / rel

    def manifest(self) -> dict:
        try:
            return json.loads((self.root / MANIFEST).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"steps": {}}

    def write_manifest(self, manifest: dict) -> None:
        """Atomic: a kill leaves the previous manifest or the new one, never half of one."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(tmp, self.root / MANIFEST)

    def record_step(self, step: str, output: str, recipe: str, **info) -> None:
        """Record a finished step whose output is the file or folder `output`, made by
        `recipe` (a step made by an older recipe is redone)."""
        out = self.root / output
        if out.is_dir():
            files = describe_files(out)
        else:
            files = {out.name: {"size": out.stat().st_size, "sha256": sha256_file(out)}}
        manifest = self.manifest()
        manifest["steps"][step] = {
            "output": output,
            "recipe": recipe,
            "files": files,
            "finished": time.time(),
            **info,
        }
        self.write_manifest(manifest)

    def step_done(self, step: str, recipe: str) -> bool:
        """A step counts as done only if it was made by `recipe` and its outputs are all
        there with the recorded checksums."""
        rec = self.manifest()["steps"].get(step)
        if rec is None or rec.get("recipe") != recipe:
            return False
        out = self.root / rec["output"]
        folder = out if rec["output"] and out.is_dir() else out.parent
        return files_match(folder, rec["files"])

    def forget_step(self, step: str) -> None:
        manifest = self.manifest()
        if manifest["steps"].pop(step, None) is not None:
            self.write_manifest(manifest)


def publish(partial: Path, final: Path) -> None:
    """Move a finished `partial` file or folder into place, replacing any stale `final`."""
    if final.is_dir():
        shutil.rmtree(final)
    elif final.exists():
        final.unlink()
    os.replace(partial, final)


def fresh_partial(final: Path) -> Path:
    """An empty `<final>.partial` path: leftovers of a killed run are discarded."""
    partial = final.with_name(final.name + ".partial")
    if partial.is_dir():
        shutil.rmtree(partial)
    elif partial.exists():
        partial.unlink()
    return partial
