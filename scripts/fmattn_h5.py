# Helpers shared by fmattn's Python scripts (imported from the scripts' own folder): reading the
# column tables and attributes of fmattn's HDF5 outputs (the deck text of their `deck` attribute
# is read by fmattn_deck.py). The scripts import h5py from here, which says in one line what to do
# where it is missing.
import os

# fmattn opens its files for each append; a reader's shared lock would make that open fail and stop
# the run, so never take one (must be set before h5py loads HDF5).
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

try:
    import h5py  # noqa: E402
    import numpy as np  # noqa: E402
except ImportError as e:  # another Python than Debian's (a pyenv or venv one without h5py)
    import sys

    sys.exit(f"{os.path.basename(sys.argv[0])}: {e.name} is not installed for {sys.executable}: "
             "run the script with Debian's /usr/bin/python3 (as its first line does; "
             "apt-get install python3-h5py python3-numpy)")


def text(v):
    """An HDF5 string (bytes or str) as str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def root_attrs(f):
    """The root attributes of an open file, strings decoded."""
    return {k: (text(v) if isinstance(v, (bytes, str)) else v) for k, v in f.attrs.items()}


def group_columns(f, group):
    """{name: 1-D array} of the datasets of a group of an open file (strings decoded, numbers as
    float), or None if there is no such group. A run stopped mid-append may leave one column a row
    longer than the others: only whole rows are kept."""
    if group not in f or not isinstance(f[group], h5py.Group):
        return None
    cols = {}
    for name, ds in f[group].items():
        if not isinstance(ds, h5py.Dataset):
            continue
        a = ds[()]
        if a.dtype.kind in "OSU":
            cols[name] = np.array([text(x) for x in np.ravel(a)], dtype=object)
        else:
            cols[name] = np.asarray(a, dtype=float).ravel()
    k = min((len(c) for c in cols.values()), default=0)
    return {name: c[:k] for name, c in cols.items()}


def run_file(path, name):
    """path itself, or path/name when path is a run directory (output.dir/run.name)."""
    return os.path.join(path, name) if os.path.isdir(path) else path
