"""The bad-input sweep's catalogue (issue 17 item 7): broken variants of the MLP example job, as data.

Files:
    variant.py    ``Variant`` (what to break, which key or file the error must name) and ``JobDir``, the copy
                  of examples/mlp a variant edits (job.yaml keys, raw YAML, model code, tensors, links).
    yaml_cases.py YAML syntax, bounds (billion laughs, nesting, size), unknown/missing keys, wrong types,
                  out-of-range numbers, huge strings and NUL bytes.
    code_cases.py model entrypoint problems (paths, module form, import/build misbehaviour), forward and
                  loss/label problems, optimizer problems that need the model, task/loss combinations.
    file_cases.py data file, weights and --output problems.
    catalogue.py  ``VARIANTS``: every case above, names unique.

The runner is tests/test_bad_input_sweep.py.
"""
