// ctwriter: Cilium's own code creates, writes and dumps the global connection-tracking maps.
//
// The tests of the Cilium source (issue 41) must not write the maps with the reader's idea of their
// layout: this program is built against a pinned github.com/cilium/cilium module (tools/cilium/v1.15,
// tools/cilium/v1.20, one go.mod each; devtools/cilium.py builds it into .cache) and uses that
// release's pkg/maps/ctmap types and pkg/bpf map code, so the bytes in the maps are Cilium's.
//
// Cilium finds its maps under the first bpf filesystem in /proc/self/mountinfo (plus tc/globals), so
// the caller runs it in a mount namespace where the test's private bpffs is the only one.
//
//	ctwriter create           create and pin the four global CT maps (tcp4, any4, tcp6, any6)
//	ctwriter apply < ops      JSON lines {"op": "put"|"delete", "map": ..., "saddr", "daddr", "sport",
//	                          "dport", "nexthdr", "flags", "entry": {CtEntry's Go fields}}; ports in
//	                          host order (converted to the map's network order here)
//	ctwriter dump             every entry as a JSON line, read back by Cilium's DumpWithCallback,
//	                          with "cilium": the entry as cilium-dbg bpf ct list global prints it (the
//	                          key's Dump, originator first, then the value's String)
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"strings"

	"github.com/cilium/cilium/pkg/bpf"
	"github.com/cilium/cilium/pkg/byteorder"
	"github.com/cilium/cilium/pkg/maps/ctmap"
	"github.com/cilium/cilium/pkg/u8proto"
)

// tuple: a map and a key as the JSON lines name them (ports in host order).
type tuple struct {
	Map     string `json:"map"`
	Saddr   string `json:"saddr"`
	Daddr   string `json:"daddr"`
	Sport   uint16 `json:"sport"`
	Dport   uint16 `json:"dport"`
	Nexthdr uint8  `json:"nexthdr"`
	Flags   uint8  `json:"flags"`
}

type op struct {
	tuple
	Op    string        `json:"op"`
	Entry ctmap.CtEntry `json:"entry"`
}

type record struct {
	tuple
	Entry  ctmap.CtEntry `json:"entry"`
	Cilium string        `json:"cilium"`
}

func die(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "ctwriter: "+format+"\n", args...)
	os.Exit(1)
}

func byName() map[string]*ctmap.Map {
	out := map[string]*ctmap.Map{}
	for _, m := range globalMaps() {
		out[m.Name()] = m
	}
	return out
}

func key(o op) bpf.MapKey {
	src, err := netip.ParseAddr(o.Saddr)
	if err != nil {
		die("saddr %q: %v", o.Saddr, err)
	}
	dst, err := netip.ParseAddr(o.Daddr)
	if err != nil {
		die("daddr %q: %v", o.Daddr, err)
	}
	if src.Is4() {
		k := &ctmap.CtKey4Global{}
		k.SourceAddr, k.DestAddr = src.As4(), dst.As4()
		k.SourcePort, k.DestPort = byteorder.HostToNetwork16(o.Sport), byteorder.HostToNetwork16(o.Dport)
		k.NextHeader, k.Flags = u8proto.U8proto(o.Nexthdr), o.Flags
		return k
	}
	k := &ctmap.CtKey6Global{}
	k.SourceAddr, k.DestAddr = src.As16(), dst.As16()
	k.SourcePort, k.DestPort = byteorder.HostToNetwork16(o.Sport), byteorder.HostToNetwork16(o.Dport)
	k.NextHeader, k.Flags = u8proto.U8proto(o.Nexthdr), o.Flags
	return k
}

func open(name string, maps map[string]*ctmap.Map) *ctmap.Map {
	m, ok := maps[name]
	if !ok {
		die("no map %q", name)
	}
	if err := m.Open(); err != nil {
		die("open %s: %v", name, err)
	}
	return m
}

func main() {
	if len(os.Args) != 2 {
		die("usage: ctwriter create|apply|dump")
	}
	maps := byName()
	switch os.Args[1] {
	case "create":
		for name, m := range maps {
			if err := m.OpenOrCreate(); err != nil {
				die("create %s: %v", name, err)
			}
			fmt.Println(name)
		}
	case "apply":
		in := bufio.NewScanner(os.Stdin)
		in.Buffer(make([]byte, 1<<20), 1<<20)
		opened := map[string]*ctmap.Map{}
		n := 0
		for in.Scan() {
			var o op
			if err := json.Unmarshal(in.Bytes(), &o); err != nil {
				die("line %d: %v", n+1, err)
			}
			m, ok := opened[o.Map]
			if !ok {
				m = open(o.Map, maps)
				opened[o.Map] = m
			}
			var err error
			switch o.Op {
			case "put":
				entry := o.Entry
				err = m.Update(key(o), &entry)
			case "delete":
				err = m.Delete(key(o))
			default:
				die("line %d: op %q", n+1, o.Op)
			}
			if err != nil {
				die("line %d: %s %s: %v", n+1, o.Op, o.Map, err)
			}
			n++
		}
		fmt.Println(n)
	case "dump":
		out := json.NewEncoder(os.Stdout)
		for name := range maps {
			m := open(name, maps)
			err := m.DumpWithCallback(func(k bpf.MapKey, v bpf.MapValue) {
				// As cilium-dbg bpf ct list global prints it: the key in host order, then the value.
				var sb strings.Builder
				if !k.(ctmap.CtKey).ToHost().Dump(&sb, true) {
					sb.WriteString("(no protocol) ")
				}
				shown := sb.String() + v.String()
				r := record{tuple: tuple{Map: name}, Entry: *v.(*ctmap.CtEntry), Cilium: shown}
				switch t := k.(type) {
				case *ctmap.CtKey4Global:
					r.Saddr, r.Daddr = netip.AddrFrom4(t.SourceAddr).String(), netip.AddrFrom4(t.DestAddr).String()
					r.Sport, r.Dport = byteorder.NetworkToHost16(t.SourcePort), byteorder.NetworkToHost16(t.DestPort)
					r.Nexthdr, r.Flags = uint8(t.NextHeader), t.Flags
				case *ctmap.CtKey6Global:
					r.Saddr, r.Daddr = netip.AddrFrom16(t.SourceAddr).String(), netip.AddrFrom16(t.DestAddr).String()
					r.Sport, r.Dport = byteorder.NetworkToHost16(t.SourcePort), byteorder.NetworkToHost16(t.DestPort)
					r.Nexthdr, r.Flags = uint8(t.NextHeader), t.Flags
				default:
					die("%s: key type %T", name, k)
				}
				if err := out.Encode(r); err != nil {
					die("%v", err)
				}
			})
			if err != nil {
				die("dump %s: %v", name, err)
			}
		}
	default:
		die("unknown command %q", os.Args[1])
	}
}
