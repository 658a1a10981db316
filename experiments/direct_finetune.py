"""
Beyond the paper: layerwise training whose last steps fine-tune the whole student end to end, by
the direct (next-token) loss at the schedule's low tail. distill.py's command line and one flag:

    python experiments/direct_finetune.py --model smollm2-135m --data data/wikitext2 --preset cpu \
        --max-steps 360 --direct-steps 60 --warmup-steps 30 --eval-interval 120

How it forks the core: REPLACE sets distill.step_loss, the loss each optimizer step trains, to the
direct loss for the last --direct-steps steps of the schedule (--decay-steps, or --max-steps) and
any step past its end, and distill.DistillConfig to one with --direct-steps. --resume keeps the
schedule, as it keeps --direct-steps: a run stopped early and resumed trains its direct steps
where the uninterrupted run does. Measured with --preset cpu on SmolLM2 (docs/results.md).
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import door  # noqa: E402
import forks  # noqa: E402


@dataclass
class DirectFinetuneConfig(distill.DistillConfig):
    """distill.py whose last --direct-steps steps train the direct loss."""
    direct_steps: int = door.opt(0, "the schedule's last this many steps, and any past its end "
                            "(--max-steps above --decay-steps), train the direct loss after "
                            "--loss's (a short fine-tune)", min=0)

    RESUMED = distill.DistillConfig.RESUMED + ("direct_steps",)

    def __post_init__(self):
        super().__post_init__()
        total = self.decay_steps or self.max_steps
        if self.direct_steps > total:
            raise door.ModelError(f"--direct-steps {self.direct_steps} is more than the schedule's "
                                 f"{total} steps (--decay-steps, or --max-steps)")


def step_loss(cfg, step):
    """The direct loss for the schedule's last --direct-steps steps, --loss before them."""
    if step >= (cfg.decay_steps or cfg.max_steps) - cfg.direct_steps:
        return "direct"
    return cfg.loss


REPLACE = {(distill, "step_loss"): step_loss, (distill, "DistillConfig"): DirectFinetuneConfig}

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
