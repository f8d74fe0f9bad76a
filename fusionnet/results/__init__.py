"""A run's results, one path for ``fusionnet run --local`` and the broker (interface.md "Results").

Both runners hand this package the same pieces (the sub-DAGs' state and gradients, each step's
micro-batch outputs as flat ``"mb/leaf"`` tensors, the metrics rows and the plan document) and get one
``RunResult``, written by one ``write_results``. It sits below the daemons and the client runtime: it
imports the IR and the partition only.

Map:
- ``assemble.py`` ``RunResult``; the sub-DAGs' tensors -> ``state_dict`` keys (tied keys, untouched
  tensors); micro-batch outputs -> ``"mb/leaf"`` tensors (what a compnode sends) -> one tensor per
  output leaf (what ``outputs.safetensors`` holds)
- ``files.py``    the result files: weights/grads/outputs (safetensors), metrics.jsonl, plan.json
- ``stream_safetensors.py`` safetensors written a tensor at a time (weights the writer never holds whole)
- ``slice_stream.py`` tensors as one safetensors byte stream, read in bounded parts (state sent ahead,
  replicas)
"""
