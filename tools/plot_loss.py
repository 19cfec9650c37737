#!/usr/bin/python3
"""Plots the loss curves of `megaton train --log-metrics-file` files into one PNG.

    /usr/bin/python3 tools/plot_loss.py METRICS.jsonl [METRICS.jsonl ...] -o loss.png
        [--label NAME ...] [--x iteration|samples|tokens] [--seq-length N]
        [--smooth 0.9] [--lr] [--title TEXT] [--width 1200] [--height 800]

Needs matplotlib: Debian's /usr/bin/python3 with python3-matplotlib (tools/install_deps.sh),
or any Python that has matplotlib. Draws with the Agg backend (no display).

Each input is one run: one curve of "lm_loss" per file, in matplotlib's colour cycle
(C0, C1, ...), labelled with --label or the file's path, so two runs can be compared.
A metrics file is JSON lines, one per iteration: {"iteration", "lm_loss", "grad_norm", "lr",
"global_batch_size", "consumed_samples", ...} (src/train/trainer_log.cpp). A non-finite
loss (written as null) is left out of the curve. A line with "lm_loss_validation" adds a
validation point (the trainer does not write such lines yet; the key follows Megatron's
"lm loss validation"). When a file holds an iteration twice (a run resumed from an earlier
checkpoint appends to the same file) the later line wins.

--x samples plots against "consumed_samples" (after the iteration); --x tokens against
consumed_samples x --seq-length (the file records samples, not tokens). --smooth A draws
the exponential moving average s = A*s + (1-A)*loss over the raw curve (which is drawn
faint). --lr adds a learning-rate panel below. --width/--height are the PNG's pixels.

Prints one line per file (points, iterations, validation points) and the PNG's path.
Exit status 2, with one line naming the file (and line) and nothing written, for a file
that cannot be read, a line that is not a JSON object, a record without an integer
"iteration", a file without any finite lm loss, or an output that cannot be written. The
PNG is written to a temporary file beside it and renamed, so no half-written PNG is left.
"""
import argparse
import json
import math
import os
import sys
import tempfile


class InputError(Exception):
    """A user's mistake (file, line, flag): one line, exit status 2."""


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Run:
    """One metrics file's curves, each a list of (iteration, consumed_samples, value)."""

    def __init__(self, path, label):
        self.path, self.label = path, label
        self.loss = {}  # iteration -> (consumed_samples or None, loss or None if non-finite)
        self.validation = {}  # iteration -> (consumed_samples or None, loss)
        self.lr = {}  # iteration -> (consumed_samples or None, lr)


def read_run(path, label):
    run = Run(path, label)
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read '{path}': {e.strerror}")
    with f:
        try:
            lines = list(f)
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read '{path}': {e}")
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: malformed JSON ({e.msg} at column {e.pos + 1})")
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
        iteration = record.get("iteration")
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            raise InputError(f"{where}: expected an integer \"iteration\", got {iteration!r}")
        samples = record.get("consumed_samples")
        if samples is not None and not is_number(samples):
            raise InputError(f"{where}: \"consumed_samples\" is {samples!r}, expected a number")
        for key, table in (("lm_loss", run.loss), ("lm_loss_validation", run.validation),
                           ("lr", run.lr)):
            if key not in record:
                continue
            value = record[key]
            if value is not None and not is_number(value):
                raise InputError(f"{where}: \"{key}\" is {value!r}, expected a number or null")
            finite = value is not None and math.isfinite(value)
            if key == "lm_loss":
                table[iteration] = (samples, float(value) if finite else None)
            elif finite:
                table[iteration] = (samples, float(value))
    if not any(v is not None for _, v in run.loss.values()):
        raise InputError(f"{path}: no lm loss records (lines with a finite \"lm_loss\")")
    return run


def points(table, x_axis, seq_length, path, what):
    """Sorted (x, value) of a table's finite values on the chosen x axis."""
    out = []
    for iteration in sorted(table):
        samples, value = table[iteration]
        if value is None:
            continue
        if x_axis == "iteration":
            x = iteration
        elif samples is None:
            raise InputError(f"{path}: iteration {iteration}'s {what} has no \"consumed_samples\""
                             f" (needed by --x {x_axis})")
        else:
            x = samples * (seq_length if x_axis == "tokens" else 1)
        out.append((x, value))
    return out


def ema(values, weight):
    smoothed, s = [], values[0]
    for v in values:
        s = weight * s + (1.0 - weight) * v
        smoothed.append(s)
    return smoothed


def smoothing_weight(text):
    try:
        w = float(text)
    except ValueError:
        w = -1.0
    if not 0.0 <= w < 1.0:
        raise argparse.ArgumentTypeError(f"expected a weight in [0, 1), got '{text}'")
    return w


