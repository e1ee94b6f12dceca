package main

import "github.com/cilium/cilium/pkg/maps/ctmap"

// globalMaps: v1.15 names the four global CT maps GlobalMaps.
func globalMaps() []*ctmap.Map { return ctmap.GlobalMaps(true, true) }
