#!/usr/bin/env python3
"""Turn a one-rank run's sampled rates (scripts/scaling.py --sample K writes them to each run's
sampled_rates.txt) into the rates of a GPU, for the GPU-cluster simulation of docs/scaling.md ("A
GPU cluster, simulated"). Each site's time per call is divided by a factor measured on both
machines, and never falls below the launches the site would cost:

  attention sites ("fma ..."): ATT, fma attention forward + backward on this core over the same
      shape on the GPU (docs/gpu.md: n = 16K, H = 12, d = 64);
  every other site (GEMMs, element-wise passes): OTHER, a whole training step's tokens per second
      on the GPU over this core's on the same deck (docs/gpu.md: the enwik8 model, n = 1024);
  floor: LAUNCH_US per kernel launch, times the launches a site's call makes on fmattn's GPU path
      (fma's six sites share the 146 launches the roofline counts for its forward + backward at
      16K; a linear layer's forward 2, its backward 3; other passes 1), written as each line's
      fourth field: the least a call is charged, whatever its work (src/parallel/simsample.h).

What runs outside the sampled sites (the optimizer, the loss, packing, planning) is charged by the
platform's host speed: write the platform with OTHER as its SPEEDUP (gpu_platform.py OTHER NODES)
so that it speeds up like the GEMMs and passes.

  scripts/simgrid/gpu_rates.py CPU_RATES ATT OTHER [LAUNCH_US] > gpu_rates.txt
"""
import sys

FMA_LAUNCHES = 146 / 6  # the roofline's launch count for fma fwd + bwd at 16K, over its 6 sites


def launches(site):
    if site.startswith("fma balance"):
        return 4
    if site.startswith("fma "):
        return FMA_LAUNCHES
    if "linear_backward" in site:
        return 3
    if "linear_forward" in site:
        return 2
    return 1


def convert(lines, att, other, launch_s):
    out = [f"# fmattn sampled sites: NAME<tab>measurements seconds work [floor] (simsample.h); "
           f"written by gpu_rates.py: attention / {att:g}, other / {other:g}, "
           f"floor {launch_s * 1e6:g} us per launch"]
    for line in lines:
        if line.startswith("#") or not line.strip():
            continue
        name, rest = line.rstrip("\n").rsplit("\t", 1)
        n, seconds, work = rest.split()[:3]
        factor = att if name.startswith("fma ") else other
        out.append(f"{name}\t{n} {float(seconds) / factor:.9g} {work} "
                   f"{launches(name) * launch_s:.9g}")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    att, other = float(sys.argv[2]), float(sys.argv[3])
    launch_us = float(sys.argv[4]) if len(sys.argv) == 5 else 2.5
    if att <= 0 or other <= 0 or launch_us < 0:
        sys.exit("gpu_rates.py: ATT and OTHER must be > 0, LAUNCH_US >= 0")
    with open(sys.argv[1]) as f:
        sys.stdout.write(convert(f.readlines(), att, other, launch_us * 1e-6))


if __name__ == "__main__":
    main()
