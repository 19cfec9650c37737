"""tools/plot_loss.py draws what the metrics files say, and refuses bad input.

    /usr/bin/python3 tests/tools/test_plot_loss.py   (ctest: test_plot_loss, label cpu)

Writes metrics files in the format of `megaton train --log-metrics-file` (the keys of
src/train/trainer_log.cpp, one JSON object per line, a non-finite loss as null) with seeded
random losses, runs the script and decodes the PNG: its signature and IHDR size; pixels of
each run's colour (C0, C1) exist, and only for the runs drawn; the higher-loss run's curve
lies above the lower one's; --lr adds a second panel (two more horizontal axis spines).
Bad input (missing file, no loss records, malformed line, non-integer iteration, bad
--smooth) exits 2 with one line naming the file and line, and writes no PNG.
"""
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors
import matplotlib.image
import numpy

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools",
                      "plot_loss.py")
SEED = int(os.environ.get("MEGATON_TEST_SEED", "1234"))


def write_metrics(path, rng, start_loss, iterations=60, validation_every=0, nan_at=()):
    """A run's metrics file as the trainer writes it; the loss decays from start_loss."""
    with open(path, "w") as f:
        for it in range(1, iterations + 1):
            loss = start_loss * math.exp(-it / 25.0) + 2.0 + rng.uniform(-0.2, 0.2)
            record = {"iteration": it, "lm_loss": None if it in nan_at else loss,
                      "grad_norm": rng.uniform(0.5, 2.0), "lr": 3e-4 * min(1.0, it / 10.0),
                      "global_batch_size": 8, "consumed_samples": 8 * it}
            if it in nan_at:
                record["skipped"] = True
            f.write(json.dumps(record) + "\n")
            if validation_every and it % validation_every == 0:
                f.write(json.dumps({"iteration": it, "consumed_samples": 8 * it,
                                    "lm_loss_validation": loss + 0.1}) + "\n")


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120)


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG signature: {head[:8]!r}"
    assert head[12:16] == b"IHDR", f"{path}: first chunk is {head[12:16]!r}, not IHDR"
    return struct.unpack(">II", head[16:24])


def colour_mask(image, name, tolerance=0.06):
    """Pixels within `tolerance` (per channel) of matplotlib colour `name`."""
    rgb = numpy.array(matplotlib.colors.to_rgb(name))
    return numpy.all(numpy.abs(image[:, :, :3] - rgb) <= tolerance, axis=2)


def spine_rows(image):
    """Groups of adjacent rows that are dark over most of the width (horizontal axis spines)."""
    dark = image[:, :, :3].mean(axis=2) < 0.35
    rows = numpy.flatnonzero(dark.mean(axis=1) > 0.5)
    groups = 0
    for i, r in enumerate(rows):
        if i == 0 or r != rows[i - 1] + 1:
            groups += 1
    return groups


