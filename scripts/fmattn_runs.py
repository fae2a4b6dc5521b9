# Helpers shared by the scripts that drive fmattn runs (compare.py, tasks.py; imported from the
# scripts' own folder): messages under the calling script's name, a small deck as fmattn --set
# options (read by fmattn_deck.py), and one run launched with its log. Reads and writes no HDF5
# (fmattn_h5.py does).
import configparser
import os
import shlex
import subprocess
import sys
import time

from fmattn_deck import read_deck


def prog():
    """The name of the running script, for its messages."""
    return os.path.basename(sys.argv[0]) or "fmattn"


def note(msg):
    print(f"{prog()}: {msg}", flush=True)


def die(msg):
    print(f"{prog()}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def deck_sets(path):
    """The settings of a small deck as fmattn --set options (section.key=value); an error where
    the file cannot be read or is not a deck."""
    try:
        values = read_deck(path)
    except (OSError, configparser.Error) as e:
        die(f"cannot read {path}: {e}")
    return [f"{k}={v}" for k, v in values.items()]


def run_one(job):
    """Run fmattn for one (name, command, environment, log) job, its command line first in the
    log and its wall clock last (`# wall_s S`, read back by log_wall); returns (name, status,
    seconds, log path)."""
    name, cmd, env, log = job
    t0 = time.time()
    with open(log, "w") as out:
        out.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        out.flush()
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    secs = time.time() - t0
    with open(log, "a") as out:
        out.write(f"# wall_s {secs:.3f}\n")
    return name, rc, secs, log


def log_wall(log):
    """The wall clock run_one wrote at the end of a log, or NaN."""
    try:
        with open(log) as f:
            for line in f:
                if line.startswith("# wall_s "):
                    return float(line.split()[2])
    except OSError:
        pass
    return float("nan")


def check_decks(named_commands):
    """Resolve every run's deck with fmattn --check (nothing is trained or written); a refused
    deck is an error naming the run and quoting fmattn's message."""
    refused = []
    for name, cmd in named_commands:
        p = subprocess.run([cmd[0], "--check"] + cmd[1:], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            refused.append(f"{name}: {p.stderr.strip().splitlines()[-1] if p.stderr else p.returncode}")
    if refused:
        die(f"{len(refused)} deck(s) refused:\n  " + "\n  ".join(refused))
    note(f"{len(named_commands)} deck(s) valid")
