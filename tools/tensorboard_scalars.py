#!/usr/bin/env python3
"""Prints the scalars of TensorBoard event files as JSON, read with the tensorboard package.

    python3 tools/tensorboard_scalars.py RUN_DIR

Output: {"tag": [[step, value], ...], ...}. The check that Megaton's --tensorboard-dir
files read back in TensorBoard's own reader (EventAccumulator); tests/train/
test_tensorboard.cpp decodes them independently where tensorboard is not installed.
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tensorboard_scalars.py RUN_DIR")
    acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
    acc.Reload()
    out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    json.dump(out, sys.stdout, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