class PlotLoss(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="plot_loss_test.")
        self.dir = self.tmp.name
        self.rng = random.Random(SEED)
        self.high = os.path.join(self.dir, "high.jsonl")
        self.low = os.path.join(self.dir, "low.jsonl")
        write_metrics(self.high, self.rng, start_loss=9.0, validation_every=20, nan_at=(33,))
        write_metrics(self.low, self.rng, start_loss=1.0)

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def plot(self, *args):
        r = run_script(*args)
        self.assertEqual(r.returncode, 0, f"seed {SEED}: {r.stderr}")
        return r.stdout

    def test_two_runs_each_drawn_in_its_colour_higher_above_lower(self):
        out = self.path("two.png")
        stdout = self.plot(self.high, self.low, "-o", out, "--width", "900", "--height", "600",
                           "--title", "two runs", "--label", "high", "--label", "low")
        self.assertEqual(png_size(out), (900, 600))
        self.assertIn(f"{self.high}: 59 lm loss points (iterations 1..60), 1 non-finite left "
                      "out, 3 validation points", stdout)
        self.assertIn(f"{self.low}: 60 lm loss points", stdout)
        image = matplotlib.image.imread(out)
        self.assertEqual(image.shape[:2], (600, 900))
        high, low = colour_mask(image, "C0"), colour_mask(image, "C1")
        # A 60-point curve across the axes is hundreds of pixels; a legend line is ~30.
        self.assertGreater(high.sum(), 300, f"seed {SEED}")
        self.assertGreater(low.sum(), 300, f"seed {SEED}")
        self.assertEqual(colour_mask(image, "C2").sum(), 0, "a third run's colour appears")
        # Image rows grow downwards: the run with the higher loss is drawn higher.
        high_rows, low_rows = numpy.nonzero(high)[0], numpy.nonzero(low)[0]
        self.assertLess(numpy.median(high_rows), numpy.median(low_rows) - 50, f"seed {SEED}")
        # Its left end (the start of training, loss ~11) is near the top of the axes.
        columns = numpy.nonzero(high)[1]
        first = high[:, columns.min():columns.min() + 5]
        self.assertLess(numpy.nonzero(first)[0].mean(), 0.3 * 600, f"seed {SEED}")

    def test_one_run_draws_no_second_colour(self):
        out = self.path("one.png")
        self.plot(self.low, "-o", out, "--smooth", "0.8")
        self.assertEqual(png_size(out), (1200, 800))
        image = matplotlib.image.imread(out)
        self.assertGreater(colour_mask(image, "C0").sum(), 300)
        self.assertEqual(colour_mask(image, "C1").sum(), 0)

    def test_lr_panel_adds_an_axes(self):
        plain, with_lr = self.path("plain.png"), self.path("lr.png")
        self.plot(self.high, "-o", plain)
        self.plot(self.high, "-o", with_lr, "--lr")
        self.assertEqual(spine_rows(matplotlib.image.imread(plain)), 2)
        self.assertEqual(spine_rows(matplotlib.image.imread(with_lr)), 4)

    def test_samples_and_tokens_axes(self):
        out = self.path("tokens.png")
        self.plot(self.high, self.low, "-o", out, "--x", "tokens", "--seq-length", "1024")
        self.assertEqual(png_size(out), (1200, 800))
        r = run_script(self.high, "-o", self.path("t.png"), "--x", "tokens")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--seq-length", r.stderr)
        no_samples = self.path("no_samples.jsonl")
        with open(no_samples, "w") as f:
            f.write(json.dumps({"iteration": 1, "lm_loss": 7.5, "lr": 1e-4}) + "\n")
        r = run_script(no_samples, "-o", self.path("s.png"), "--x", "samples")
        self.assertEqual(r.returncode, 2)
        self.assertIn("consumed_samples", r.stderr)
        self.assertFalse(os.path.exists(self.path("s.png")))

    def test_bad_input_exits_2_naming_the_file_and_writes_nothing(self):
        empty = self.path("empty.jsonl")
        open(empty, "w").close()
        only_null = self.path("null.jsonl")
        with open(only_null, "w") as f:
            f.write(json.dumps({"iteration": 1, "lm_loss": None, "skipped": True}) + "\n")
        malformed = self.path("malformed.jsonl")
        with open(malformed, "w") as f:
            f.write(json.dumps({"iteration": 1, "lm_loss": 8.25}) + "\n\n")
            f.write('{"iteration": 2, "lm_loss": 8.1\n')
        no_iteration = self.path("no_iteration.jsonl")
        with open(no_iteration, "w") as f:
            f.write(json.dumps({"iteration": 1.5, "lm_loss": 8.25}) + "\n")
        cases = [
            ([self.path("missing.jsonl")], "cannot read '" + self.path("missing.jsonl")),
            ([self.high, empty], f"{empty}: no lm loss records"),
            ([only_null], f"{only_null}: no lm loss records"),
            ([malformed], f"{malformed}:3: malformed JSON"),
            ([no_iteration], f"{no_iteration}:1: expected an integer \"iteration\""),
            ([self.high, "--smooth", "1.5"], "--smooth"),
            ([self.high, self.low, "--label", "only-one"], "--label"),
        ]
        out = self.path("bad.png")
        for args, message in cases:
            r = run_script(*args, "-o", out)
            self.assertEqual(r.returncode, 2, f"{args}: {r.stderr}")
            self.assertIn(message, r.stderr, args)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertFalse(os.path.exists(out), args)
        # Nothing else either: no temporary file left beside the output.
        self.assertEqual(sorted(n for n in os.listdir(self.dir) if "png" in n), [])

    def test_existing_png_is_replaced_whole(self):
        out = self.path("replace.png")
        with open(out, "wb") as f:
            f.write(b"old")
        self.plot(self.low, "-o", out, "--width", "640", "--height", "480")
        self.assertEqual(png_size(out), (640, 480))
        # A refused run leaves the previous PNG as it was.
        r = run_script(self.path("missing.jsonl"), "-o", out)
        self.assertEqual(r.returncode, 2)
        self.assertEqual(png_size(out), (640, 480))


if __name__ == "__main__":
    print(f"seed {SEED} (MEGATON_TEST_SEED)")
    unittest.main(verbosity=2)
