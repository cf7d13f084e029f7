"""common/live_memory.py: the CPU's counter of every byte a rank's tensors hold at once, exact on cases
whose bytes are known by hand, and a trainer measured whole (its weights, gradients, AdamW and the step's
transients)."""
import torch

from common.live_memory import LivePeak, LiveTensors, held_tensors


def test_each_storage_counts_once_while_it_lives():
    with LiveTensors() as meter:
        a = torch.zeros(1000)                                    # 4,000 bytes
        view, same = a[10:20], a.view(10, 100)                   # views of a: nothing more
        b = a + 1                                                # 4,000 more
        assert (meter.live, meter.peak) == (8000, 8000)
        del a, view, same                                        # a's storage is freed with its last view
        assert meter.live == 4000
        c = torch.ones(250, dtype=torch.float64)                 # 2,000 bytes
        assert (meter.live, meter.peak) == (6000, 8000)
        assert meter.reset() == 8000 and meter.peak == 6000      # the next step's peak starts at what lives
        del b, c
    assert meter.live == 0


def test_a_storage_resized_in_place_counts_as_it_is_now():
    """ZeRO-2/3's way (FSDP's): a full buffer emptied between steps, then filled again by an operation."""
    flat = torch.zeros(1000)                                     # 4,000 bytes, made before
    with LiveTensors([flat]) as meter:
        flat.untyped_storage().resize_(0)                        # no operation returns it: seen on resync
        meter.resync()
        assert meter.live == 0
        flat.untyped_storage().resize_(4000)
        flat.zero_()                                             # an operation returns it: 4,000 again
        assert (meter.live, meter.peak) == (4000, 4000)


def test_what_a_trainer_holds_is_found_through_its_modules_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    holder = {"trainer": [model, opt]}
    params = sum(p.numel() for p in model.parameters()) * 4                 # 8·16 + 16 + 16·4 = 208 floats
    meter = LiveTensors(held_tensors(holder))
    # weights, gradients, exp_avg and exp_avg_sq: 4 × 832 bytes; AdamW's step counters: 3 × 4 bytes
    assert meter.live == 4 * params + 3 * 4


class OneLinear:
    """The smallest trainer: loss = sum((Σ_rows x) W), plain SGD; its bytes are known by hand."""

    def __init__(self):
        self.w = torch.zeros(64, 32, requires_grad=True)                     # 8,192 bytes

    def forward_backward(self, x, y, sync=True):
        loss = (x.sum(0) @ self.w).sum()                                     # (64,) @ (64, 32)
        loss.backward()
        return loss.detach()

    def step(self):
        with torch.no_grad():
            self.w -= 0.1 * self.w.grad

    def zero_grad(self):
        self.w.grad = None

    def memory(self):
        return {}


def test_a_trainer_measured_whole_has_the_peak_of_its_step():
    trainer = LivePeak(OneLinear())
    x = torch.ones(16, 64)                                                  # 4,096 bytes, made before the step
    trainer.forward_backward(x, None)
    trainer.step()
    trainer.zero_grad()
    # after backward: W, x (no operation of the step returns x or a view of it: counted as the batch) and
    # W's gradient; the peak is the update's, which makes 0.1·grad (8,192) beside them all
    assert trainer.memory() == {"live_peak_bytes": 8192 + 4096 + 8192 + 8192}
    assert trainer.meter.live == 8192 + 4096                                # W and x: the rest is freed


class FullBuffer(OneLinear):
    """OneLinear with a ZeRO-2/3-like full buffer: filled by an operation in the backward, emptied in place by
    the step (its storage resized to 0: no operation returns it, as ZeRO's flat buffers between steps)."""

    def __init__(self):
        super().__init__()
        self.full = torch.zeros(1000)                                        # 4,000 bytes when full
        self.full.untyped_storage().resize_(0)

    def forward_backward(self, x, y, sync=True):
        self.full.untyped_storage().resize_(4000)
        self.full.zero_()                                                    # an operation returns it: 4,000
        return super().forward_backward(x, y, sync)

    def step(self):
        super().step()
        self.full.untyped_storage().resize_(0)                               # emptied in place, inside a verb


def test_a_buffer_emptied_in_place_inside_a_verb_stops_counting_after_it():
    trainer = LivePeak(FullBuffer())
    x = torch.ones(16, 64)                                                  # 4,096 bytes
    for _ in range(2):                                                      # the second step starts where it ends
        trainer.forward_backward(x, None)
        assert trainer.meter.live == 8192 + 4096 + 8192 + 4000              # W, x, W's gradient, the full buffer
        trainer.step()
        assert trainer.meter.live == 8192 + 4096 + 8192                     # the buffer is empty: not counted
        trainer.zero_grad()
        # the update's peak: 0.1·grad (8,192) beside W, x, the gradient and the buffer, still full then
        assert trainer.memory() == {"live_peak_bytes": 8192 + 4096 + 8192 + 4000 + 8192}
        assert trainer.meter.live == 8192 + 4096
