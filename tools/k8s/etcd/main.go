// Command etcd is the upstream etcd server, built as a plain Go module so that tests need no
// prebuilt release tarball; it only hands its arguments to etcdmain.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
