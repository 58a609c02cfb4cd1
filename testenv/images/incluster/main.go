// incluster: the test workload of the node tests (testenv/tests/node.rs). A Pod running it
//   1. calls the API server the way in-cluster clients do — https://$KUBERNETES_SERVICE_HOST:
//      $KUBERNETES_SERVICE_PORT, the mounted ca.crt, the projected service-account token — and
//      GETs its own Pod, printing "api GET <path> -> <status>" (retrying until 200, 60 s);
//   2. when PEER_URL is set, GETs it until it answers 200, printing "peer <url> -> 200 <body>";
//   3. serves "hello from <hostname>" on :8080 for Services to route to.
// No client library: standard library only, built static (CGO_ENABLED=0).
package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

const sa = "/var/run/secrets/kubernetes.io/serviceaccount/"

func apiGet(path string) (int, string, error) {
	ca, err := os.ReadFile(sa + "ca.crt")
	if err != nil {
		return 0, "", err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	token, err := os.ReadFile(sa + "token")
	if err != nil {
		return 0, "", err
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	host := net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	req, _ := http.NewRequest("GET", "https://"+host+path, nil)
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
	return resp.StatusCode, string(body), nil
}

func retry(what string, f func() (int, string, error)) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		code, body, err := f()
		if err != nil {
			fmt.Printf("%s -> error %v\n", what, err)
		} else {
			fmt.Printf("%s -> %d %s\n", what, code, strings.ReplaceAll(body, "\n", " "))
		}
		if (err == nil && code == 200) || time.Now().After(deadline) {
			return
		}
		time.Sleep(time.Second)
	}
}

func main() {
	ns, _ := os.ReadFile(sa + "namespace")
	path := fmt.Sprintf("/api/v1/namespaces/%s/pods/%s", strings.TrimSpace(string(ns)), os.Getenv("POD_NAME"))
	go func() {
		retry("api GET "+path, func() (int, string, error) { code, _, err := apiGet(path); return code, "", err })
		if peer := os.Getenv("PEER_URL"); peer != "" {
			c := &http.Client{Timeout: 3 * time.Second}
			retry("peer "+peer, func() (int, string, error) {
				resp, err := c.Get(peer)
				if err != nil {
					return 0, "", err
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
				return resp.StatusCode, string(b), nil
			})
		}
	}()
	host, _ := os.Hostname()
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintf(w, "hello from %s", host) })
	if err := http.ListenAndServe(":8080", nil); err != nil {
		fmt.Println("serve:", err)
		os.Exit(1)
	}
}
