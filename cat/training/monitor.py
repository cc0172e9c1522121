"""Training scalars: TensorBoard and `log/scalars.jsonl` (rank 0), and `monitor.png`.

Usage:
    monitor = Monitor(Path("exp/asr/log"), enabled=True)
    monitor.add(step, loss__train=1.2, lr=1e-3)
    plot_scalars(Path("exp/asr/log/scalars.jsonl"), Path("exp/asr/monitor.png"))
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from cat.core.io import atomic_write

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- monitoring


class Monitor:
    """Scalars to TensorBoard and `scalars.jsonl` (rank 0 only), and `monitor.png`."""

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.log_dir = log_dir
        self.enabled = enabled
        self.writer = None
        self.file = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            log_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(log_dir / "tensorboard"))
            self.file = open(log_dir / "scalars.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def add(self, step: int, **scalars: float) -> None:
        """Record scalars (tag names such as `loss/train`, given with `/` as `__`)."""
        if not self.enabled:
            return
        for name, value in scalars.items():
            tag = name.replace("__", "/")
            self.writer.add_scalar(tag, value, step)
            self.file.write(json.dumps({"step": step, "tag": tag, "value": value}) + "\n")
        self.file.flush()

    def close(self) -> None:
        """Flush and close the writers."""
        if self.writer is not None:
            self.writer.close()
            self.file.close()
            self.writer = self.file = None


def plot_scalars(scalars_path: Path, out: Path) -> None:
    """Plot every tag of a `scalars.jsonl` against the step into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = {}
    with open(scalars_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            # A resumed run rewrites steps after its checkpoint: the last value wins.
            series.setdefault(record["tag"], {})[record["step"]] = record["value"]
    if not series:
        return
    tags = sorted(series)
    columns = min(3, len(tags))
    rows = math.ceil(len(tags) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    for axis, tag in zip(axes.flat, tags, strict=False):
        steps = sorted(series[tag])
        axis.plot(steps, [series[tag][s] for s in steps], marker="." if len(steps) < 50 else "")
        axis.set_title(tag)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(tags):]:
        axis.axis("off")
    figure.tight_layout()
    with atomic_write(out, "wb") as f:
        figure.savefig(f, format="png", dpi=100)
    plt.close(figure)
