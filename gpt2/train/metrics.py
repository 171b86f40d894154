"""Step metrics (tokens/s, MFU) and where they go: console, JSONL, a loss-curve plot, TensorBoard, W&B.

A step record is a plain dict: ``step, loss, lr, grad_norm, dt_ms, tokens_per_second, mfu,
scored_tokens, skipped, skipped_steps``, plus ``loss_scale`` (fp16) and ``val_loss`` (evaluation
steps). ``mfu`` is FLOPs per token (:meth:`gpt2.model.GPT.flops_per_token`) x tokens/s over the
peak FLOP/s of the run's precision (fp32 runs against the fp32 peak); None on CPU and on GPUs
missing from :data:`PEAK_FLOPS` unless a peak is given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, Union

import torch
from tqdm.auto import tqdm  # a widget in notebooks

from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.files import progress_enabled, replace_atomically, write_advice
from gpt2.model.checkpoint_files import CHECKPOINT_DIR, find_latest_checkpoint, first_line
from gpt2.train.config import parsed_log_to

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"  # in out_dir: every step's record
PLOT_FILE = "loss.png"  # in out_dir: the loss curve, drawn after each fit()

Sink = Union[Callable[[dict], None], Any]  # a callable, or an object with log(record) [and close()]


class Peaks(NamedTuple):
    """Dense peak FLOP/s of one GPU for each precision policy's matmuls."""

    fp32: float  # plain fp32 (CUDA cores)
    tf32: float  # TF32 tensor cores (= fp32 on GPUs without them)
    bf16: float  # bf16 / fp16 tensor cores with fp32 accumulation (fp16 on V100 and T4: no bf16)


# From NVIDIA's data sheets (H100/H200/GH200, A100, A30, A40, A10, L40S, L40, L4, V100, T4) and the Ampere (GA102) and
# Ada (AD102) architecture white papers for the RTX cards: dense numbers, i.e. half of the "with sparsity" figures the
# data sheets print for TF32 and bf16. Patterns are tried in order, so the more specific names come first.
PEAK_FLOPS: list[tuple[str, Peaks]] = [
    (r"H200", Peaks(67e12, 494.5e12, 989.5e12)),
    (r"H100.*PCIe", Peaks(51e12, 378e12, 756e12)),
    (r"H100.*NVL", Peaks(60e12, 417.5e12, 835e12)),
    (r"H100|GH200", Peaks(67e12, 494.5e12, 989.5e12)),  # SXM ("H100 80GB HBM3") and Grace Hopper
    (r"A100", Peaks(19.5e12, 156e12, 312e12)),
    (r"\bA30\b", Peaks(10.3e12, 82e12, 165e12)),
    (r"\bA40\b", Peaks(37.4e12, 74.8e12, 149.7e12)),
    (r"\bA10\b", Peaks(31.2e12, 62.5e12, 125e12)),
    (r"L40S", Peaks(91.6e12, 183e12, 362e12)),
    (r"\bL40\b", Peaks(90.5e12, 90.5e12, 181e12)),
    (r"\bL4\b", Peaks(30.3e12, 60e12, 121e12)),
    (r"RTX A6000", Peaks(38.7e12, 77.4e12, 154.8e12)),
    (r"RTX 4090", Peaks(82.6e12, 82.6e12, 165.2e12)),
    (r"RTX 4080", Peaks(48.7e12, 48.7e12, 97.5e12)),
    (r"RTX 3090", Peaks(35.6e12, 35.6e12, 71e12)),
    (r"RTX 3080", Peaks(29.8e12, 29.8e12, 59.5e12)),
    (r"V100", Peaks(15.7e12, 15.7e12, 125e12)),  # no TF32 tensor cores: "tf32" runs fp32
    (r"\bT4\b", Peaks(8.1e12, 8.1e12, 65e12)),
]


def peak_flops_for(device_name: str, precision: str = "bf16") -> float | None:
    """Peak FLOP/s of the GPU called ``device_name`` (as ``torch.cuda.get_device_name`` says) for
    a precision policy's matmuls ("fp32", "tf32", "bf16" or "fp16"), or None if it is unknown.
    """
    field = "bf16" if precision == "fp16" else precision
    return next((getattr(peaks, field) for pattern, peaks in PEAK_FLOPS if re.search(pattern, device_name)), None)


