"""
Beyond the paper: layerwise training whose last steps fine-tune the whole student end to end, by the direct
(next-token) loss at the schedule's low tail. A fork of distill.py, the same command line and one flag more:

    python experiments/direct_finetune.py --model smollm2-135m --data data/wikitext-smollm2 --preset cpu \
        --max-steps 360 --direct-steps 60 --warmup-steps 30 --eval-interval 120

How it forks the core: its config's step_loss, the loss each optimizer step trains, is the direct loss for the
last --direct-steps steps of the schedule (--decay-steps, or --max-steps) and any step past its end; --resume keeps
the schedule, as it keeps --direct-steps: a run stopped early and resumed trains its direct steps where the
uninterrupted run does.
Measured with --preset cpu on SmolLM2 (docs/results.md, the preset grid's "360 steps, the last 60 direct").
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
from common import ModelError, check_positive, opt, run_main  # noqa: E402


@dataclass
class DirectFinetuneConfig(distill.DistillConfig):
    """distill.py whose last --direct-steps steps train the direct loss (experiments/direct_finetune.py)."""
    direct_steps: int = opt(0, "the schedule's last this many steps, and any past its end (--max-steps above "
                            "--decay-steps), train the direct loss after --loss's (a short fine-tune)")

    RESUMED = distill.DistillConfig.RESUMED + ("direct_steps",)

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, ("direct_steps",), 0)
        if self.direct_steps > (total := self.decay_steps or self.max_steps):
            raise ModelError(f"--direct-steps {self.direct_steps} is more than the schedule's {total} steps "
                             "(--decay-steps, or --max-steps)")

    def step_loss(self, step):
        return "direct" if step >= (self.decay_steps or self.max_steps) - self.direct_steps else self.loss


def main(argv=None):
    distill.main(distill.parse_args(argv, DirectFinetuneConfig))


if __name__ == "__main__":
    run_main(main)
