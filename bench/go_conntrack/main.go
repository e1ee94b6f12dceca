// The peer for bench/bench_compiled.py: Antrea's conntrack library (github.com/ti-mo/conntrack) dumping
// the same table, as Antrea's flow exporter does each poll. Prints one JSON line: the seconds each of
// `-runs` dumps took and the entries of the last. Run inside the table's network namespace.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/ti-mo/conntrack"
)

func main() {
	runs := flag.Int("runs", 5, "dumps to time")
	flag.Parse()
	c, err := conntrack.Dial(nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		os.Exit(1)
	}
	defer c.Close()
	if _, err := c.Dump(nil); err != nil { // warm-up
		fmt.Fprintln(os.Stderr, "dump:", err)
		os.Exit(1)
	}
	var secs []float64
	n := 0
	for i := 0; i < *runs; i++ {
		t := time.Now()
		flows, err := c.Dump(nil)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dump:", err)
			os.Exit(1)
		}
		secs = append(secs, time.Since(t).Seconds())
		n = len(flows)
	}
	_ = json.NewEncoder(os.Stdout).Encode(map[string]any{"seconds": secs, "entries": n})
}
