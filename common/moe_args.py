"""The flags of every script that trains a mixture of experts, and their checks, in one place.

    p = base_parser(...); add_moe_args(p); args = p.parse_args(argv)
    cfg = moe_model_config(args)                  # the preset, with --top-k applied
    ep = expert_parallel_degree(args.ep, cfg, world)
    check_moe_args(args, cfg, world, ep)          # ConfigError naming the fix; no communication

The checks run on every rank on the same inputs, before any process group work, so every rank
reaches the same verdict and exits with the same one-line message.
"""
import dataclasses
import math

from common.domains import NON_NEGATIVE_REAL, POSITIVE_INT, POSITIVE_REAL
from common.errors import require
from common.model import PRESETS, ModelConfig
from common.moe_routing import RoutingOptions


def add_moe_args(parser, ep_help: str | None = None) -> None:
    """ep_help: what --ep means in this script, where it is not train_moe.py's (ep inside dp = the world)."""
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--aux-loss-coef", type=NON_NEGATIVE_REAL, default=0.01,
                   help="α of the Switch/GShard balance loss α·E·Σᵢ fᵢPᵢ (per sequence and layer); 0: off")
    g.add_argument("--z-loss-coef", type=NON_NEGATIVE_REAL, default=0.001,
                   help="β of the router z-loss β·mean(logsumexp(logits)²) (per layer); 0: off")
    g.add_argument("--capacity-factor", type=POSITIVE_REAL, default=None,
                   help="each expert takes at most ⌈CF·S·k/E⌉ slots per sequence, the rest are dropped "
                        "(default: dropless)")
    g.add_argument("--router-bias-rate", type=NON_NEGATIVE_REAL, default=0.0,
                   help="γ of aux-loss-free balancing: b += γ·sign(mean load − load) after each step; 0: off")
    g.add_argument("--top-k", type=POSITIVE_INT, default=None, help="experts per token (default: the preset's)")
    g.add_argument("--ep", type=POSITIVE_INT, default=None,
                   help=ep_help or "expert-parallel degree (default: the largest that divides both the world size "
                                   "and the number of experts); world/ep ranks of data parallelism around it")


def moe_model_config(args) -> ModelConfig:
    """The preset's configuration with --top-k applied (unknown presets are check_common's to report;
    a script without the MoE flags gets the preset)."""
    cfg, top_k = PRESETS.get(args.model, ModelConfig()), getattr(args, "top_k", None)
    return dataclasses.replace(cfg, top_k=top_k) if top_k is not None and cfg.n_experts else cfg


def expert_parallel_degree(ep: int | None, cfg: ModelConfig, world: int) -> int:
    """--ep, or by default the largest degree dividing both the world size and E (1 for a dense model)."""
    if ep is not None:
        return ep
    return math.gcd(world, cfg.n_experts) if cfg.n_experts else 1


def check_moe_args(args, cfg: ModelConfig, world: int, ep: int) -> None:
    """Every divisibility expert parallelism needs (each flag's own domain is checked while parsing)."""
    if not cfg.n_experts:
        for flag, given in (("--ep", args.ep is not None), ("--top-k", args.top_k is not None),
                            ("--capacity-factor", args.capacity_factor is not None),
                            ("--router-bias-rate", args.router_bias_rate > 0)):
            require(not given, f"{flag} needs a mixture-of-experts model, but --model {args.model} is dense; "
                               f"use --model {_moe_presets()} or leave {flag} out")
        return
    E = cfg.n_experts
    require(1 <= cfg.top_k <= E, f"--top-k {cfg.top_k} must be between 1 and the model's {E} experts")
    require(E % ep == 0, f"the model's {E} experts do not split over --ep {ep}; use an --ep that divides {E}")
    require(world % ep == 0, f"--ep {ep} does not divide the world size {world}; use an --ep that divides {world} "
                             f"or launch a multiple of {ep} ranks with torchrun --nproc_per_node")


def routing_options(args, sequences_per_step: int, seq_len: int) -> RoutingOptions:
    """What every MoE layer needs to know: the capacity factor, and the weights that turn its summed
    balancing terms into α·(mean over the step's sequences) and β·(mean over the step's tokens).
    Each layer adds its own terms (as in Switch, GShard, ST-MoE): L layers add up to L·α at uniform routing."""
    return RoutingOptions(capacity_factor=args.capacity_factor,
                          aux_weight=args.aux_loss_coef / sequences_per_step,
                          z_weight=args.z_loss_coef / (sequences_per_step * seq_len))


def _moe_presets() -> str:
    return " or ".join(name for name, c in PRESETS.items() if c.n_experts)
