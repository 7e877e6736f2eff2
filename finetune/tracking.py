"""Experiment trackers (--report-to tensorboard wandb): rank 0 writes what the log lines say, under the metric names
the HF Trainer uses (train/loss, eval/loss, ...), so runs of this template and of Trainer-based scripts sit side by
side in one dashboard. A resumed run continues the same curves."""
import atexit
import contextlib
import io
import json
import os
import secrets
import sys
from pathlib import Path

from .base import fail

TRACKERS = ("none", "tensorboard", "wandb")


class Trackers:
    """The trackers --report-to names, opened on rank 0 at the first metric (after a resume has restored the step),
    and closed however the run ends: finished (close), stopped by a signal (a checkpoint finished them), failed (at the
    interpreter's exit), hung (the hang report closes them before it ends the process). TensorBoard is flushed at
    every write, so a SIGKILL (nothing can run then) loses none of it. W&B hands its records to its own service
    process, which writes them in blocks and as the run finishes (measured: a SIGKILL after 200 steps left 103 to
    199 of them, however long after the last one): at each checkpoint its run is finished, and the next metric
    reopens it, so a SIGKILL loses at most what was logged since the last checkpoint."""

    def __init__(self, names, out, settings, rank):
        self.names = [n for n in names if n != "none"]
        self.out, self.settings, self.rank, self.writers, self.closed = Path(out), settings, rank, None, False
        if rank == 0 and "wandb" in self.names:
            check_wandb(os.environ)

    def open(self, step):
        """`step`: the last step already done (0, or the step resumed from). Opens those not open."""
        if self.writers is None:
            self.writers = {}
            atexit.register(self.close)  # however the process leaves but os._exit (a hang report closes them itself)
        if "tensorboard" in self.names and "tensorboard" not in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events a killed run logged after its checkpoint are dropped, so a resume does not draw
            # the same steps twice; the curves go on from the checkpoint
            writer = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=step + 1)
            writer.add_text("args", "    " + json.dumps(self.settings, indent=1, default=str).replace("\n", "\n    "))
            self.writers["tensorboard"] = writer
        if "wandb" in self.names and "wandb" not in self.writers:
            import wandb

            id_file = self.out / "wandb-run-id"  # the same W&B run on every resume
            run_id = (id_file.read_text().strip() if step and id_file.exists() else "") or secrets.token_hex(4)
            tmp = id_file.with_name(f"{id_file.name}.tmp")  # reopened at each checkpoint: a kill mid-write must not
            tmp.write_text(run_id)  # leave an empty id (wandb refuses it), so the file is replaced whole
            os.replace(tmp, id_file)
            self.writers["wandb"] = wandb.init(project=os.environ.get("WANDB_PROJECT", "finetune"), id=run_id,
                                               resume="allow", dir=str(self.out), config=self.settings,
                                               name=self.out.name, settings=wandb.Settings(console="off"))

    def log(self, metrics, step):
        if self.rank != 0 or not self.names or self.closed:
            return
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
        if self.rank != 0 or not self.names or not rows or self.closed:
            return
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

    def checkpoint(self):
        """At a checkpoint: W&B's run finished (all it was handed written), to be reopened by the next metric."""
        if self.writers and "wandb" in self.writers:
            self.writers.pop("wandb").finish()

    def close(self):
        for writer in (self.writers or {}).values():
            if hasattr(writer, "close"):
                writer.close()
            else:
                writer.finish()
        self.writers, self.closed = {}, True
        atexit.unregister(self.close)


def check_wandb(environ, say=True):
    """W&B is optional: a missing package or login is one line at the start, not a traceback at the first log. Every
    rank checks (none goes on into a collective that the others left), and the one that says it is rank 0 (`say`)."""
    stop = fail if say else lambda message: sys.exit(1)
    try:
        import wandb
    except ImportError:
        stop("--report-to wandb: the wandb package is not installed; pip install wandb, or leave wandb out")
    offline = environ.get("WANDB_MODE") in ("offline", "disabled") or environ.get("WANDB_DISABLED") == "true"
    if not offline and not environ.get("WANDB_API_KEY"):
        with contextlib.redirect_stderr(io.StringIO()):  # its own lines about the credentials it found
            logged_in = wandb.login(prompt=False, verify=False)  # the netrc's key; no network (verify), no prompt
        if not logged_in:
            stop("--report-to wandb: not logged in to W&B; run `wandb login`, set WANDB_API_KEY, or set "
                 "WANDB_MODE=offline to write the run locally (`wandb sync` uploads it later)")
