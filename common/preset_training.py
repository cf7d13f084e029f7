"""The learning rate and warm-up each preset trains with by default (`--lr` and `--warmup` left out).

A larger model needs a smaller step. Its updates add up over more weights that all move together, so
the same learning rate moves its outputs further; and its first steps, when AdamW's moment estimates
rest on a handful of gradients, are where a large model diverges, hence a longer warm-up. Published
runs of GPT-style models with AdamW (the GPT-3 paper's table of model sizes) use about 6e-4 at 125 M
parameters, 3e-4 at 350 M and 2e-4 at 1.3 B; a model of a few million parameters trains well at a few
times 1e-3. The presets take the published rate of the nearest size:

    preset       parameters   lr      warm-up (steps)
    tiny, tiny-moe   1.6 M, 5.2 M    3e-3    10        every result the course shows was trained so
    small, small-moe 6.0 M, 36 M     3e-3    10        (they are small enough for it)
    medium           47 M            1e-3    20
    large            284 M           3e-4    50        (GPT-3's 350 M)
    xl               1.08 B          2e-4    100       (GPT-3's 1.3 B): 3e-3 diverges here

The warm-up is counted in steps, as `--warmup` is; with fewer `--steps` than the warm-up, a run spends
all of its steps warming up (the rate still rises every step: such a run trains, slowly).
"""

DEFAULTS = {          # preset: (peak learning rate, warm-up steps)
    "tiny": (3e-3, 10), "tiny-moe": (3e-3, 10),
    "small": (3e-3, 10), "small-moe": (3e-3, 10),
    "medium": (1e-3, 20),
    "large": (3e-4, 50),
    "xl": (2e-4, 100),
}


def training_defaults(preset: str) -> tuple[float, int]:
    """(peak learning rate, warm-up steps) for `preset`."""
    return DEFAULTS[preset]


def describe() -> str:
    """For --help: 'tiny 3e-3, small 3e-3, ...'."""
    return ", ".join(f"{name} {lr:g}/{warmup}" for name, (lr, warmup) in DEFAULTS.items())
