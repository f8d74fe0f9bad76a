"""``fusionnet.results``: the one path that turns the sub-DAGs' reports into result files, for ``run --local``
and the broker alike (state under ``state_dict`` keys, outputs joined per output tensor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.errors import ExecutionError
from fusionnet.job.loader import load_job
from fusionnet.results.assemble import assemble_state, join_outputs, output_tensors
from fusionnet.runtime.local import run_local
from tests.jobfiles import write_job

pytestmark = pytest.mark.timeout(120)


def test_outputs_flatten_per_microbatch_and_join_in_order() -> None:
    rows = torch.arange(24.0).reshape(12, 2)
    # 12 micro-batches of one row each: "10/0" must come after "9/0" (numeric, not string, order).
    step0 = output_tensors([(rows[i : i + 1], {"h": rows[i : i + 1] * 2, "n": None}) for i in range(12)])
    assert sorted(step0)[:3] == ["0/0", "0/1", "1/0"] and "11/1" in step0
    step1 = output_tensors([rows[:3]])  # a later step whose model output is a bare tensor: leaf 0 only
    joined = join_outputs([step0, step1])
    assert torch.equal(joined["outputs"], torch.cat([rows, rows[:3]]))
    assert torch.equal(joined["outputs.1"], rows * 2)
    scalars = join_outputs([output_tensors([torch.tensor(1.0), torch.tensor(2.0)])])
    assert torch.equal(scalars["outputs"], torch.tensor([1.0, 2.0]))
    with pytest.raises(ExecutionError, match="not 'microbatch/leaf'"):
        join_outputs([{"x": rows}])


def test_state_takes_tied_keys_from_their_owner_and_keeps_untouched_ones() -> None:
    keys = ["emb.weight", "head.weight", "unused"]
    got = assemble_state(
        keys,
        [{"emb.weight": torch.ones(2)}],
        {"unused": torch.zeros(1), "rotary.inv_freq": torch.ones(3)},
        {"head.weight": "emb.weight"},
    )
    assert list(got) == keys and torch.equal(got["head.weight"], torch.ones(2))


def test_infer_of_a_model_with_several_outputs_writes_each(tmp_path: Path) -> None:
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    path = write_job(
        tmp_path / "job", model_class="TwoHeads", inputs=x, labels=None, task="infer", batch_size=4
    )
    job = load_job(path)
    run_local(job, 2, tmp_path / "out")
    written = load_file(tmp_path / "out" / "outputs.safetensors")
    with torch.no_grad():
        want_cls, want_h = job.model(x)
    assert sorted(written) == ["outputs", "outputs.1"]
    assert (written["outputs"] - want_cls).abs().max().item() <= 1e-6
    assert (written["outputs.1"] - want_h).abs().max().item() <= 1e-6


def test_streamed_safetensors_load_back_exactly_and_tensors_are_read_one_at_a_time(tmp_path) -> None:
    """``stream_safetensors``: any reader loads what it writes (dtypes, 0-d, empty, non-contiguous, shared
    storage), and a ``StateView`` over lazy files reads a tensor only when it is written."""
    import torch
    from safetensors.torch import load_file, save_file

    from fusionnet.broker.tensorfiles import TensorFiles
    from fusionnet.results.assemble import StateView
    from fusionnet.results.files import write_tensors

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    tensors = {
        "w": base,
        "w_t": base.t(),  # non-contiguous, shares storage with "w"
        "half": torch.randn(5, generator=g).half(),
        "bf": torch.randn(3, 2, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ids": torch.arange(7),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
    }
    write_tensors(tmp_path / "a.safetensors", tensors)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k

    save_file({"a": torch.ones(2), "b": torch.full((3,), 2.0)}, str(tmp_path / "ckpt.safetensors"))
    files = TensorFiles.of_files([tmp_path / "ckpt.safetensors"])
    reads: list[str] = []

    class Counting(dict):
        def __getitem__(self, key: str) -> torch.Tensor:
            reads.append(key)
            return files[key]

        def __contains__(self, key: object) -> bool:
            return key in files

    view = StateView(["a", "tied_a", "b", "gone"], Counting(), {"tied_a": "a"})
    assert list(view) == ["a", "tied_a", "b"] and not reads  # nothing read to build it
    write_tensors(tmp_path / "w.safetensors", view)
    got = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(got["tied_a"], torch.ones(2)) and torch.equal(got["b"], torch.full((3,), 2.0))
    # twice each (the header's pass, then the bytes'), tied keys through their owner, one at a time
    assert sorted(reads) == ["a", "a", "a", "a", "b", "b"]


def test_a_view_over_checkpoint_files_reads_each_tensor_once_when_written(tmp_path, monkeypatch) -> None:
    """Over ``TensorFiles`` the header comes from the files' headers (``TensorFiles.meta``): each tensor's
    bytes are read once, for writing them."""
    import torch
    from safetensors.torch import load_file, save_file

    from fusionnet.broker.tensorfiles import TensorFiles
    from fusionnet.results.assemble import StateView
    from fusionnet.results.files import write_tensors

    want = {"a": torch.randn(3, 2).bfloat16(), "b": torch.arange(4), "s": torch.tensor(1.5)}
    save_file(want, str(tmp_path / "ckpt.safetensors"))
    files = TensorFiles.of_files([tmp_path / "ckpt.safetensors"])
    reads: list[str] = []
    select = TensorFiles.select
    monkeypatch.setattr(TensorFiles, "select", lambda self, keys: (reads.extend(keys), select(self, keys))[1])
    write_tensors(tmp_path / "w.safetensors", StateView(["a", "tied", "b", "s"], files, {"tied": "a"}))
    got = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(reads) == ["a", "a", "b", "s"]
    assert all(torch.equal(got[k], want[k]) for k in want) and torch.equal(got["tied"], want["a"])
