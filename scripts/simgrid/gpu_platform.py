#!/usr/bin/env python3
"""Write a SimGrid platform of GPU nodes for scripts/scaling.py --simulate (docs/scaling.md, "A GPU
cluster, simulated"): NODES nodes of 8 GPUs, each GPU one host. Within a node every GPU has its
own NVLink port to the node's NVSwitch (450 GB/s per direction, H100/H200 SXM's NVLink 4); between
nodes each node reaches a non-blocking NDR core through one uplink of 8 x 400 Gb/s (one ConnectX-7
per GPU, as in a DGX H100/H200, pooled into one link). A host computes SPEEDUP times as fast as the
core that runs smpirun (speed SPEEDUP Gf against smpi/host-speed 1Gf): every measured CPU burst is
charged 1/SPEEDUP of its time. Hosts are named nNN-gG so that smpirun's name order puts ranks
0-7 on node 0, 8-15 on node 1, and so on.

  scripts/simgrid/gpu_platform.py SPEEDUP [NODES] > platform.xml
"""
import sys

NVLINK_GBPS = 450  # per GPU and direction, NVLink 4 (900 GB/s both ways)
NVLINK_LAT = "1us"  # per link: a GPU-to-GPU route crosses two, plus the switch's backbone
NDR_NODE_GBPS = 400  # 8 NICs x 50 GB/s per node
NDR_LAT = "1.5us"  # a node's uplink; a route between nodes crosses two


def platform(speedup, nodes):
    out = ["<?xml version='1.0'?>",
           '<!DOCTYPE platform SYSTEM "https://simgrid.org/simgrid.dtd">',
           f"<!-- Written by scripts/simgrid/gpu_platform.py {speedup:g} {nodes}: {nodes} nodes of 8 GPUs,",
           f"     NVLink {NVLINK_GBPS} GB/s per GPU within a node, {NDR_NODE_GBPS} GB/s of NDR per node",
           f"     between nodes; every host {speedup:g} times the smpirun core. -->",
           '<platform version="4.1">',
           "  <config>",
           '    <prop id="smpi/host-speed" value="1Gf"/>',
           '    <prop id="smpi/bw-factor" value="0:0.95"/>',
           '    <prop id="smpi/lat-factor" value="0:1"/>',
           '    <!-- no simulated sleep in MPI_Test: see scripts/simgrid/README.md -->',
           '    <prop id="smpi/test" value="0"/>',
           "  </config>",
           '  <zone id="world" routing="Full">']
    for k in range(nodes):
        out.append(f'    <cluster id="n{k:02d}" prefix="n{k:02d}-g" suffix="" radical="0-7" '
                   f'speed="{speedup:g}Gf" bw="{NVLINK_GBPS}GBps" lat="{NVLINK_LAT}" '
                   f'bb_bw="{8 * NVLINK_GBPS}GBps" bb_lat="0us" sharing_policy="SPLITDUPLEX"/>')
    for k in range(nodes):
        out.append(f'    <link id="up{k:02d}" bandwidth="{NDR_NODE_GBPS}GBps" latency="{NDR_LAT}" '
                   'sharing_policy="SPLITDUPLEX"/>')
    out.append('    <link id="core" bandwidth="100TBps" latency="0us" sharing_policy="FATPIPE"/>')
    for a in range(nodes):  # both directions written: each leaves by its uplink's UP side
        for b in range(nodes):
            if a != b:
                out += [f'    <zoneRoute src="n{a:02d}" dst="n{b:02d}" gw_src="n{a:02d}-gn{a:02d}_router" '
                        f'gw_dst="n{b:02d}-gn{b:02d}_router" symmetrical="NO">',
                        f'      <link_ctn id="up{a:02d}" direction="UP"/><link_ctn id="core"/>'
                        f'<link_ctn id="up{b:02d}" direction="DOWN"/>',
                        "    </zoneRoute>"]
    out += ["  </zone>", "</platform>"]
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    speedup = float(sys.argv[1])
    nodes = int(sys.argv[2]) if len(sys.argv) == 3 else 16
    if speedup <= 0 or not 1 <= nodes <= 99:
        sys.exit("gpu_platform.py: SPEEDUP must be > 0 and NODES in 1..99")
    sys.stdout.write(platform(speedup, nodes))


if __name__ == "__main__":
    main()
