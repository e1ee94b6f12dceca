package main

import "github.com/cilium/cilium/pkg/maps/ctmap"

// globalMaps: v1.20 names the four global CT maps Maps.
func globalMaps() []*ctmap.Map { return ctmap.Maps(true, true) }