def detect_peak_flops(
    device: torch.device | str, override: float | None = None, precision: str = "bf16"
) -> float | None:
    """``override`` if given, else the table's value for this CUDA device and ``precision``; None on CPU."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_for(name, precision)
    if peak is None:
        logger.warning("no peak FLOP/s known for %r: MFU not reported (set TrainConfig.peak_flops)", name)
    return peak


def mfu(
    flops_per_token: float | None, tokens_per_second: float, peak_flops: float | None, world_size: int = 1
) -> float | None:
    """Model FLOPs utilisation of one accelerator, as a fraction (0.441 = 44.1%); None without a
    model FLOP count or a peak to compare with.
    """
    if not flops_per_token or not peak_flops:
        return None
    return flops_per_token * tokens_per_second / (peak_flops * world_size)


# A console line's parts, in order: each record entry shown (when present and not None) and its format.
LINE_FORMATS = {
    "step": "step {}",
    "loss": "loss {:.4f}",
    "lr": "lr {:.1e}",
    "grad_norm": "norm {:.2f}",
    "dt_ms": "{:.1f} ms",
    "tokens_per_second": "{:,.0f} tok/s",
    "mfu": "mfu {:.1%}",
    "val_loss": "val {:.4f}",
    "loss_scale": "scale {:g}",
}


def format_line(record: dict[str, Any]) -> str:
    """``step 50 | loss 5.0860 | lr 6.0e-05 | norm 0.41 | 50.6 ms | 161,818 tok/s | mfu 44.1%``, then
    when present ``| val 4.9000``, ``| scale 65536`` and ``| skipped (N total)``.
    """
    parts = [form.format(record[key]) for key, form in LINE_FORMATS.items() if record.get(key) is not None]
    if record.get("skipped"):
        parts.append(f"skipped ({record.get('skipped_steps', 1)} total)")
    return " | ".join(parts)


class RunOutputError(Gpt2Error, OSError):
    """Writing a run's output (metrics.jsonl, a checkpoint) failed, e.g. on a full disk. The message (one line) names
    the file, what to do and the newest intact checkpoint; ``errno`` and ``filename`` are the failed write's.
    """

    def __str__(self) -> str:
        # the message alone: once filename is set, OSError's own str() shows "[Errno n] strerror: filename"
        return str(self.args[0])


def output_error(
    path: str | os.PathLike,
    doing: str,
    e: BaseException,
    checkpoint_dir: Path,
    error: type[RunOutputError] = RunOutputError,
) -> RunOutputError:
    """The :class:`RunOutputError` (or its subclass ``error``) for ``e``, raised while ``doing`` (e.g. "appending to")
    ``path``: it names the newest complete checkpoint under ``checkpoint_dir``, which a resume continues from.
    """
    newest = find_latest_checkpoint(checkpoint_dir)
    kept = "no checkpoint of this run is on disk yet"
    then = "start the run again"
    if newest is not None:
        kept = f"the newest checkpoint {newest} is intact"
        then = "resume (resume='auto' continues from it)"
    err = error(f"{doing} {path} failed ({first_line(e)}); {kept}. To go on: {write_advice(e)} (out_dir), then {then}")
    err.errno = getattr(e, "errno", None)
    err.filename = str(path)
    return err


class ConsoleSink:
    """Writes :func:`format_line` for every ``interval``-th step, the first step, evaluation steps
    and skipped steps. ``write`` defaults to ``tqdm.write`` (stdout, above the progress bar).
    """

    def __init__(self, interval: int = 1, write: Callable[[str], None] | None = None):
        if interval < 1:
            raise InvalidValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        # tqdm.write prints above an active progress bar instead of through it
        self.write = write or tqdm.write

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step == 1 or step % self.interval == 0 or record.get("val_loss") is not None or record.get("skipped"):
            self.write(format_line(record))


class JSONLSink:
    """Appends one JSON object per record to ``path`` (flushed each time, so a crash loses nothing).
    ``keep_until_step``: the file's records up to that step are kept (a resumed run continues the
    log without the steps it redoes); 0 starts a new log. A failed write (a full disk) raises
    :class:`RunOutputError`, naming the newest checkpoint of the run (``checkpoints/`` beside ``path``).
    """

    def __init__(self, path: str | os.PathLike, keep_until_step: int = 0):
        self.path = Path(path)
        self.checkpoint_dir = self.path.parent / CHECKPOINT_DIR
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self.rewind(keep_until_step)

    def rewind(self, step: int) -> None:
        """Keep the file's records up to ``step`` (0: none) and append after them: the run goes on after
        ``step`` (a resume from it, or a divergence recovery gone back to it).
        """
        self.close()
        kept = []
        if step:
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        try:
            replace_atomically(self.path, lambda f: f.write(text.encode()))
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise output_error(self.path, "rewriting", e, self.checkpoint_dir) from e

    def log(self, record: dict[str, Any]) -> None:
        # JSON has no nan/inf literals that every reader accepts: they are written as strings.
        finite = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        try:
            self._file.write(json.dumps(finite) + "\n")
            self._file.flush()
        except OSError as e:
            # the unwritten line would fail again when the file is closed
            with contextlib.suppress(OSError):
                self._file.close()
            raise output_error(self.path, "appending to", e, self.checkpoint_dir) from e

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a metrics file (empty if it does not exist); a torn last line is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    # errors="replace": a damaged byte spoils its line only
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            # a blank line (a user's edit) holds no record and is not damage
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("ignoring a malformed line in %s: %.80s", path, line)
    return records


def plot_loss_curve(records: Iterable[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Training (and validation) loss against step as a PNG; None if matplotlib is missing."""
    try:
        # The Figure API draws without pyplot, so no GUI backend is chosen or changed.
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: no loss curve (pip install 'gpt2-minlora[plot]')")
        return None
    records = list(records)

    def finite(key: str) -> tuple[list[int], list[float]]:
        pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [s for s, _ in pairs], [v for _, v in pairs]

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    steps, losses = finite("loss")
    ax.plot(steps, losses, label="train", linewidth=1)
    val_steps, val_losses = finite("val_loss")
    if val_steps:
        ax.plot(val_steps, val_losses, "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a record (bools as 0/1), without the step."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (bool, int, float))}


