"""Broken data files, weights and output paths."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.badinput.variant import MLP, Edit, JobDir, Variant, setter, variant

DATA = "data.path"
W = "model.weights"
GOOD_DATA = (MLP / "data.safetensors").read_bytes()


def _data(make: Callable[[Any], Any]) -> Edit:
    return lambda j: j.tensors("data.safetensors", make(j.data()))


def _bytes(content: bytes) -> Edit:
    return lambda j: j.file("data.safetensors", content)


def _header(n: int, body: bytes = b"") -> bytes:
    return struct.pack("<Q", n) + body


def _poisoned(value: float) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def make(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = t["inputs"].clone()
        x[5, 3] = value
        return {"inputs": x, "labels": t["labels"]}

    return make


def _data_path(path: str) -> Edit:
    return setter(**{DATA: path})


def _data_link(target: str) -> Edit:
    def edit(j: JobDir) -> None:
        j.link("linked.safetensors", target.format(outside=j.outside))
        j.set(DATA, "linked.safetensors")

    return edit


def _loop(j: JobDir) -> None:
    j.link("a.safetensors", j.dir / "b.safetensors")
    j.link("b.safetensors", j.dir / "a.safetensors")
    j.set(DATA, "a.safetensors")


DATAFILES = [
    variant("data", "missing-file", DATA, _data_path("nope.safetensors"), says="not found"),
    variant("data", "a-text-file", DATA, _bytes(b"inputs,labels\n1,2\n" * 20), says="safetensors"),
    variant("data", "truncated", DATA, _bytes(GOOD_DATA[: len(GOOD_DATA) // 2]), says="safetensors"),
    variant("data", "empty-file", DATA, _bytes(b""), says="safetensors"),
    variant("data", "header-length-2-60", DATA, _bytes(_header(1 << 60, b"{}")), says="safetensors"),
    variant("data", "header-not-json", DATA, _bytes(_header(8, b"not json")), says="safetensors"),
    variant(
        "data",
        "header-bad-offsets",
        DATA,
        _bytes(
            _header(
                64,
                json.dumps({"inputs": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4000000]}})
                .encode()
                .ljust(64),
            )
        ),
        says="safetensors",
    ),
    variant("data", "missing-inputs", DATA, _data(lambda t: {"labels": t["labels"]}), says="inputs"),
    variant("data", "missing-labels", DATA, _data(lambda t: {"inputs": t["inputs"]}), says="labels"),
    variant("data", "extra-tensor", DATA, _data(lambda t: {**t, "weights": t["inputs"]}), says="unexpected"),
    variant(
        "data",
        "mismatched-samples",
        DATA,
        _data(lambda t: {"inputs": t["inputs"], "labels": t["labels"][:100]}),
        says="samples",
    ),
    variant(
        "data",
        "zero-samples",
        DATA,
        _data(lambda t: {"inputs": t["inputs"][:0], "labels": t["labels"][:0]}),
        says="no samples",
    ),
    variant(
        "data", "scalar-inputs", DATA, _data(lambda t: {"inputs": torch.tensor(1.0), "labels": t["labels"]})
    ),
    variant("data", "nan-inputs", DATA, _data(_poisoned(float("nan"))), says="NaN"),
    variant("data", "inf-inputs", DATA, _data(_poisoned(float("inf"))), says="NaN or inf"),
    variant(
        "data",
        "outside-relative",
        DATA,
        _data_path("../outside/data.safetensors"),
        says="outside the job folder",
    ),
    variant(
        "data",
        "outside-absolute",
        DATA,
        lambda j: j.set(DATA, str(j.outside / "data.safetensors")),
        says="outside",
    ),
    variant("data", "etc-passwd", DATA, _data_path("/etc/passwd"), says="outside the job folder"),
    variant("data", "symlink-to-etc-passwd", DATA, _data_link("/etc/passwd"), says="outside the job folder"),
    variant(
        "data",
        "symlink-outside",
        DATA,
        _data_link("{outside}/data.safetensors"),
        says="outside the job folder",
    ),
    variant("data", "symlink-loop", DATA, _loop),
    variant(
        "data",
        "a-folder",
        DATA,
        lambda j: ((j.dir / "folder").mkdir(), j.set(DATA, "folder"))[-1],
        says="not a file",
    ),
    variant("data", "dev-zero", DATA, _data_path("/dev/zero"), says="outside"),
    variant(
        "data",
        "text-without-block-size",
        "data.block_size",
        lambda j: (j.file("t.txt", "abc" * 100), j.set(DATA, "t.txt"))[-1],
    ),
    variant(
        "data",
        "text-too-short",
        "data.block_size",
        lambda j: (j.file("t.txt", "abc"), j.set(DATA, "t.txt"), j.set("data.block_size", 64))[-1],
    ),
    variant(
        "data",
        "text-not-utf8",
        DATA,
        lambda j: (j.file("t.txt", b"\xff\xfe" * 100), j.set(DATA, "t.txt"), j.set("data.block_size", 8))[-1],
        says="UTF-8",
    ),
    variant(
        "data",
        "labels-strings-dtype-bool",
        ("loss", DATA),
        _data(lambda t: {"inputs": t["inputs"], "labels": t["labels"] > 1}),
    ),
]


def _weights(make: Callable[[Any], Any]) -> Edit:
    def edit(j: JobDir) -> None:
        j.tensors("w.safetensors", make(j.state()))
        j.set(W, "w.safetensors")

    return edit


def _nan_weight(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    s["fc2.bias"][3] = float("nan")
    return s


def _folder(files: dict[str, bytes]) -> Edit:
    def edit(j: JobDir) -> None:
        (j.dir / "pretrained").mkdir()
        for name, content in files.items():
            (j.dir / "pretrained" / name).write_bytes(content)
        j.set(W, "pretrained")

    return edit


WEIGHTS = [
    variant("weights", "missing-file", W, setter(**{W: "nope.safetensors"}), says="not found"),
    variant(
        "weights", "missing-keys", W, _weights(lambda s: {k: v for k, v in s.items() if k.startswith("fc1")})
    ),
    variant("weights", "extra-keys", W, _weights(lambda s: {**s, "fc9.weight": torch.zeros(2)})),
    variant("weights", "wrong-shape", W, _weights(lambda s: {**s, "fc1.weight": torch.zeros(8, 8)})),
    variant("weights", "wrong-dtype", W, _weights(lambda s: {**s, "fc1.weight": s["fc1.weight"].long()})),
    variant("weights", "nan", W, _weights(_nan_weight), says="NaN"),
    variant(
        "weights",
        "not-safetensors",
        W,
        lambda j: (j.file("w.safetensors", b"PK\x03\x04 not a tensor file"), j.set(W, "w.safetensors"))[-1],
    ),
    variant("weights", "empty-folder", W, _folder({})),
    variant(
        "weights",
        "folder-with-bin-only",
        W,
        _folder({"pytorch_model.bin": b"\x80\x02pickle"}),
        says="safetensors",
    ),
    variant("weights", "folder-bad-index", W, _folder({"model.safetensors.index.json": b"{not json"})),
    variant(
        "weights",
        "folder-index-points-outside",
        W,
        _folder(
            {
                "model.safetensors.index.json": json.dumps(
                    {"weight_map": {"fc1.weight": "../../outside/data.safetensors"}}
                ).encode()
            }
        ),
    ),
    variant(
        "weights",
        "outside-relative",
        W,
        setter(**{W: "../outside/data.safetensors"}),
        says="outside the job folder",
    ),
    variant("weights", "outside-absolute", W, setter(**{W: "/etc/passwd"}), says="outside the job folder"),
    variant(
        "weights",
        "symlink-outside",
        W,
        lambda j: (j.link("w.safetensors", j.outside / "data.safetensors"), j.set(W, "w.safetensors"))[-1],
        says="outside",
    ),
    variant("weights", "data-file-as-weights", W, setter(**{W: "data.safetensors"})),
]


OUTPUTS = [
    variant(
        "output",
        "an-existing-file",
        "{out}",
        lambda j: None,
        output=lambda r, flag: str(_touch(r / "taken") if flag == "--output" else _folder_at(r / "dir")),
    ),
    variant(
        "output",
        "under-a-file",
        "{out}",
        lambda j: None,
        output=lambda r, flag: str(_touch(r / "taken") / "sub" / "x"),
    ),
    variant("output", "nul-byte", "{out}", lambda j: None, output=lambda r, flag: str(r / "o\x00ut")),
    variant("output", "name-too-long", "{out}", lambda j: None, output=lambda r, flag: str(r / ("o" * 300))),
    variant("output", "in-proc", "{out}", lambda j: None, output=lambda r, flag: "/proc/fusionnet-out/x"),
]


def _folder_at(path: Path) -> Path:  # plan --json may overwrite a file, not a folder
    path.mkdir()
    return path


def _touch(path: Path) -> Path:
    path.write_text("taken")
    return path


CASES: list[Variant] = DATAFILES + WEIGHTS + OUTPUTS