def pixels(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 64 <= n <= 10000:
        raise argparse.ArgumentTypeError(f"expected a size in pixels, 64 to 10000, got '{text}'")
    return n


def positive_int(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return n


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, without argparse's usage block
        print(f"plot_loss: {message} (--help for usage)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv):
    p = OneLineParser(
        prog="plot_loss.py",
        description="Plot lm loss curves of `megaton train --log-metrics-file` files to a PNG.")
    p.add_argument("metrics", nargs="+", help="metrics files (JSON lines), one curve each")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--label", action="append", default=[],
                   help="legend name of each file, in order (default: the file's path)")
    p.add_argument("--x", choices=("iteration", "samples", "tokens"), default="iteration",
                   help="x axis: iteration, consumed samples, or consumed tokens (--seq-length)")
    p.add_argument("--seq-length", type=positive_int,
                   help="tokens per sample, for --x tokens")
    p.add_argument("--smooth", type=smoothing_weight, default=None, metavar="A",
                   help="exponential moving average weight in [0, 1), e.g. 0.9")
    p.add_argument("--lr", action="store_true", help="add a learning-rate panel")
    p.add_argument("--title", default=None, help="the figure's title")
    p.add_argument("--width", type=pixels, default=1200, help="PNG width in pixels")
    p.add_argument("--height", type=pixels, default=800, help="PNG height in pixels")
    args = p.parse_args(argv)
    if args.label and len(args.label) != len(args.metrics):
        p.error(f"{len(args.label)} --label for {len(args.metrics)} metrics files")
    if args.x == "tokens" and args.seq_length is None:
        p.error("--x tokens needs --seq-length (the metrics file records samples)")
    return args


def plot(runs, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    dpi = 100
    panels = 2 if args.lr else 1
    fig, axes = plt.subplots(
        panels, 1, sharex=True, squeeze=False, figsize=(args.width / dpi, args.height / dpi),
        dpi=dpi, gridspec_kw={"height_ratios": [3, 1]} if args.lr else None)
    loss_ax = axes[0][0]
    lr_ax = axes[1][0] if args.lr else None
    summary = []
    for index, run in enumerate(runs):
        colour = f"C{index % 10}"
        curve = points(run.loss, args.x, args.seq_length, run.path, "lm loss")
        xs, ys = [x for x, _ in curve], [y for _, y in curve]
        if args.smooth is not None:
            loss_ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=1.0)
            loss_ax.plot(xs, ema(ys, args.smooth), color=colour, linewidth=1.8,
                         label=f"{run.label} (EMA {args.smooth:g})")
        else:
            loss_ax.plot(xs, ys, color=colour, linewidth=1.5, label=run.label)
        valid = points(run.validation, args.x, args.seq_length, run.path, "validation loss")
        if valid:
            loss_ax.plot([x for x, _ in valid], [y for _, y in valid], linestyle="none",
                         marker="o", markersize=6, markerfacecolor="white",
                         markeredgecolor=colour, markeredgewidth=1.8,
                         label=f"{run.label} validation")
        if lr_ax is not None:
            lr = points(run.lr, args.x, args.seq_length, run.path, "learning rate")
            if lr:
                lr_ax.plot([x for x, _ in lr], [y for _, y in lr], color=colour, linewidth=1.5)
        skipped = sum(1 for _, v in run.loss.values() if v is None)
        summary.append(f"{run.path}: {len(curve)} lm loss points (iterations {min(run.loss)}"
                       f"..{max(run.loss)}), {skipped} non-finite left out, "
                       f"{len(valid)} validation points")
    loss_ax.set_ylabel("lm loss")
    loss_ax.grid(True, color="0.88")
    loss_ax.legend(loc="best")
    bottom = lr_ax if lr_ax is not None else loss_ax
    if lr_ax is not None:
        lr_ax.set_ylabel("learning rate")
        lr_ax.grid(True, color="0.88")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    bottom.set_xlabel({"iteration": "iteration", "samples": "consumed samples",
                       "tokens": "consumed tokens"}[args.x])
    if args.x != "iteration":
        bottom.xaxis.set_major_formatter(EngFormatter())
    if args.title:
        loss_ax.set_title(args.title)
    fig.tight_layout()
    return fig, summary


def write_png_atomically(fig, output):
    directory = os.path.dirname(os.path.abspath(output))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".plot_loss.", suffix=".png.tmp", dir=directory)
    except OSError as e:
        raise InputError(f"cannot write '{output}': {e.strerror}")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, "wb") as f:
            # The size in pixels is figsize x dpi; no bbox_inches="tight", which would change it.
            fig.savefig(f, format="png", dpi=fig.dpi)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise InputError(f"cannot write '{output}': {e.strerror or e}")
        raise


def main(argv):
    args = parse_args(argv)
    try:
        labels = args.label or args.metrics
        runs = [read_run(path, label) for path, label in zip(args.metrics, labels)]
        fig, summary = plot(runs, args)
        write_png_atomically(fig, args.output)
    except InputError as e:
        print(f"plot_loss: {e}", file=sys.stderr)
        return 2
    for line in summary:
        print(line)
    print(f"wrote {args.output} ({args.width}x{args.height})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
