"""The wrong answers the grader is checked against, as code: for each exercise, each realistic mistake a
student makes (named and described beside the exercise in catalog.py, `wrong=`) as one edit of the
reference body, (the reference's lines, the mistaken lines). An instructor's file: each edit is one line
away from the answer, so a student's copy leaves this file out (answer_keys.py).

`python -m common.exercises wrong --check` (`make wrong-answers`) plants each in a copy and grades it:
common/exercises/WRONG_ANSWERS.md holds the table it writes; every row must read `wrong:`."""

WRONG_EDITS = {
    "01.bucket_hook": {
        "off_by_one": ("if bucket.ready == len(bucket.params):", "if bucket.ready == len(bucket.params) - 1:"),
        "every_gradient": ("if bucket.ready == len(bucket.params):", "if bucket.ready >= 1:"),
        "no_count": ("        bucket.ready += 1\n", ""),
    },
    "01.zero2_reduce_scatter": {
        "no_reset": ("        self._ready[u] = 0\n", ""),
        "off_by_one": ("if self._ready[u] < len(self.params[u]):", "if self._ready[u] < len(self.params[u]) - 1:"),
        "keeps_full_grad": ("            q.grad = None                                                  # the full "
                            "gradient is freed\n", "            pass\n"),
    },
    "02.f_g": {
        "f_backward_identity": ("return _all_reduce(grad, ctx.group), None", "return grad, None"),
        "g_forward_mean": ("        return _all_reduce(x, group)\n",
                           "        return _all_reduce(x, group) / dist.get_world_size(group)\n"),
        "g_forward_identity": ("        return _all_reduce(x, group)\n", "        return x.clone()\n"),
    },
    "02.row_parallel": {
        "no_g": ("return self.g(y) if self.apply_g else y", "return y"),
        "g_always": ("return self.g(y) if self.apply_g else y", "return self.g(y)"),
        "transposed_weight": ("y = F.linear(x, self.weight)", "y = x @ self.weight"),
    },
    "02.vocab_ce": {
        "local_max": ("        comm.all_reduce(z_max, group=group, name=\"tp\", op=dist.ReduceOp.MAX)\n", ""),
        "target_unmasked": ("target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside",
                            "target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)"),
        "onehot_everywhere": ("g[rows, local_t] -= inside.to(g.dtype)", "g[rows, local_t] -= 1"),
        "upstream_grad_dropped": ("return g * grad, None, None, None", "return g, None, None, None"),
    },
    "02.ring_step": {
        "neighbours_swapped": ("comm.exchange(pairs, nxt, prv, group", "comm.exchange(pairs, prv, nxt, group"),
        "counted_as_cp": ('prv, group, "tp")', 'prv, group, "cp")'),
        "first_pair_only": ("comm.exchange(pairs, nxt", "comm.exchange(pairs[:1], nxt"),
    },
    "03.one_f_one_b": {
        "warmup_off_by_one": ("warmup = min(p - r - 1, m)                 #", "warmup = min(p - r, m)                 #"),
        "warmup_reversed": ("warmup = min(p - r - 1, m)                 #", "warmup = min(r, m)                 #"),
        "steady_backward_off_by_one": ("Action(\"B\", i, r)]\n        # === cooldown ===  drain",
                                       "Action(\"B\", i + 1, r)]\n        # === cooldown ===  drain"),
    },
    "03.receive_order": {
        "reversed_order": ("if dst == me]", "if dst == me][::-1]"),
        "outgoing_not_incoming": ("if dst == me]", "if dst != me]"),
        "own_schedule": ("produced_messages(schedule[src],", "produced_messages(schedule[me],"),
    },
    "03.zbv": {
        "warmup_too_long": ("for _ in range(2 * (p - r) - 1)]", "for _ in range(2 * (p - r))]"),
        "steady_up_first": ("            acts += [c.whole(down)]\n"
                            "            acts += [c.take(\"F\", up), c.whole(up)]\n",
                            "            acts += [c.take(\"F\", up), c.whole(up)]\n"
                            "            acts += [c.whole(down)]\n"),
        "flush_down_first": ("        acts += [c.take(\"W\", up) for _ in range(c.next[(\"B\", up)] - c.next[(\"W\", up)])]\n"
                             "        acts += [c.take(\"W\", down) for _ in range(c.next[(\"B\", down)] - c.next[(\"W\", down)])]\n",
                             "        acts += [c.take(\"W\", down) for _ in range(c.next[(\"B\", down)] - c.next[(\"W\", down)])]\n"
                             "        acts += [c.take(\"W\", up) for _ in range(c.next[(\"B\", up)] - c.next[(\"W\", up)])]\n"),
        "torch_reference": ("        acts += [c.take(\"W\", down) for _ in range(c.next[(\"B\", down)] - c.next[(\"W\", down)])]\n",
                            "        acts = __import__(\"importlib\").import_module(\"03_pipeline_parallel.torch_order\")"
                            ".torch_schedule(\"zb-v\", p, m)[r]\n"),
    },
    "04.grad_sync": {
        "dp_only": ("self.optimizer.sync_gradients(partial_sums=tp_sums)", "self.optimizer.sync_gradients()"),
        "tp_only": ("        self.optimizer.sync_gradients(partial_sums=tp_sums)", "        tp_sums()"),
        "tp_sum_on_pp_group": ("sync_tp_gradients(self.model, self.tp_group)", "sync_tp_gradients(self.model, self.pp_group)"),
    },
    "04.clip_norm": {
        "every_replica_counted": ("counted = [p.grad for _, p in self.named if counted_here(replicas(p), "
                                  "self.mesh.coords)]", "counted = grads"),
        "no_groups": ("groups=groups, all_grads=grads", "groups=(), all_grads=grads"),
        "only_counted_scaled": ("groups=groups, all_grads=grads", "groups=groups, all_grads=counted"),
    },
    "05.all_to_all": {
        "forward_splits_swapped": ("comm.all_to_all_single(out, rows.contiguous(), output_splits, input_splits,",
                                   "comm.all_to_all_single(out, rows.contiguous(), input_splits, output_splits,"),
        "backward_splits_not_swapped": ("grad_out.contiguous(), input_splits, output_splits, group=ctx.group,",
                                        "grad_out.contiguous(), output_splits, input_splits, group=ctx.group,"),
        "backward_stays_home": ("        return grad_in, None, None, None", "        return grad_out, None, None, None"),
    },
    "05.counts_first": {
        "transposed": ("send = counts.view(ep, -1).contiguous()", "send = counts.view(-1, ep).t().contiguous()"),
        "no_exchange": ("name=\"ep\")\n    return recv\n", "name=\"ep\")\n    return send\n"),
        "summed_not_exchanged": ("    comm.all_to_all_single(recv, send, [1] * ep, [1] * ep, group=group, name=\"ep\")",
                                 "    recv.copy_(send)\n    comm.all_reduce(recv, group=group, name=\"ep\")"),
    },
    "06.merge": {
        "no_max": ("new_lse = m + torch.log(torch.exp(lse - m) + torch.exp(lse_b - m))",
                   "new_lse = torch.log(torch.exp(lse) + torch.exp(lse_b))"),
        "no_rescale": ("new_out = out * torch.exp(lse - new_lse)[..., None] +",
                       "new_out = out +"),
        "weights_swapped": ("new_out = out * torch.exp(lse - new_lse)[..., None] + out_b * torch.exp(lse_b - new_lse)[..., None]",
                            "new_out = out * torch.exp(lse_b - new_lse)[..., None] + out_b * torch.exp(lse - new_lse)[..., None]"),
        "lse_is_the_max": ("new_lse = m + torch.log(torch.exp(lse - m) + torch.exp(lse_b - m))", "new_lse = m"),
    },
    "06.zigzag": {
        "late_off_by_one": ("late = 2 * self.cp - 1 - rank", "late = 2 * self.cp - rank"),
        "not_mirrored": ("late = 2 * self.cp - 1 - rank", "late = self.cp + rank"),
        "late_first": ("return [(rank * c, (rank + 1) * c), (late * c, (late + 1) * c)]",
                       "return [(late * c, (late + 1) * c), (rank * c, (rank + 1) * c)]"),
    },
    "07.refusal": {
        "refuses_nothing": ("        return str(err)\n    return None\n", "        return None\n    return None\n"),
        "parser_only": ("        import_module(SCRIPTS[kind][1]).checked_layout(args, world, cfg, build=False)   # (not every rank's actions)\n", ""),
        "message_lost": ("        return str(err)\n    return None\n", "        return \"refused\"\n    return None\n"),
        "no_cfg": ("checked_layout(args, world, cfg, build=False)", "checked_layout(args, world, build=False)"),
    },
    "07.ranking": {
        "ignores_fit": ("    if r[\"fits\"]:\n        return False,", "    if True:\n        return False,"),
        "unfitting_first": ("    if r[\"fits\"]:\n        return False,", "    if not r[\"fits\"]:\n        return False,"),
        "memory_before_time": ("return False, float(f\"{r['step_time_s']:.4g}\"), r[\"memory_bytes\"][\"total\"]",
                               "return False, r[\"memory_bytes\"][\"total\"], float(f\"{r['step_time_s']:.4g}\")"),
    },
}
