"""Request batches through a resident sub-DAG (deployments, issue 14): the compnode's half of
``serve_step``.

A deployment is an ``infer`` assignment that stays: its "steps" are request batches whose data comes
with each call (``ServeStepRequest.data``) instead of from the assigned dataset. The broker keeps up to
``in_flight`` batches in the pipeline, so a compnode may be asked for batch ``k + 1`` while it (or a
sub-DAG after it) still computes batch ``k``; batches run here strictly in step order (``StepOrder``),
because the mailbox forgets a step's messages once a later step finished and a batch run out of order
would wait forever for them.

A batch's call may come twice: the broker's RPC client repeats a call whose stream p2pd closed before
the answer came (every method is safe to repeat). The answers of the last ``KEPT_ANSWERS`` batches are
kept, and a repeated call gets the first one's answer (or waits for it): never a second run, which would
be refused as out of order and, with KV caches, write a session's cache twice.
"""

from __future__ import annotations

import asyncio

import torch

from fusionnet.compnode.assignment_intake import JobAssignment
from fusionnet.errors import JobError
from fusionnet.messages.blobs import pack_tensors, unpack_tensors
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.results.assemble import output_tensors

ORDER_TIMEOUT = 120.0  # a batch waits this long for the ones before it to arrive
KEPT_ANSWERS = 8  # more than the batches a deployment keeps in flight


class StepOrder:
    """Lets batch ``n`` run once batch ``n - 1`` has run (or failed) here."""

    def __init__(self) -> None:
        self.next = 0
        self._changed = asyncio.Condition()
        self.answers: dict[int, asyncio.Future[ServeStepReply]] = {}  # the last batches' answers

    def answer_of(self, step: int) -> asyncio.Future[ServeStepReply] | None:
        return self.answers.get(step)

    def keep(self, step: int) -> asyncio.Future[ServeStepReply]:
        future: asyncio.Future[ServeStepReply] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody may ask again
        self.answers[step] = future
        for old in sorted(self.answers)[:-KEPT_ANSWERS]:
            del self.answers[old]
        return future

    async def wait_turn(self, step: int) -> None:
        if step < self.next:
            raise JobError(f"batch {step} already ran here (next is {self.next})")
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.next == step), ORDER_TIMEOUT)

    async def done(self, step: int) -> None:
        async with self._changed:
            self.next = max(self.next, step + 1)
            self._changed.notify_all()


def split_batch(
    job: JobAssignment, blob: bytes, sizes: list[int], step: int
) -> list[dict[str, torch.Tensor]]:
    """``"<micro-batch>/<field>"`` tensors -> per-micro-batch field maps, checked against the fields
    this sub-DAG reads and the micro-batch ``sizes`` (a sub-DAG without placeholders gets no data)."""
    tensors = unpack_tensors(blob, f"serve {job.job_id} batch {step}") if blob else {}
    wanted = {job.graph.node(p).target for p in job.subdag.placeholders}
    where = f"serve {job.job_id} batch {step}"
    per_mb: list[dict[str, torch.Tensor]] = [{} for _ in sizes]
    for key, t in tensors.items():
        mb, sep, name = key.partition("/")
        if not sep or not mb.isdigit() or name not in wanted or int(mb) >= len(sizes):
            raise JobError(f"{where}: unexpected tensor {key[:60]!r}")
        if t.dim() == 0 or t.shape[0] != sizes[int(mb)]:
            raise JobError(f"{where}: {key[:60]!r} does not hold {sizes[int(mb)]} rows")
        per_mb[int(mb)][name] = t
    for mb, fields in enumerate(per_mb):
        if set(fields) != wanted:
            raise JobError(f"{where}: micro-batch {mb} lacks {sorted(wanted - set(fields))}")
    return per_mb


