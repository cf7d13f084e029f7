"""Every exercise of the course: which lines of which file a student writes, where the README explains
it, a hint, and the course's own tests that grade it.

In the chapter's code an exercise is the lines between two marker comments, at the body's indentation:

    def backward(ctx, grad):
        # >>> exercise 02.f_g
        return _all_reduce(grad, ctx.group), None
        # <<< exercise 02.f_g

An exercise may have several marked regions (f's backward and g's forward are one idea). `make` replaces
each region's lines by one `raise NotImplementedError(...)`; `grade` runs `units` (tests of the piece
alone) and `layout` (one run that must reproduce the single-device losses). tests/test_exercises.py
checks that the markers in the code and this catalog name the same exercises, and that each README
section named here is a real heading of the chapter's README.
"""
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError

BEGIN = "# >>> exercise "
MARKER = re.compile(r"^(\s*)# (>>>|<<<) exercise (\S+)\s*$")


@dataclass(frozen=True)
class Exercise:
    id: str                 # "02.f_g": chapter number, then a short name
    file: str               # the file that holds its marked region(s), from the repository root
    title: str              # what to implement, in one line
    section: str            # a heading of the chapter's README.md, without the #'s
    hint: str
    units: tuple = ()       # pytest node ids of the piece's own tests (a test function covers its parameters)
    layout: str = ""        # one pytest node id: a layout that must reproduce the single-device run
    wrong: tuple = ()       # (name, what the student wrote): realistic wrong answers its tests fail, each
                            # planted by `python -m common.exercises wrong --check` (from wrong_answers_key.py)
    references: tuple = ()  # names of the course's own answer its tests compare with: a body that calls one
                            # has borrowed the answer, not written it (the grader says so)

    @property
    def chapter(self) -> str:
        return self.id.split(".")[0]

    @property
    def readme(self) -> str:
        return str(Path(self.file).parent / "README.md")

    def node_ids(self, quick: bool = False) -> list[str]:
        """The tests that grade it: the units (with --quick), or the units and the layout run."""
        return list(self.units) if quick and self.units else list(self.units) + [self.layout]


