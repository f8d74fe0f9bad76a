"""load_job: batches, text data, entry-point forms, seeding and initial weights."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from fusionnet.errors import JobError
from fusionnet.job.loader import batch_indices, infer_batches, load_job, split_microbatches

MODEL_PY = """
import torch
from torch import nn

TAG = {tag!r}

def build(width: int = 4, classes: int = 3):
    net = nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, classes))
    net.tag = TAG
    return net
"""


def _job(directory: Path, *, data: dict[str, Any] | None = None, tag: str = "a", **top: Any) -> Path:
    """A small job in ``directory``: model.py, data.safetensors (12 samples x 4) and job.yaml."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.py").write_text(MODEL_PY.format(tag=tag))
    g = torch.Generator().manual_seed(7)
    save_file(
        {"inputs": torch.randn(12, 4, generator=g), "labels": torch.randint(0, 3, (12,), generator=g)},
        str(directory / "data.safetensors"),
    )
    doc: dict[str, Any] = {
        "name": "t",
        "task": "train",
        "model": {"entrypoint": "model.py:build"},
        "loss": {"name": "cross_entropy"},
        "data": {"path": "data.safetensors", "batch_size": 4, **(data or {})},
        "optimizer": {"name": "sgd", "lr": 0.1},
        **top,
    }
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_batch_indices_wrap_around_the_dataset() -> None:
    n, b = 10, 4
    flat = [i % n for i in range(5 * b)]  # the sample sequence, cut into batches in order
    for step in range(5):
        assert batch_indices(step, b, n).tolist() == flat[step * b : (step + 1) * b]
    assert batch_indices(0, 7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert batch_indices(0, 2, 5).dtype == torch.int64


def test_infer_batches_cover_every_sample_once_in_order() -> None:
    batches = infer_batches(10, 4)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.tolist() for b in infer_batches(3, 8)] == [[0, 1, 2]]


def test_split_microbatches_is_contiguous_and_balanced() -> None:
    for n in range(1, 30):
        for m in range(1, n + 1):
            slices = split_microbatches(n, m)
            sizes = [s.stop - s.start for s in slices]
            assert len(slices) == m and slices[0].start == 0 and slices[-1].stop == n
            assert all(a.stop == b.start for a, b in itertools.pairwise(slices))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(JobError, match=r"^data\.microbatches"):
        split_microbatches(3, 4)


def test_text_data_windows(tmp_path: Path) -> None:
    text = "the cat sat on the mat.\nthe end\n"
    path = _job(tmp_path, data={"path": "corpus.txt", "block_size": 5})
    (tmp_path / "corpus.txt").write_text(text)
    doc = yaml.safe_load(path.read_text())
    (tmp_path / "text.py").write_text(
        "from torch import nn\n\nclass Text(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.emb = nn.Embedding(20, 20)\n\n    def forward(self, x):\n"
        "        return self.emb(x).transpose(1, 2)\n\ndef build():\n    return Text()\n"
    )
    doc["model"] = {"entrypoint": "text.py:build"}
    path.write_text(yaml.safe_dump(doc))
    job = load_job(path)
    vocab = sorted(set(text))
    assert job.vocab == vocab
    decode = lambda row: "".join(vocab[i] for i in row.tolist())
    n = (len(text) - 1) // 5
    assert job.inputs.shape == job.labels.shape == (n, 5) and job.inputs.dtype == torch.int64
    for k in range(n):
        assert decode(job.inputs[k]) == text[5 * k : 5 * k + 5]
        assert decode(job.labels[k]) == text[5 * k + 1 : 5 * k + 6]


def test_text_data_problems(tmp_path: Path) -> None:
    path = _job(tmp_path, data={"path": "corpus.txt"})
    (tmp_path / "corpus.txt").write_text("abc")
    with pytest.raises(JobError, match=r"^data\.block_size: required for text data"):
        load_job(path)
    path = _job(tmp_path, data={"path": "corpus.txt", "block_size": 3})
    with pytest.raises(JobError, match=r"^data\.block_size: corpus\.txt has 3 characters"):
        load_job(path)
    (tmp_path / "corpus.txt").write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(JobError, match=r"^data\.path: corpus\.txt: text data must be UTF-8"):
        load_job(path)


def test_infer_drops_labels_and_does_not_need_them(tmp_path: Path) -> None:
    path = _job(tmp_path, task="infer")
    job = load_job(path)
    assert job.labels is None and job.loss_fn is None
    save_file({"inputs": torch.zeros(5, 4)}, str(tmp_path / "data.safetensors"))
    assert load_job(path).inputs.shape == (5, 4)
    doc = yaml.safe_load(path.read_text())
    doc["task"] = "grad"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(JobError, match=r"^data.path: data.safetensors: missing tensor\(s\) \['labels'\]"):
        load_job(path)


def test_package_module_entrypoint_and_dotted_attribute(tmp_path: Path) -> None:
    path = _job(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["model"] = {"entrypoint": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3}}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(JobError, match=r"^model\.entrypoint: 'torch\.nn:Linear' names an importable module"):
        load_job(path)
    assert isinstance(load_job(path, allow_outside_paths=True).model, torch.nn.Linear)
    (tmp_path / "nested.py").write_text(
        "from torch import nn\n\nclass Factory:\n    @staticmethod\n"
        "    def make():\n        return nn.Linear(4, 3)\n"
    )
    doc["model"] = {"entrypoint": "nested.py:Factory.make"}
    path.write_text(yaml.safe_dump(doc))
    assert isinstance(load_job(path).model, torch.nn.Linear)


