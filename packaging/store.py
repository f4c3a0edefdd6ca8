"""Where prepared models live, and the manifest that makes `tandem models prepare` idempotent."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from collab.plumbing.files import atomic_write, sha256_file

MANIFEST = "manifest.json"


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
        atomic_write(self.root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))

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
