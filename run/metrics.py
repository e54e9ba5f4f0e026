"""The run's metrics: the step metrics tallied on the host (Tally, saved with each checkpoint) and
written to metrics.jsonl and tensorboard event files (Logger), both trimmed back to the checkpoint
a run resumes from, so a resumed run reads as one uninterrupted run; and the devices' datasheet
peaks that MFU is measured against, and the model's FLOPs per token it counts.
"""
import html
import json
import time
import uuid

import jax
import numpy as np
from etils import epath

from configs import Config
from run.errors import RunError, UsageError


class Logger:
    """Scalars to tensorboard event files and metrics.jsonl in the run directory (local or gs://),
    written by process 0 alone (every process has the same numbers). A run resumed at step `start`
    first drops what was logged after that step (it came after the checkpoint). A local
    metrics.jsonl grows by one appended line per log. GCS objects cannot be appended to: there the
    whole file is rewritten, at most once a minute and at the end (a kill loses at most that minute
    of lines, which the tensorboard events still hold), not at every log (O(lines^2) bytes over a
    run)."""

    def __init__(self, rundir: epath.Path, start: int, wandb_project: str = "",
                 config: dict | None = None, writes: bool = True):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        # process 0 alone writes, and not under --debug (writes False: its steps are a profile, no
        # part of the run); elsewhere every method does nothing
        if jax.process_index() != 0 or not writes:
            self.log = self.text = self.close = lambda *args: None
            return
        # wandb first: a login or network it lacks stops the launch before any file is touched
        self.wandb = wandb_run(rundir, wandb_project, config) if wandb_project else None
        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        self.tb = EventFileWriter(str(rundir))
        # Tensorboard discards the events of steps >= a START session log's step that came before
        # it: after the checkpoint resumed from (all, if none was saved). Its server takes a run's
        # first START for no restart, so a fresh run writes one too.
        start_log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        first = start + 1 if start else 0
        self.tb.add_event(self.event(wall_time=time.time(), step=first, session_log=start_log))
        self.path, self.local = rundir / "metrics.jsonl", not str(rundir).startswith("gs://")
        old = read_lines(self.path) if start else []
        # (a kill mid-append can leave half a line, a crash a line of zero bytes where the
        # filesystem had not written the data yet: no record, dropped; a whole record that lost
        # only its newline is kept, as checkpoint.say_dropped counts it)
        self.lines = [line.rstrip("\n") + "\n" for line in old if 0 <= logged_step(line) <= start]
        self.rewrite()

    def rewrite(self) -> None:
        """The whole file, written aside and renamed into place: a kill never leaves half of it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(self.lines))
        tmp.replace(self.path)
        self.written = time.monotonic()

    def log(self, step: int, record: dict[str, float], tags: dict[str, str]) -> None:
        """Write record as one JSON line, and each value named in tags (record key -> tensorboard
        tag)."""
        self.lines.append(json.dumps({"step": step, **record}) + "\n")
        if self.local:
            try:
                with self.path.open("a") as f:
                    f.write(self.lines[-1])
            except OSError as e:  # a full disk, say: one line, as a failed checkpoint save
                raise RunError(f"writing {self.path} failed: {e.strerror or e}") from None
        elif time.monotonic() - self.written > 60:
            self.rewrite()
        values = [self.summary.Value(tag=tag, simple_value=record[k])
                  for k, tag in tags.items() if record.get(k) is not None]
        summary = self.summary(value=values)
        self.tb.add_event(self.event(wall_time=time.time(), step=step, summary=summary))
        self.tb.flush()
        if self.wandb:
            self.wandb.log({v.tag: v.simple_value for v in values}, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        """Text for tensorboard's text plugin (markdown). Every process computes it: sampling takes
        them all."""
        from tensorboard.plugins.text.summary_v2 import text_pb

        self.tb.add_event(self.event(wall_time=time.time(), step=step, summary=text_pb(tag, text)))
        self.tb.flush()
        if self.wandb:  # a text panel in wandb too, as tensorboard's Text tab
            import wandb

            self.wandb.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        if not self.local:
            self.rewrite()
        self.tb.close()
        if self.wandb:
            self.wandb.finish()


def wandb_run(rundir: epath.Path, project: str, config: dict | None):
    """A Weights & Biases run (--config.wandb_project) beside tensorboard, imported only when
    asked for. Its id is kept in RUNDIR/wandb_id, so a resumed run continues the same one
    (wandb drops the steps it already has: those after the checkpoint are not rewritten). It gets
    the resolved config, as nanoGPT passes its own, so runs can be filtered by their settings."""
    import wandb

    path = rundir / "wandb_id"
    run_id = path.read_text().strip() if path.exists() else uuid.uuid4().hex[:12]
    local = None if str(rundir).startswith("gs://") else str(rundir)
    try:
        run = wandb.init(project=project, id=run_id, resume="allow", dir=local,
                         name=rundir.name, config=config)
    except Exception as e:  # no API key, no network, a bad project name: wandb's own errors
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"--config.wandb_project={project}: wandb could not start a run "
                         f"({type(e).__name__}: {why}): run `wandb login`, set "
                         "WANDB_MODE=offline, or pass --config.wandb_project=''") from None
    path.write_text(run_id)
    return run


def logged_step(line: str) -> int:
    """The step of a line of metrics.jsonl; -1 for a line that is not a record. Logger writes
    each step as a JSON integer: a step of Infinity, 3.5 or "3" is a damaged line, not a record."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return -1
    return step if type(step) is int else -1


