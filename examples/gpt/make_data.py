"""The GPT example's data is corpus.txt itself (self-written English prose, public domain); FusionNet's
text mode turns it into samples when the job loads. What can drift is ``model.kwargs.vocab_size`` in
job.yaml, which must equal the number of distinct characters in the corpus: this script prints the
vocabulary and rewrites that number in job.yaml if it differs (``--check``: only report, exit 1 on a
mismatch). Deterministic: the vocabulary is the sorted set of characters.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_VOCAB_KWARG = re.compile(r"(\bvocab_size:\s*)(\d+)")


def corpus_vocab(corpus: Path) -> list[str]:
    return sorted(set(corpus.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report a mismatch instead of fixing it")
    args = parser.parse_args(argv)
    vocab = corpus_vocab(HERE / "corpus.txt")
    job = HERE / "job.yaml"
    text = job.read_text(encoding="utf-8")
    found = _VOCAB_KWARG.search(text)
    if found is None:
        print(f"{job}: no vocab_size in model.kwargs", file=sys.stderr)
        return 1
    current = int(found.group(2))
    print(f"corpus.txt: {len(vocab)} distinct characters; job.yaml vocab_size: {current}")
    if current == len(vocab):
        return 0
    if args.check:
        return 1
    job.write_text(_VOCAB_KWARG.sub(lambda m: f"{m.group(1)}{len(vocab)}", text, count=1), encoding="utf-8")
    print(f"updated {job}: vocab_size {current} -> {len(vocab)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
