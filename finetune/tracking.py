"""Experiment trackers (--report-to tensorboard wandb): rank 0 writes what the log lines say, under the metric names
the HF Trainer uses (train/loss, eval/loss, ...), so runs of this template and of Trainer-based scripts sit side by
side in one dashboard. A resumed run continues the same curves."""
import json
import os
import secrets
from pathlib import Path

from .base import fail

TRACKERS = ("none", "tensorboard", "wandb")


class Trackers:
    """The trackers --report-to names, opened on rank 0 at the first metric (after a resume has restored the step),
    flushed at every write (a run that is killed keeps what it logged) and closed at the end."""

    def __init__(self, names, out, args, rank):
        self.names = [n for n in names if n != "none"]
        self.out, self.args, self.rank, self.writers = Path(out), args, rank, None
        if rank == 0 and "wandb" in self.names:
            check_wandb(os.environ)

    def open(self, step):
        """`step`: the last step already done (0, or the step resumed from)."""
        self.writers = {}
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events a killed run logged after its checkpoint are dropped, so a resume does not draw
            # the same steps twice; the curves go on from the checkpoint
            writer = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=step + 1)
            writer.add_text("args", "    " + json.dumps(vars(self.args), indent=1, default=str).replace("\n", "\n    "))
            self.writers["tensorboard"] = writer
        if "wandb" in self.names:
            import wandb

            id_file = self.out / "wandb-run-id"  # the same W&B run on every resume
            run_id = id_file.read_text().strip() if step and id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self.writers["wandb"] = wandb.init(project=os.environ.get("WANDB_PROJECT", "finetune"), id=run_id,
                                               resume="allow", dir=str(self.out), config=vars(self.args),
                                               name=self.out.name, settings=wandb.Settings(console="off"))

    def log(self, metrics, step):
        if self.rank != 0 or not self.names:
            return
        if self.writers is None:
            self.open(step - 1)
        if "tensorboard" in self.writers:
            for name, value in metrics.items():
                if value is not None:
                    self.writers["tensorboard"].add_scalar(name, value, step)
            self.writers["tensorboard"].flush()
        if "wandb" in self.writers:
            self.writers["wandb"].log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def text(self, name, rows, step):
        """A table of text (rows: dicts with the same keys), e.g. the answers to a few eval prompts at each eval:
        TensorBoard's text tab shows it as markdown, W&B as a table."""
        if self.rank != 0 or not self.names or not rows:
            return
        if self.writers is None:
            self.open(step - 1)
        columns = list(rows[0])
        if "tensorboard" in self.writers:
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
            table = [" | ".join(columns), " | ".join("---" for _ in columns)]
            table += [" | ".join(cell(row[c]) for c in columns) for row in rows]
            self.writers["tensorboard"].add_text(name, "\n".join(table), step)
            self.writers["tensorboard"].flush()
        if "wandb" in self.writers:
            import wandb

            self.writers["wandb"].log({name: wandb.Table(columns=columns, data=[[row[c] for c in columns]
                                                                                for row in rows])}, step=step)

    def close(self):
        for writer in (self.writers or {}).values():
            if hasattr(writer, "close"):
                writer.close()
            else:
                writer.finish()
        self.writers = None if not self.names else {}


def check_wandb(environ):
    """W&B is optional: a missing package or login is one line at the start, not a traceback at the first log."""
    try:
        import wandb
    except ImportError:
        fail("--report-to wandb: the wandb package is not installed; pip install wandb, or leave wandb out")
    offline = environ.get("WANDB_MODE") in ("offline", "disabled") or environ.get("WANDB_DISABLED") == "true"
    if not offline and not environ.get("WANDB_API_KEY") and not wandb.api.api_key:
        fail("--report-to wandb: not logged in to W&B; run `wandb login`, set WANDB_API_KEY, or set "
             "WANDB_MODE=offline to write the run locally (`wandb sync` uploads it later)")