def read_lines(path: epath.Path) -> list[str]:
    """metrics.jsonl's lines ([] where there is none). Bytes that are not UTF-8 are refused in one
    line naming the line, not dropped with the torn lines: no kill or crash leaves them (a
    filesystem that lost an append leaves zeros), so the file was edited or damaged otherwise."""
    data = path.read_bytes() if path.exists() else b""
    try:
        return data.decode().splitlines(keepends=True)
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UsageError(f"{path}, line {line}: not UTF-8 text, so not a record mugpt wrote: "
                         f"delete that line, or restore the file") from None


class Tally:
    """The step metrics on the host: fetched from the device only at log points and saves (a fetch
    waits), saved with each checkpoint so a resumed run logs exactly what an uninterrupted one
    would; counts skipped steps."""

    def __init__(self, cfg: Config, saved: dict | None = None):
        self.cfg = cfg
        self.on_device = []  # each step's metrics not fetched yet: dicts of scalar arrays
        # since_log: the fetched metrics of the steps after the last multiple of log_interval;
        # streak: the steps skipped in a row; worst: the longest streak since the last check (a
        # streak can end between two checks, which see only the current one); lr: the last
        # applied update's (optimizers.applied_lr)
        self.state = {"since_log": [], "streak": 0, "worst": 0, "skipped": 0, "lr": 0.0} | (
            saved or {})

    def fetch(self) -> None:
        for m in jax.device_get(self.on_device):  # one transfer for all of them
            m = {k: v.item() for k, v in m.items()}
            self.state["since_log"].append(m)
            self.state["streak"] = self.state["streak"] + 1 if m["skipped"] else 0
            self.state["worst"] = max(self.state.get("worst", 0), self.state["streak"])
            self.state["skipped"] += m["skipped"]
            self.state["lr"] = m["lr"]
        self.on_device = []

    def record(self, step: int) -> dict:
        """Mean loss (the cross-entropy) over the applied steps since the last log, and the
        objective's where it differs; the last grad norm, the skipped count, the LR."""
        self.fetch()
        steps = self.state["since_log"]
        losses = [m["loss"] for m in steps if not m["skipped"]]
        objectives = [m.get("objective", m["loss"]) for m in steps if not m["skipped"]]
        # a last step off the interval keeps them: a longer resumed run logs them at its next log
        if step % self.cfg.log_interval == 0:
            self.state["since_log"] = []
        mean = lambda values: float(np.mean(values)) if values else None  # noqa: E731
        return {"loss": mean(losses), "grad_norm": steps[-1]["grad_norm"],
                "skipped": self.state["skipped"], "lr": self.state["lr"]} | (
            {"objective": mean(objectives)} if objectives != losses else {})

    def last_lr(self) -> float:
        """The LR of the last update applied, 0 before any (an evaluation's "lr")."""
        self.fetch()
        return self.state["lr"]

    def check(self, step: int) -> None:
        worst, self.state["worst"] = self.state["worst"], self.state["streak"]
        if worst >= self.cfg.max_nonfinite:
            raise RunError(f"{worst} steps in a row by step {step} had a non-finite loss or "
                           f"gradient and were skipped (max_nonfinite={self.cfg.max_nonfinite}): "
                           f"the run has diverged")


# Dense bf16 peak FLOP/s per device from the datasheets, by jax's device_kind exactly (the GPU
# driver's product name, libtpu's chip name): a substring would score an H100 PCIe (756) or NVL
# (835) against the SXM's 989. A kind not listed has no peak, so no MFU rather than a wrong one.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM: the H100's tensor cores, more and faster memory
    "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12, "TPU v5e": 197e12,  # v5e: libtpu says "v5 lite"
    "TPU v5": 459e12, "TPU v5p": 459e12,  # v5p: libtpu says "v5"
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,  # v6e (Trillium)
}


def peak_flops(device) -> float | None:
    """None where no datasheet peak is known (a CPU, a kind not in PEAK_FLOPS): MFU is then
    reported as unknown."""
    return PEAK_FLOPS.get(device.device_kind)
