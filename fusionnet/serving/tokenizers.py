"""A deployment's tokenizer: the tokenizer files of the model folder, as the deploy command sent them,
written to the deployment's folder and loaded with ``transformers`` (no remote code, no pickle: only the
JSON/text files ``PreTrainedTokenizerFast`` reads are accepted); or, for a job on text data
(``data.path: *.txt``), its own character vocabulary (``CharTokenizer``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fusionnet.errors import JobError
from fusionnet.job.data import resolve_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",  # where transformers 5 saves a chat template
    "chat_template.json",
)
MAX_TOKENIZER_BYTES = 64 << 20


def tokenizer_files(
    folder: Path, *, job_folder: Path | None = None, allow_outside: bool = False
) -> dict[str, bytes] | None:
    """The tokenizer files in ``folder``; None without ``tokenizer.json`` or ``tokenizer_config.json``.

    Each file must lie inside ``job_folder`` (default ``folder``) after symlinks, unless ``allow_outside``
    (``deploy --allow-outside-paths``): these bytes are sent to the broker and stored there, so a
    ``merges.txt`` that is a symlink to a file outside the folder the user reviewed would ship that file.
    A refused file is one ``JobError`` naming it (``resolve_file``, as for every other path of a job)."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        return None
    job_folder = job_folder or folder
    files: dict[str, bytes] = {}
    for name in TOKENIZER_FILES:
        if not (folder / name).is_file():
            continue
        # relative to the job folder, as the user sees it (the model folder may be a weights subfolder)
        rel = os.path.relpath(folder / name, job_folder)
        files[name] = resolve_file(job_folder, rel, "tokenizer", allow_outside=allow_outside).read_bytes()
    if sum(map(len, files.values())) > MAX_TOKENIZER_BYTES:
        raise JobError(f"tokenizer files in {folder} exceed {MAX_TOKENIZER_BYTES >> 20} MiB")
    return files


def load_tokenizer(files: dict[str, bytes], folder: Path) -> Any:
    """A ``transformers`` tokenizer from ``files``, kept under ``folder/tokenizer``."""
    bad = sorted(set(files) - set(TOKENIZER_FILES))
    if bad:
        raise JobError(f"deploy: tokenizer file {bad[0]!r} is not one of {', '.join(TOKENIZER_FILES)}")
    if sum(map(len, files.values())) > MAX_TOKENIZER_BYTES:
        raise JobError(f"deploy: tokenizer files exceed {MAX_TOKENIZER_BYTES >> 20} MiB")
    target = folder / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        (target / name).write_bytes(blob)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(target), trust_remote_code=False, local_files_only=True)
    except Exception as e:
        raise JobError(f"deploy: the tokenizer does not load: {type(e).__name__}: {e}"[:300]) from None


class CharTokenizer:
    """The character-level vocabulary of a text-data job: token id ``i`` is ``vocab[i]``."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = list(vocab)
        self.ids = {ch: i for i, ch in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        unknown = sorted({ch for ch in text if ch not in self.ids})
        if unknown:
            raise ValueError(f"characters outside the vocabulary: {''.join(unknown)[:40]!r}")
        return [self.ids[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if 0 <= i < len(self.vocab))