EXERCISES = [
    Exercise("01.bucket_hook", "01_data_parallel/data_parallel.py",
             "BucketedDataParallel._on_grad_ready: count the gradient into its bucket; a full bucket starts its all-reduce",
             "Buckets, and overlap with backward",
             "self.bucket_of[p] is the parameter's _Bucket; bucket.ready counts the gradients that exist; when all of "
             "bucket.params are ready, bucket.launch(self.group) and append (bucket index, self._hooks_fired) to "
             "self.launch_log (the test reads it)",
             units=("tests/test_dp.py::test_buckets_are_sent_during_backward",
                    "tests/test_dp.py::test_every_impl_reproduces_single_device_gradients[2]"),
             layout="tests/test_dp.py::test_every_impl_reproduces_single_device_losses[2]",
             wrong=(('off_by_one', 'launches a bucket when all but one of its gradients exist'),
                    ('every_gradient', 'launches the bucket on every gradient, not once it is full'),
                    ('no_count', 'never counts the gradient into its bucket'))),
    Exercise("01.zero2_reduce_scatter", "01_data_parallel/zero_sharding.py",
             "ZeroOptimizer._on_grad_ready (stage 2): once a unit's gradients all exist, flatten them, free them, "
             "reduce-scatter the flat gradient",
             "Part two: ZeRO — sharding the replicas",
             "count ready gradients per unit (self.unit_of[p], self._ready[u]) and reset the count when the unit is "
             "full; self.units[u].flatten(grads) gives the padded flat gradient; set each q.grad = None before "
             "self.reduce_scatter.launch(u, full), which adds this rank's summed shard into self.shard_grads[u]",
             units=("tests/test_zero.py::test_stage2_reduce_scatters_each_unit_once_its_gradients_exist",),
             layout="tests/test_zero.py::test_two_ranks",
             wrong=(('no_reset', "never resets the unit's count: from the second step no unit is sent"),
                    ('off_by_one', 'sends a unit when all but one of its gradients exist'),
                    ('keeps_full_grad', 'keeps the full gradients after the reduce-scatter (stage 2 frees them)'))),
    Exercise("02.f_g", "02_tensor_parallel/tp_operators.py",
             "f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward)",
             "2. f and g: where the communication goes",
             "_all_reduce(t, group) sums t over the TP group; backward returns one gradient per input of forward "
             "(None for the group)",
             units=("tests/test_tp_ops.py::test_operators_at_two_ranks",),
             layout="tests/test_tp.py::test_tp_layouts_match_single_device[2]",
             wrong=(('f_backward_identity', "f's backward returns the gradient unsummed"),
                    ('g_forward_mean', "g's forward averages the partial sums instead of adding them"),
                    ('g_forward_identity', "g's forward returns this rank's partial sum"))),
    Exercise("02.row_parallel", "02_tensor_parallel/tp_layers.py",
             "RowParallelLinear.forward: the partial product of this rank's input columns, then g",
             "1. Split columns, then rows",
             "F.linear(x, self.weight) with the (out, in/tp) shard gives a partial sum of y; self.g adds the "
             "partials (or reduce-scatters them with SP), unless apply_g is False",
             units=("tests/test_tp_ops.py::test_layers_at_two_ranks",),
             layout="tests/test_tp.py::test_tp_layouts_match_single_device[2]",
             wrong=(('no_g', 'never applies g: each rank keeps its partial sum'),
                    ('g_always', 'applies g even when the caller asked for the partial sum (apply_g False)'),
                    ('transposed_weight', 'multiplies by the weight untransposed (x @ W)'))),
    Exercise("02.vocab_ce", "02_tensor_parallel/tp_layers.py",
             "VocabParallelCrossEntropy forward and backward: the loss from vocabulary-split logits, three all-reduces",
             "3. The vocab-parallel cross-entropy",
             "all-reduce the row max (ReduceOp.MAX), the sum of exp(z - max), and the target's shifted logit (zero "
             "on the ranks that do not hold the target); save the local softmax; backward is softmax - onehot on "
             "the local columns",
             units=("tests/test_tp_ops.py::test_vocab_parallel_loss_at_two_ranks",),
             layout="tests/test_tp.py::test_tp_layouts_match_single_device[2]",
             wrong=(('local_max', "shifts by this rank's row max, not the all-reduced one"),
                    ('target_unmasked', "adds the target's logit from every rank, not only the one that holds it"),
                    ('onehot_everywhere', 'backward subtracts the one-hot on every rank'),
                    ('upstream_grad_dropped', 'backward ignores the incoming gradient (grad)'))),
    Exercise("02.ring_step", "02_tensor_parallel/tp_overlap.py",
             "ring_step: post the step's hops to the ring neighbours, compute while they travel, then wait",
             "Hide it under the matmuls (--tp-overlap)",
             "comm.exchange(pairs, nxt, prv, group, \"tp\") posts every (outgoing, incoming) pair and returns the "
             "works; run compute() before wait(works); return what compute() returned (span only times it)",
             units=("tests/test_tp_overlap.py::test_operators_equal_the_plain_ones",),
             layout="tests/test_tp_overlap.py::test_overlapped_runs_match_one_device[2]",
             wrong=(('neighbours_swapped', 'sends to the previous rank and receives from the next'),
                    ('counted_as_cp', 'posts the hops under "cp" (as ring attention does): the TP bytes miss them'),
                    ('first_pair_only', "posts only the step's first pair: the entrance's backward never sends dX's "
                                        "partial sums"))),
    Exercise("03.one_f_one_b", "03_pipeline_parallel/pipeline_schedules.py",
             "one_f_one_b: rank r's action list (warmup forwards, then one forward one backward, then the cooldown)",
             "The bubble, step by step — `pipeline_schedules.py`",
             "rank r does min(p - r - 1, m) warmup forwards; Action(kind, mb, r) with kind 'F' or 'B'; build `acts` "
             "for rank r (the loop appends it)",
             units=("tests/test_pp_schedules.py::test_every_forward_has_its_backward_once",
                    "tests/test_pp_schedules.py::test_dependencies_and_in_flight_limit",
                    "tests/test_pp_schedules.py::test_1f1b_warmup_is_min_p_minus_r_minus_1_m"),
             layout="tests/test_pp.py::test_world_2",
             wrong=(('warmup_off_by_one', 'p - r warmup forwards instead of p - r - 1'),
                    ('warmup_reversed', 'rank r does r warmup forwards (the first rank none)'),
                    ('steady_backward_off_by_one', "the steady state's backward is of micro-batch i + 1, not i"))),
    Exercise("03.receive_order", "03_pipeline_parallel/pipeline_executor.py",
             "incoming_order: for each other rank, the messages it sends to this rank, in its sending order",
             "One executor — `pipeline_executor.py`",
             "produced_messages(schedule[src], n_stages, p) lists (key, destination) in src's order; keep those "
             "addressed to `me`",
             units=("tests/test_pp_schedules.py::test_executor_message_plan_matches_and_never_deadlocks",),
             layout="tests/test_pp.py::test_world_2",
             wrong=(('reversed_order', "a rank's messages in the reverse of its sending order"),
                    ('outgoing_not_incoming', 'keeps the messages addressed to other ranks'),
                    ('own_schedule', "reads this rank's own schedule instead of the sender's"))),
    Exercise("03.zbv", "03_pipeline_parallel/v_schedules.py",
             "zb_v: rank r's action list on its two stages of the V (warmup, steady state, cooldown, flush)",
             "The bubble, step by step — `pipeline_schedules.py`",
             "c.take(kind, stage) issues the next micro-batch of that kind on that stage, c.whole(stage) its B and W "
             "as one whole backward (BW); warmup: 2(p-r)-1 F down, r × (F up, F down), p-r × (F up, BW up); steady "
             "state, while forwards remain: F down (if any left), BW down, then F up, BW up; cooldown: r × (B down, "
             "B up), p-r × c.b_then_a_w(down) (B, then the oldest W owed); flush the W's still owed, up stage first "
             "(c.next[(kind, stage)] counts what was issued)",
             units=("tests/test_pp_schedules.py::test_v_schedules_have_torch_s_order_rank_by_rank",
                    "tests/test_pp_schedules.py::test_v_every_forward_has_its_backward_once",
                    "tests/test_pp_schedules.py::test_v_dependencies_and_in_flight_limit"),
             layout="tests/test_pp.py::test_world_2", references=("torch_order", "torch_schedule", "pipelining"),
             wrong=(('warmup_too_long', '2(p-r) forwards down in the warmup, one too many'),
                    ('steady_up_first', 'the steady state runs the up stage before the down stage'),
                    ('flush_down_first', "flushes the down stage's W's before the up stage's"),
                    ('torch_reference', "returns rank r's list of the course's PyTorch order (torch_order.torch_schedule)"))),
    Exercise("04.grad_sync", "04_3d_combined/trainer_3d.py",
             "Trainer3D.sync_gradients: the DP sums (the optimizer's) and the TP sums of the replicated tensors",
             "One step, one batch, through the grid (`main` in `train_3d.py`, the verbs in `trainer_3d.py`)",
             "the optimizer's sync_gradients(partial_sums=f) sums over DP (replicated: waits for the per-stage "
             "all-reduces) and calls f where the whole gradient is here; chapter 02's "
             "tensor_parallel.sync_tp_gradients(model, tp_group) sums the gradients of TP-replicated tensors",
             units=("tests/test_3d.py::test_sync_gradients_gives_the_single_device_gradients",),
             layout="tests/test_3d.py::test_four_rank_layouts_and_resume_in_another_layout",
             wrong=(('dp_only', 'the DP all-reduces only: TP-replicated gradients stay partial'),
                    ('tp_only', 'the TP sums only: no DP all-reduce'),
                    ('tp_sum_on_pp_group', 'the TP sums over the pipeline group'))),
    Exercise("04.clip_norm", "04_3d_combined/replicated_3d.py",
             "ReplicatedOptimizer.clip_grad_norm: the whole model's gradient norm, each tensor counted once",
             "One step, one batch, through the grid (`main` in `train_3d.py`, the verbs in `trainer_3d.py`)",
             "counted_here(replicas(p), self.mesh.coords) picks one holder of a TP-replicated tensor; "
             "clip_by_global_norm(counted, max_norm, groups=groups, all_grads=every grad) sums the squares over "
             "`groups` (the trainer's norm_groups: TP and PP) and scales every gradient",
             units=("tests/test_3d.py::test_clip_grad_norm_is_the_single_device_norm",),
             layout="tests/test_3d.py::test_four_rank_layouts_and_resume_in_another_layout",
             wrong=(('every_replica_counted', 'counts every TP replica of a replicated tensor in the norm'),
                    ('no_groups', 'sums the squares over no group: each rank clips by its own piece'),
                    ('only_counted_scaled', 'scales only the counted gradients, not the replicas'))),
    Exercise("05.all_to_all", "05_moe_expert_parallel/moe_dispatch.py",
             "AllToAll forward and backward: rows out by input_splits, in by output_splits; gradients go home",
             "5. Expert parallelism: the all-to-all",
             "comm.all_to_all_single(out, inp, output_splits, input_splits, group=group, name='ep') fills `out`; "
             "backward is the same collective with the two split lists swapped",
             units=("tests/test_moe_ep.py::test_all_to_all_and_mesh",),
             layout="tests/test_moe_ep.py::test_training_matches_world_size_one[2]",
             wrong=(('forward_splits_swapped', 'forward passes input_splits as the output splits'),
                    ('backward_splits_not_swapped', "backward reuses forward's split lists unswapped"),
                    ('backward_stays_home', 'backward returns the gradient where it is, no all-to-all'))),
    Exercise("05.counts_first", "05_moe_expert_parallel/moe_dispatch.py",
             "exchange_counts: the row counts every rank will send, exchanged before the rows",
             "5. Expert parallelism: the all-to-all",
             "view the (E,) counts as (ep, E/ep): row j goes to rank j; one all_to_all_single with splits of 1 row each",
             units=("tests/test_moe_ep.py::test_counts_are_exchanged_before_the_rows",
                    "tests/test_moe_ep.py::test_expert_parallel_layer_equals_single_device_layer"),
             layout="tests/test_moe_ep.py::test_training_matches_world_size_one[2]",
             wrong=(('transposed', 'views the counts as (E/ep, ep), transposed: rank j gets a column'),
                    ('no_exchange', "returns this rank's own counts"),
                    ('summed_not_exchanged', 'all-reduces the counts instead of exchanging them'))),
    Exercise("06.merge", "06_context_parallel/ring_attention.py",
             "merge: fold one block's (out_b, lse_b) into the running (out, lse), the online softmax",
             "3. Ring attention — `ring_attention.py`",
             "lse' = log(e^lse + e^lse_b), computed after subtracting the max of the two; out' = out·e^(lse − lse') + "
             "out_b·e^(lse_b − lse'); before any key lse is −inf, and its weight e^(−inf) is 0",
             # graded on a contiguous split, so that it needs no other exercise (06.zigzag comes after it)
             units=("tests/test_ring_attention.py::test_merge_folds_blocks_into_one_softmax",),
             layout="tests/test_cp.py::test_every_cp_layout_matches_one_device[cp2 \\xd7 dp2 ring contiguous, selective "
                    "recompute]",   # pytest's id: × escaped
             wrong=(('no_max', "lse' = log(e^lse + e^lse_b) without subtracting the max: overflows at large logits"),
                    ('no_rescale', "adds the running output without rescaling it by e^(lse − lse')"),
                    ('weights_swapped', "each output weighted by the other's factor"),
                    ('lse_is_the_max', "lse' = max(lse, lse_b): the max without the log-sum-exp"))),
    Exercise("06.zigzag", "06_context_parallel/cp_split.py",
             "SequenceSplit.chunks, zig-zag: rank r holds chunk r and chunk 2·cp − 1 − r",
             "5. Causal balance: zig-zag",
             "the sequence is cut into 2·cp chunks of c positions; return the two [start, stop) pairs, the early one first",
             units=("tests/test_ring_attention.py::test_zigzag_chunks_and_positions",
                    "tests/test_ring_attention.py::test_positions_form_a_permutation",
                    "tests/test_ring_attention.py::test_work_zigzag_balanced_contiguous_not"),
             layout="tests/test_cp.py::test_every_cp_layout_matches_one_device",
             wrong=(('late_off_by_one', 'late chunk 2·cp − r instead of 2·cp − 1 − r'),
                    ('not_mirrored', 'late chunk cp + r: the second half in order, not mirrored'),
                    ('late_first', 'the late chunk listed first'))),
    Exercise("07.refusal", "07_choosing_a_layout/runnable.py",
             "refusal: ask the script that would run a layout whether it accepts it; its own message if not",
             "2. Only the layouts the course runs — `runnable.py`",
             "parse flags(c, ...) with parser_of(kind), then call the script module's checked_layout(args, world, "
             "cfg, build=False); a ConfigError from either is the refusal (return its text), else None",
             units=("tests/test_runnable.py::test_every_candidate_is_a_layout_the_chapters_accept",
                    "tests/test_runnable.py::test_a_refused_layout_gets_its_chapter_s_own_message",
                    "tests/test_runnable.py::test_a_published_shape_is_asked_with_its_own_shape"),
             layout="tests/test_runnable.py::test_the_first_three_start_and_train_two_steps",
             wrong=(('refuses_nothing', 'returns None when the script refuses'),
                    ('parser_only', "parses the flags but never asks the script's checked_layout"),
                    ('message_lost', "returns its own word instead of the script's message"),
                    ('no_cfg', "leaves out the optional cfg: the script checks its --model preset, not the shape planned"))),
    Exercise("07.ranking", "07_choosing_a_layout/planner.py",
             "ranking: the sort key, fastest first among the layouts that fit, equal times by memory, then the rest",
             "4. What it prints, and `--explain`",
             "return a tuple: whether it does not fit first (False sorts first); for a fitting row its step time "
             "rounded to 4 significant digits, then its memory total; for the others the memory total",
             units=("tests/test_choose_layout.py::test_json_schema",
                    "tests/test_choose_layout.py::test_ranking_puts_what_fits_first_fastest_then_the_rest_smallest_first",
                    "tests/test_choose_layout.py::test_explain_a_layout_and_a_published_run"),
             layout="tests/test_runnable.py::test_the_first_three_start_and_train_two_steps",
             wrong=(('ignores_fit', 'sorts by time whether the layout fits or not'),
                    ('unfitting_first', 'the layouts that do not fit first'),
                    ('memory_before_time', 'memory before step time among the layouts that fit'))),
]
BY_ID = {e.id: e for e in EXERCISES}
CHAPTERS = sorted({e.chapter for e in EXERCISES})


