"""The museum of real bugs, as data: one row per realistic bug, planted by replacing one snippet; a row
is an `Exhibit`, its fields in the order the class lists and explains them.

Every exhibit is a class of bug that real training projects shipped (ring attention reusing stale
K/V blocks, a loss not reduced over the context-parallel group, router gradients left out of the
data-parallel sum, ...), written into this course's own code at the place where it would live here.
`python -m common.exercises bug --check` plants each one in a copy and runs its `catch` tests:
common/exercises/MUSEUM.md holds the table it writes.

This file (with museum_catalog_06.py) is the instructor's key: a copy of the course made by `make` or
`bug ID --out` holds, in its place, a catalog of the public fields only (see answer_keys.py).
"""
from .museum_catalog_06 import CP_EXHIBITS
from .museum_exhibit import Exhibit

EXHIBITS = (
    Exhibit("01.bug1",
        "with --microbatches 2 the loss is half the single-device loss; with one micro-batch all is well",
        "gradient accumulation that divides twice",
        "01_data_parallel/train_dp.py",
        "kw = dict(tokens_per_step=args.global_batch * args.seq_len, bf16=args.dtype == \"bf16\")",
        "kw = dict(tokens_per_step=args.global_batch * args.seq_len * args.microbatches, bf16=args.dtype == \"bf16\")",
        ("tests/test_dp.py::test_every_impl_reproduces_single_device_losses",),
        ("python 01_data_parallel/train_dp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 01_data_parallel/train_dp.py --steps 5 --quiet --metrics runs/bug/mb1.jsonl",
         "torchrun --nproc_per_node=2 01_data_parallel/train_dp.py --steps 5 --microbatches 2 --quiet "
         "--metrics runs/bug/mb2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/mb1.jsonl runs/bug/mb2.jsonl"),
        "`compare_metrics` passes the 1-micro-batch run and fails the 2-micro-batch one from step 1, by a "
        "factor of exactly 2 (0.5 relative): the number of micro-batches is the culprit, not the ranks. "
        "`forward_backward_rows` divides each micro-batch's summed loss by `tokens_per_step`, and "
        "`build_trainer` now passes `global_batch · seq_len · microbatches`: the global token count already "
        "covers every micro-batch, so multiplying by their count divides the accumulated loss (and gradient) "
        "a second time. Fix: `tokens_per_step` is the step's token count, `global_batch · seq_len`."),
    Exhibit("01.bug2",
        "--impl torch trains to the same losses as ours, but reports a gradient norm N times smaller",
        "gradient accumulation that divides twice (the all-reduce averages a loss already divided by the "
        "global token count)",
        "01_data_parallel/torch_dp.py",
        "    return work.get_future().then(lambda fut: fut.value()[0])",
        "    return work.get_future().then(lambda fut: fut.value()[0].div_(torch.distributed.get_world_size(group)))",
        ("tests/test_dp.py::test_every_impl_reproduces_single_device_losses",),
        ("python 01_data_parallel/train_dp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 01_data_parallel/train_dp.py --impl torch --steps 5 --quiet "
         "--metrics runs/bug/torch.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/torch.jsonl --key grad_norm",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/torch.jsonl"),
        "`compare_metrics --key grad_norm` fails from step 1 with a ratio of exactly 1/N (0.5 at 2 ranks) "
        "while the losses match to 1e-7, and `--impl naive` and `bucketed` pass: the culprit is what only the torch path does, DDP's communication hook. "
        "It now averages each bucket (sum ÷ N, DDP's own default), but our loss is already divided by the "
        "global token count: the gradient is divided by N twice. The losses hide it: `--clip 1.0` scales both "
        "runs' gradients (norm 9 and 4.5 at step 1) to norm 1, and AdamW's m/√v ignores a constant factor "
        "anyway (but for `eps`). The gradient norm is the number to watch; with `--clip 0` and SGD the steps "
        "would be N times too small. Fix: the hook returns the sum."),
    Exhibit("02.bug1",
        "TP runs report a gradient norm several times one device's from step 1 (TP 2: 6.6×), and the losses follow",
        "f and g swapped (the conjugate operators' backward)",
        "02_tensor_parallel/tp_operators.py",
        "    def forward(ctx, x, group):\n        # >>> exercise 02.f_g\n        return _all_reduce(x, group)\n"
        "        # <<< exercise 02.f_g\n\n    @staticmethod\n"
        "    def backward(ctx, grad):             # d(sum of partials)/d(partial) = 1\n"
        "        # >>> exercise 02.f_g\n        return grad, None",
        "    def forward(ctx, x, group):\n        # >>> exercise 02.f_g\n        ctx.group = group\n"
        "        return _all_reduce(x, group)\n        # <<< exercise 02.f_g\n\n    @staticmethod\n"
        "    def backward(ctx, grad):             # d(sum of partials)/d(partial) = 1\n"
        "        # >>> exercise 02.f_g\n        return _all_reduce(grad, ctx.group), None",
        ("tests/test_tp_ops.py::test_operators_at_two_ranks", "tests/test_tp.py::test_tp_layouts_match_single_device[2]"),
        ("python 02_tensor_parallel/train_tp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --tp 2 --steps 5 --quiet --metrics runs/bug/tp2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/tp2.jsonl --key grad_norm"),
        "`compare_metrics --key grad_norm` fails at step 1 while the step-1 loss still matches (the forward "
        "is right: only backward is wrong). `check_operators` (tests/test_tp_ops.py::test_operators_at_two_ranks) "
        "names the operator: fed 10·r on rank r, g's backward must give 10·r back, and gives the sum over ranks. "
        "Megatron's g is all-reduce forward, *identity* backward: each rank's partial sum enters the total "
        "with coefficient 1, so its gradient is the incoming gradient itself. An all-reduce there sums tp "
        "identical gradients, tp× too large, and the error compounds block after block down the residual "
        "stream. Fix: g's backward returns `grad` unchanged (f is the one that all-reduces in backward)."),
    Exhibit("02.bug2",
        "--sequence-parallel reports another gradient norm than plain TP from step 2, and its losses slowly drift away",
        "gradients of replicated parameters left partial (sequence-parallel norm gains)",
        "02_tensor_parallel/tensor_parallel.py",
        "            if p.grad is not None and p.tp_split_dim is None and replicas(p)[\"tp\"] == model.tp_size:\n"
        "                comm.all_reduce(p.grad, group=tp_group, name=\"tp\")",
        "            if p.grad is not None and p.tp_split_dim is None and replicas(p)[\"tp\"] == model.tp_size:\n"
        "                pass          # each rank keeps its own norm gradient",
        ("tests/test_tp.py::test_tp_layouts_match_single_device[2]",),
        ("torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --tp 2 --steps 5 --quiet --metrics runs/bug/tp.jsonl",
         "torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --tp 2 --sequence-parallel --steps 5 --quiet "
         "--metrics runs/bug/sp.jsonl",
         "python -m common.compare_metrics runs/bug/tp.jsonl runs/bug/sp.jsonl",
         "python -m common.compare_metrics runs/bug/tp.jsonl runs/bug/sp.jsonl --key grad_norm"),
        "`compare_metrics --key grad_norm` of the SP run against plain TP fails from step 2; the loss stays within "
        "1e-5 for 5 steps but drifts (4e-6 at step 5, where plain TP matches one device to 1e-7; the tests compare "
        "at 1e-6 and catch it). Only `--sequence-parallel` shows it, so the suspects are what SP changes: the "
        "norms run on S/tp tokens per rank. A norm gain is replicated on every TP rank, but each rank's "
        "gradient of it sums over its own S/tp tokens only: a partial sum. `sync_sequence_parallel_grads` "
        "must all-reduce it over the TP group (D floats per norm); without it the replicas' norm gains "
        "drift apart. Fix: the all-reduce of the norm gradients."),
    Exhibit("02.bug3",
        "TP 2 × DP 2 with --recompute full trains to other losses than --recompute none; TP 2 alone is fine",
        "a wrong TP group in recomputed code",
        "02_tensor_parallel/tp_layers.py",
        "        return tp_operators.reduce_from_tp_region(y, self.group)",
        "        from common.recompute import is_recomputing          # the recomputation rebuilds the block\n"
        "        return tp_operators.reduce_from_tp_region(y, None if is_recomputing() else self.group)",
        ("tests/test_recompute.py::test_every_mode_is_the_run_of_none_and_the_ledger_holds[4]",),
        ("torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --tp 2 --steps 3 --quiet "
         "--metrics runs/bug/none.jsonl",
         "torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --tp 2 --steps 3 --recompute full --quiet "
         "--metrics runs/bug/full.jsonl",
         "python -m common.compare_metrics runs/bug/none.jsonl runs/bug/full.jsonl --key grad_norm"),
        "Recomputation must give the bit-identical run: `compare_metrics` of `--recompute full` against "
        "`none` fails from step 1's gradient norm, but only when the TP group is not the world (TP 2 at 2 "
        "ranks passes; TP 2 × DP 2 at 4 fails): so a collective of the recomputed forward runs on the wrong "
        "ranks. `TPRegion.g` passes `None` (the default group: the world) while `is_recomputing()`: the "
        "rebuilt activations sum the other TP group's partial outputs too, and backward differentiates a "
        "forward that never happened. Fix: the recomputation uses the module's own `self.group`, like the "
        "forward (common/recompute.py: the same collectives on the same groups)."),
    Exhibit("02.bug4",
        "--tp-overlap's gradient norm differs from plain --sequence-parallel's from step 1 (its step-1 loss "
        "matches), then the losses drift; without --tp-overlap all is well",
        "a chunk multiplied against the wrong shard (a decomposed collective's index bookkeeping)",
        "02_tensor_parallel/tp_overlap.py",
        "dw.add_((dyc[src].flatten(0, -2).t() @ held",
        "dw.add_((dyc[j].flatten(0, -2).t() @ held",
        ("tests/test_tp_overlap.py::test_operators_equal_the_plain_ones[2]",
         "tests/test_tp_overlap.py::test_overlapped_runs_match_one_device[2]"),
        ("torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --tp 2 --sequence-parallel --steps 5 --quiet "
         "--metrics runs/bug/sp.jsonl",
         "torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --tp 2 --sequence-parallel --tp-overlap "
         "--steps 5 --quiet --metrics runs/bug/overlap.jsonl",
         "python -m common.compare_metrics runs/bug/sp.jsonl runs/bug/overlap.jsonl",
         "python -m common.compare_metrics runs/bug/sp.jsonl runs/bug/overlap.jsonl --key grad_norm"),
        "`compare_metrics --key grad_norm` fails at step 1 while the step-1 loss matches: the forward is right, a "
        "gradient is wrong, and only --tp-overlap shows it, so the suspects are tp_overlap.py's backwards. "
        "`check_column_entrance` (tests/test_tp_overlap.py) names the piece: the input gradient and the outputs "
        "match the plain entrance, the weight gradients do not. In the entrance's backward two rings run at once, "
        "with two indices per step: `src`, the rank whose input shard is held now, and `j`, the chunk whose dX "
        "partial sum passes through. The weight gradient pairs each shard with the gradient of the SAME "
        "positions, dy[src]ᵀ·x_src; the bug pairs it with dy[j], the positions of another rank's shard. Every "
        "product is the right shape, so nothing raises: only the sum is wrong. Fix: dyc[src]."),
    Exhibit("03.bug1",
        "zero-bubble (zb-h1) with data parallelism drifts from one device; 1F1B with DP, and zb-h1 alone, match",
        "gradients reduced before they are final (the all-reduce launched before zero bubble's W)",
        "03_pipeline_parallel/pipeline_executor.py",
        "return {u.stage: i for i, a in enumerate(actions) for u in units([a]) if u.kind in GRADS_DONE}",
        "return {u.stage: i for i, a in enumerate(actions) for u in units([a]) if u.kind in BACKWARDS}",
        ("tests/test_pp.py::test_world_4",),
        ("python 03_pipeline_parallel/train_pp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --pp 2 --schedule zb-h1 --microbatches 2 "
         "--steps 5 --quiet --metrics runs/bug/zb.jsonl --timeline runs/bug/zb_trace.json",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/zb.jsonl --key grad_norm",
         "python 03_pipeline_parallel/plot_timeline.py runs/bug/zb_trace.json --out runs/bug/zb.png"),
        "`compare_metrics` fails from step 1's gradient norm, only for zb-h1 with dp > 1 (1F1B with dp, and "
        "zb-h1 without, pass): so the data-parallel sum meets something only zero bubble does. The timeline "
        "shows it: a stage's last action of the step is a W, not a B. The sum of a stage starts from "
        "`on_stage_grads_ready`, which `PipelineExecutor.run_actions` calls after the stage's last gradient action; "
        "counting only B, it fires while W actions of that stage still follow. The bucket copies `.grad` when "
        "it is launched and copies the sum back when waited for, so the weight gradients that the later W actions added are overwritten by a sum that never had them. "
        "Fix: a stage's gradients are final after its last B *or W* (`last_grad_actions` counts both)."),
    Exhibit("03.bug2",
        "--schedule zb-v and dualpipev stop at their first step with a KeyError on every rank; every other "
        "schedule trains",
        "stages placed in a loop while the schedule was written for a V (model and schedule disagree on where "
        "each stage lives)",
        "03_pipeline_parallel/train_pp.py",
        "specs = pipeline_stages.stage_specs(cfg, layout.pp, layout.v, args.seq_len, rank_of)",
        "specs = pipeline_stages.stage_specs(cfg, layout.pp, layout.v, args.seq_len)",
        ("tests/test_pp.py::test_world_2",),
        ("torchrun --nproc_per_node=2 03_pipeline_parallel/train_pp.py --schedule zb-v --microbatches 4 --steps 2",
         "torchrun --nproc_per_node=2 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 2 "
         "--microbatches 4 --steps 2",
         "python 03_pipeline_parallel/train_pp.py --pp 2 --microbatches 4 --schedule zb-v --print-schedule"),
        "The printed schedule is fine on paper (`--print-schedule` simulates it: no deadlock), and the interleaved "
        "schedule, with as many stages per rank, trains: so the lists are right and something about where they "
        "run is not. The stage table printed at the start of the zb-v run says it: rank 0 holds stages 0 and 2, "
        "rank 1 stages 1 and 3, the interleaved placement, while rank 0's list runs stages 0 and 3 (a V: rank r "
        "holds r and 2p-1-r). The executor then looks for the input of stage 3 on the rank that the stage table "
        "names for stage 2, itself, finds no local hand-over, and fails. Each stage's rank must come from the "
        "schedule (`pipeline_schedules.stage_ranks`): `stage_specs` was called without it and fell back to the "
        "loop, stage s on rank s % p. Fix: pass `rank_of` (as `train_pp.main` does), so the model's stages, "
        "the executor's message routes and the schedule's lists agree."),
    Exhibit("04.bug1",
        "with --tp 2 the 3D run's gradient norm differs from one device's from step 1 (dp × pp layouts match)",
        "gradient-norm clipping that forgets a model-parallel group",
        "04_3d_combined/trainer_3d.py",
        "self.norm_groups = [self.tp_group, self.pp_group]",
        "self.norm_groups = [self.pp_group]",
        ("tests/test_3d.py::test_clip_grad_norm_is_the_single_device_norm",
         "tests/test_3d.py::test_four_rank_layouts_and_resume_in_another_layout"),
        ("python 04_3d_combined/train_3d.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=4 04_3d_combined/train_3d.py --dp 1 --tp 2 --pp 2 --steps 5 --quiet "
         "--metrics runs/bug/tp2pp2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/tp2pp2.jsonl --key grad_norm"),
        "`compare_metrics --key grad_norm` fails at step 1 in every layout with tp > 1 (dp × pp layouts pass), "
        "and the losses follow once clipping acts (the default `--clip 1.0`). The norm of the whole model "
        "sums squares over the groups whose ranks hold *different* parts: TP shards and pipeline stages. "
        "Without the TP group each rank clips by the norm of its own shard, the ranks of a TP group scale by "
        "different factors, and the layers' shards stop being slices of one model. Fix: sum over TP too "
        "(`norm_groups = [tp_group, pp_group]`); DP replicas are the ones never summed."),
    Exhibit("05.bug1",
        "expert parallelism trains to other losses than one device, a little more every step",
        "router gradients never summed across ranks",
        "05_moe_expert_parallel/moe_trainer.py",
        "dense = [(n, p) for n, p in named if not is_expert_param(n)]",
        "dense = [(n, p) for n, p in named if not is_expert_param(n) and \".router.\" not in n]",
        ("tests/test_moe_ep.py::test_training_matches_world_size_one[2]",),
        ("python 05_moe_expert_parallel/train_moe.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 05_moe_expert_parallel/train_moe.py --ep 2 --steps 5 --quiet "
         "--metrics runs/bug/ep2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/ep2.jsonl --key grad_norm"),
        "`compare_metrics` fails at step 1's gradient norm, and on the loss a few steps later (the first loss "
        "above 1e-5 varies with the machine: the routers part slowly). The MoE layer test "
        "(`test_expert_parallel_layer_equals_single_device_layer`) still passes: one layer's forward and "
        "backward are right, so the bug is in what happens to the gradients after backward. The router is a "
        "dense parameter (every rank holds it whole, each computed its gradient from its own rows): it must "
        "be summed over all data-parallel ranks like every dense weight. Left out of both the dense and the "
        "expert all-reduce, each rank's router learns from its own rows only and the replicas part. Fix: the "
        "router is in `dense`, the first kind of `replicated_over_groups`."),
    Exhibit("05.bug2",
        "expert-parallel runs (ep 4; or ep 2 at dp 4) part from one device from step 1's gradient norm",
        "expert gradients reduced over the wrong group",
        "05_moe_expert_parallel/moe_trainer.py",
        "\"experts\": (experts, \"edp\")}",
        "\"experts\": (experts, \"ep\")}",
        ("tests/test_moe_ep.py::test_training_matches_world_size_one[4]",),
        ("python 05_moe_expert_parallel/train_moe.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --ep 2 --steps 5 --quiet "
         "--metrics runs/bug/ep2dp4.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/ep2dp4.jsonl --key grad_norm"),
        "`compare_metrics` fails at step 1's gradient norm at dp 4 = edp 2 × ep 2. An expert's gradient must "
        "be summed over the ranks holding *the same* expert (edp: each saw its own EP group's rows); the EP "
        "group's ranks hold *different* experts, so summing over it adds unrelated experts' gradients into "
        "each other's slots and misses the other copy's rows. Read the grid that `train_moe.py` prints: the "
        "expert sum must run along edp. Fix: `\"experts\": (experts, \"edp\")`."),
    Exhibit("05.bug3",
        "with TP and --router-bias-rate the 4D run slowly drifts from chapter 05's one-device run; the TP ranks "
        "of a stage route the same tokens differently",
        "the selection bias updated on one TP rank only",
        "05_moe_expert_parallel/router_statistics.py",
        "        if self.bias_rate > 0:                                     # aux-loss-free balancing, from the whole step",
        "        if self.bias_rate > 0 and self.counted:                    # aux-loss-free balancing, from the whole step",
        ("tests/test_4d.py::test_selection_biases_equal_across_each_tp_group",),
        ("torchrun --nproc_per_node=4 05_moe_expert_parallel/train_4d.py --model tiny-moe --dp 2 --ep 2 --tp 2 --pp 1 "
         "--router-bias-rate 0.01 --steps 10 --quiet --metrics runs/bug/tp2.jsonl",
         "torchrun --nproc_per_node=4 05_moe_expert_parallel/train_4d.py --model tiny-moe --dp 4 --ep 2 --tp 1 --pp 1 "
         "--router-bias-rate 0.01 --steps 10 --quiet --metrics runs/bug/tp1.jsonl",
         "python -m common.compare_metrics runs/bug/tp1.jsonl runs/bug/tp2.jsonl --key max_over_mean_load"),
        "The losses may match for several steps (a bias moves the selection only when it flips a top-k "
        "choice), so compare the routing: `expert_load` and `max_over_mean_load` part between the TP 2 and "
        "TP 1 runs, and `test_selection_biases_equal_across_each_tp_group` reads the biases of every rank: "
        "they differ inside a TP group. The statistics are *counted* by tp rank 0 only (else the TP ranks, "
        "which route the same tokens, would count them tp times), but after the all-reduce *every* rank "
        "holds the same totals and must update its copy of the bias. Fix: update on every rank; only the "
        "counting is restricted to tp rank 0."),
    Exhibit("05.bug4",
        "with --recompute full the MoE run reports twice the expert loads and aux loss of --recompute none",
        "a side effect repeated by recomputation",
        "common/moe_routing.py",
        "        if is_recomputing():         # backward reruns the forward (--recompute): these tokens are counted\n"
        "            return\n",
        "",
        ("tests/test_recompute.py::test_every_mode_is_the_run_of_none_and_the_ledger_holds[2]",),
        ("torchrun --nproc_per_node=2 05_moe_expert_parallel/train_moe.py --ep 2 --steps 3 --quiet "
         "--metrics runs/bug/none.jsonl",
         "torchrun --nproc_per_node=2 05_moe_expert_parallel/train_moe.py --ep 2 --steps 3 --recompute full --quiet "
         "--metrics runs/bug/full.jsonl",
         "python -m common.compare_metrics runs/bug/none.jsonl runs/bug/full.jsonl --key aux_loss"),
        "The losses match (the gradients are right), but `compare_metrics --key aux_loss` shows a factor of "
        "exactly 2, and `expert_load` doubles. Full recomputation runs each block's forward a second time in "
        "backward, and the router's tally (`RoutingTally.add`) records every call: each token is counted "
        "twice. Fix: a forward with a side effect checks `is_recomputing()` and records once. The bias "
        "update hides it (its sign(mean − load) is unchanged by a factor of 2); the reported numbers do not."),
) + CP_EXHIBITS

BY_ID = {e.id: e for e in EXHIBITS}
