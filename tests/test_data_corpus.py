"""Corpus reading, Gutenberg cleaning and the validation split."""

import json

import datasets
import pytest

from kdamoe.training.config import DataConfig
from kdamoe.training.corpus import (
    Document,
    fetch_shakespeare,
    load_corpus,
    read_text_files,
    split_documents,
    strip_gutenberg,
)

GUTENBERG = """The Project Gutenberg EBook of Something
This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***

ACT I.
<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>
Enter a Ghost.
Ghost. Remember me.

*** END OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***
Licence text that must go.
"""


def test_strip_gutenberg():
    body = strip_gutenberg(GUTENBERG.replace("\n", "\r\n"))
    assert body == "ACT I.\nEnter a Ghost.\nGhost. Remember me."
    assert strip_gutenberg("  plain text\n") == "plain text"


def test_read_files_and_split(tmp_path):
    (tmp_path / "b.txt").write_text(GUTENBERG)
    (tmp_path / "a.txt").write_text("first play")
    (tmp_path / "metadata.txt").write_text("[ignored]")
    with open(tmp_path / "c.jsonl", "w") as f:
        f.write(json.dumps({"text": "record one"}) + "\n\n" + json.dumps({"text": "record two"}) + "\n")
    docs = read_text_files([tmp_path])
    assert [d.name for d in docs] == ["a", "b", "c:0", "c:2"]
    assert docs[1].text.startswith("ACT I.")

    train, val = split_documents(docs, val_documents=["b"])
    assert [d.name for d in val] == ["b"] and len(train) == 3
    with pytest.raises(ValueError, match="val_documents"):
        split_documents(docs, val_documents=["zzz"])

    train, val = split_documents(docs, val_fraction=0.3, seed=0)
    assert not {d.name for d in train} & {d.name for d in val} and len(train) + len(val) == 4

    with pytest.raises(ValueError, match="data.files"):
        read_text_files([tmp_path / "missing.txt"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="text"):
        read_text_files([tmp_path / "bad.jsonl"])


def test_single_document_splits_its_tail():
    text = "\n".join(f"line {i}" for i in range(100))
    train, val = split_documents([Document("only", text)], val_fraction=0.1)
    assert train[0].text + "\n" + val[0].text == text
    assert 0.05 < len(val[0].text) / len(text) < 0.15


def test_load_corpus_sources(tmp_path):
    folder = tmp_path / "shk"
    folder.mkdir()
    for name in ["x", "y", "z"]:
        (folder / f"{name}.txt").write_text(f"text of {name}")
    assert fetch_shakespeare(folder) == sorted(folder.glob("*.txt"))  # already there: no download
    train, val = load_corpus(DataConfig(source="shakespeare", path=str(folder), val_documents=["y"]))
    assert [d.name for d in train] == ["x", "z"] and [d.name for d in val] == ["y"]
    with pytest.raises(ValueError, match="fetch_corpus"):
        load_corpus(DataConfig(source="shakespeare", path=str(tmp_path / "empty")))


    ds = datasets.Dataset.from_dict({"text": ["alpha beta", "", "gamma", "delta epsilon"]})
    ds.save_to_disk(str(tmp_path / "hf"))
    train, val = load_corpus(DataConfig(source="hf", hf_name=str(tmp_path / "hf"), val_fraction=0.2))
    assert sorted(d.text for d in train + val) == ["alpha beta", "delta epsilon", "gamma"]
