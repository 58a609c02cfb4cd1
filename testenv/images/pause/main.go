// pause: the node's Pod sandbox image (localhost/kf/pause:1.0). It holds a Pod's namespaces open
// and does nothing else: sleeps until SIGINT or SIGTERM, then exits 0. Built static
// (CGO_ENABLED=0) so the image needs no other file.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
