"""Serving deployed models (issue 14): dynamic batching, sampling, generation sessions, the HTTP API
(OpenAI-compatible ``/v1/completions`` and ``/v1/models``, plus ``/v1/infer``) and a small client.

The broker hosts it (``broker.deployments``); nothing here knows about compnodes: a deployment is a
``ServedModel`` whose batcher runs batches through a callable the broker supplies.

Map of the package:

- ``served.py``       ``ServedModel``, the ``Deployments`` lookup, ``ApiError``, ``ServingObserver``.
- ``batching.py``     ``DynamicBatcher``: bounded wait, max batch, bounded queue, batches in flight.
- ``answers.py``      what the batcher answers (``RowAnswers``, a request's part) and why it may not.
- ``sampling.py``     greedy, temperature, top-p, seeded generators.
- ``generation.py``   one session per choice without KV caches: the padded window per token (``Window``).
- ``kv_sessions.py``  with KV caches on the compnodes: cache slots, prefill + a row per token, replay
                      after a lost placement, sequences scored for ``/v1/infer``.
- ``completion_request.py`` the ``/v1/completions`` request model, its 400s, prompts as checked token ids.
- ``completions.py``  ``POST /v1/completions``: choices run and timed, the reply's parts, server-sent events.
- ``chat.py``         ``POST /v1/chat/completions``: messages through the tokenizer's chat template, then
                      generated as ``/v1/completions`` does.
- ``logprobs.py``     log probabilities of generated tokens, in both APIs' formats.
- ``stopping.py``     when a completion ends (end-of-text, stop tokens, stop strings) and the text streamed.
- ``http.py``         the aiohttp application and its error middleware.
- ``tokenizers.py``   the model folder's tokenizer files, sent by ``deploy`` and loaded on the broker.
- ``client.py``       ``ServingClient``-free HTTP client for users and tests (``FusionNetClient``).
"""
