// Command gouserspace is the data path of kube-proxy's userspace proxier (removed in
// Kubernetes v1.26), rebuilt for benchmarks/peers.py: one listener per Service port, an accept
// loop that dials the backend itself before it accepts the next client (the endpoint chosen
// round robin; on a failed dial the next endpoint, with the proxier's timeouts of 250 ms,
// 500 ms, 1 s and 2 s), then one goroutine per direction copying until EOF.
//
// Usage: gouserspace LISTEN=ENDPOINT[,ENDPOINT...] [LISTEN=...]
// e.g.   gouserspace 0.0.0.0:41080=10.244.2.10:80,10.244.2.11:80 0.0.0.0:41201=10.244.2.10:5201
package main

import (
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

// The proxier's dial ladder: one attempt per step, each on the next endpoint.
var dialTimeouts = []time.Duration{
	250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second,
}

// roundRobin hands out the endpoints of one Service port in turn.
type roundRobin struct {
	mu        sync.Mutex
	endpoints []string
	next      int
}

func (rr *roundRobin) pick() string {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	endpoint := rr.endpoints[rr.next]
	rr.next = (rr.next + 1) % len(rr.endpoints)
	return endpoint
}

// dial walks the ladder, moving to the next endpoint whenever a dial fails.
func dial(rr *roundRobin) (net.Conn, error) {
	for _, timeout := range dialTimeouts {
		conn, err := net.DialTimeout("tcp", rr.pick(), timeout)
		if err == nil {
			return conn, nil
		}
	}
	return nil, fmt.Errorf("no endpoint answered")
}

// serve is the accept loop: the dial happens here, serially, as in the Go proxier.
func serve(listener net.Listener, rr *roundRobin) {
	for {
		in, err := listener.Accept()
		if err != nil {
			log.Printf("accept: %v", err)
			continue
		}
		out, err := dial(rr)
		if err != nil {
			in.Close()
			continue
		}
		go splice(in, out)
	}
}

// splice copies both ways until either side ends, then closes both.
func splice(in, out net.Conn) {
	var done sync.WaitGroup
	done.Add(2)
	relay := func(to, from net.Conn) {
		defer done.Done()
		io.Copy(to, from)
		to.Close()
		from.Close()
	}
	go relay(out, in)
	go relay(in, out)
	done.Wait()
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: gouserspace LISTEN=ENDPOINT[,ENDPOINT...] ...")
		os.Exit(2)
	}
	for _, arg := range os.Args[1:] {
		listen, endpoints, ok := strings.Cut(arg, "=")
		if !ok || endpoints == "" {
			log.Fatalf("bad argument %q: want LISTEN=ENDPOINT[,ENDPOINT...]", arg)
		}
		listener, err := net.Listen("tcp", listen)
		if err != nil {
			log.Fatalf("listen %s: %v", listen, err)
		}
		go serve(listener, &roundRobin{endpoints: strings.Split(endpoints, ",")})
	}
	select {}
}
