"""The ONNX embedder against sentence-transformers: same vectors, unit norm, order kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from retrieval.embedder import (
    FP32_FILE,
    INFO_FILE,
    INT8_FILE,
    OnnxEmbedder,
    TorchEmbedder,
    _OrtModel,
    faster_file,
    prepare_onnx_embedder,
)

_LONG_HISTORY = (
    "The printing press, developed by Johannes Gutenberg in Mainz around 1440, combined movable "
    "metal type, oil-based ink and a screw press adapted from wine making. Within a few decades "
    "presses operated in more than two hundred European cities, and by 1500 they had produced "
    "millions of copies of books. Cheaper books spread literacy, standardised spelling and "
    "grammar, and allowed scholars to compare identical copies of texts across great distances. "
    "The Reformation relied on pamphlets printed in large numbers, and scientific societies "
    "later used printed journals to share experiments and argue about results. Governments and "
    "churches tried to control what was printed through licensing and censorship, with mixed "
    "success, because printers could move across borders and smuggle forbidden works back in. "
)
_LONG_MEDICINE = (
    "Type 2 diabetes develops when the body becomes resistant to insulin or when the pancreas "
    "no longer produces enough of it. Risk factors include excess weight, physical inactivity, "
    "family history and age. Early symptoms are often mild: increased thirst, frequent "
    "urination, tiredness and blurred vision. Treatment usually starts with changes in diet and "
    "exercise, followed by medication such as metformin when blood sugar remains high. Over "
    "years, poorly controlled glucose damages blood vessels and nerves, raising the risk of "
    "heart disease, kidney failure, blindness and amputations, which is why regular checks of "
    "HbA1c, blood pressure, cholesterol, eyes and feet are recommended for every patient. "
)

TEXTS: list[str] = [
    "How do I reset my router to factory settings?",
    "The mitochondria is the powerhouse of the cell.",
    "Our flight to Lisbon leaves at 7:40 from terminal 2.",
    "Quarterly revenue grew 12% year over year, driven by subscriptions.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The patient reported mild headaches and occasional dizziness.",
    "Don't forget to water the tomatoes while I'm away.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "The court ruled that the contract was void for lack of consideration.",
    "Add two cups of flour and stir until the dough is smooth.",
    "Jupiter is the largest planet in the Solar System.",
    "The API returns HTTP 429 when the rate limit is exceeded.",
    "She plays the cello in the city orchestra on weekends.",
    "Interest rates were raised by a quarter of a percentage point.",
    "Backup completed: 1,204 files, 3.2 GB, no errors.",
    "yes",
    "Thanks!",
    "tax return 2023",
    "Why is the sky blue?",
    "The Great Wall of China stretches thousands of kilometres across northern China.",
    "Use a torque wrench to tighten the wheel nuts to 110 Nm.",
    "The novel follows three generations of a family in post-war Naples.",
    "Vaccines train the immune system to recognise a pathogen without causing the disease.",
    "Deadline for the grant application: 15 May, 17:00 CET.",
    "The cat knocked the glass off the table again.",
    "Le petit déjeuner est servi de sept heures à dix heures.",
    "Die Bundesregierung hat ein neues Klimaschutzgesetz beschlossen.",
    "Me gustaría reservar una mesa para cuatro personas esta noche.",
    "Il Colosseo è l'anfiteatro più grande mai costruito nell'antica Roma.",
    "Санкт-Петербург был основан Петром Первым в 1703 году.",
    "北京是中华人民共和国的首都。",
    "日本の桜は春に咲きます。",
    "Η Ακρόπολη της Αθήνας είναι μνημείο παγκόσμιας κληρονομιάς.",
    "O Brasil é o maior país da América do Sul.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\nprint(x.mean())",
    'fn main() {\n    let v: Vec<i32> = (1..=10).collect();\n    println!("{:?}", v);\n}',
    "const total = items.reduce((acc, item) => acc + item.price * item.qty, 0);",
    "docker run --rm -p 8080:80 -v $(pwd):/usr/share/nginx/html nginx:alpine",
    '<div class="card"><h2>Title</h2><p>Body text</p></div>',
    "CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT UNIQUE NOT NULL);",
    "# TODO\n- [ ] call the plumber\n- [x] pay rent\n- [ ] book dentist",
    "Name, Age, City\nAlice, 34, Berlin\nBob, 29, Madrid",
    _LONG_HISTORY * 2,  # > 256 word pieces: truncation is exercised
    _LONG_MEDICINE * 3,
    _LONG_HISTORY + _LONG_MEDICINE,
    (
        "The Amazon rainforest covers much of the Amazon basin of South America. It is home to "
        "an estimated 390 billion individual trees of about 16,000 species, and plays a major "
        "role in regulating the climate of the whole planet."
    ),
    (
        "Rust guarantees memory safety without a garbage collector through its ownership "
        "system: every value has a single owner, references are checked by the borrow "
        "checker, and data races are prevented at compile time."
    ),
    "Ein Gedicht ist ein Text, der durch Rhythmus, Reim und Bildsprache wirkt. " * 12,
    "",
    "   ",
]


@pytest.fixture(scope="session")
def onnx_dir(tmp_path_factory) -> Path:
    return prepare_onnx_embedder(tmp_path_factory.mktemp("embedder") / "minilm-onnx")


@pytest.fixture(scope="session")
def onnx_embedder(onnx_dir) -> OnnxEmbedder:
    return OnnxEmbedder(onnx_dir, batch_size=8)


@pytest.fixture(scope="session")
def torch_vectors() -> np.ndarray:
    return TorchEmbedder().embed(TEXTS)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1)


def test_texts_exercise_truncation(onnx_embedder):
    lengths = [len(ids) for ids in onnx_embedder._model.tokenizer(TEXTS)["input_ids"]]
    assert max(lengths) > 300 and len(TEXTS) >= 45


def test_onnx_matches_sentence_transformers(onnx_embedder, torch_vectors):
    vectors = onnx_embedder.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    cos = _cos(vectors, torch_vectors)
    assert cos.mean() >= 0.99, cos
    assert cos.min() >= 0.98, cos


def test_fp32_onnx_is_exact(onnx_dir, torch_vectors):
    fp32 = _OrtModel(onnx_dir, onnx_dir / FP32_FILE, threads=None, batch_size=8)
    cos = _cos(fp32.embed(TEXTS), torch_vectors)
    assert cos.min() >= 0.9999, cos


def test_unit_norm(onnx_embedder):
    norms = np.linalg.norm(onnx_embedder.embed(TEXTS), axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


def test_order_preserved_under_length_sorting(onnx_embedder):
    together = onnx_embedder.embed(TEXTS)
    one_by_one = np.concatenate([onnx_embedder.embed([t]) for t in TEXTS[::7]])
    # Dynamic int8 quantises activations per batch, so allow a little drift between batchings.
    assert _cos(together[::7], one_by_one).min() >= 0.98
    shuffled = list(reversed(TEXTS))
    np.testing.assert_allclose(onnx_embedder.embed(shuffled)[::-1], together, atol=0.02)
    # Each row is its own text, not its neighbour's: the best match is the diagonal.
    sims = together @ one_by_one.T
    assert list(np.argmax(sims[::7], axis=0)) == list(range(len(one_by_one)))


def test_empty_input(onnx_embedder):
    out = onnx_embedder.embed([])
    assert out.shape == (0, 384) and out.dtype == np.float32
    assert onnx_embedder.dim == 384


def test_second_prepare_reuses_folder(onnx_dir):
    before = {p.name: p.stat().st_mtime_ns for p in onnx_dir.iterdir()}
    assert prepare_onnx_embedder(onnx_dir) == onnx_dir
    assert {p.name: p.stat().st_mtime_ns for p in onnx_dir.iterdir()} == before
    assert not onnx_dir.with_name(onnx_dir.name + ".partial").exists()


def test_json_records_int8_decision(onnx_dir, onnx_embedder):
    info = json.loads((onnx_dir / INFO_FILE).read_text())
    int8 = info["int8"]
    assert int8["candidates"], int8
    for c in int8["candidates"]:
        assert 0.0 < c["min_cosine"] <= c["mean_cosine"] <= 1.0
        assert c["passed"] == (c["min_cosine"] >= 0.99)
    assert int8["passed"] == any(c["passed"] for c in int8["candidates"])
    assert (onnx_dir / "model-int8.onnx").is_file() == int8["passed"]
    if int8["passed"]:
        assert int8["min_cosine"] >= 0.99


def test_the_served_file_is_the_one_measured_fastest_here(onnx_dir, onnx_embedder):
    """Issue 46: int8 is faster only on CPUs with int8 dot products, so the preparation times
    both files on this CPU and serves the faster of those that passed."""
    info = json.loads((onnx_dir / INFO_FILE).read_text())
    rates = info["speed"]["rates"]
    expected = {FP32_FILE, INT8_FILE} if info["int8"]["passed"] else {FP32_FILE}
    assert set(rates) == expected and all(r > 0 for r in rates.values()), rates
    assert info["model_file"] == faster_file(rates)
    assert onnx_embedder.model_file.name == info["model_file"]
    assert onnx_embedder.quantized == (info["model_file"] == INT8_FILE)


def test_faster_file_picks_by_rate_and_int8_on_a_tie():
    assert faster_file({FP32_FILE: 18.7, INT8_FILE: 26.6}) == INT8_FILE
    assert faster_file({FP32_FILE: 26.6, INT8_FILE: 18.7}) == FP32_FILE
    assert faster_file({FP32_FILE: 20.0, INT8_FILE: 20.0}) == INT8_FILE
    assert faster_file({FP32_FILE: 20.0}) == FP32_FILE


def _copy_with_info(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).symlink_to(path)
    info = json.loads((src / INFO_FILE).read_text())
    for key, value in changes.items():
        if value is None:
            info.pop(key, None)
        else:
            info[key] = value
    (dst / INFO_FILE).unlink()
    (dst / INFO_FILE).write_text(json.dumps(info))
    return dst


def test_the_embedder_serves_what_the_record_names_and_never_an_unvalidated_int8(
    onnx_dir, tmp_path
):
    info = json.loads((onnx_dir / INFO_FILE).read_text())
    fp32 = _copy_with_info(onnx_dir, tmp_path / "fp32", model_file=FP32_FILE)
    assert OnnxEmbedder(fp32).model_file.name == FP32_FILE
    failed = dict(info["int8"], passed=False)
    refused = _copy_with_info(onnx_dir, tmp_path / "refused", model_file=INT8_FILE, int8=failed)
    assert OnnxEmbedder(refused).model_file.name == FP32_FILE
    if info["int8"]["passed"]:  # a preparation from before the timing: int8 when it passed
        old = _copy_with_info(onnx_dir, tmp_path / "old", model_file=None, speed=None)
        assert OnnxEmbedder(old).model_file.name == INT8_FILE
