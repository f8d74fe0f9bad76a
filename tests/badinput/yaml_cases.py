"""Job files broken as text or as keys: nothing here needs the model, so every refusal costs milliseconds."""

from __future__ import annotations

from fusionnet.job.schema import MAX_PATH_CHARS
from tests.badinput.variant import MLP, JobDir, Variant, dropper, setter, text, variant

VALID = (MLP / "job.yaml").read_text()
JOB = "{job}"


def _laughs_unknown_key() -> str:
    levels = ['lol0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"lol{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return VALID + "\n".join(levels) + "\n"


def _laughs_as_name() -> str:
    anchors = ["_0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    anchors += [f"_{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    # The anchors live under the unknown key ``_0`` ...; ``name`` refers to the last one.
    body = VALID.replace("name: mlp", "name: *a8")
    return "\n".join(anchors) + "\n" + body


def _no_mapping(j: JobDir) -> None:
    j.job.unlink()
    j.job.mkdir()
    j.written = True


SYNTAX = [
    variant("yaml", "unclosed-flow-mapping", JOB, text(VALID.replace("classes: 4}", "classes: 4"))),
    variant("yaml", "tab-indentation", JOB, text(VALID.replace("  batch_size: 32", "\tbatch_size: 32"))),
    variant("yaml", "bad-indentation", JOB, text(VALID.replace("  batch_size: 32", "     batch_size: 32"))),
    variant("yaml", "unterminated-quote", JOB, text(VALID.replace("name: mlp", 'name: "mlp'))),
    variant("yaml", "stray-colon", JOB, text(VALID.replace("steps: 20", "steps: : 20"))),
    variant("yaml", "a-list-document", JOB, text("- name: mlp\n- task: train\n"), says="mapping"),
    variant("yaml", "empty-file", JOB, text(""), says="mapping"),
    variant("yaml", "a-scalar-document", JOB, text("just words\n"), says="mapping"),
    variant("yaml", "two-documents", JOB, text(VALID + "---\n" + VALID)),
    variant("yaml", "not-utf8", JOB, text(b"name: \xff\xfe mlp\n" + VALID.encode())),
    variant("yaml", "nul-byte-in-text", JOB, text(VALID.replace("name: mlp", "name: ml\x00p"))),
    variant("yaml", "duplicate-top-key", JOB, text(VALID + "steps: 5\n"), says="duplicate key"),
    variant(
        "yaml",
        "duplicate-nested-key",
        JOB,
        text(VALID.replace("  batch_size: 32", "  batch_size: 32\n  batch_size: 8")),
        says="duplicate key",
    ),
    variant("yaml", "undefined-alias", JOB, text(VALID.replace("steps: 20", "steps: *nope"))),
    variant(
        "yaml",
        "python-object-tag",
        JOB,
        text(VALID.replace("name: mlp", "name: !!python/object/apply:os.system ['echo pwned']")),
    ),
    variant("yaml", "billion-laughs-unknown-key", JOB, text(_laughs_unknown_key()), says="refused"),
    variant("yaml", "billion-laughs-as-name", JOB, text(_laughs_as_name()), says="refused"),
    variant("yaml", "deep-flow-nesting", JOB, text(VALID + "deep: " + "[" * 50_000 + "]" * 50_000 + "\n")),
    variant(
        "yaml",
        "deep-block-nesting",
        JOB,
        text(VALID + "".join(f"{'  ' * i}k{i}:\n" for i in range(200)) + "  " * 200 + "v: 1\n"),
    ),
    variant("yaml", "file-over-1-MiB", JOB, text(VALID + "# " + "x" * (1 << 20) + "\n"), says="bytes"),
    variant(
        "yaml",
        "many-alias-references",
        JOB,
        text("_: &s 1\n" + VALID + "extra: [" + ", ".join(["*s"] * 150) + "]\n"),
    ),
    variant("yaml", "many-values", JOB, text(VALID + "extra: [" + ", ".join(["1"] * 30_000) + "]\n")),
    variant("yaml", "job-file-missing", JOB, lambda j: j.text(""), job_path=lambda j: j.dir / "nope.yaml"),
    variant("yaml", "job-file-is-a-folder", JOB, _no_mapping, says="not a file"),
]

KEYS = [
    variant("keys", "unknown-top-key", "stesp", setter(stesp=5), says="unknown key"),
    variant("keys", "capitalised-key", "Steps", setter(Steps=5), says="unknown key"),
    variant(
        "keys",
        "misspelt-entrypoint",
        ("model.entrypoint", "model.entrypiont"),
        lambda j: _rename(j, "model.entrypoint", "entrypiont"),
    ),
    variant(
        "keys", "misspelt-batch-size", "data.batch", lambda j: _rename(j, "data.batch_size", "batchsize")
    ),
    variant("keys", "misspelt-lr", "optimizer.l", lambda j: _rename(j, "optimizer.lr", "learning_rate")),
    variant("keys", "misspelt-loss-name", "loss.n", lambda j: _rename(j, "loss.name", "nmae")),
    variant(
        "keys",
        "misspelt-compnodes",
        "placement.compnode",
        lambda j: _rename(j, "placement.compnodes", "compnode"),
    ),
    variant("keys", "unknown-model-key", "model.weigths", setter(**{"model.weigths": "w.safetensors"})),
    variant(
        "keys",
        "unknown-per-op-key",
        "optimizer.per_op.fc1.*.lrr",
        setter(**{"optimizer.per_op": {"fc1.*": {"lrr": 1}}}),
    ),
    variant("keys", "unknown-data-key", "data.shuffle", setter(**{"data.shuffle": True})),
    variant("keys", "missing-name", "name", dropper("name"), says="required"),
    variant("keys", "missing-task", "task", dropper("task"), says="required"),
    variant("keys", "missing-model", "model", dropper("model"), says="required"),
    variant("keys", "missing-data", "data", dropper("data"), says="required"),
    variant("keys", "missing-optimizer-for-train", "optimizer", dropper("optimizer"), says="required"),
    variant("keys", "missing-data-path", "data.path", dropper("data.path"), says="required"),
    variant("keys", "missing-entrypoint", "model.entrypoint", dropper("model.entrypoint"), says="required"),
    variant("keys", "missing-loss-name", "loss.name", dropper("loss.name"), says="required"),
    variant("keys", "missing-optimizer-lr", "optimizer.lr", dropper("optimizer.lr"), says="required"),
    variant("keys", "unknown-key-100k-chars", "k" * 40, setter(**{"k" * 100_000: 1})),
]


def _rename(j: JobDir, key: str, new: str) -> None:
    *parents, last = key.split(".")
    node = j.doc
    for part in parents:
        node = node[part]
    node[new] = node.pop(last)


TYPES = [
    variant("types", "steps-string", "steps", setter(steps="5"), says="integer"),
    variant("types", "steps-float", "steps", setter(steps=5.5), says="integer"),
    variant("types", "steps-bool", "steps", setter(steps=True)),
    variant("types", "steps-list", "steps", setter(steps=[5])),
    variant("types", "batch-size-string", "data.batch_size", setter(**{"data.batch_size": "32"})),
    variant("types", "batch-size-float", "data.batch_size", setter(**{"data.batch_size": 32.0})),
    variant("types", "microbatches-null", "data.microbatches", setter(**{"data.microbatches": None})),
    variant("types", "seed-string", "seed", setter(seed="zero")),
    variant("types", "lr-string", "optimizer.lr", setter(**{"optimizer.lr": "fast"})),
    variant("types", "lr-bool", "optimizer.lr", setter(**{"optimizer.lr": True})),
    variant("types", "lr-list", "optimizer.lr", setter(**{"optimizer.lr": [0.1]})),
    variant("types", "task-unknown", "task", setter(task="trainn"), says="one of"),
    variant("types", "task-number", "task", setter(task=1)),
    variant("types", "name-number", "name", setter(name=123), says="string"),
    variant("types", "name-empty", "name", setter(name="")),
    variant("types", "name-null", "name", setter(name=None)),
    variant("types", "model-a-string", "model", setter(model="model.py:build"), says="mapping"),
    variant("types", "model-kwargs-list", "model.kwargs", setter(**{"model.kwargs": [1, 2]}), says="mapping"),
    variant("types", "data-a-list", "data", setter(data=[]), says="mapping"),
    variant(
        "types", "optimizer-kwargs-string", "optimizer.kwargs", setter(**{"optimizer.kwargs": "momentum"})
    ),
    variant("types", "placement-a-number", "placement", setter(placement=2), says="mapping"),
    variant("types", "loss-a-string", "loss", setter(loss="cross_entropy"), says="mapping"),
    variant("types", "entrypoint-number", "model.entrypoint", setter(**{"model.entrypoint": 42})),
    variant("types", "data-path-number", "data.path", setter(**{"data.path": 3})),
    variant("types", "weights-number", "model.weights", setter(**{"model.weights": 5})),
    variant("types", "per-op-a-list", "optimizer.per_op", setter(**{"optimizer.per_op": ["fc1.*"]})),
]

RANGES = [
    variant("range", "steps-zero", "steps", setter(steps=0)),
    variant("range", "steps-negative", "steps", setter(steps=-1)),
    variant("range", "steps-1e9", "steps", setter(steps=10**9)),
    variant("range", "steps-1e30", "steps", setter(steps=10**30)),
    variant("range", "steps-inf", "steps", text(VALID.replace("steps: 20", "steps: .inf"))),
    variant("range", "batch-size-zero", "data.batch_size", setter(**{"data.batch_size": 0})),
    variant("range", "batch-size-negative", "data.batch_size", setter(**{"data.batch_size": -5})),
    variant("range", "batch-size-1e9", "data.batch_size", setter(**{"data.batch_size": 10**9})),
    variant("range", "batch-size-over-limit", "data.batch_size", setter(**{"data.batch_size": 2**24 + 1})),
    variant("range", "microbatches-zero", "data.microbatches", setter(**{"data.microbatches": 0})),
    variant("range", "microbatches-over-batch", "data.microbatches", setter(**{"data.microbatches": 64})),
    variant("range", "microbatches-1e6", "data.microbatches", setter(**{"data.microbatches": 10**6})),
    variant("range", "compnodes-zero", "placement.compnodes", setter(**{"placement.compnodes": 0})),
    variant("range", "compnodes-1e6", "placement.compnodes", setter(**{"placement.compnodes": 10**6})),
    variant("range", "compnodes-1025", "placement.compnodes", setter(**{"placement.compnodes": 1025})),
    variant("range", "block-size-for-tensors", "data.block_size", setter(**{"data.block_size": 8})),
    variant(
        "range",
        "block-size-1e9",
        "data.block_size",
        setter(**{"data.path": "t.txt", "data.block_size": 10**9}),
    ),
    variant("range", "lr-zero", "optimizer.lr", setter(**{"optimizer.lr": 0})),
    variant("range", "lr-negative", "optimizer.lr", setter(**{"optimizer.lr": -0.1})),
    variant("range", "lr-1e300", "optimizer.lr", setter(**{"optimizer.lr": 1e300})),
    variant("range", "lr-inf", "optimizer.lr", text(VALID.replace("lr: 0.1", "lr: .inf"))),
    variant("range", "lr-nan", "optimizer.lr", text(VALID.replace("lr: 0.1", "lr: .nan"))),
    variant("range", "seed-2-63", "seed", setter(seed=2**63)),
    variant("range", "seed-negative", "seed", setter(seed=-1)),
    variant(
        "range",
        "per-op-lr-negative",
        "optimizer.per_op.fc1.*.lr",
        setter(**{"optimizer.per_op": {"fc1.*": {"lr": -1}}}),
    ),
    variant(
        "range", "momentum-negative", "optimizer.kwargs", setter(**{"optimizer.kwargs": {"momentum": -1}})
    ),
]

STRINGS = [
    variant("strings", "name-100k", "name", setter(name="n" * 100_000), says="at most"),
    variant(
        "strings",
        "entrypoint-5000",
        "model.entrypoint",
        setter(**{"model.entrypoint": "m" * 5000 + ".py:build"}),
    ),
    variant(
        "strings",
        "entrypoint-long-component",
        "model.entrypoint",
        setter(**{"model.entrypoint": "m" * 300 + ".py:build"}),
    ),
    variant(
        "strings",
        "entrypoint-nul",
        "model.entrypoint",
        setter(**{"model.entrypoint": "model.py\x00x.py:build"}),
    ),
    variant("strings", "data-path-nul", "data.path", setter(**{"data.path": "data\x00.safetensors"})),
    variant("strings", "data-path-5000", "data.path", setter(**{"data.path": "d" * 5000 + ".safetensors"})),
    variant(
        "strings",
        "data-path-long-component",
        "data.path",
        setter(**{"data.path": "d" * 300 + ".safetensors"}),
    ),
    variant("strings", "weights-nul", "model.weights", setter(**{"model.weights": "w\x00.safetensors"})),
    variant(
        "strings",
        "weights-too-long",
        "model.weights",
        setter(**{"model.weights": "w" * (MAX_PATH_CHARS + 1)}),
    ),
    variant("strings", "loss-name-100k", "loss.name", setter(**{"loss.name": "l" * 100_000})),
    variant("strings", "optimizer-name-nul", "optimizer.name", setter(**{"optimizer.name": "sg\x00d"})),
    variant("strings", "entrypoint-no-colon", "model.entrypoint", setter(**{"model.entrypoint": "model.py"})),
    variant(
        "strings", "entrypoint-empty-module", "model.entrypoint", setter(**{"model.entrypoint": ":build"})
    ),
    variant(
        "strings",
        "entrypoint-call-syntax",
        "model.entrypoint",
        setter(**{"model.entrypoint": "model.py:build()"}),
    ),
    variant(
        "strings",
        "entrypoint-empty-callable",
        "model.entrypoint",
        setter(**{"model.entrypoint": "model.py:"}),
    ),
    variant("strings", "data-path-empty", "data.path", setter(**{"data.path": ""})),
]

CUTS = "placement.cuts"
# placement.cuts (the MLP example: 2 compnodes, so 1 cut; modules fc1, fc2, fc3): the first two are refused
# as keys, the others once the model is traced (names are checked against its graph)
CUT_CASES = [
    variant("cuts", "one-too-many", CUTS, setter(**{CUTS: ["fc2", "fc3"]}), says="2 cut(s) make 3 sub-DAGs"),
    variant("cuts", "a-string", CUTS, setter(**{CUTS: "fc2"}), says="list"),
    variant("cuts", "names-nothing", CUTS, setter(**{CUTS: ["fc9"]}), says="names no op"),
    variant("cuts", "the-first-op", CUTS, setter(**{CUTS: ["fc1"]}), says="sub-DAG 0 would be empty"),
]

CASES: list[Variant] = SYNTAX + KEYS + TYPES + RANGES + STRINGS + CUT_CASES
