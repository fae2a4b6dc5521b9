# Plot helpers shared by fmattn's plotting scripts (imported from the scripts' own folder): PNG
# output without a display, and readable log axes.
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, out_dir, name, written, tight=True):
    """Write fig as out_dir/name (PNG, 120 dpi), close it and note the path in `written`."""
    path = os.path.join(out_dir, name)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)


def log_ticks(ax):
    """Labelled ticks on a log y axis even when the data span less than a decade (matplotlib's
    default would then label nothing): 1-2-5 steps, or every integer mantissa if that is too few."""
    ax.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(mticker.NullFormatter())
    lo, hi = ax.get_ylim()
    for subs in ((1.0,), (1.0, 2.0, 5.0), tuple(range(1, 10))):
        loc = mticker.LogLocator(base=10, subs=subs)
        if sum(lo <= t <= hi for t in loc.tick_values(lo, hi)) >= 3:
            break
    ax.yaxis.set_major_locator(loc)


def byte_unit(v):
    """(divisor, name) that keeps the largest finite value of v between 1 and 1024 units."""
    v = np.asarray(v, dtype=float)
    top = np.nanmax(v) if np.isfinite(v).any() else 0.0
    for div, name in ((1024.0**3, "GiB"), (1024.0**2, "MiB"), (1024.0, "KiB")):
        if top >= div:
            return div, name
    return 1.0, "bytes"