def test_same_file_name_in_two_jobs_stays_separate(tmp_path: Path) -> None:
    a = load_job(_job(tmp_path / "a", tag="first"))
    b = load_job(_job(tmp_path / "b", tag="second"))
    assert (a.model.tag, b.model.tag) == ("first", "second")
    assert a.base_dir == (tmp_path / "a").resolve() and a.path.name == "job.yaml"


def test_model_is_built_after_seeding(tmp_path: Path) -> None:
    first = load_job(_job(tmp_path / "s0", seed=3)).model.state_dict()
    torch.manual_seed(12345)  # global RNG state before loading must not matter
    again = load_job(_job(tmp_path / "s1", seed=3)).model.state_dict()
    other = load_job(_job(tmp_path / "s2", seed=4)).model.state_dict()
    torch.manual_seed(3)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).state_dict()
    for key in first:
        assert torch.equal(first[key], again[key]) and torch.equal(first[key], expected[key])
    assert not torch.equal(first["0.weight"], other["0.weight"])


def test_initial_weights_are_loaded(tmp_path: Path) -> None:
    path = _job(tmp_path)
    state = {k: torch.full_like(v, 0.25) for k, v in load_job(path).model.state_dict().items()}
    save_file(state, str(tmp_path / "init.safetensors"))
    doc = yaml.safe_load(path.read_text())
    doc["model"]["weights"] = "init.safetensors"
    path.write_text(yaml.safe_dump(doc))
    loaded = load_job(path).model.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    save_file({**state, "extra.weight": torch.zeros(1)}, str(tmp_path / "init.safetensors"))
    with pytest.raises(JobError, match=r"unexpected keys \['extra.weight'\]"):
        load_job(path)
    save_file({k: v.double() for k, v in state.items()}, str(tmp_path / "init.safetensors"))
    with pytest.raises(JobError, match=r"has dtype torch\.float64, the model expects torch\.float32"):
        load_job(path)


def test_loss_kwargs_are_bound(tmp_path: Path) -> None:
    path = _job(
        tmp_path, loss={"name": "cross_entropy", "kwargs": {"reduction": "sum", "label_smoothing": 0.1}}
    )
    job = load_job(path)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    expected = torch.nn.functional.cross_entropy(x, y, reduction="sum", label_smoothing=0.1)
    assert job.loss_fn is not None and torch.equal(job.loss_fn(x, y), expected)


def _outside_variants(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(key, value, what the refusal must say) for files that leave the job folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text("from torch import nn\n\ndef build():\n    return nn.Linear(4, 3)\n")
    tensors = {"inputs": torch.zeros(5, 4), "labels": torch.zeros(5, dtype=torch.long)}
    save_file(tensors, str(outside / "d.st"))
    return [
        ("model.entrypoint", "../outside/evil.py:build", "leads outside the job folder"),
        ("model.entrypoint", f"{outside}/evil.py:build", "leads outside the job folder"),
        ("model.entrypoint", "linked.py:build", "leads outside the job folder"),
        ("model.entrypoint", "os:system", "names an importable module"),
        ("model.entrypoint", "imports.py:system", "imported from 'posix'"),
        ("data.path", "../outside/d.st", "leads outside the job folder"),
        ("data.path", f"{outside}/d.st", "leads outside the job folder"),
        ("data.path", "linked.st", "leads outside the job folder"),
        ("data.path", "/etc/passwd", "leads outside the job folder"),
        ("model.weights", "../outside/d.st", "leads outside the job folder"),
    ]


def test_paths_outside_the_job_folder_are_refused_before_anything_runs(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    for key, value, message in _outside_variants(tmp_path):
        path = _job(job_dir)
        (job_dir / "linked.py").unlink(missing_ok=True)
        (job_dir / "linked.py").symlink_to(tmp_path / "outside" / "evil.py")
        (job_dir / "linked.st").unlink(missing_ok=True)
        (job_dir / "linked.st").symlink_to(tmp_path / "outside" / "d.st")
        (job_dir / "imports.py").write_text("from os import system\n")
        doc = yaml.safe_load(path.read_text())
        section, field = key.split(".")
        doc[section][field] = value
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(JobError) as info:
            load_job(path)
        assert str(info.value).startswith(key) and message in str(info.value), (value, str(info.value))


def test_outside_paths_load_with_the_explicit_flag(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _outside_variants(tmp_path)
    path = _job(job_dir)
    doc = yaml.safe_load(path.read_text())
    doc["model"] = {"entrypoint": "../outside/evil.py:build"}
    doc["data"]["path"] = str(tmp_path / "outside" / "d.st")
    path.write_text(yaml.safe_dump(doc))
    job = load_job(path, allow_outside_paths=True)
    assert isinstance(job.model, torch.nn.Linear) and job.inputs.shape == (5, 4)


@pytest.mark.parametrize("value", ["x" * 5000 + ".py:build", "bad\0name.py:build"])
def test_unusable_entrypoint_paths_give_one_message(tmp_path: Path, value: str) -> None:
    path = _job(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["model"] = {"entrypoint": value}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(
        JobError, match=r"^model\.entrypoint: .*(not a usable path|at most 1024 char)"
    ) as info:
        load_job(path)
    assert len(str(info.value)) < 400
