"""The IR plane and the execution plane: a model as a DAG of named ops, cut into sub-DAGs and run.

Map of the package:

- ``ir.py``          ``IRGraph`` / ``IRNode``: the model as pure data.
- ``trace.py``       ``nn.Module`` + loss + example inputs -> ``IRGraph`` with shapes and costs (torch.fx).
- ``custom_backward.py`` refusing backward code of a model's own (custom autograd Functions, backward hooks)
                     in train/grad jobs: the backward is rebuilt from the traced forward ops.
- ``graph_builder.py`` an fx graph (symbolic or exported) -> normalised ``IRGraph``: parameters folded, costs.
- ``registry.py``    the operator registry: how ops are added, and the decoder's allowlist.
- ``allowlist.py``   the curated operator allowlist, the data behind ``registry.py`` (what must stay out).
- ``guards.py``      argument checks of allowed ops whose sizes come from the IR or data (allocation caps).
- ``costs.py``       per-op FLOPs and bytes moved (``NodeCost``); ``op_call.py`` prices one call with
                     the per-operator rules of ``flop_rules.py``.
- ``codec.py``       IR <-> msgpack bytes, with the checks a compnode applies to IR from a peer.
- ``partition.py``   an assignment IR node -> sub-DAG turned into sub-DAGs (FusionAI Table 3).
- ``cuts.py``        a job's own cuts (``placement.cuts``: op names or module paths) -> an assignment.
- ``rebuild.py``     IR nodes -> callables; a sub-DAG -> ``torch.fx.GraphModule``; the one IR interpreter
                     (``run_whole_graph``, with a per-node hook the tracer uses).
- ``executor.py``    FP, BP and Update of one sub-DAG (``SubDagExecutor``), inline or on a compute thread,
                     in the order of the job's pipeline schedule (``fusionnet.schedules``).
- ``schedule_loop.py`` one step of the schedule: the sub-DAG's program of actions in order, then Update.
- ``outbox.py``      the executor's sends in flight during a step.
- ``split_backward.py`` a backward split into I (input gradients) and W (weight gradients).
- ``param_groups.py`` where each parameter's autograd branch joins the inputs' path (for the split).
- ``backward_pass.py`` BP of one sub-DAG: gradients in from consumers, out to producers (a mixin).
- ``activation_memory.py`` the activation bytes a sub-DAG holds between F and B, measured per step.
- ``short_stretches.py`` which compute stretches of a sandbox worker run on its event loop, not its thread.
- ``devices.py``     a compnode's torch device (``--device``): values moved in and copied out.
- ``row_lookup.py``  row-served embeddings: a tied weight whose far side only looks rows up gets those rows.
- ``row_trade.py``   the executor's half of row-served embeddings: ids out, rows back, per step (a mixin).
- ``hooks.py``       what runs around each FP, BP and Update (timing, --slowdown, fault injection).
- ``channel.py``     the message passing between executors; ``LocalHub`` keeps it in memory.
- ``checkpoint.py``  a sub-DAG's optimizer state as flat named tensors, and back.
- ``precision.py``   the job's ``precision``: autocast of the forward pass, fp16's loss scaler.
"""