def _missing(package: str, extra: str, e: ImportError) -> ImportError:
    return ImportError(
        f"logging to {extra} needs the {package!r} package, which is not installed: "
        f"pip install 'gpt2-minlora[{extra}]' (or pip install {package}) [{e}]"
    )


class TensorBoardSink:
    """Every numeric entry of every record as a TensorBoard scalar (tag = its key) at its step,
    under ``log_dir`` (``tensorboard --logdir <out_dir>/tensorboard``). ``purge_step``: TensorBoard
    drops what earlier event files logged from that step on (a resumed run redoes those steps).
    """

    def __init__(self, log_dir: str | os.PathLike, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        except ImportError as e:
            raise _missing("tensorboard", "tensorboard", e) from e
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def rewind(self, step: int) -> None:
        """The run goes on after ``step`` (a divergence recovery went back to it): a new event file, purging the
        later steps as a resume from ``step`` does.
        """
        self.writer.close()
        self.writer = type(self.writer)(log_dir=self.writer.log_dir, purge_step=step + 1)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.close()  # flushes the event file


def wandb_mode() -> str:
    """``$WANDB_MODE`` if set; else "online" when an API key is configured ($WANDB_API_KEY or a
    ``wandb login`` entry in ~/.netrc), else "offline" (no network needed; ``wandb sync`` uploads later).
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class WandbSink:
    """Every numeric entry of every record to a Weights & Biases run in ``out_dir/wandb``, named by
    the arguments, else ``$WANDB_PROJECT`` / ``$WANDB_NAME``, else ``"gpt2"`` / the run directory's
    name; in :func:`wandb_mode` (offline runs: ``wandb sync <out_dir>/wandb/offline-run-*``).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        project: str | None = None,
        name: str | None = None,
        config: dict[str, Any] | None = None,
        mode: str | None = None,
    ):
        try:
            import wandb
        except ImportError as e:
            raise _missing("wandb", "wandb", e) from e
        out_dir = Path(out_dir)
        (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.mode = mode or wandb_mode()
        self.run = wandb.init(
            dir=str(out_dir),  # wandb adds the "wandb" folder itself
            project=project or os.environ.get("WANDB_PROJECT") or "gpt2",
            name=name or os.environ.get("WANDB_NAME") or out_dir.resolve().name,
            config=config,
            mode=self.mode,
        )
        self.run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>
        if self.mode == "offline":
            logger.info("W&B offline run in %s (upload later with: wandb sync %s)", self.run_dir, self.run_dir)
        # W&B ignores a record logged at a lower step than the last one, so its own step only grows (it equals the
        # training step until a recovery goes back); the charts plot against the training step, logged as "step".
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.wandb_step = 0

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self.wandb_step = max(self.wandb_step + 1, step)
        self.run.log({**_scalars(record), "step": step}, step=self.wandb_step)

    def rewind(self, step: int) -> None:
        """The run goes on after ``step`` (a divergence recovery went back to it). W&B history cannot be cut:
        the steps redone are logged again (at their training step, at new W&B steps).
        """

    def close(self) -> None:
        self.run.finish()


def make_sinks(targets: Iterable[str], out_dir: str | os.PathLike, config: dict | None = None, step: int = 0) -> list:
    """The sinks named in ``targets`` (``"tensorboard"``, ``"wandb"``) writing under ``out_dir``, after ``step``."""
    sinks: list[Any] = []
    try:
        for target in parsed_log_to(targets):
            if target == "tensorboard":
                sinks.append(TensorBoardSink(Path(out_dir) / "tensorboard", purge_step=step + 1 if step else None))
            else:
                sinks.append(WandbSink(out_dir, config=config))
    except BaseException:
        # close the ones already started
        for sink in sinks:
            sink.close()
        raise
    return sinks


class FitLog:
    """Where one ``fit()`` call's records go on rank 0 (other ranks' log is empty): ``metrics.jsonl`` (keeping its
    records up to ``step``), the ``TrainConfig.log_to`` sinks, the Trainer's sinks and the progress bar.
    :meth:`close` closes (flushes) what this call opened; the Trainer's own sinks stay open for its next call.
    """

    def __init__(self, sinks: Iterable[Sink], config: Any, *, out_dir: Path | None, step: int, is_main: bool) -> None:
        # what this call opens (and closes at its end), then every sink a record goes to
        self.opened: list[Any] = []
        self.sinks: list[Sink] = []
        self.bar: Any = None
        if not is_main:
            return
        # TensorBoard / W&B (config.log_to; none by default): first, so a missing package fails before anything else
        # is opened
        self.opened = make_sinks(config.log_to, out_dir, config.to_dict(), step)
        try:
            if out_dir is not None:
                self.opened.insert(0, JSONLSink(out_dir / METRICS_FILE, keep_until_step=step))
            if progress_enabled(config.progress):
                self.bar = tqdm(dynamic_ncols=True, total=config.max_steps, initial=step, unit="step", desc="train")
        except BaseException:
            # e.g. metrics.jsonl cannot be written: close the sinks just opened
            self.close()
            raise
        self.sinks = [*self.opened, *sinks]

    def emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            if hasattr(sink, "log"):
                sink.log(record)
            else:
                sink(record)
        if self.bar is not None:
            # postfix first: update() redraws the bar, which then shows this step's loss
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            self.bar.update(1)

    def rewind(self, step: int) -> None:
        """The run goes on after ``step`` (a divergence recovery went back to it), as after a resume from ``step``:
        metrics.jsonl keeps its records up to ``step``, TensorBoard purges the later ones, the progress bar shows
        ``step``; a sink of the Trainer's with a ``rewind(step)`` method is told too.
        """
        for sink in self.sinks:
            if hasattr(sink, "rewind"):
                sink.rewind(step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def status(self, text: str) -> None:
        """Show ``text`` on the bar until the next record (e.g. while evaluating)."""
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for sink in self.opened:
            sink.close()
