"""The second source: Cilium's BPF connection-tracking maps, for nodes where conntrack sees nothing (issue 41)."""
