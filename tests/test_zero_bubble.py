"""Chapter 03's zero-bubble split of a backward (zero_bubble.py), in one process: B and W together equal
one plain backward, and a whole backward (a BW action) runs as one pass with the same gradients."""
from importlib import import_module

from common.model import PRESETS



def test_split_linear_defers_weight_grads_and_w_completes_them():
    """B computes the input gradient and the non-linear parameters' gradients; W adds the linear
    layers' dW = dyᵀ x. Together they equal one plain backward, even under saved-tensor hooks (the
    executor counts activation bytes with one) and with gradients already accumulated."""
    import torch
    from common.model import build_model, loss_sum
    zero_bubble = import_module("03_pipeline_parallel.zero_bubble")
    cfg = PRESETS["tiny"]
    ref, split = build_model(cfg, seed=3), build_model(cfg, seed=3)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))

    def stage(model, h):                          # every layer and the head: a last pipeline stage
        for layer in model.layers:
            h = layer(h, model.rope_cos, model.rope_sin)
        return loss_sum(model.head(h), y)

    store = zero_bubble.WeightGradStore()
    deferred = zero_bubble.split_linears(split, store)
    assert len(deferred) == 7 * cfg.n_layers + 1 and not any(type(m) is torch.nn.Linear for m in split.modules())
    b_params = [p for n, p in split.named_parameters() if id(p) not in deferred and n != "tok_emb.weight"]
    for rep in range(2):                          # twice: the second pass accumulates onto the first
        h_ref = ref.embed(x).detach().requires_grad_(True)
        stage(ref, h_ref).backward()
        h = split.embed(x).detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = stage(split, h)
        with store.deferring() as pending:        # B
            torch.autograd.backward(out, inputs=[h] + b_params)
        assert torch.equal(h.grad, h_ref.grad)
        assert len(pending) == len(deferred)
        assert all(split.get_parameter(n).grad is None for n in ("layers.0.attn.wq.weight", "lm_head.weight")) or rep
        zero_bubble.apply_weight_grads(pending)            # W
    for (name, p_ref), p in zip(ref.named_parameters(), split.parameters()):
        if name != "tok_emb.weight":
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_a_whole_backward_is_one_pass_with_the_split_s_gradients():
    """DualPipeV's pairs and ZB-V's steady state write a whole backward as a BW action: its F says so
    (`whole`), the executor runs that forward with the linear layers as nn.Linear (WeightGradStore.whole)
    and the BW as one pass, and the gradients are the split's, bit for bit."""
    import torch
    from common.model import build_model, loss_sum
    zero_bubble = import_module("03_pipeline_parallel.zero_bubble")
    v_schedules = import_module("03_pipeline_parallel.v_schedules")
    actions = import_module("03_pipeline_parallel.pipeline_actions")
    A = actions.Action
    acts = [A("F", 0, 1), A("BW", 0, 1), A("F", 1, 1), A("B", 1, 1), A("W", 1, 1),
            actions.Pair(A("F", 2, 1), A("BW", 0, 2)), A("BW", 2, 1)]
    assert [a.whole for a in actions.units(actions.mark_whole_forwards(acts)) if a.kind == "F"] == [True, False, True]
    for rank in v_schedules.dualpipe_v(2, 8):                      # every pair: an F, and a BW on the other stage
        pairs = [a for a in rank if a.kind == actions.OVERLAP]
        assert pairs and all((f.kind, b.kind) == ("F", "BW") and f.stage != b.stage for f, b in pairs)
    cfg = PRESETS["tiny"]
    models = [build_model(cfg, seed=3) for _ in range(2)]
    store = zero_bubble.WeightGradStore()
    for model in models:
        zero_bubble.split_linears(model, store)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))

    def stage(model):                               # every layer and the head: a last pipeline stage
        h = model.embed(x).detach()
        for layer in model.layers:
            h = layer(h, model.rope_cos, model.rope_sin)
        return loss_sum(model.head(h), y)

    def node_names(fn, seen):                       # every autograd node of a graph
        if fn is not None and fn not in seen:
            seen.add(fn)
            for nxt, _ in fn.next_functions:
                node_names(nxt, seen)
        return {type(f).__name__ for f in seen}

    split_out = stage(models[0])
    assert "_SplitLinearFunctionBackward" in node_names(split_out.grad_fn, set())
    with store.deferring() as pending:              # B, then W
        split_out.backward()
    zero_bubble.apply_weight_grads(pending)
    with store.whole():                             # the F of a whole pass
        whole_out = stage(models[1])
    assert "_SplitLinearFunctionBackward" not in node_names(whole_out.grad_fn, set()) and not store.native
    whole_out.backward()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        if name != "tok_emb.weight":
            assert torch.equal(a.grad, b.grad), name
