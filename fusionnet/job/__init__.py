"""Job files: what the user asks FusionNet to run (interface.md "Job definition file").

Map of the package:

- ``schema.py``     pydantic models of the YAML (unknown keys refused), pure validators
- ``parse.py``      YAML text -> ``JobSpec``; pydantic errors -> one ``JobError`` naming the key
- ``optim.py``      optimizer allowlist, per-parameter settings (``per_op`` globs), ``build_optimizers``,
                    ``optimizer_factory`` (the one way reference, ``run --local`` and compnodes build them)
- ``losses.py``     loss allowlist (``torch.nn.functional``), keyword checks, the bound loss function
- ``data.py``       the dataset: safetensors ``inputs``/``labels`` or char-level text windows
- ``entrypoint.py`` imports and calls the model entry point
- ``weights.py``    ``model.weights``: a safetensors file or a ``save_pretrained`` folder (shards + index)
- ``batches.py``    which samples each step uses; micro-batch slicing
- ``kwargs_check.py`` checks shared by ``loss.kwargs`` and ``optimizer.kwargs``: every number finite
- ``preflight.py``  checks that need the data and model: finite tensors, memory, one forward pass and loss
- ``loader.py``     ``load_job``: all of the above in an order where nothing runs before validation
- ``kv_decode.py``  a ``transformers`` causal LM as a ``SlotDecoder`` (KV caches in its buffers) for
                    generate deployments

Everything a user can get wrong surfaces as one ``fusionnet.errors.JobError`` whose message starts
with the job-file key (``data.batch_size: must be > 0``) or the file and line (YAML syntax).
"""

from fusionnet.job.loader import LoadedJob, load_job, load_job_spec
from fusionnet.job.schema import JobSpec

__all__ = ["JobSpec", "LoadedJob", "load_job", "load_job_spec"]