def picked(outputs: dict[str, torch.Tensor], pick: list[int] | None) -> dict[str, torch.Tensor]:
    """Keeps position ``pick[row]`` of dimension 1 of every output with one (rows counted over the
    micro-batches in order): a causal LM answers with the logits of each row's last token only."""
    if pick is None:
        return outputs
    out: dict[str, torch.Tensor] = {}
    row = 0
    for key in sorted(outputs, key=lambda k: tuple(int(p) for p in k.split("/"))):
        t = outputs[key]
        n = t.shape[0] if t.dim() else 0
        if t.dim() >= 2 and key.endswith("/0"):
            take = pick[row : row + n]
            if len(take) != n or any(p >= t.shape[1] for p in take):
                raise JobError(f"pick: {len(pick)} positions do not fit the outputs ({key}: {list(t.shape)})")
            t = t[torch.arange(n), torch.tensor(take, dtype=torch.long)]
            row += n
        out[key] = t.contiguous()
    return out


def kept(
    outputs: dict[str, torch.Tensor], keep: list[bool] | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """``keep`` (one flag per row, over the micro-batches in order): the outputs of the kept rows only,
    and every row's argmax over the last dimension of its first output (``"<micro-batch>/0"``, which
    must hold one position per row: a causal LM's logits after ``picked``). ``keep`` None: all, no ids."""
    if keep is None:
        return outputs, None
    out: dict[str, torch.Tensor] = {}
    ids: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}  # per micro-batch, from its first output (sorted first)
    row = 0
    for key in sorted(outputs, key=lambda k: tuple(int(p) for p in k.split("/"))):
        mb, _, leaf = key.partition("/")
        t = outputs[key]
        n = t.shape[0] if t.dim() else 0
        if leaf == "0":
            if t.dim() != 2:
                shape = list(t.shape)
                raise JobError(f"keep: the first output must hold one position per row ({key}: {shape})")
            if row + n > len(keep):
                raise JobError(f"keep: {len(keep)} flags do not cover the outputs' rows ({key}: {n} rows)")
            masks[mb] = torch.tensor(keep[row : row + n], dtype=torch.bool, device=t.device)
            ids[key] = t.argmax(dim=-1).to("cpu", torch.long)
            row += n
        mask = masks.get(mb)
        if mask is None:
            raise JobError(f"keep: micro-batch {mb} has no first output")
        # per-row outputs lose the rows not kept; others (a 0-dim loss, say) stay whole
        out[key] = t[mask].contiguous() if t.dim() and n == int(mask.numel()) else t
    if row != len(keep):
        raise JobError(f"keep: {len(keep)} flags for {row} rows of outputs")
    return out, ids


async def serve_step(job: JobAssignment, order: StepOrder, request: ServeStepRequest) -> ServeStepReply:
    """Runs one request batch (FP of each micro-batch) in step order; the output sub-DAG answers with
    the outputs, picked as asked, packed where the executor routes a short stretch."""
    step = request.step
    kept = order.answer_of(step)
    if kept is not None:  # a repeated call: the first one's answer
        return await asyncio.shield(kept)
    answer = order.keep(step)
    try:
        reply = await _run_batch(job, order, request)
    except BaseException as e:
        answer.set_exception(e if isinstance(e, Exception) else JobError(f"batch {step} was cancelled"))
        raise
    answer.set_result(reply)
    return reply


async def _run_batch(job: JobAssignment, order: StepOrder, request: ServeStepRequest) -> ServeStepReply:
    step = request.step
    sizes = list(request.sizes)
    microbatches = split_batch(job, request.data, sizes, step)
    await order.wait_turn(step)
    try:
        report = await job.executor.run_step(step, microbatches, sizes)
        job.channel.mailbox.forget_step(step)
    finally:
        await order.done(step)
    outputs = None
    if report.outputs:

        def pack() -> tuple[bytes, bytes | None]:
            rows, ids = kept(picked(output_tensors(report.outputs), request.pick), request.keep)
            return pack_tensors(rows), None if ids is None else pack_tensors(ids)

        # on the compute thread, or inline where this phase's packs have been short (a decode pass's)
        outputs, ids = await job.executor.run_routed("pack", pack)
        return ServeStepReply(step=step, fp_seconds=report.fp_seconds, outputs=outputs, ids=ids)
    return ServeStepReply(step=step, fp_seconds=report.fp_seconds)
