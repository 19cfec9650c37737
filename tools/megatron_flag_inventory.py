#!/usr/bin/env python3
"""Writes the inventory of Megatron-LM's `pretrain_gpt.py` command-line flags as TSV.

Megaton gives every Megatron flag one rule (implemented, no effect, or refused naming the
feature: issue 19). The test tests/train/test_megatron_flag_coverage.cpp reads this
inventory and fails on any Megatron flag the code has no rule for. Regenerate it when
moving to a newer Megatron-LM:

    python3 tools/megatron_flag_inventory.py /path/to/Megatron-LM [COMMIT] > tests/golden/megatron_flags.tsv

(COMMIT names the checkout's commit when it is not a git work tree.)

Needs a Python with torch (Megatron's argument module imports it) and the checkout on
sys.path. The flags come from Megatron's own parser (`add_megatron_arguments`), so the
flags generated from its config dataclasses are included. Columns: flag, argparse group
title, dest, nargs, choices (comma-separated, empty for none). One row per long option
string, so `--foo` and its `--no-foo` form are two rows.
"""
import argparse
import subprocess
import sys
import typing


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: megatron_flag_inventory.py MEGATRON_LM_DIR [COMMIT]")
    root = sys.argv[1]
    given_commit = sys.argv[2] if len(sys.argv) == 3 else None
    sys.path.insert(0, root)
    if not hasattr(typing, "override"):  # Python < 3.12: Megatron imports typing.override
        typing.override = lambda f: f
    sys.argv = [sys.argv[0]]  # Megatron's modules may parse sys.argv on import
    from megatron.training.arguments import add_megatron_arguments  # noqa: E402

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    commit = given_commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    print(f"# Megatron-LM {commit}: flags of add_megatron_arguments")
    print("# flag\tgroup\tdest\tnargs\tchoices")
    seen = set()
    for group in parser._action_groups:
        for action in group._group_actions:
            choices = ",".join(str(c) for c in action.choices) if action.choices else ""
            for flag in action.option_strings:
                if not flag.startswith("--") or flag in seen:
                    continue
                seen.add(flag)
                nargs = "0" if action.nargs == 0 else ("1" if action.nargs is None else str(action.nargs))
                print(f"{flag}\t{group.title}\t{action.dest}\t{nargs}\t{choices}")


if __name__ == "__main__":
    main()
