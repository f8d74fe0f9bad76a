"""The torch contenders of ``pipeline_vs_torch.py``: plain PyTorch (c) and ``torch.distributed.pipelining``
(b), each in processes of its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from functools import partial
from typing import Any

from pipeline_common import Config, Result, format_split, load_batches, set_threads, torch_allocator_env


# ---- (c) plain PyTorch -----------------------------------------------------------------------------
def plain_worker(cfg: Config, queue: Any) -> None:
    try:
        import pipeline_model
        import torch
        import torch.nn.functional as F

        set_threads(cfg.threads, cfg.torch_allocator)
        batches = load_batches(cfg)
        torch.manual_seed(cfg.seed)
        model = getattr(pipeline_model, cfg.builder)(**cfg.model_kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        times, losses = [], []
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for xm, ym in zip(x.chunk(cfg.microbatches), y.chunk(cfg.microbatches)):
                mean = model(xm, ym) if cfg.model == "gpt2" else F.cross_entropy(model(xm), ym)
                loss = mean * (xm.shape[0] / x.shape[0])
                loss.backward()
                total += loss.item()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(total)
        queue.put(("ok", times, losses))
    except BaseException:
        queue.put(("error", traceback.format_exc(), None))


# ---- (b) torch.distributed.pipelining ------------------------------------------------------------------
def pipe_worker(
    rank: int, world: int, port: int, cfg: Config, split: list[tuple[int, int]], queue: Any
) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        import pipeline_model
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from pipeline_model import GPT2Stage, causal_lm_loss, stage_module
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        set_threads(cfg.threads, cfg.torch_allocator)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        batches = load_batches(cfg)
        torch.manual_seed(cfg.seed)
        model = getattr(pipeline_model, cfg.builder)(**cfg.model_kwargs)
        cut = (lambda a, b: GPT2Stage(model, a, b)) if cfg.model == "gpt2" else partial(stage_module, model)
        loss_fn = causal_lm_loss if cfg.model == "gpt2" else F.cross_entropy
        if cfg.per_rank > 1:  # rank r holds stages r, world + r, ... (as FusionNet's compnodes do)
            mine = [rank + c * world for c in range(cfg.per_rank)]
            subs = [cut(*split[i]) for i in mine]
            stages = [PipelineStage(s, i, len(split), torch.device("cpu")) for s, i in zip(subs, mine)]
            schedule: Any = ScheduleInterleaved1F1B(stages, cfg.microbatches, loss_fn=loss_fn)
        else:
            subs = [cut(*split[rank])]
            stage = PipelineStage(subs[0], rank, world, torch.device("cpu"))
            if cfg.schedule == "zero-bubble":  # FusionNet's own ZB-H1 programs, run by torch's runtime
                schedule = zero_bubble_runtime(stage, world, cfg.microbatches, loss_fn)
            else:
                kind = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
                schedule = kind(stage, cfg.microbatches, loss_fn=loss_fn)  # scale_grads: 1/M
        opt = torch.optim.SGD([p for s in subs for p in s.parameters()], lr=cfg.lr)
        times, losses = [], []
        for x, y in batches:
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                mb_losses: list[Any] = []
                schedule.step(target=y, losses=mb_losses, return_outputs=False)
                losses.append(float(torch.stack([v.detach() for v in mb_losses]).mean()))
            else:
                schedule.step()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == world - 1:
            queue.put(("losses", rank, losses))
        if rank == 0:
            queue.put(("times", rank, times))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


def zero_bubble_actions(world: int, microbatches: int) -> dict[int, list[Any]]:
    """FusionNet's ZB-H1 programs (``fusionnet.schedules.zero_bubble_h1``) as torch's compute actions, rank
    r running stage r: the same F, I (input gradients) and W (weight gradients) of each micro-batch in
    the same order (FusionNet's U is the optimizer step, which the caller runs after ``step``)."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, _Action

    from fusionnet.schedules import zero_bubble_h1

    kinds = {"F": FORWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
    programs = zero_bubble_h1(world, microbatches).programs
    return {
        rank: [_Action(rank, kinds[a.kind], a.mb) for a in program if a.kind in kinds]
        for rank, program in enumerate(programs)
    }


def zero_bubble_runtime(stage: Any, world: int, microbatches: int, loss_fn: Any) -> Any:
    """torch's schedule runtime (``_PipelineScheduleRuntime``, what its ``ScheduleInterleavedZeroBubble``
    runs on) given ``zero_bubble_actions``, so both pipelines run one schedule; it adds the sends and
    receives. torch's own zero-bubble schedules need several stages per rank."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    runtime = _PipelineScheduleRuntime([stage], microbatches, loss_fn=loss_fn)  # scale_grads: 1/M
    runtime._prepare_schedule_with_comms(zero_bubble_actions(world, microbatches))
    return runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(targets: list[tuple[Any, tuple]], expect: int, timeout: float) -> list[tuple]:
    """Runs ``targets`` as spawned processes; collects ``expect`` queue messages (or an error)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, queue), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    messages: list[tuple] = []
    deadline = time.monotonic() + timeout
    try:
        while len(messages) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result after {timeout:g} s")
            try:
                msg = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("worker processes exited without a result") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"worker failed:\n{msg[-1]}")
            messages.append(msg)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return messages


def run_plain(cfg: Config, timeout: float) -> Result:
    res = Result("plain torch", note="1 process")
    try:
        with torch_allocator_env(cfg.torch_allocator):
            [(_, times, losses)] = run_processes([(plain_worker, (cfg,))], 1, timeout)
        res.times, res.losses = times, losses
    except Exception as e:
        res.error = str(e)
    return res


def run_torchpipe(cfg: Config, split: list[tuple[int, int]], split_source: str, timeout: float) -> Result:
    world = len(split) // cfg.per_rank
    res = Result(f"torch pipe {world}", note=f"split {format_split(split)} ({split_source})")
    port = free_port()
    try:
        with torch_allocator_env(cfg.torch_allocator):
            msgs = run_processes(
                [(pipe_worker, (r, world, port, cfg, split)) for r in range(world)], 2, timeout
            )
        for kind, _, payload in msgs:
            if kind == "times":
                res.times = payload
            else:
                res.losses = payload
    except Exception as e:
        res.error = str(e)
    return res