def for_chapter(chapter: str) -> list[Exercise]:
    """The exercises of chapter '02' (or of every chapter for 'all'); a ConfigError names the choices."""
    chapter = chapter.zfill(2) if chapter.isdigit() else chapter
    if chapter == "all":
        return list(EXERCISES)
    if chapter not in CHAPTERS:
        raise ConfigError(f"--chapter {chapter}: use one of {', '.join(CHAPTERS)} or all")
    return [e for e in EXERCISES if e.chapter == chapter]


def regions(text: str) -> list[tuple[str, int, int]]:
    """(exercise id, first body line, line after the body) of every marked region in `text`, 0-based
    line indices; raises ValueError on a marker without its partner."""
    out, open_ = [], None
    for i, line in enumerate(text.splitlines()):
        m = MARKER.match(line)
        if not m:
            continue
        _, kind, ex = m.groups()
        if kind == ">>>":
            if open_:
                raise ValueError(f"line {i + 1}: exercise {ex} opens inside exercise {open_[0]}")
            open_ = (ex, i + 1)
        else:
            if not open_ or open_[0] != ex:
                raise ValueError(f"line {i + 1}: exercise {ex} closes without its '{BEGIN}{ex}'")
            out.append((ex, open_[1], i))
            open_ = None
    if open_:
        raise ValueError(f"exercise {open_[0]} is never closed")
    return out
